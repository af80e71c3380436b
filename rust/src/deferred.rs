//! [`DeferredRows`]: one batch of embedding rows per step, gathered by the host and
//! consumed by GPU work that may have been launched (or captured) before the host
//! gathered them.
//!
//! Three modes share one lifecycle ([`crate::state::Phase`]) and give byte-identical
//! staging contents:
//!
//! * **Deferred** (stream memory operations supported): `enqueue` puts
//!   `WAIT(gate) ; H2D staging <- slot ; WRITE(filled = EMPTY)` on the caller's stream,
//!   eagerly or under capture; `fill` writes the pinned slot and stores FILLED.
//! * **Sync** (a GPU without the capability): `fill` writes the slot and enqueues the
//!   H2D copy on the given stream right away, so it must precede the launch; `enqueue`
//!   records nothing.
//! * **Host** (no GPU): `fill` writes the host staging buffer directly.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::cuda::driver::{
    self, DeviceBuffer, DevicePtr, Event, Kernels, OwnedStream, PrimaryContext, RawStream, Stream,
};
use crate::cuda::pinned::{HostFlag, PinnedBuf};
use crate::cuda::stall::{StallClock, StallSamples, Stamp};
use crate::error::{Error, Op, Result};
use crate::probe;
use crate::state::Phase;
use crate::wait::wait_until;
use crate::watchdog::{self, Watched};

/// Sizes and policy of one object.
#[derive(Debug, Clone)]
pub struct Config {
    /// Rows the slot and staging buffer hold.
    pub max_rows: usize,
    /// Bytes per row.
    pub row_bytes: usize,
    /// Abort a step that nobody fills within this bound (`None`: never).
    pub watchdog: Option<Duration>,
    /// Enqueue an extra WRITE before the WAIT so `fill` can tell whether the GPU was
    /// already waiting (counted in [`Stats::gpu_waited`]). Costs one stream write a step
    /// (two on the memop path).
    pub track_arrival: bool,
    /// How the consumer's side runs on the GPU (deferred mode only).
    pub copy: CopyPath,
    /// Time each step's consumer stall on the GPU ([`crate::cuda::stall`]): two
    /// one-thread kernels a step. Deferred mode only; ignored elsewhere.
    pub time_stalls: bool,
}

/// Where the consumer of an enqueued step runs (for stall timing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumer {
    /// On the stream the step is enqueued on: it arrives right before the wait.
    Inline,
    /// On another stream that joins this one later and calls
    /// [`DeferredRows::stamp_arrival`] there first.
    Joins,
}

/// The device side of a deferred step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyPath {
    /// [`CopyPath::Kernel`] up to [`KERNEL_MAX_BYTES`] a step, [`CopyPath::Memop`] above.
    #[default]
    Auto,
    /// Kernels only. Up to [`KERNEL_MAX_BYTES`]: one single-block kernel polls the flag,
    /// reads the mapped slot over PCIe, writes the staging buffer and resets the flag
    /// (lowest latency; occupies one SM while it waits). Above: one warp polls, then a grid
    /// of blocks reads the slot and the last one resets the flag (one block's PCIe reads
    /// would be too slow).
    Kernel,
    /// `cuStreamWaitValue64` ; copy-engine H2D ; `cuStreamWriteValue32`. Occupies no SM
    /// while waiting; the copy engine wins on bandwidth for large steps.
    Memop,
    /// The single-block kernel of [`CopyPath::Kernel`] at every size (one SM reads the
    /// whole slot over PCIe): one kernel node, no grid launch, no copy engine.
    KernelFused,
}

/// Largest step [`CopyPath::Auto`] sends through the kernel path (chosen by measurement:
/// BENCHMARKS.md, "copy path"), and the largest the kernel path copies with its fused
/// single-block kernel (a forced kernel path takes the grid copy above it).
pub const KERNEL_MAX_BYTES: usize = 64 * 1024;

impl CopyPath {
    pub fn name(self) -> &'static str {
        match self {
            CopyPath::Auto => "auto",
            CopyPath::Kernel => "kernel",
            CopyPath::Memop => "memop",
            CopyPath::KernelFused => "kernel-fused",
        }
    }

    fn resolve(self, bytes: usize) -> CopyPath {
        match self {
            CopyPath::Auto if bytes <= KERNEL_MAX_BYTES => CopyPath::Kernel,
            CopyPath::Auto => CopyPath::Memop,
            other => other,
        }
    }
}

/// Where the staging buffer lives.
#[derive(Debug, Clone, Copy)]
pub enum Target {
    /// Device memory on CUDA device `device` (e.g. a torch tensor's `data_ptr()`).
    /// `force_sync` selects the synchronous fallback even where deferral is supported.
    Cuda {
        device: i32,
        staging: DevicePtr,
        force_sync: bool,
    },
    /// Host memory (no GPU).
    Host { staging: *mut u8 },
}

/// Which protocol an object runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Deferred,
    Sync,
    Host,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Deferred => "deferred",
            Mode::Sync => "sync",
            Mode::Host => "host",
        }
    }
}

