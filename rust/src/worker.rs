//! Device-produced row ids: the graph publishes its ids into an [`IdMailbox`], a native
//! worker thread (no GIL) sees them, maps them to table rows, gathers into the
//! [`DeferredRows`] slot and signals FILLED. No host synchronisation anywhere in the step.
//!
//! Per step the host calls [`GatherWorker::begin`] (the step's extent; arms the worker and
//! the watchdog), launches, and later [`GatherWorker::complete`], which waits (bounded)
//! for the worker's fill and surfaces its error, if any. Everything that can fail on the
//! worker (an id out of range, a count over the limit, an I/O error on the mapped file)
//! aborts the `DeferredRows` (the GPU is released, the consumer copies zeros) and is
//! returned, typed, by the next `complete()`; later calls raise `Poisoned`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cuda::driver::{self, DevicePtr, Kernels, PrimaryContext, RawStream};
use crate::cuda::pinned::IdMailbox;
use crate::deferred::{DeferredRows, Mode};
use crate::error::{Error, Op, Result};

/// Where rows come from (a memory-mapped table, or anything else that can gather).
pub trait RowSource: Send + Sync {
    /// Rows in the table.
    fn rows(&self) -> u64;
    /// Bytes per row.
    fn row_bytes(&self) -> usize;
    /// A name for error messages.
    fn name(&self) -> String;
    /// Write rows `ids` (all already checked to be in range) to `dst`, `ids.len()` rows.
    fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()>;
    /// The threads of this source's own that a gather of `rows` rows would run on, if any:
    /// the worker keeps them awake while a step is armed (see [`WarmThreads`]).
    fn own_pool_for(&self, _rows: usize) -> Option<&rayon::ThreadPool> {
        None
    }
}

impl RowSource for crate::table::MmapTable {
    fn rows(&self) -> u64 {
        crate::table::MmapTable::rows(self)
    }
    fn row_bytes(&self) -> usize {
        crate::table::MmapTable::row_bytes(self)
    }
    fn name(&self) -> String {
        self.label().to_string()
    }
    fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
        self.gather_into(crate::table::RowIds::I64(ids), dst)
    }
    fn own_pool_for(&self, rows: usize) -> Option<&rayon::ThreadPool> {
        crate::table::MmapTable::own_pool_for(self, rows)
    }
}

/// A table's own gather threads held awake while a step is armed, so that the fill after
/// READY does not start by waking them.
///
/// Between two decode steps (milliseconds) a pool's threads go to sleep; the fill that
/// follows READY then wakes them one after another, and on a VM each wake of an idle vCPU
/// costs tens of microseconds. Measured on an H200 host (`bench_fill.py --idle-us
/// 7000`, 1,024 rows of 256 B from one adopted 1 GiB table on the pool): 176 us a gather
/// after 7 ms idle against 34-38 us back to back. So when a step is armed and the previous
/// fill ran on the source's own pool, one job a thread is spawned on that pool that naps
/// (20 us sleeps, no spinning) until the worker has seen READY; the threads are then awake
/// and take the gather at once. The jobs end when this value is dropped, and by themselves
/// after [`WARM_MAX`], so a pool thread is never held by a step the GPU does not reach.
/// Another gather on the same table's threads meanwhile (a direct `gather` from another
/// thread) waits for them: at most until READY or [`WARM_MAX`].
pub struct WarmThreads {
    done: Arc<AtomicBool>,
}

/// The longest a warm job naps on a pool thread waiting for READY.
pub const WARM_MAX: Duration = Duration::from_millis(200);

impl WarmThreads {
    fn start(pool: &rayon::ThreadPool) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&done);
        pool.spawn_broadcast(move |_| {
            let t0 = Instant::now();
            while !flag.load(Ordering::Acquire) && t0.elapsed() < WARM_MAX {
                std::thread::sleep(NAP);
            }
        });
        Self { done }
    }
}

impl Drop for WarmThreads {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
    }
}

/// How a published id becomes a table row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowMap {
    /// The id is the row.
    Identity,
    /// Ids come in groups of `offsets.len()` heads (`[token, head]` row-major); head `h`'s
    /// id must lie in `0..sizes[h]` and maps to row `offsets[h] + id` (per-head
    /// vocabularies, as in Qwen4Exp's n-gram embedding).
    PerHead { offsets: Vec<i64>, sizes: Vec<i64> },
}

