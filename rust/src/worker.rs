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
    /// From `begin()` (the worker armed) to READY seen: how early the host was.
    pub armed_to_ready_ns_last: u64,
    pub publishes_captured: u64,
    pub publishes_eager: u64,
}

struct Ctl {
    armed: Option<u64>,
    done: Option<u64>,
    failure: Option<Error>,
    stats: WorkerStats,
    published: bool,
}

struct Shared {
    rows: DeferredRows,
    source: Arc<dyn RowSource>,
    map: RowMap,
    mailbox: Mutex<IdMailbox>,
    path: PublishPath,
    kernels: Option<Kernels>,
    ctx: Option<PrimaryContext>,
    ctl: Mutex<Ctl>,
    cv: Condvar,
    /// The armed step (0: none), readable without the lock by the polling worker.
    armed_step: AtomicU64,
    stop: AtomicBool,
}

/// See the module docs. Every method takes `&self`; the object is `Send + Sync`.
pub struct GatherWorker {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

const SPIN: Duration = Duration::from_micros(100);

impl GatherWorker {
    /// A worker that fills `rows` from `source` with ids of `id_bytes` (4 or 8) published
    /// into a mailbox of `max_ids`. `rows` must run the deferred protocol (or host mode,
    /// where ids are published from the host).
    pub fn new(
        rows: DeferredRows,
        source: Arc<dyn RowSource>,
        map: RowMap,
        max_ids: usize,
        id_bytes: usize,
        path: PublishPath,
    ) -> Result<Self> {
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
        if source.row_bytes() != rows.row_bytes() {
            return Err(Error::invalid(format!(
                "table rows are {} bytes, the rows object's are {}",
                source.row_bytes(),
                rows.row_bytes()
            )));
        }
        map.validate(source.rows())?;
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
            path,
            kernels,
            ctx,
            ctl: Mutex::new(Ctl {
                armed: None,
                done: None,
                failure: None,
                stats: WorkerStats::default(),
                published: false,
            }),
            cv: Condvar::new(),
            armed_step: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ple-memops-gather".into())
            .spawn(move || run(&sh))
            .map_err(|e| Error::invalid(format!("cannot start the gather worker thread: {e}")))?;
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

    pub fn stats(&self) -> WorkerStats {
        self.shared.ctl().stats.clone()
    }

    /// Start a step of `rows` rows and arm the worker for its ids.
    pub fn begin(&self, rows: usize) -> Result<u64> {
        let sh = &self.shared;
        let mut ctl = sh.ctl();
        if ctl.armed.is_some() {
            return Err(Error::state(
                Op::Begin,
                "the previous step is still armed; call complete() first",
            ));
        }
        let step = sh.rows.begin(rows)?;
        ctl.armed = Some(step);
        ctl.done = None;
        sh.armed_step.store(step, Ordering::Release);
        sh.cv.notify_all();
        Ok(step)
    }

    /// Wait (at most `timeout`) for the worker to fill the armed step, then complete it.
    /// Returns the worker's error, typed, if its gather failed (the GPU was released).
    pub fn complete(&self, timeout: Duration) -> Result<()> {
        let sh = &self.shared;
        let mut ctl = sh.ctl();
        let Some(step) = ctl.armed else {
            if let Some(e) = ctl.failure.take() {
                return Err(e);
            }
            return sh.rows.complete();
        };
        let deadline = Instant::now() + timeout;
        while ctl.done != Some(step) {
            // The watchdog (or an abort) may release the step while the GPU never publishes.
            if sh.rows.is_released() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::state(
                    Op::Complete,
                    format!("the worker has not filled step {step} within {timeout:?}: the GPU has not published its ids"),
                ));
            }
            ctl = sh
                .cv
                .wait_timeout(ctl, (deadline - now).min(Duration::from_millis(5)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        ctl.armed = None;
        sh.armed_step.store(0, Ordering::Release);
        if let Some(e) = ctl.failure.take() {
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
        let mailbox = sh.mailbox();
        if n_ids == 0 || n_ids > mailbox.max_ids() {
            return Err(Error::rows(format!(
                "publish of {n_ids} ids: the mailbox holds 1..={}",
                mailbox.max_ids()
            )));
        }
        let dev = ctx.ordinal();
        let _g = ctx.bind()?;
        // SAFETY: the caller's contract on `stream`.
        let captured = unsafe { driver::capture_id(stream, dev)? }.is_some();
        let (m_ids, m_count, m_ready) = mailbox.device_ptrs().expect("pinned mailbox");
        let elem = mailbox.id_bytes();
        // SAFETY: the mailbox is retained forever once anything was published (see drop),
        // the caller vouches for `ids`, `count_dev` and `stream`.
        unsafe {
            match sh.path {
                PublishPath::Kernel => kernels
                    .publish_ids(stream, ids, n_ids, count_dev, elem, m_ids, m_count, m_ready)?,
                PublishPath::Memop => {
                    driver::copy_d2h_async(mailbox.ids_host_ptr(), ids, n_ids * elem, stream, dev)?;
                    if count_dev != 0 {
                        driver::copy_d2h_async(
                            mailbox.count_host_ptr(),
                            count_dev,
                            4,
                            stream,
                            dev,
                        )?;
                    } else {
                        driver::write_u32(stream, m_count, n_ids as u32, dev)?;
                    }
                    driver::write_u32(stream, m_ready, 1, dev)?;
                }
            }
        }
        drop(mailbox);
        let mut ctl = sh.ctl();
        ctl.published = true;
        if captured {
            ctl.stats.publishes_captured += 1;
        } else {
            ctl.stats.publishes_eager += 1;
        }
        Ok(())
    }

    /// Publish ids from the host (host mode, and tests of the worker without a GPU).
    pub fn publish_from_host(&self, ids: &[i64]) -> Result<()> {
        let mailbox = self.shared.mailbox();
        if ids.len() > mailbox.max_ids() {
            return Err(Error::rows(format!(
                "{} ids: the mailbox holds at most {}",
                ids.len(),
                mailbox.max_ids()
            )));
        }
        mailbox.publish_from_host(ids);
        Ok(())
    }

    /// Whether `close()` ran.
    pub fn is_closed(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// Stop the worker thread (idempotent); a step still armed is aborted (the GPU is
    /// released).
    pub fn close(&self) {
        let sh = &self.shared;
        sh.stop.store(true, Ordering::Release);
        {
            let ctl = sh.ctl();
            if ctl.armed.is_some() && ctl.done != ctl.armed {
                sh.rows.abort("gather worker closed with a step pending");
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

impl Shared {
    fn ctl(&self) -> MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mailbox(&self) -> MutexGuard<'_, IdMailbox> {
        self.mailbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Poll for READY while `step` stays armed: spin briefly, then yield, then sleep in
    /// growing steps (up to 50 us), so an early host costs little CPU. Returns false if
    /// the step was disarmed, the rows released, or the worker stopped.
    fn wait_ready(&self, step: u64) -> bool {
        let t0 = Instant::now();
        let mut nap = Duration::from_micros(2);
        loop {
            if self.mailbox().is_ready() {
                return true;
            }
            if self.stop.load(Ordering::Acquire)
                || self.armed_step.load(Ordering::Acquire) != step
                || self.rows.is_released()
            {
                return false;
            }
            let e = t0.elapsed();
            if e < SPIN {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            } else if e < SPIN * 10 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_micros(50));
            }
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
        self.rows
            .fill_with(rows.len(), None, Duration::from_secs(1), |dst| {
                src.gather_rows(rows, dst)
            })?;
        Ok(count)
    }
}

fn run(sh: &Shared) {
    let max_ids = sh.mailbox().max_ids();
    let mut ids = Vec::with_capacity(max_ids);
    let mut rows = Vec::with_capacity(max_ids);
    loop {
        let step = {
            let mut ctl = sh.ctl();
            loop {
                if sh.stop.load(Ordering::Acquire) {
                    return;
                }
                match ctl.armed {
                    Some(s) if ctl.done != Some(s) => break s,
                    _ => ctl = sh.cv.wait(ctl).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        let armed_at = Instant::now();
        if !sh.wait_ready(step) {
            // Disarmed, released or stopping: nothing to fill. Mark the step done so a
            // waiting complete() returns (it then reports the rows' own state).
            let mut ctl = sh.ctl();
            if ctl.armed == Some(step) {
                ctl.done = Some(step);
            }
            sh.cv.notify_all();
            if sh.stop.load(Ordering::Acquire) {
                return;
            }
            // Wait until the host disarms this step before polling again.
            while ctl.armed == Some(step) && !sh.stop.load(Ordering::Acquire) {
                ctl = sh.cv.wait(ctl).unwrap_or_else(|e| e.into_inner());
            }
            continue;
        }
        let t_ready = Instant::now();
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
        let mut ctl = sh.ctl();
        match result {
            Ok(count) => {
                let st = &mut ctl.stats;
                st.fills += 1;
                st.ids_total += count as u64;
                st.ready_to_filled_ns_last = ns;
                st.ready_to_filled_ns_max = st.ready_to_filled_ns_max.max(ns);
                st.ready_to_filled_ns_total += ns;
                st.armed_to_ready_ns_last = (t_ready - armed_at).as_nanos() as u64;
            }
            Err(e) => {
                sh.rows.abort(&format!("gather worker: {e}"));
                ctl.stats.failures += 1;
                ctl.failure = Some(e);
            }
        }
        ctl.done = Some(step);
        sh.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deferred::{Config, CopyPath, Target};
    use crate::error::ErrorKind;

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

    fn host_rows(max_rows: usize, width: usize, staging: &mut [u8]) -> DeferredRows {
        let cfg = Config {
            max_rows,
            row_bytes: width,
            watchdog: None,
            track_arrival: false,
            copy: CopyPath::Auto,
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
        let w = GatherWorker::new(
            rows.clone(),
            src,
            RowMap::Identity,
            8,
            8,
            PublishPath::Kernel,
        )
        .unwrap();
        for step in 0..50i64 {
            w.begin(8).unwrap();
            let ids: Vec<i64> = (0..(step % 8 + 1)).map(|i| (i * 7 + step) % 100).collect();
            w.publish_from_host(&ids).unwrap();
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
        w.publish_from_host(&[1, 200]).unwrap();
        let e = w.complete(Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RowId, "{e}");
        assert_eq!(w.begin(8).unwrap_err().kind(), ErrorKind::Poisoned);
        assert!(rows.poison_cause().unwrap().contains("out of range"));
        w.close();
    }

    #[test]
    fn complete_times_out_when_nothing_is_published_and_close_releases() {
        let mut staging = vec![0u8; 4 * 4];
        let rows = host_rows(4, 4, &mut staging);
        let src = Arc::new(Counting { rows: 10, width: 4 });
        let w = GatherWorker::new(
            rows.clone(),
            src,
            RowMap::Identity,
            4,
            4,
            PublishPath::Kernel,
        )
        .unwrap();
        w.begin(4).unwrap();
        let e = w.complete(Duration::from_millis(30)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::State);
        w.close();
        assert!(rows.poison_cause().unwrap().contains("closed"));
    }

    #[test]
    fn bad_construction_is_refused() {
        let mut staging = vec![0u8; 4 * 4];
        let rows = host_rows(4, 4, &mut staging);
        let src: Arc<dyn RowSource> = Arc::new(Counting { rows: 10, width: 4 });
        let wide: Arc<dyn RowSource> = Arc::new(Counting { rows: 10, width: 8 });
        for r in [
            GatherWorker::new(
                rows.clone(),
                src.clone(),
                RowMap::Identity,
                5,
                8,
                PublishPath::Kernel,
            ),
            GatherWorker::new(
                rows.clone(),
                src.clone(),
                RowMap::Identity,
                4,
                2,
                PublishPath::Kernel,
            ),
            GatherWorker::new(
                rows.clone(),
                wide,
                RowMap::Identity,
                4,
                8,
                PublishPath::Kernel,
            ),
            GatherWorker::new(
                rows.clone(),
                src.clone(),
                RowMap::PerHead {
                    offsets: vec![0],
                    sizes: vec![11],
                },
                4,
                8,
                PublishPath::Kernel,
            ),
        ] {
            assert_eq!(r.err().unwrap().kind(), ErrorKind::InvalidArgument);
        }
    }
}