/// What an `enqueue` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// Recorded into the capture with this id.
    Captured(u64),
    /// Issued eagerly (the WAIT passes at once: the step was filled first).
    Eager,
    /// Nothing to record (fallback modes: the fill did the copy).
    Nothing,
}

/// Counters and timings of one object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub steps: u64,
    pub fills: u64,
    pub dummies: u64,
    pub aborts: u64,
    pub watchdog_releases: u64,
    pub eager_enqueues: u64,
    pub captured_enqueues: u64,
    pub slot_busy: u64,
    /// Fills that found the GPU already at its WAIT (only with `track_arrival`).
    pub gpu_waited: u64,
    /// Host time of the last fill, from entry to the flag store, in nanoseconds.
    pub fill_ns_last: u64,
    pub fill_ns_max: u64,
    pub fill_ns_total: u64,
}

enum Slot {
    Pinned(PinnedBuf),
    Heap(Vec<u8>),
}

impl Slot {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Slot::Pinned(p) => p.as_mut_slice(),
            Slot::Heap(v) => v,
        }
    }
}

struct Inner {
    phase: Phase,
    slot: Slot,
    /// Rows of the slot that may hold non-zero bytes (padding above is already zero).
    dirty_rows: usize,
    /// A fill is writing the slot without the lock (see `Shared::fill_impl`): until it
    /// clears this, nothing else reads or writes the slot's bytes on the host.
    filling: bool,
    /// The last eager copy (deferred: an eager enqueue; sync: a fill); `None` until one.
    last_copy: Option<Event>,
    copy_pending: bool,
    captured_ids: Vec<u64>,
    step_seq: u64,
    stats: Stats,
}

struct Shared {
    cfg: Config,
    mode: Mode,
    staging: Target,
    fallback_reason: Option<String>,
    /// Host address of the pinned slot (null in host mode); stable for the object's life.
    slot_ptr: *const u8,
    /// Device address of the same slot (0 in host mode).
    slot_dptr: DevicePtr,
    /// The protocol kernels (deferred mode).
    kernel: Option<Kernels>,
    /// A native worker fills this object (see [`crate::worker`]): eager enqueues may precede
    /// the fill, since no host-thread synchronisation can block the worker.
    worker_fed: AtomicBool,
    /// Set (under `inner`'s lock) when the phase becomes `Poisoned`, never cleared: lets
    /// [`DeferredRows::poison_cause`] answer "usable" without the lock, which a worker's
    /// gather holds for the whole fill (an engine asks every step, while the next step's
    /// rows are being gathered).
    poisoned: AtomicBool,
    flag: Option<HostFlag>,
    /// Stall timing (deferred mode with `time_stalls`).
    stall: Option<StallClock>,
    /// The grid copy's count of finished blocks (deferred mode with a forced kernel path,
    /// the only one that copies with a grid; see `Kernels::wait_copy_reset`): device
    /// memory, zero between steps.
    copy_done: Option<DeviceBuffer>,
    inner: Mutex<Inner>,
    /// A dedicated stream for staged consumers (created on first use).
    side: Mutex<Option<OwnedStream>>,
    // Declared last: dropped after the pinned memory it owns.
    ctx: Option<PrimaryContext>,
}

// SAFETY: the raw pointers (`slot_ptr`, a host staging pointer) name memory that lives as
// long as the object (new()'s contract); all host access to it happens under `inner`'s lock,
// except a fill's write of the slot, which `Inner::filling` (set and cleared under the lock)
// keeps exclusive.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// See the module docs. Cheap to clone (a shared handle); thread-safe.
#[derive(Clone)]
pub struct DeferredRows {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for DeferredRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredRows")
            .field("mode", &self.shared.mode)
            .field("max_rows", &self.shared.cfg.max_rows)
            .field("row_bytes", &self.shared.cfg.row_bytes)
            .field("phase", &self.phase_name())
            .finish()
    }
}