impl RowMap {
    /// Check the map against a table of `rows` rows.
    pub fn validate(&self, rows: u64) -> Result<()> {
        if let RowMap::PerHead { offsets, sizes } = self {
            if offsets.is_empty() || offsets.len() != sizes.len() {
                return Err(Error::invalid(format!(
                    "per-head map needs as many offsets as sizes (at least one), got {} and {}",
                    offsets.len(),
                    sizes.len()
                )));
            }
            for (h, (&o, &s)) in offsets.iter().zip(sizes).enumerate() {
                let end = o.checked_add(s);
                if o < 0 || s <= 0 || end.is_none_or(|e| e as u64 > rows) {
                    return Err(Error::invalid(format!(
                        "head {h}: rows {o}..{o}+{s} do not lie inside the table's {rows} rows"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Map `ids` to rows into `out`, checking every id before anything is written.
    pub fn map(&self, ids: &[i64], out: &mut Vec<i64>, rows: u64, table: &str) -> Result<()> {
        out.clear();
        match self {
            RowMap::Identity => {
                if let Some((position, &id)) = ids
                    .iter()
                    .enumerate()
                    .find(|(_, &id)| id < 0 || id as u64 >= rows)
                {
                    return Err(Error::RowId {
                        id,
                        position,
                        rows,
                        table: table.to_string(),
                    });
                }
                out.extend_from_slice(ids);
            }
            RowMap::PerHead { offsets, sizes } => {
                let heads = offsets.len();
                for (position, &id) in ids.iter().enumerate() {
                    let h = position % heads;
                    if id < 0 || id >= sizes[h] {
                        return Err(Error::RowId {
                            id,
                            position,
                            rows: sizes[h] as u64,
                            table: format!("{table} (head {h} of {heads})"),
                        });
                    }
                    out.push(offsets[h] + id);
                }
            }
        }
        Ok(())
    }
}

/// How the graph publishes its ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PublishPath {
    /// One single-block kernel copies ids and count into the mailbox and stores READY.
    #[default]
    Kernel,
    /// Copy-engine D2H copies of ids (and count), then `cuStreamWriteValue32(READY)`.
    Memop,
}

/// Counters and timings of one worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerStats {
    pub steps: u64,
    pub fills: u64,
    pub failures: u64,
    pub ids_total: u64,
    /// From the worker seeing READY to its FILLED store, nanoseconds.
    pub ready_to_filled_ns_last: u64,
    pub ready_to_filled_ns_max: u64,
    pub ready_to_filled_ns_total: u64,
    /// The fills of steps begun with [`GatherWorker::begin_eager`] (an engine's eager
    /// forward: a prefill chunk, a mixed batch), counted in `fills` and
    /// `ready_to_filled_ns_total` too; the rest are replays.
    pub eager_fills: u64,
    pub eager_fill_ns_total: u64,
    /// From the worker starting to wait for a step's ids to READY seen: how early it was.
    pub armed_to_ready_ns_last: u64,
    pub publishes_captured: u64,
    pub publishes_eager: u64,
    /// Steps given host-known ids with [`GatherWorker::publish_from_host`].
    pub publishes_host: u64,
    /// Replays that published ids with no step armed (each released with zero rows).
    pub unarmed_replays: u64,
    /// Steps whose wait for READY kept the source's own gather threads awake
    /// ([`WarmThreads`]).
    pub warmed_steps: u64,
}

/// How a worker is set up (beyond its rows, table and row map).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerOptions {
    /// Ids a step may publish (at most the rows object's `max_rows`).
    pub max_ids: usize,
    /// 4 (int32) or 8 (int64).
    pub id_bytes: usize,
    pub path: PublishPath,
    /// Steps that may be armed at once: 2 lets a host running one step ahead (asynchronous
    /// scheduling) arm step N+1 before the GPU published step N's ids.
    pub depth: usize,
    /// How long the worker stays hot (spinning, then yielding) while waiting for ids or for
    /// the next step before it falls back to short sleeps (waiting for ids) or blocking
    /// (idle). A worker that sleeps sees READY late: on a VM, waking an idle vCPU can take
    /// longer than the whole gather.
    pub spin: Duration,
    /// Diagnostics only: fill each step without gathering (the slot keeps whatever bytes
    /// it held, so consumers read stale rows). Times the protocol without the host's
    /// gather; never for serving.
    pub skip_gather: bool,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            max_ids: 1,
            id_bytes: 8,
            path: PublishPath::Kernel,
            depth: 2,
            spin: DEFAULT_SPIN,
            skip_gather: false,
        }
    }
}

/// Default for [`WorkerOptions::spin`].
pub const DEFAULT_SPIN: Duration = Duration::from_millis(2);

struct Ctl {
    /// Steps armed and not yet completed, oldest first.
    armed: VecDeque<u64>,
    /// The armed steps begun with [`GatherWorker::begin_eager`] (a subset of `armed`).
    eager: Vec<u64>,
    /// The newest step the worker is done with (filled, failed or given up).
    handled: u64,
    failure: Option<Error>,
    stats: WorkerStats,
    published: bool,
    /// Captures that recorded a publish (one per capture: a second would publish twice a step).
    captures: Vec<u64>,
    /// The newest step given ids by [`GatherWorker::publish_from_host`].
    host_published: u64,
}

impl Ctl {
    fn next_to_fill(&self) -> Option<u64> {
        self.armed.iter().copied().find(|&s| s > self.handled)
    }

    /// The oldest armed step that has not been given host ids yet.
    fn next_for_host_ids(&self) -> Option<u64> {
        let after = self.handled.max(self.host_published);
        self.armed.iter().copied().find(|&s| s > after)
    }
}

/// Lock order: `ctl` before `mailbox`, never the reverse. The worker checks the mailbox
/// while holding `ctl` (a READY with nothing armed must be judged under `ctl`); a caller
/// that held `mailbox` while taking `ctl` deadlocked with it (a publish under capture
/// against an idle worker: the engine froze at its first CUDA graph capture, the GPU idle).
struct Shared {
    rows: DeferredRows,
    source: Arc<dyn RowSource>,
    map: RowMap,
    mailbox: Mutex<IdMailbox>,
    opts: WorkerOptions,
    kernels: Option<Kernels>,
    ctx: Option<PrimaryContext>,
    ctl: Mutex<Ctl>,
    cv: Condvar,
    /// The newest armed step, readable without the lock by the polling worker.
    armed_seq: AtomicU64,
    stop: AtomicBool,
    /// Serialises host publishers: the mailbox holds one step's ids, and the ids must
    /// enter it in step order.
    host_publish: Mutex<()>,
}

/// See the module docs. Every method takes `&self`; the object is `Send + Sync`.
pub struct GatherWorker {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Pure spinning before yielding, while hot.
const SPIN_PAUSE: Duration = Duration::from_micros(50);
/// Sleep between READY checks once a step has waited longer than `spin` (with a fine timer
/// slack: see `os::fine_timer_slack`).
const NAP: Duration = Duration::from_micros(20);
/// How often an idle (cold) worker looks for a READY nobody armed it for.
const IDLE_POLL: Duration = Duration::from_millis(1);

impl GatherWorker {
    /// A worker that fills `rows` from `source`, mapping ids with `map`. `rows` must run
    /// the deferred protocol (or host mode, where ids are published from the host).
    pub fn new(
        rows: DeferredRows,
        source: Arc<dyn RowSource>,
        map: RowMap,
        opts: WorkerOptions,
    ) -> Result<Self> {
        let (max_ids, id_bytes) = (opts.max_ids, opts.id_bytes);
        if id_bytes != 4 && id_bytes != 8 {
            return Err(Error::invalid(format!(
                "ids are int32 or int64, got {id_bytes}-byte ids"
            )));
        }
        if max_ids == 0 || max_ids > rows.max_rows() {
            return Err(Error::invalid(format!(
                "max_ids must be 1..={} (the rows object's max_rows), got {max_ids}",
                rows.max_rows()
            )));
        }
        if max_ids > u32::MAX as usize {
            return Err(Error::invalid("max_ids must fit in 32 bits"));
        }
        if !(1..=8).contains(&opts.depth) {
            return Err(Error::invalid(format!(
                "depth must be 1..=8 steps in flight, got {}",
                opts.depth
            )));
        }
        if source.row_bytes() != rows.row_bytes() {
            return Err(Error::invalid(format!(
                "table rows are {} bytes, the rows object's are {}",
                source.row_bytes(),
                rows.row_bytes()
            )));
        }
        map.validate(source.rows())?;
        if rows.in_flight() > 0 {
            return Err(Error::state(
                Op::Begin,
                "the rows object has a step in flight; complete it before attaching a worker",
            ));
        }
        let (mailbox, kernels, ctx) = match (rows.mode(), rows.device()) {
            (Mode::Deferred, Some(dev)) => {
                let ctx = PrimaryContext::retain(dev)?;
                let mailbox = {
                    let _g = ctx.bind()?;
                    IdMailbox::pinned(max_ids, id_bytes, dev)?
                };
                (mailbox, Some(Kernels::get(dev)?), Some(ctx))
            }
            (Mode::Host, _) => (IdMailbox::heap(max_ids, id_bytes), None, None),
            (Mode::Sync, _) | (Mode::Deferred, None) => {
                return Err(Error::unsupported(
                    "device-produced ids need the deferred protocol; this device uses the synchronous fallback (copy the ids to the host and fill before launch)",
                ))
            }
        };
        rows.set_worker_fed(true);
        let shared = Arc::new(Shared {
            rows,
            source,
            map,
            mailbox: Mutex::new(mailbox),
            opts,
            kernels,
            ctx,
            ctl: Mutex::new(Ctl {
                armed: VecDeque::new(),
                eager: Vec::new(),
                handled: 0,
                failure: None,
                stats: WorkerStats::default(),
                published: false,
                captures: Vec::new(),
                host_published: 0,
            }),
            cv: Condvar::new(),
            armed_seq: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            host_publish: Mutex::new(()),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ple-memops-gather".into())
            .spawn(move || run(&sh))
            .map_err(|e| {
                shared.rows.set_worker_fed(false);
                Error::invalid(format!("cannot start the gather worker thread: {e}"))
            })?;
        Ok(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn rows(&self) -> &DeferredRows {
        &self.shared.rows
    }

    pub fn max_ids(&self) -> usize {
        self.shared.mailbox().max_ids()
    }

    pub fn id_bytes(&self) -> usize {
        self.shared.mailbox().id_bytes()
    }

    pub fn depth(&self) -> usize {
        self.shared.opts.depth
    }

    /// Steps armed and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.shared.ctl().armed.len()
    }

    pub fn stats(&self) -> WorkerStats {
        self.shared.ctl().stats.clone()
    }

    /// Start a step of `rows` rows and arm the worker for its ids. Up to `depth` steps
    /// may be armed at once; the worker fills them in order.
    pub fn begin(&self, rows: usize) -> Result<u64> {
        self.begin_step(rows, false)
    }

    /// [`Self::begin`] for an eager forward's step: the same protocol, its fill counted
    /// apart in [`WorkerStats`] (`eager_fills`), so a replay's fill time is not averaged
    /// with a prefill chunk's.
    pub fn begin_eager(&self, rows: usize) -> Result<u64> {
        self.begin_step(rows, true)
    }

    fn begin_step(&self, rows: usize, eager: bool) -> Result<u64> {
        let sh = &self.shared;
        let mut ctl = sh.ctl();
        if let Some(e) = ctl.failure.take() {
            ctl.armed.clear();
            ctl.eager.clear();
            return Err(e);
        }
        if ctl.armed.len() >= sh.opts.depth {
            return Err(Error::state(
                Op::Begin,
                format!(
                    "{} steps already armed (depth {}); call complete() first",
                    ctl.armed.len(),
                    sh.opts.depth
                ),
            ));
        }
        if sh.rows.in_flight() > ctl.armed.len() {
            return Err(Error::state(
                Op::Begin,
                "the rows object has a step begun outside this worker; complete it first",
            ));
        }
        let step = sh.rows.begin_for_worker(rows, sh.opts.depth)?;
        ctl.armed.push_back(step);
        if eager {
            ctl.eager.push(step);
        }
        sh.armed_seq.store(step, Ordering::Release);
        sh.cv.notify_all();
        Ok(step)
    }

    /// Wait (at most `timeout`) for the worker to fill the oldest armed step, then
    /// complete it. Returns the worker's error, typed, if a gather failed (the GPU was
    /// released) or a replay published ids nobody armed the worker for.
    pub fn complete(&self, timeout: Duration) -> Result<()> {
        match self.try_complete() {
            Some(done) => done,
            None => self.complete_waiting(timeout),
        }
    }

    /// [`Self::complete`] if it need not wait: the oldest armed step is filled (or failed),
    /// or none is armed; `None` when the worker is still on it. Never blocks beyond the
    /// locks, so a caller holding an interpreter lock may call it without releasing that
    /// (a serving loop completes a step the worker filled long ago: releasing and
    /// retaking a contended interpreter lock costs more than the completion).
    pub fn try_complete(&self) -> Option<Result<()>> {
        let sh = &self.shared;
        let ctl = sh.ctl();
        let waits = ctl.failure.is_none()
            && ctl
                .armed
                .front()
                .is_some_and(|&step| ctl.handled < step && !sh.rows.is_released());
        if waits {
            return None;
        }
        drop(ctl);
        Some(self.complete_waiting(Duration::ZERO))
    }

    fn complete_waiting(&self, timeout: Duration) -> Result<()> {
        let sh = &self.shared;
        let mut ctl = sh.ctl();
        if let Some(e) = ctl.failure.take() {
            ctl.armed.clear();
            ctl.eager.clear();
            return Err(e);
        }
        let Some(&step) = ctl.armed.front() else {
            return sh.rows.complete();
        };
        let deadline = Instant::now() + timeout;
        while ctl.handled < step && ctl.failure.is_none() {
            // An abort (or, once its ids came, the watchdog) may release the step meanwhile.
            if sh.rows.is_released() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::state(
                    Op::Complete,
                    format!("the worker has not filled step {step} within {timeout:?}: the GPU has not published its ids (is complete()'s timeout shorter than the work queued ahead of this step?)"),
                ));
            }
            ctl = sh
                .cv
                .wait_timeout(ctl, (deadline - now).min(Duration::from_millis(5)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        ctl.armed.pop_front();
        ctl.eager.retain(|&s| s > step);
        if let Some(e) = ctl.failure.take() {
            ctl.armed.clear();
            ctl.eager.clear();
            return Err(e);
        }
        ctl.stats.steps += 1;
        drop(ctl);
        sh.rows.complete()
    }

    /// Enqueue the publish of `ids` (device address of `max_ids` ids; `count_dev` 0 or the
    /// device address of an int32 count) on `stream`, eagerly or under capture.
    ///
    /// # Safety
    /// `stream` is a live stream of the rows' device; `ids` and `count_dev` stay valid for
    /// every execution (graph replays included).
    pub unsafe fn publish(
        &self,
        stream: RawStream,
        ids: DevicePtr,
        n_ids: usize,
        count_dev: DevicePtr,
    ) -> Result<()> {
        let sh = &self.shared;
        let (Some(ctx), Some(kernels)) = (&sh.ctx, &sh.kernels) else {
            return Err(Error::state(
                Op::Enqueue,
                "host mode: publish ids with publish_from_host()",
            ));
        };
        sh.rows
            .poison_cause()
            .map_or(Ok(()), |cause| Err(Error::Poisoned { cause }))?;
        // What the enqueue needs of the mailbox, read and the lock released before `ctl`
        // is taken (the lock order is ctl, then mailbox: see `Shared`). Its addresses
        // are fixed for its life, so nothing here needs the lock held.
        let (max_ids, (m_ids, m_count, m_ready), elem, ids_host, count_host) = {
            let mailbox = sh.mailbox();
            (
                mailbox.max_ids(),
                mailbox.device_ptrs().expect("pinned mailbox"),
                mailbox.id_bytes(),
                mailbox.ids_host_ptr(),
                mailbox.count_host_ptr(),
            )
        };
        if n_ids == 0 || n_ids > max_ids {
            return Err(Error::rows(format!(
                "publish of {n_ids} ids: the mailbox holds 1..={max_ids}"
            )));
        }
        let dev = ctx.ordinal();
        let _g = ctx.bind()?;
        // SAFETY: the caller's contract on `stream`.
        let capture = unsafe { driver::capture_id(stream, dev)? };
        let mut ctl = sh.ctl();
        match capture {
            Some(id) if ctl.captures.contains(&id) => {
                return Err(Error::state(
                    Op::Enqueue,
                    "already published in this capture: one publish per step",
                ))
            }
            None if ctl.next_to_fill().is_none() => {
                return Err(Error::state(
                    Op::Enqueue,
                    "eager publish with no step armed: call begin() first (an unarmed publish would be an unaccounted step)",
                ))
            }
            _ => {}
        }
        // SAFETY: the mailbox is retained forever once anything was published (see drop),
        // the caller vouches for `ids`, `count_dev` and `stream`.
        unsafe {
            match sh.opts.path {
                PublishPath::Kernel => kernels
                    .publish_ids(stream, ids, n_ids, count_dev, elem, m_ids, m_count, m_ready)?,
                PublishPath::Memop => {
                    driver::copy_d2h_async(ids_host, ids, n_ids * elem, stream, dev)?;
                    if count_dev != 0 {
                        driver::copy_d2h_async(count_host, count_dev, 4, stream, dev)?;
                    } else {
                        driver::write_u32(stream, m_count, n_ids as u32, dev)?;
                    }
                    driver::write_u32(stream, m_ready, 1, dev)?;
                }
            }
        }
        ctl.published = true;
        if let Some(id) = capture {
            ctl.captures.push(id);
            ctl.stats.publishes_captured += 1;
        } else {
            ctl.stats.publishes_eager += 1;
        }
        Ok(())
    }

    /// Give the oldest armed step that has no ids yet the ids the host knows; the worker
    /// thread gathers and fills them. This is how host-known ids should reach a step's
    /// rows: the call only copies the ids into the mailbox, so it may come before the
    /// launch (the gather then overlaps it) or from any thread after it, and the thread
    /// that launches the graph never has to fill. (Filling from the launching thread after
    /// the launch can stall until the watchdog: with a copy-engine consumer and thousands
    /// of nodes behind its wait, the launch itself may not return before the wait was
    /// passed; measured on the H200, see BENCHMARKS.md.)
    ///
    /// One call per armed step, in step order. Refused (nothing written) when the worker
    /// is closed or poisoned, when no armed step lacks ids, or when the previous ids are
    /// still in the mailbox after `timeout` (the worker takes them as soon as it is done
    /// with the step before). A graph of a step given host ids must not publish its own.
    pub fn publish_from_host(&self, ids: &[i64], timeout: Duration) -> Result<()> {
        let sh = &self.shared;
        let max_ids = sh.mailbox().max_ids();
        if ids.len() > max_ids {
            return Err(Error::rows(format!(
                "{} ids: the mailbox holds at most {max_ids}",
                ids.len()
            )));
        }
        let id_bytes = sh.mailbox().id_bytes();
        if id_bytes == 4 {
            // The mailbox holds int32 ids: a wider one would be truncated into another row.
            if let Some(position) = ids.iter().position(|&v| i32::try_from(v).is_err()) {
                return Err(Error::RowId {
                    id: ids[position],
                    position,
                    rows: sh.source.rows(),
                    table: sh.source.name(),
                });
            }
        }
        let _order = sh.host_publish.lock().unwrap_or_else(|e| e.into_inner());
        let step = {
            let mut ctl = sh.ctl();
            if sh.stop.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            if let Some(e) = ctl.failure.take() {
                ctl.armed.clear();
                ctl.eager.clear();
                return Err(e);
            }
            sh.rows
                .poison_cause()
                .map_or(Ok(()), |cause| Err(Error::Poisoned { cause }))?;
            ctl.next_for_host_ids().ok_or_else(|| Error::NoArmedStep {
                op: Op::Fill,
                detail: "no armed step is waiting for ids: call begin() first (one publish per begun step)".into(),
            })?
        };
        let deadline = Instant::now() + timeout;
        let t0 = Instant::now();
        loop {
            {
                let mailbox = sh.mailbox();
                if !mailbox.is_ready() {
                    mailbox.publish_from_host(ids);
                    break;
                }
            }
            if sh.stop.load(Ordering::Acquire) || sh.rows.is_released() {
                return Err(sh
                    .rows
                    .poison_cause()
                    .map_or(Error::Closed, |cause| Error::Poisoned { cause }));
            }
            if Instant::now() >= deadline {
                return Err(Error::state(
                    Op::Fill,
                    format!("the worker has not taken the previous step's ids within {timeout:?}; these ids were not published"),
                ));
            }
            pause(t0.elapsed(), sh.opts.spin, NAP);
        }
        let mut ctl = sh.ctl();
        ctl.host_published = ctl.host_published.max(step);
        ctl.published = true;
        ctl.stats.publishes_host += 1;
        Ok(())
    }

    /// Store ids and READY in the mailbox with no checks at all, as a graph replay would
    /// (tests of the worker's own guards, e.g. a replay nobody armed it for).
    #[doc(hidden)]
    pub fn simulate_replay_publish(&self, ids: &[i64]) {
        self.shared.mailbox().publish_from_host(ids);
        self.shared.ctl().published = true;
    }

    /// Whether `close()` ran.
    pub fn is_closed(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// Stop the worker thread (idempotent). A step still armed is aborted (the GPU is
    /// released), and so is the rows object if ids were ever published to this worker: a
    /// graph that publishes to it could no longer be filled, so its consumer must never
    /// wait again.
    pub fn close(&self) {
        let sh = &self.shared;
        sh.stop.store(true, Ordering::Release);
        {
            let ctl = sh.ctl();
            if ctl.next_to_fill().is_some() {
                sh.rows.abort("gather worker closed with a step pending");
            } else if ctl.published {
                sh.rows.abort(
                    "gather worker closed: graphs that publish ids to it can no longer be filled",
                );
            }
            sh.cv.notify_all();
        }
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = handle {
            let _ = t.join();
        }
        sh.rows.set_worker_fed(false);
    }
}

impl Drop for GatherWorker {
    fn drop(&mut self) {
        self.close();
        let sh = &self.shared;
        if sh.ctl().published {
            // A captured graph (or a queued eager publish) may still write the mailbox.
            sh.mailbox().retain_forever();
        }
    }
}

/// Wait politely: spin, then yield, for the first `spin`; then `nap`.
fn pause(waited: Duration, spin: Duration, nap: Duration) {
    if waited < SPIN_PAUSE.min(spin) {
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    } else if waited < spin {
        std::thread::yield_now();
    } else {
        std::thread::sleep(nap);
    }
}

impl Shared {
    fn ctl(&self) -> MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mailbox(&self) -> MutexGuard<'_, IdMailbox> {
        self.mailbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next armed step to fill; `None` once stopped. While nothing is armed, stay hot
    /// for `spin` (a serving loop arms the next step within milliseconds), then block,
    /// waking every `IDLE_POLL`. Any READY seen meanwhile came from a replay that nobody
    /// armed this worker for: release it (see [`Self::unarmed_replay`]).
    fn next_step(&self) -> Option<u64> {
        let t0 = Instant::now();
        loop {
            let mut ctl = self.ctl();
            if self.stop.load(Ordering::Acquire) {
                return None;
            }
            if let Some(s) = ctl.next_to_fill() {
                return Some(s);
            }
            // Holding `ctl`, nothing armed: a begin() for the ids now in the mailbox would
            // have had to happen before its replay was launched, i.e. before READY.
            if self.mailbox().is_ready() {
                self.unarmed_replay(&mut ctl);
                continue;
            }
            let waited = t0.elapsed();
            if waited >= self.opts.spin {
                drop(
                    self.cv
                        .wait_timeout(ctl, IDLE_POLL)
                        .unwrap_or_else(|e| e.into_inner()),
                );
                continue;
            }
            let handled = ctl.handled;
            drop(ctl);
            // Hot: poll the lock-free words until something changes (or the window ends).
            while self.armed_seq.load(Ordering::Acquire) <= handled
                && !self.mailbox().is_ready()
                && !self.stop.load(Ordering::Acquire)
                && t0.elapsed() < self.opts.spin
            {
                pause(t0.elapsed(), self.opts.spin, NAP);
            }
        }
    }

    /// READY with no step armed: take the ids, release the GPU with zero rows, poison the
    /// rows and record the typed error for the next call.
    fn unarmed_replay(&self, ctl: &mut Ctl) {
        let mut scratch = Vec::new();
        let count = self.mailbox().take(&mut scratch);
        ctl.stats.unarmed_replays += 1;
        if self.rows.is_released() {
            // Already aborted or closed: the gate is open for good and the cause recorded.
            return;
        }
        let detail = format!(
            "a graph replay published {count} ids with no step armed (replayed without begin()); its consumer was released with zero rows, never another step's"
        );
        self.rows
            .release_unaccounted(&format!("gather worker: {detail}"));
        ctl.stats.failures += 1;
        if ctl.failure.is_none() {
            ctl.failure = Some(Error::UnarmedReplay { detail });
        }
        self.cv.notify_all();
    }

    /// Poll for READY while a step is armed: hot for `spin`, then short naps. Returns
    /// false if the rows were released or the worker stopped.
    fn wait_ready(&self) -> bool {
        let t0 = Instant::now();
        loop {
            if self.mailbox().is_ready() {
                return true;
            }
            if self.stop.load(Ordering::Acquire) || self.rows.is_released() {
                return false;
            }
            pause(t0.elapsed(), self.opts.spin, NAP);
        }
    }

    fn fill_step(&self, ids: &mut Vec<i64>, rows: &mut Vec<i64>) -> Result<usize> {
        let count = self.mailbox().take(ids);
        let extent = self.rows.step_rows().unwrap_or(0);
        if count > ids.len() || count > extent {
            return Err(Error::rows(format!(
                "the GPU published {count} ids but the step holds {extent} rows (mailbox {})",
                ids.len().max(count)
            )));
        }
        self.map
            .map(ids, rows, self.source.rows(), &self.source.name())?;
        let src = &self.source;
        let skip = self.opts.skip_gather;
        self.rows
            .fill_with(rows.len(), None, Duration::from_secs(1), |dst| {
                if skip {
                    return Ok(());
                }
                src.gather_rows(rows, dst)
            })?;
        Ok(count)
    }
}

fn run(sh: &Shared) {
    crate::os::fine_timer_slack();
    let max_ids = sh.mailbox().max_ids();
    let mut ids = Vec::with_capacity(max_ids);
    let mut rows = Vec::with_capacity(max_ids);
    // Rows of the last fill: the next step's size is most likely the same (decode batches).
    let mut last_rows = 0usize;
    while let Some(step) = sh.next_step() {
        let armed_at = Instant::now();
        let warm = sh.source.own_pool_for(last_rows).map(WarmThreads::start);
        // Counted under the `ctl` lock each way below takes anyway.
        let warmed = u64::from(warm.is_some());
        let ready = sh.wait_ready();
        drop(warm);
        if !ready {
            // Released or stopping: nothing to fill. Mark the step handled so a waiting
            // complete() returns (it then reports the rows' own state).
            let mut ctl = sh.ctl();
            ctl.stats.warmed_steps += warmed;
            ctl.handled = ctl.handled.max(step);
            sh.cv.notify_all();
            continue;
        }
        let t_ready = Instant::now();
        // The GPU reached the step: from now on it may be waiting for these rows.
        sh.rows.watch(step);
        // A panic here (a bug) must still release the GPU: it becomes the step's error.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sh.fill_step(&mut ids, &mut rows)
        }))
        .unwrap_or_else(|_| {
            Err(Error::state(
                Op::Fill,
                "the gather worker panicked while filling this step",
            ))
        });
        let ns = t_ready.elapsed().as_nanos() as u64;
        last_rows = rows.len();
        let mut ctl = sh.ctl();
        ctl.stats.warmed_steps += warmed;
        match result {
            Ok(count) => {
                let eager = ctl.eager.contains(&step);
                let st = &mut ctl.stats;
                st.fills += 1;
                st.ids_total += count as u64;
                st.ready_to_filled_ns_last = ns;
                st.ready_to_filled_ns_max = st.ready_to_filled_ns_max.max(ns);
                st.ready_to_filled_ns_total += ns;
                if eager {
                    st.eager_fills += 1;
                    st.eager_fill_ns_total += ns;
                }
                st.armed_to_ready_ns_last = (t_ready - armed_at).as_nanos() as u64;
            }
            Err(e) => {
                sh.rows.abort(&format!("gather worker: {e}"));
                ctl.stats.failures += 1;
                if ctl.failure.is_none() {
                    ctl.failure = Some(e);
                }
            }
        }
        ctl.handled = ctl.handled.max(step);
        sh.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deferred::{Config, CopyPath, Target};
    use crate::error::ErrorKind;

    const T: Duration = Duration::from_secs(5);

    struct Counting {
        rows: u64,
        width: usize,
    }

    impl RowSource for Counting {
        fn rows(&self) -> u64 {
            self.rows
        }
        fn row_bytes(&self) -> usize {
            self.width
        }
        fn name(&self) -> String {
            "counting".into()
        }
        fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
            for (row, id) in dst.chunks_mut(self.width).zip(ids) {
                row.fill((*id % 251) as u8 + 1);
            }
            Ok(())
        }
    }

    fn opts(max_ids: usize, id_bytes: usize) -> WorkerOptions {
        WorkerOptions {
            max_ids,
            id_bytes,
            ..WorkerOptions::default()
        }
    }

    fn host_rows(max_rows: usize, width: usize, staging: &mut [u8]) -> DeferredRows {
        watched_rows(max_rows, width, staging, None)
    }

    fn watched_rows(
        max_rows: usize,
        width: usize,
        staging: &mut [u8],
        watchdog: Option<Duration>,
    ) -> DeferredRows {
        let cfg = Config {
            max_rows,
            row_bytes: width,
            watchdog,
            track_arrival: false,
            copy: CopyPath::Auto,
            time_stalls: false,
        };
        // SAFETY: `staging` is max_rows * width bytes and outlives the object in each test.
        unsafe {
            DeferredRows::new(
                cfg,
                Target::Host {
                    staging: staging.as_mut_ptr(),
                },
            )
        }
        .unwrap()
    }

    #[test]
    fn per_head_map_checks_and_offsets() {
        let m = RowMap::PerHead {
            offsets: vec![0, 10],
            sizes: vec![10, 5],
        };
        m.validate(15).unwrap();
        assert!(m.validate(14).is_err());
        let mut out = Vec::new();
        m.map(&[3, 4, 9, 0], &mut out, 15, "t").unwrap();
        assert_eq!(out, vec![3, 14, 9, 10]);
        let e = m.map(&[3, 5], &mut out, 15, "t").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RowId);
        assert!(e.to_string().contains("head 1"), "{e}");
        let e = RowMap::Identity
            .map(&[0, -1], &mut out, 15, "t")
            .unwrap_err();
        assert!(matches!(
            e,
            Error::RowId {
                id: -1,
                position: 1,
                ..
            }
        ));
    }

    #[test]
    fn worker_fills_published_ids_and_surfaces_errors() {
        let mut staging = vec![0u8; 8 * 4];
        let rows = host_rows(8, 4, &mut staging);
        let src = Arc::new(Counting {
            rows: 100,
            width: 4,
        });
        let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(8, 8)).unwrap();
        for step in 0..50i64 {
            w.begin(8).unwrap();
            let ids: Vec<i64> = (0..(step % 8 + 1)).map(|i| (i * 7 + step) % 100).collect();
            w.publish_from_host(&ids, T).unwrap();
            w.complete(Duration::from_secs(5)).unwrap();
            for (i, id) in ids.iter().enumerate() {
                assert!(staging[i * 4..i * 4 + 4]
                    .iter()
                    .all(|&b| b == (*id % 251) as u8 + 1));
            }
            assert!(staging[ids.len() * 4..].iter().all(|&b| b == 0));
        }
        assert_eq!(w.stats().fills, 50);
        // A bad id from the "GPU": typed error at complete, then poisoned.
        w.begin(8).unwrap();
        w.publish_from_host(&[1, 200], T).unwrap();
        let e = w.complete(Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RowId, "{e}");
        assert_eq!(w.begin(8).unwrap_err().kind(), ErrorKind::Poisoned);
        assert!(rows.poison_cause().unwrap().contains("out of range"));
        w.close();
    }

    /// A source whose every gather takes `delay`.
    struct Slow {
        inner: Counting,
        delay: Duration,
    }

    impl RowSource for Slow {
        fn rows(&self) -> u64 {
            self.inner.rows()
        }
        fn row_bytes(&self) -> usize {
            self.inner.row_bytes()
        }
        fn name(&self) -> String {
            "slow".into()
        }
        fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
            std::thread::sleep(self.delay);
            self.inner.gather_rows(ids, dst)
        }
    }

    #[test]
    fn the_watchdog_counts_from_the_ids_not_from_begin() {
        let watchdog = Duration::from_millis(60);
        let mut staging = vec![0u8; 4 * 4];
        let rows = watched_rows(4, 4, &mut staging, Some(watchdog));
        let src = Arc::new(Slow {
            inner: Counting { rows: 10, width: 4 },
            delay: Duration::from_millis(5),
        });
        let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8)).unwrap();
        // Armed long before its ids come (the GPU busy with work queued ahead): no wait.
        w.begin(4).unwrap();
        std::thread::sleep(watchdog * 4);
        w.publish_from_host(&[1, 2], T).unwrap();
        w.complete(T).unwrap();
        assert_eq!(rows.stats().watchdog_releases, 0);
        assert!(staging[..4].iter().all(|&b| b == 2));
        // A step whose ids never come (the GPU never reached it) is not released: the
        // host's bounded complete() says so instead.
        w.begin(4).unwrap();
        std::thread::sleep(watchdog * 3);
        assert_eq!(w.complete(watchdog).unwrap_err().kind(), ErrorKind::State);
        assert_eq!(rows.stats().watchdog_releases, 0);
        w.close();
    }