impl DeferredRows {
    /// Create an object whose staging buffer is `target`.
    ///
    /// # Safety
    /// The staging memory named by `target` is at least `max_rows * row_bytes` bytes, lives
    /// at least as long as this object and every graph that captured it, and (for
    /// `Target::Host`) is not accessed by anyone else during `fill`.
    pub unsafe fn new(cfg: Config, target: Target) -> Result<Self> {
        if cfg.max_rows == 0 || cfg.row_bytes == 0 {
            return Err(Error::invalid(format!(
                "max_rows and row_bytes must be positive, got {} and {}",
                cfg.max_rows, cfg.row_bytes
            )));
        }
        let bytes = cfg
            .max_rows
            .checked_mul(cfg.row_bytes)
            .ok_or_else(|| Error::invalid("max_rows * row_bytes overflows"))?;
        if let Some(d) = cfg.watchdog {
            if d.is_zero() {
                return Err(Error::invalid(
                    "watchdog timeout must be positive (or None)",
                ));
            }
        }
        let (mode, ctx, flag, slot, fallback_reason) = match target {
            Target::Host { staging } => {
                if staging.is_null() {
                    return Err(Error::invalid("null host staging buffer"));
                }
                (
                    Mode::Host,
                    None,
                    None,
                    Slot::Heap(vec![0; bytes]),
                    Some("no CUDA device".to_string()),
                )
            }
            Target::Cuda {
                device,
                staging,
                force_sync,
            } => {
                if staging == 0 {
                    return Err(Error::invalid("null device staging buffer"));
                }
                let cap = probe::probe(device)?;
                let ctx = PrimaryContext::retain(device)?;
                let _g = ctx.bind()?;
                let slot = Slot::Pinned(PinnedBuf::new(bytes, device)?);
                if cap.supported && !force_sync {
                    let flag = HostFlag::new(device)?;
                    (Mode::Deferred, Some(ctx), Some(flag), slot, None)
                } else {
                    let why = if force_sync {
                        "synchronous fallback requested".to_string()
                    } else {
                        cap.reason.clone()
                    };
                    (Mode::Sync, Some(ctx), None, slot, Some(why))
                }
            }
        };
        let (slot_ptr, slot_dptr) = match &slot {
            Slot::Pinned(p) => (p.host_ptr(), p.device_ptr()),
            Slot::Heap(_) => (std::ptr::null(), 0),
        };
        let kernel = match (&mode, &ctx) {
            (Mode::Deferred, Some(ctx)) => {
                let _g = ctx.bind()?;
                Some(Kernels::get(ctx.ordinal())?)
            }
            _ => None,
        };
        let stall = match (&kernel, &ctx) {
            (Some(k), Some(ctx)) if cfg.time_stalls => {
                let _g = ctx.bind()?;
                Some(StallClock::new(ctx.ordinal(), *k)?)
            }
            _ => None,
        };
        let copy_done = match (&kernel, &ctx) {
            (Some(_), Some(ctx)) if cfg.copy == CopyPath::Kernel => {
                let _g = ctx.bind()?;
                let buf = DeviceBuffer::new(16, ctx.ordinal())?;
                buf.zero(16, ctx.ordinal())?;
                Some(buf)
            }
            _ => None,
        };
        let shared = Arc::new(Shared {
            cfg,
            stall,
            copy_done,
            slot_ptr,
            slot_dptr,
            kernel,
            worker_fed: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            mode,
            staging: target,
            fallback_reason,
            flag,
            inner: Mutex::new(Inner {
                phase: Phase::default(),
                slot,
                dirty_rows: 0,
                filling: false,
                last_copy: None,
                copy_pending: false,
                captured_ids: Vec::new(),
                step_seq: 0,
                stats: Stats::default(),
            }),
            side: Mutex::new(None),
            ctx,
        });
        Ok(Self { shared })
    }

    pub fn mode(&self) -> Mode {
        self.shared.mode
    }

    /// The configured device-side path (see [`CopyPath`]).
    pub fn copy_path(&self) -> CopyPath {
        self.shared.cfg.copy
    }

    /// Why this object does not defer (`None` when it does).
    pub fn fallback_reason(&self) -> Option<&str> {
        self.shared.fallback_reason.as_deref()
    }

    pub fn max_rows(&self) -> usize {
        self.shared.cfg.max_rows
    }

    pub fn row_bytes(&self) -> usize {
        self.shared.cfg.row_bytes
    }

    pub fn device(&self) -> Option<i32> {
        self.shared.ctx.as_ref().map(|c| c.ordinal())
    }

    pub fn phase_name(&self) -> &'static str {
        self.shared.lock().phase.name()
    }

    pub fn stats(&self) -> Stats {
        self.shared.lock().stats.clone()
    }

    /// The first cause, once poisoned. While the object is usable this takes no lock, so
    /// it never waits for a fill in progress.
    pub fn poison_cause(&self) -> Option<String> {
        if !self.shared.poisoned.load(Ordering::Acquire) {
            return None;
        }
        match &self.shared.lock().phase {
            Phase::Poisoned { cause } => Some(cause.clone()),
            _ => None,
        }
    }

    /// Start a step whose consumer copies `rows` rows (the captured extent). One step at
    /// a time; on an object a worker fills, only while the worker has none in flight
    /// (the eager, host-filled path).
    pub fn begin(&self, rows: usize) -> Result<u64> {
        if self.shared.worker_fed.load(Ordering::Acquire) && self.in_flight() > 0 {
            return Err(Error::state(
                Op::Begin,
                "its gather worker has steps in flight; complete them before a host-filled step",
            ));
        }
        self.begin_step(rows, 1, false)
    }

    /// A step the gather worker arms, with up to `depth` of its steps in flight. Its
    /// watchdog clock starts when its ids arrive ([`DeferredRows::watch`]), not here: the
    /// GPU waits for rows only once it has reached the step, and whatever it runs before
    /// (a long prefill queued ahead, a first-time kernel compile) is no wait on us.
    pub(crate) fn begin_for_worker(&self, rows: usize, depth: usize) -> Result<u64> {
        self.begin_step(rows, depth, true)
    }

    /// Whether the GPU has handed the slot back (the last fill's consumer copied it and
    /// reset the flag), so a fill writes it without waiting. Always true off the deferred
    /// protocol (host mode has no consumer on a device).
    pub(crate) fn slot_free(&self) -> bool {
        self.shared
            .flag
            .as_ref()
            .is_none_or(|f| f.filled() == HostFlag::EMPTY)
    }

    /// Start the watchdog's clock for `step` now (the worker saw its ids: the GPU is at
    /// the step's wait, or about to be). Nothing without a watchdog or for a step that is
    /// no longer pending (the watchdog checks when it fires).
    pub(crate) fn watch(&self, step: u64) {
        if let Some(d) = self.shared.cfg.watchdog {
            let target: Arc<dyn Watched> = self.shared.clone();
            watchdog::arm(&target, step, Instant::now() + d);
        }
    }

    fn begin_step(&self, rows: usize, depth: usize, worker: bool) -> Result<u64> {
        let s = &self.shared;
        let step = {
            let mut inner = s.lock();
            let step = inner.step_seq + 1;
            inner
                .phase
                .begin(rows, s.cfg.max_rows, step, depth, worker)?;
            inner.step_seq = step;
            step
        };
        if !worker {
            // Host-filled: the step may be waited on from now.
            self.watch(step);
        }
        Ok(step)
    }

    /// Block until the GPU consumed the last fill (the slot is the host's again), at most
    /// `timeout`. Returns whether it did.
    pub fn wait_consumed(&self, timeout: Duration) -> Result<bool> {
        let s = &self.shared;
        s.lock().phase.check_live()?;
        match s.mode {
            Mode::Deferred => {
                let flag = s.flag.as_ref().expect("deferred mode has a flag");
                Ok(wait_until(timeout, || flag.filled() == HostFlag::EMPTY))
            }
            Mode::Sync => {
                let inner = s.lock();
                if inner.copy_pending {
                    if let Some(ev) = &inner.last_copy {
                        let _g = s.bind()?;
                        ev.synchronize()?;
                    }
                }
                Ok(true)
            }
            Mode::Host => Ok(true),
        }
    }

    /// Fill the pending step with `k` rows written by `write` into a `k * row_bytes` view
    /// of the slot, zero the padding rows up to the step's extent, and publish. If `write`
    /// fails, nothing is published and the step stays pending. `stream` is required in the
    /// sync fallback (the consumer's stream: the copy to staging is enqueued on it; the
    /// deferred and host modes do not use it); `busy_wait` bounds how long to wait for the
    /// GPU to release the slot before refusing with `SlotBusy`.
    pub fn fill_with_stream(
        &self,
        k: usize,
        stream: Option<Stream>,
        busy_wait: Duration,
        write: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let raw = stream.map(Stream::raw);
        self.shared
            .fill_impl(Op::Fill, k, raw, busy_wait, Some(write))
    }

    /// [`Self::fill_with_stream`] without a stream: sound in every mode (the synchronous
    /// fallback refuses it with a typed error; deferred and host modes need none).
    pub fn fill_with(
        &self,
        k: usize,
        busy_wait: Duration,
        write: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.shared
            .fill_impl(Op::Fill, k, None, busy_wait, Some(write))
    }

    /// Fill from contiguous rows (`rows.len()` a multiple of `row_bytes`); `stream` as for
    /// [`Self::fill_with_stream`].
    pub fn fill(&self, rows: &[u8], stream: Option<Stream>, busy_wait: Duration) -> Result<()> {
        let rb = self.shared.cfg.row_bytes;
        if rows.len() % rb != 0 {
            return Err(Error::rows(format!(
                "{} bytes is not a whole number of {rb}-byte rows",
                rows.len()
            )));
        }
        self.fill_with_stream(rows.len() / rb, stream, busy_wait, |dst| {
            dst.copy_from_slice(rows);
            Ok(())
        })
    }

    /// Publish the pending step without real data (warm-up, profiling, capture passes):
    /// the consumer sees whatever the slot held. `stream` as for [`Self::fill_with_stream`].
    pub fn prepare_dummy(&self, stream: Option<Stream>, busy_wait: Duration) -> Result<()> {
        self.shared.fill_impl(
            Op::PrepareDummy,
            0,
            stream.map(Stream::raw),
            busy_wait,
            None::<fn(&mut [u8]) -> Result<()>>,
        )
    }

    /// Put the consumer's side on `stream`: under capture, record it (`rows`: the
    /// captured extent, default `max_rows`); eagerly, issue it for the filled step.
    pub fn enqueue(&self, stream: Stream, rows: Option<usize>) -> Result<Enqueued> {
        self.enqueue_for(stream, rows, Consumer::Inline)
    }

    /// [`Self::enqueue`], saying where the consumer runs (see [`Consumer`]): with stall
    /// timing, a consumer on another stream stamps its arrival at its join.
    pub fn enqueue_for(
        &self,
        stream: Stream,
        rows: Option<usize>,
        consumer: Consumer,
    ) -> Result<Enqueued> {
        let stream = stream.raw();
        let s = &self.shared;
        let mut inner = s.lock();
        inner.phase.check_live()?;
        let Some(ctx) = &s.ctx else {
            // Host mode: nothing runs on a GPU; keep the eager ordering rule anyway.
            inner.phase.eager_enqueue()?;
            inner.stats.eager_enqueues += 1;
            return Ok(Enqueued::Nothing);
        };
        let _g = ctx.bind()?;
        let dev = ctx.ordinal();
        // SAFETY: `stream` is live (`Stream::from_raw`'s contract).
        let capture = unsafe { driver::capture_id(stream, dev)? };
        if let Some(r) = rows {
            if r == 0 || r > s.cfg.max_rows {
                return Err(Error::rows(format!(
                    "enqueue extent must be 1..={}, got {r}",
                    s.cfg.max_rows
                )));
            }
        }
        match (s.mode, capture) {
            (Mode::Deferred, Some(id)) => {
                if inner.captured_ids.contains(&id) {
                    return Err(Error::state(
                        Op::Enqueue,
                        "already enqueued in this capture: a second WAIT in one graph would never be released",
                    ));
                }
                let n = rows.unwrap_or(s.cfg.max_rows);
                // Captured addresses live as long as the graph: from now on this object's
                // pinned memory is retained, never freed (see cuda::pinned).
                inner.captured_ids.push(id);
                // SAFETY: stream is live (`Stream::from_raw`); the flag and slot are retained
                // forever once captured, and the staging buffer outlives the graphs (new()'s
                // contract).
                unsafe { s.issue(stream, n, dev, consumer)? };
                inner.stats.captured_enqueues += 1;
                Ok(Enqueued::Captured(id))
            }
            (Mode::Deferred, None) => {
                // Applied to a copy: a failed issue below leaves the phase unchanged.
                let mut next = inner.phase.clone();
                let n = next.eager_enqueue()?;
                if let Some(r) = rows {
                    if r != n {
                        return Err(Error::rows(format!(
                            "eager enqueue extent {r} differs from the pending step's {n} rows"
                        )));
                    }
                }
                // SAFETY: stream is live (`Stream::from_raw`); memory stays alive until the
                // event recorded below has completed (Drop waits for it).
                unsafe { s.issue(stream, n, dev, consumer)? };
                // SAFETY: live, non-capturing stream (capture was ruled out above).
                unsafe { inner.record_copy(stream, dev)? };
                inner.phase = next;
                inner.stats.eager_enqueues += 1;
                Ok(Enqueued::Eager)
            }
            (_, Some(_)) => {
                inner.stats.captured_enqueues += 1;
                Ok(Enqueued::Nothing)
            }
            (_, None) => {
                inner.phase.eager_enqueue()?;
                inner.stats.eager_enqueues += 1;
                Ok(Enqueued::Nothing)
            }
        }
    }

    /// With stall timing, stamp that the consumer of a step enqueued for
    /// [`Consumer::Joins`] reached its join on `stream` (eagerly or under capture); call it
    /// once per such enqueue, right before the join. Nothing without stall timing.
    ///
    pub fn stamp_arrival(&self, stream: Stream) -> Result<()> {
        let stream = stream.raw();
        let s = &self.shared;
        let (Some(clock), Some(ctx)) = (&s.stall, &s.ctx) else {
            return Ok(());
        };
        self.shared.lock().phase.check_live()?;
        let _g = ctx.bind()?;
        // SAFETY: `stream` is live (`Stream::from_raw`'s contract); a captured stamp is
        // retained with the object's other captured memory (an enqueue under the same
        // capture came first).
        unsafe { clock.stamp(stream, Stamp::Arrived) }
    }

    /// Whether steps' stalls are timed ([`Config::time_stalls`] in deferred mode).
    pub fn times_stalls(&self) -> bool {
        self.shared.stall.is_some()
    }

    /// The consumer stalls of every step timed since the last call (empty without stall
    /// timing).
    pub fn stall_samples(&self) -> StallSamples {
        self.shared
            .stall
            .as_ref()
            .map(StallClock::drain)
            .unwrap_or_default()
    }

    /// End the step. Raises the poison cause if the watchdog or an abort fired meanwhile.
    pub fn complete(&self) -> Result<()> {
        let mut inner = self.shared.lock();
        inner.phase.complete()?;
        inner.stats.steps += 1;
        Ok(())
    }

    /// Release the GPU and poison for good (idempotent: the first cause stays).
    pub fn abort(&self, cause: &str) {
        let mut inner = self.shared.lock();
        self.shared.abort_locked(&mut inner, cause.to_string());
    }

    /// Release the GPU for good and refuse every later call with `Closed`. Memory is
    /// freed when the last handle drops (or retained if a graph captured it).
    pub fn close(&self) {
        let mut inner = self.shared.lock();
        if let Some(flag) = &self.shared.flag {
            flag.store_poison();
        }
        if !matches!(inner.phase, Phase::Closed) {
            inner.phase = Phase::Closed;
        }
    }

    pub fn is_closed(&self) -> bool {
        matches!(self.shared.lock().phase, Phase::Closed)
    }

    /// Whether this object was ever enqueued under capture (its memory is then retained).
    pub fn was_captured(&self) -> bool {
        !self.shared.lock().captured_ids.is_empty()
    }

    /// Whether the GPU side is released for good (aborted, closed or dropped): a worker
    /// waiting for this object's ids should stop.
    pub fn is_released(&self) -> bool {
        match &self.shared.flag {
            Some(flag) => flag.is_poisoned(),
            None => matches!(
                self.shared.lock().phase,
                Phase::Poisoned { .. } | Phase::Closed
            ),
        }
    }

    /// A worker fills this object, or no longer does.
    pub(crate) fn set_worker_fed(&self, on: bool) {
        self.shared.worker_fed.store(on, Ordering::Release);
    }

    /// The extent of the oldest step still waiting for its fill.
    pub fn step_rows(&self) -> Option<usize> {
        self.shared.lock().phase.oldest_unfilled().map(|s| s.rows)
    }

    /// A non-blocking stream of this object's device, its own for its life, for staged
    /// consumers: a publish and a wait forked onto it never share a CUDA stream with the
    /// work they are meant to overlap (a pooled stream can be the capture stream itself).
    pub fn side_stream(&self) -> Result<RawStream> {
        let s = &self.shared;
        let Some(ctx) = &s.ctx else {
            return Err(Error::unsupported(
                "no CUDA device: there is no side stream",
            ));
        };
        let mut side = s.side.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = side.as_ref() {
            return Ok(st.raw);
        }
        let _g = ctx.bind()?;
        let st = OwnedStream::new(ctx.ordinal())?;
        let raw = st.raw;
        *side = Some(st);
        Ok(raw)
    }

    /// Steps begun and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.shared.lock().phase.in_flight()
    }

    /// A graph replay reached this object's consumer with no step begun for it (a worker
    /// saw ids that nobody armed it for). Release the GPU with zero rows and poison with
    /// `cause`: if the gate is still EMPTY the consumer has not passed its wait, so the
    /// slot is zeroed first and the replay reads zeros, never another step's rows.
    pub(crate) fn release_unaccounted(&self, cause: &str) {
        let s = &self.shared;
        let mut inner = s.lock();
        if inner.filling {
            // A host fill owns the slot right now; its consumer is released below.
        } else if let Some(flag) = &s.flag {
            if flag.filled() == HostFlag::EMPTY && !flag.is_poisoned() {
                inner.slot.bytes().fill(0);
                inner.dirty_rows = 0;
            }
        } else if matches!(inner.phase, Phase::Live(_)) {
            // Host mode: the "consumer" reads the host staging buffer directly.
            inner.slot.bytes().fill(0);
            inner.dirty_rows = 0;
            if let Target::Host { staging } = s.staging {
                // SAFETY: new()'s contract: `staging` holds max_rows * row_bytes bytes and
                // nobody else touches it while we hold the lock.
                unsafe { std::ptr::write_bytes(staging, 0, s.cfg.max_rows * s.cfg.row_bytes) };
            }
        }
        s.abort_locked(&mut inner, cause.to_string());
    }

    /// The slot's current bytes (tests and diagnostics).
    pub fn slot_snapshot(&self) -> Vec<u8> {
        loop {
            let mut inner = self.shared.lock();
            if !inner.filling {
                return inner.slot.bytes().to_vec();
            }
            drop(inner);
            std::thread::yield_now(); // a fill is writing it
        }
    }
}