    #[test]
    fn complete_times_out_when_nothing_is_published_and_close_releases() {
        let mut staging = vec![0u8; 4 * 4];
        let rows = host_rows(4, 4, &mut staging);
        let src = Arc::new(Counting { rows: 10, width: 4 });
        let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 4)).unwrap();
        w.begin(4).unwrap();
        let e = w.complete(Duration::from_millis(30)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::State);
        w.close();
        assert!(rows.poison_cause().unwrap().contains("closed"));
    }

    #[test]
    fn try_complete_never_waits_and_completes_only_a_filled_step() {
        let mut staging = vec![0u8; 4 * 4];
        let rows = host_rows(4, 4, &mut staging);
        let src = Arc::new(Counting { rows: 10, width: 4 });
        let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 4)).unwrap();
        assert!(
            matches!(w.try_complete(), Some(Err(_))),
            "nothing begun: the rows say so"
        );
        w.begin(4).unwrap();
        w.begin(4).unwrap();
        assert!(
            w.try_complete().is_none(),
            "no ids yet: it would have to wait"
        );
        assert_eq!(w.in_flight(), 2);
        w.publish_from_host(&[3], T).unwrap();
        let t0 = Instant::now();
        while w.stats().fills < 1 {
            assert!(t0.elapsed() < T, "the worker never filled");
            std::thread::yield_now();
        }
        assert!(matches!(w.try_complete(), Some(Ok(()))));
        assert_eq!((w.in_flight(), staging[0]), (1, 4));
        assert!(w.try_complete().is_none(), "the second step has no ids");
        // A failure is returned at once, typed, whatever is armed.
        w.publish_from_host(&[99], T).unwrap();
        let t0 = Instant::now();
        loop {
            if let Some(done) = w.try_complete() {
                assert_eq!(done.unwrap_err().kind(), ErrorKind::RowId);
                break;
            }
            assert!(t0.elapsed() < T, "the failure never surfaced");
            std::thread::yield_now();
        }
        w.close();
    }

    #[test]
    fn bad_construction_is_refused() {
        let mut staging = vec![0u8; 4 * 4];
        let rows = host_rows(4, 4, &mut staging);
        let src: Arc<dyn RowSource> = Arc::new(Counting { rows: 10, width: 4 });
        let wide: Arc<dyn RowSource> = Arc::new(Counting { rows: 10, width: 8 });
        for r in [
            GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(5, 8)),
            GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(4, 2)),
            GatherWorker::new(rows.clone(), wide, RowMap::Identity, opts(4, 8)),
            GatherWorker::new(
                rows.clone(),
                src.clone(),
                RowMap::PerHead {
                    offsets: vec![0],
                    sizes: vec![11],
                },
                opts(4, 8),
            ),
        ] {
            assert_eq!(r.err().unwrap().kind(), ErrorKind::InvalidArgument);
        }
    }

    #[test]
    fn two_steps_armed_fill_in_order_and_complete_oldest_first() {
        let mut staging = vec![0u8; 8 * 4];
        let rows = host_rows(8, 4, &mut staging);
        let src = Arc::new(Counting {
            rows: 100,
            width: 4,
        });
        let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(8, 8)).unwrap();
        assert_eq!(w.depth(), 2);
        // Host one step ahead: arm 1 and 2 before either is published.
        w.begin(8).unwrap();
        w.begin(8).unwrap();
        assert_eq!(w.begin(8).unwrap_err().kind(), ErrorKind::State);
        assert_eq!(w.in_flight(), 2);
        for round in 0..20i64 {
            w.publish_from_host(&[round, round + 1], T).unwrap();
            // The oldest step completes once its ids were gathered.
            w.complete(Duration::from_secs(5)).unwrap();
            assert_eq!(staging[0], (round % 251) as u8 + 1);
            assert_eq!(staging[4], ((round + 1) % 251) as u8 + 1);
            w.begin(8).unwrap();
        }
        w.publish_from_host(&[7], T).unwrap();
        w.complete(Duration::from_secs(5)).unwrap();
        w.publish_from_host(&[9], T).unwrap();
        w.complete(Duration::from_secs(5)).unwrap();
        assert_eq!(staging[0], 10);
        assert_eq!(w.in_flight(), 0);
        assert_eq!(w.stats().fills, 22);
        // A host-fed step on the rows object while the worker has steps armed is refused.
        w.begin(8).unwrap();
        assert_eq!(rows.begin(8).unwrap_err().kind(), ErrorKind::State);
        w.publish_from_host(&[1], T).unwrap();
        w.complete(Duration::from_secs(5)).unwrap();
        w.close();
    }

    /// Rows as [`Counting`]'s, gathered on a pool of its own from 4 rows up.
    struct Pooled {
        pool: rayon::ThreadPool,
    }

    impl RowSource for Pooled {
        fn rows(&self) -> u64 {
            100
        }
        fn row_bytes(&self) -> usize {
            4
        }
        fn name(&self) -> String {
            "pooled".into()
        }
        fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
            use rayon::prelude::*;
            self.pool.install(|| {
                dst.par_chunks_mut(4)
                    .zip(ids.par_iter())
                    .for_each(|(row, id)| row.fill((*id % 251) as u8 + 1))
            });
            Ok(())
        }
        fn own_pool_for(&self, rows: usize) -> Option<&rayon::ThreadPool> {
            (rows >= 4).then_some(&self.pool)
        }
    }

    /// How long a trivial job on `pool` waits for a free thread.
    fn pool_wait(pool: &rayon::ThreadPool) -> Duration {
        let t0 = Instant::now();
        pool.install(|| ());
        t0.elapsed()
    }

    #[test]
    fn own_gather_threads_are_held_awake_only_while_a_step_is_armed() {
        let mut staging = vec![0u8; 8 * 4];
        let rows = host_rows(8, 4, &mut staging);
        let src = Arc::new(Pooled {
            pool: rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap(),
        });
        let w = GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(8, 8)).unwrap();
        // The first step has no previous fill to go by; 2 rows stay below the pool.
        for (k, ids) in [
            vec![1, 2],
            vec![3, 4],
            (0..8).collect(),
            (10..18).collect(),
            vec![5],
            (20..28).collect(),
        ]
        .into_iter()
        .enumerate()
        {
            w.begin(8).unwrap();
            std::thread::sleep(Duration::from_millis(5));
            w.publish_from_host(&ids, T).unwrap();
            w.complete(T).unwrap();
            for (i, id) in ids.iter().enumerate() {
                assert!(
                    staging[i * 4..i * 4 + 4]
                        .iter()
                        .all(|&b| b == (*id % 251) as u8 + 1),
                    "step {k} row {i}"
                );
            }
            // The warm jobs ended with the step: the pool is free long before WARM_MAX.
            let wait = pool_wait(&src.pool);
            assert!(wait < WARM_MAX / 2, "step {k}: the pool was held {wait:?}");
        }
        // Warmed: the steps after an 8-row fill (the 4th and the 5th), not the one after
        // the 1-row fill.
        assert_eq!(w.stats().warmed_steps, 2);
        assert_eq!(w.stats().fills, 6);
        // Armed after an 8-row fill and never published: closing ends the warm jobs too.
        w.begin(8).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        w.close();
        let wait = pool_wait(&src.pool);
        assert!(
            wait < WARM_MAX / 2,
            "after close the pool was held {wait:?}"
        );
        assert_eq!(w.stats().warmed_steps, 3);
    }

    #[test]
    fn eager_steps_fills_are_counted_apart_from_replays() {
        let mut staging = vec![0u8; 8 * 4];
        let rows = host_rows(8, 4, &mut staging);
        let src = Arc::new(Slow {
            inner: Counting {
                rows: 100,
                width: 4,
            },
            delay: Duration::from_millis(20),
        });
        let w = GatherWorker::new(rows, src, RowMap::Identity, opts(8, 8)).unwrap();
        // replay, eager, replay, with two armed at once (the eager one second in line).
        w.begin(8).unwrap();
        w.begin_eager(8).unwrap();
        w.publish_from_host(&[1], T).unwrap();
        w.complete(T).unwrap();
        w.begin(8).unwrap();
        for ids in [[2i64], [3]] {
            w.publish_from_host(&ids, T).unwrap();
            w.complete(T).unwrap();
        }
        let s = w.stats();
        assert_eq!((s.fills, s.eager_fills), (3, 1));
        // Every gather sleeps 20 ms: the eager share of the time is one fill's.
        assert!(s.eager_fill_ns_total >= 20_000_000, "{s:?}");
        assert!(
            s.ready_to_filled_ns_total >= s.eager_fill_ns_total + 40_000_000,
            "{s:?}"
        );
        // A failed eager step leaves no mark on the next steps' accounting.
        w.begin_eager(8).unwrap();
        w.publish_from_host(&[500], T).unwrap();
        assert_eq!(w.complete(T).unwrap_err().kind(), ErrorKind::RowId);
        assert_eq!(w.stats().eager_fills, 1);
        w.close();
    }

    #[test]
    fn a_publish_nobody_armed_is_released_with_zeros_and_typed() {
        let mut staging = vec![0u8; 4 * 4];
        let rows = host_rows(4, 4, &mut staging);
        let src = Arc::new(Counting { rows: 10, width: 4 });
        let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8)).unwrap();
        w.begin(4).unwrap();
        w.publish_from_host(&[3, 4], T).unwrap();
        w.complete(Duration::from_secs(5)).unwrap();
        assert_eq!(staging[0], 4);
        // A host publish for no armed step is refused, and writes nothing.
        let e = w.publish_from_host(&[5, 6], T).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoArmedStep, "{e}");
        assert!(e.kind().is_state(), "{e}");
        assert_eq!(staging[0], 4);
        // A "replay" without begin(): the worker must not keep the ids for the next step.
        w.simulate_replay_publish(&[5, 6]);
        let t0 = Instant::now();
        while !rows.is_released() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(rows.is_released(), "the unarmed publish was not released");
        assert!(
            staging.iter().all(|&b| b == 0),
            "the consumer must read zeros"
        );
        let e = w.begin(4).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnarmedReplay, "{e}");
        assert!(e.to_string().contains("without begin()"), "{e}");
        assert_eq!(w.begin(4).unwrap_err().kind(), ErrorKind::Poisoned);
        assert_eq!(w.stats().unarmed_replays, 1);
        w.close();
    }

    #[test]
    fn closing_a_worker_that_published_releases_its_rows() {
        let mut staging = vec![0u8; 4 * 4];
        let rows = host_rows(4, 4, &mut staging);
        let src = Arc::new(Counting { rows: 10, width: 4 });
        let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8)).unwrap();
        w.begin(4).unwrap();
        w.publish_from_host(&[1], T).unwrap();
        w.complete(Duration::from_secs(5)).unwrap();
        assert!(!rows.is_released());
        w.close();
        assert!(rows.is_released());
        assert!(rows
            .poison_cause()
            .unwrap()
            .contains("can no longer be filled"));
    }

    #[test]
    fn host_ids_go_to_armed_steps_in_order_once_each() {
        let mut staging = vec![0u8; 4 * 4];
        let rows = host_rows(4, 4, &mut staging);
        let src = Arc::new(Counting {
            rows: 1000,
            width: 4,
        });
        let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 4)).unwrap();
        // Two steps armed, two publishes back to back: the second waits for the worker to
        // take the first ids, then goes to the second step.
        w.begin(4).unwrap();
        w.begin(4).unwrap();
        w.publish_from_host(&[3], T).unwrap();
        w.publish_from_host(&[7], T).unwrap();
        // A third has no armed step to go to.
        let e = w.publish_from_host(&[9], T).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoArmedStep, "{e}");
        assert!(e.kind().is_state(), "{e}");
        assert!(e.to_string().contains("no armed step"), "{e}");
        w.complete(T).unwrap();
        w.complete(T).unwrap();
        assert_eq!(staging[0], 8, "the second step's row");
        assert_eq!(w.stats().publishes_host, 2);
        // int32 ids: a wider id is refused before anything is written, typed.
        w.begin(4).unwrap();
        let e = w.publish_from_host(&[1, 1 << 33], T).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RowId, "{e}");
        w.publish_from_host(&[5], T).unwrap();
        w.complete(T).unwrap();
        assert_eq!(staging[0], 6);
        w.close();
        assert_eq!(
            w.publish_from_host(&[1], T).unwrap_err().kind(),
            ErrorKind::Closed
        );
    }
}