impl Inner {
    /// Record that an eager copy reading the slot was just enqueued on `stream`, so the
    /// slot is not rewritten (sync mode) or freed (drop) before it completes.
    ///
    /// # Safety
    /// `stream` is live and not capturing.
    unsafe fn record_copy(&mut self, stream: RawStream, dev: i32) -> Result<()> {
        let ev = match self.last_copy.take() {
            Some(ev) => ev,
            None => Event::new(dev)?,
        };
        // SAFETY: the caller's contract.
        let recorded = unsafe { ev.record(stream) };
        self.last_copy = Some(ev);
        recorded?;
        self.copy_pending = true;
        Ok(())
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic inside a lock holder must not stop abort or drop from releasing the GPU.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bind(&self) -> Result<Option<driver::CtxGuard>> {
        self.ctx.as_ref().map(|c| c.bind()).transpose()
    }

    /// The consumer's side for `n` rows on `stream`: `WAIT ; H2D ; WRITE(EMPTY)` or the
    /// kernel that does all three (see [`CopyPath`]).
    ///
    /// # Safety
    /// `stream` is live; see `enqueue` for the memory's lifetime.
    unsafe fn issue(
        &self,
        stream: RawStream,
        n: usize,
        dev: i32,
        consumer: Consumer,
    ) -> Result<()> {
        let flag = self.flag.as_ref().expect("deferred mode has a flag");
        let Target::Cuda { staging, .. } = self.staging else {
            unreachable!("deferred mode has a device staging buffer")
        };
        let bytes = n * self.cfg.row_bytes;
        // SAFETY: (all calls) the caller's contract; the addresses are of live pinned and
        // device memory sized for max_rows >= n rows. The copy reads the slot only after
        // the wait, when the host is done writing it.
        unsafe {
            if let (Some(clock), Consumer::Inline) = (&self.stall, consumer) {
                clock.stamp(stream, Stamp::Arrived)?;
            }
            if self.cfg.track_arrival {
                driver::write_u32(stream, flag.arrived_device_ptr(), 1, dev)?;
            }
            match self.cfg.copy.resolve(bytes) {
                path @ (CopyPath::Kernel | CopyPath::KernelFused) => {
                    let k = self.kernel.expect("deferred mode loads the kernel");
                    // Above the fused kernel's size, the grid copy and its block counter.
                    let grid = (path == CopyPath::Kernel && bytes > KERNEL_MAX_BYTES).then(|| {
                        let done = self.copy_done.as_ref();
                        done.expect("a forced kernel path has a counter").ptr
                    });
                    k.wait_copy_reset(
                        stream,
                        self.slot_dptr,
                        staging,
                        bytes,
                        flag.gate_device_ptr(),
                        HostFlag::WAIT_MASK,
                        grid,
                    )?;
                }
                _ => {
                    driver::wait_any_bit64(
                        stream,
                        flag.gate_device_ptr(),
                        HostFlag::WAIT_MASK,
                        dev,
                    )?;
                    driver::copy_h2d_async(staging, self.slot_ptr, bytes, stream, dev)?;
                    driver::write_u32(stream, flag.gate_device_ptr(), HostFlag::EMPTY, dev)?;
                    if self.cfg.track_arrival {
                        driver::write_u32(stream, flag.arrived_device_ptr(), 0, dev)?;
                    }
                }
            }
            if let Some(clock) = &self.stall {
                clock.stamp(stream, Stamp::Copied)?;
            }
        }
        Ok(())
    }

    fn fill_impl(
        &self,
        op: Op,
        k: usize,
        stream: Option<RawStream>,
        busy_wait: Duration,
        write: Option<impl FnOnce(&mut [u8]) -> Result<()>>,
    ) -> Result<()> {
        let t0 = Instant::now();
        let rb = self.cfg.row_bytes;
        if let Some(flag) = &self.flag {
            // Wait (bounded, without the lock) for the GPU to hand the slot back.
            if flag.filled() != HostFlag::EMPTY && !busy_wait.is_zero() {
                wait_until(busy_wait, || flag.filled() == HostFlag::EMPTY);
            }
        }
        let mut inner = self.lock();
        let extent = inner.phase.check_fill(op, k)?;
        if inner.filling {
            return Err(Error::state(op, "another fill of this step is in progress"));
        }
        match self.mode {
            Mode::Deferred => {
                let flag = self.flag.as_ref().expect("deferred mode has a flag");
                if flag.filled() != HostFlag::EMPTY {
                    inner.stats.slot_busy += 1;
                    return Err(Error::SlotBusy);
                }
            }
            Mode::Sync => {
                let stream = stream.ok_or_else(|| {
                    Error::invalid("the synchronous fallback needs the consumer's stream")
                })?;
                let _g = self.bind()?;
                let dev = self.ctx.as_ref().map_or(-1, |c| c.ordinal());
                // SAFETY: the caller passes a live stream of this device.
                if unsafe { driver::capture_id(stream, dev)? }.is_some() {
                    return Err(Error::state(
                        op,
                        "the synchronous fallback fills before launch, not inside a capture",
                    ));
                }
                if inner.copy_pending {
                    // The previous step's copy must be done reading the slot.
                    if let Some(ev) = &inner.last_copy {
                        ev.synchronize()?;
                    }
                    inner.copy_pending = false;
                }
            }
            Mode::Host => {}
        }
        if let Some(write) = write {
            // The write (a worker's whole gather) runs without the lock, so the calls an
            // engine makes every step (arming the next step, the failure check, stats) and
            // the watchdog never wait for it; `filling` keeps every other host access off
            // the slot meanwhile.
            let dirty = inner.dirty_rows;
            // Zero the padding, skipping rows that are zero already.
            let pad_end = extent.min(dirty.max(k));
            let slot = inner.slot.bytes();
            let (ptr, len) = (slot.as_mut_ptr(), slot.len());
            if k.max(pad_end) * rb > len {
                return Err(Error::rows(format!("{k} rows do not fit the slot")));
            }
            inner.filling = true;
            drop(inner);
            let filling = Filling { shared: self };
            let written = {
                // SAFETY: `ptr`/`len` name the slot, which lives as long as `self` (it is
                // never reallocated; a pinned slot is freed only when `Shared` drops, and
                // `self` is borrowed here). Exclusive: `filling` was set under the lock,
                // and every host access to the slot's bytes takes the lock and keeps off
                // while it is set (another fill is refused, abort and release skip their
                // zeroing, a snapshot waits); the GPU reads the slot only after the publish
                // below.
                let slot = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
                let written = write(&mut slot[..k * rb]);
                if written.is_ok() && pad_end > k {
                    slot[k * rb..pad_end * rb].fill(0);
                }
                written
            };
            inner = self.lock();
            inner.filling = false;
            std::mem::forget(filling);
            if written.is_err() || inner.phase.check_live().is_err() {
                // Rows [0, k) may hold bytes now; nothing is published.
                inner.dirty_rows = dirty.max(k);
                written?;
                // Aborted (the watchdog, an abort) or closed while the rows were written:
                // the GPU was released meanwhile, and this fill is the step's failure.
                inner.phase.check_live()?;
            }
            inner.dirty_rows = if dirty > extent { dirty } else { k };
        }
        self.publish(&mut inner, extent, stream)?;
        inner.phase.mark_filled();
        let ns = t0.elapsed().as_nanos() as u64;
        let st = &mut inner.stats;
        if op == Op::Fill {
            st.fills += 1;
        } else {
            st.dummies += 1;
        }
        st.fill_ns_last = ns;
        st.fill_ns_max = st.fill_ns_max.max(ns);
        st.fill_ns_total += ns;
        Ok(())
    }

    fn publish(&self, inner: &mut Inner, extent: usize, stream: Option<RawStream>) -> Result<()> {
        let bytes = extent * self.cfg.row_bytes;
        match (self.mode, self.staging) {
            (Mode::Deferred, _) => {
                let flag = self.flag.as_ref().expect("deferred mode has a flag");
                if self.cfg.track_arrival && flag.gpu_arrived() {
                    inner.stats.gpu_waited += 1;
                }
                flag.store_filled();
            }
            (Mode::Sync, Target::Cuda { staging, .. }) => {
                let stream = stream.expect("checked in fill_impl");
                let dev = self.ctx.as_ref().map_or(-1, |c| c.ordinal());
                let _g = self.bind()?;
                let src = match &mut inner.slot {
                    Slot::Pinned(p) => p.host_ptr(),
                    Slot::Heap(_) => unreachable!("sync mode has a pinned slot"),
                };
                // SAFETY: live stream (caller); pinned slot and staging hold `bytes`; the
                // slot is not rewritten before the event recorded below completes.
                unsafe { driver::copy_h2d_async(staging, src, bytes, stream, dev)? };
                // SAFETY: live, non-capturing stream (checked in fill_impl).
                unsafe { inner.record_copy(stream, dev)? };
            }
            (Mode::Host, Target::Host { staging }) => {
                let src = inner.slot.bytes();
                // SAFETY: new()'s contract: `staging` holds max_rows * row_bytes >= bytes
                // and nobody else touches it during fill.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), staging, bytes) };
            }
            _ => unreachable!("mode and target agree by construction"),
        }
        Ok(())
    }

    fn abort_locked(&self, inner: &mut Inner, cause: String) {
        if matches!(inner.phase, Phase::Poisoned { .. } | Phase::Closed) {
            if let Some(flag) = &self.flag {
                flag.store_poison();
            }
            return;
        }
        if let Some(flag) = &self.flag {
            // Pending and not yet released: the GPU is not reading the slot, so clear it
            // first; whatever the released consumer copies is then zeros, not stale rows.
            // (A fill writing the slot right now owns it: the released consumer may read
            // that step's rows or earlier ones; the step is poisoned, so its output is
            // never handed out.)
            if inner.phase.oldest_unfilled().is_some()
                && flag.filled() == HostFlag::EMPTY
                && !inner.filling
            {
                inner.slot.bytes().fill(0);
            }
            flag.store_poison();
        }
        inner.phase = Phase::Poisoned { cause };
        self.poisoned.store(true, Ordering::Release);
        inner.stats.aborts += 1;
    }
}

/// Clears `Inner::filling` if a fill's write unwinds (a panic in the row source), so the
/// object stays usable for the abort that follows; the normal path clears it under the
/// lock it takes anyway and forgets the guard.
struct Filling<'a> {
    shared: &'a Shared,
}

impl Drop for Filling<'_> {
    fn drop(&mut self) {
        self.shared.lock().filling = false;
    }
}

impl Watched for Shared {
    fn expire(&self, step: u64) {
        let mut inner = self.lock();
        if inner.phase.is_unfilled(step) {
            let secs = self.cfg.watchdog.map_or(0.0, |d| d.as_secs_f64());
            let cause = format!(
                "watchdog: step {step} was not filled within {secs:.3} s; the GPU was released"
            );
            self.abort_locked(&mut inner, cause);
            inner.stats.watchdog_releases += 1;
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // First, whatever else happens: no GPU work may wait on this object again.
        if let Some(flag) = &self.flag {
            flag.store_poison();
        }
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        let guard = self.ctx.as_ref().and_then(|c| c.bind().ok());
        if !inner.captured_ids.is_empty() {
            if let Slot::Pinned(p) = &mut inner.slot {
                p.retain_forever();
            }
            if let Some(flag) = &mut self.flag {
                flag.retain_forever();
            }
            if let Some(clock) = &mut self.stall {
                clock.retain_forever();
            }
            if let Some(done) = &mut self.copy_done {
                done.retain_forever();
            }
        } else if inner.copy_pending {
            if let Some(ev) = &inner.last_copy {
                // Errors (driver gone at exit) leave nothing to wait for.
                let _ = ev.synchronize();
            }
        }
        // Free the pinned memory while the context is bound; ctx itself drops last. A
        // stream destroyed with work queued finishes that work first (cuStreamDestroy).
        *self.side.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        inner.last_copy = None;
        inner.slot = Slot::Heap(Vec::new());
        self.flag = None;
        self.copy_done = None;
        if let Some(clock) = &mut self.stall {
            clock.release();
        }
        self.stall = None;
        drop(guard);
    }
}
