//! How a worker is set up ([`WorkerOptions`], [`PublishPath`]) and what it counts
//! ([`WorkerStats`]).

use std::time::Duration;

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
    /// The fills of steps begun with
    /// [`GatherWorker::begin_eager`](super::GatherWorker::begin_eager) (an engine's eager
    /// forward: a prefill chunk, a mixed batch), counted in `fills` and
    /// `ready_to_filled_ns_total` too; the rest are replays.
    pub eager_fills: u64,
    pub eager_fill_ns_total: u64,
    /// From the worker starting to wait for a step's ids to READY seen: how early it was.
    pub armed_to_ready_ns_last: u64,
    pub publishes_captured: u64,
    pub publishes_eager: u64,
    /// Steps given host-known ids with
    /// [`GatherWorker::publish_from_host`](super::GatherWorker::publish_from_host).
    pub publishes_host: u64,
    /// Replays that published ids with no step armed (each released with zero rows).
    pub unarmed_replays: u64,
    /// Steps whose wait for READY kept the source's own gather threads awake
    /// ([`WarmThreads`](super::WarmThreads)).
    pub warmed_steps: u64,
    /// Completions that found their step not yet filled and waited for the worker
    /// ([`GatherWorker::wait_and_complete`](super::GatherWorker::wait_and_complete)), and
    /// how long they waited in all, nanoseconds: a serving loop's completion should find
    /// the fill done.
    pub completes_waited: u64,
    pub complete_wait_ns_total: u64,
    /// With [`WorkerOptions::predict_ready`]: steps whose wait began with a sleep until
    /// shortly before their predicted READY, and of those, the steps whose READY came
    /// during the sleep (seen up to one sleep chunk, 100 us, late).
    pub predicted_sleeps: u64,
    pub ready_in_sleep: u64,
    /// Steps begun with the ids the host expects
    /// ([`GatherWorker::begin_expecting`](super::GatherWorker::begin_expecting)), and their
    /// rows: gathered before the step's READY (expected ids), gathered at READY because
    /// no id was expected there (`-1`), and gathered again at READY because the GPU
    /// published another id than the expected one (the host's ids were wrong there: the
    /// published ids win; a non-zero count is a bug in whoever computed the expectation).
    pub expected_steps: u64,
    pub expected_rows_early: u64,
    pub expected_rows_late: u64,
    pub expected_rows_wrong: u64,
    /// In a step object that reads in order
    /// ([`Steps::read_in_order`](super::Steps::read_in_order)): the steps whose reads
    /// from storage waited for an earlier table's, how long in all (nanoseconds), and
    /// the steps that passed an earlier table over (its READY late, or its reads past
    /// [`TURN_LIMIT`](super::TURN_LIMIT)).
    pub ordered_waits: u64,
    pub ordered_wait_ns_total: u64,
    pub ordered_passed_over: u64,
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
    /// Place the hot window where READY is expected instead of at arming: once a few
    /// steps were armed ahead of their READY, the worker sleeps (in short chunks, checking
    /// READY between them) until shortly before the earliest of the last arm-to-READY
    /// times, then is hot for `spin` as usual. Under asynchronous scheduling a worker is
    /// armed a whole step before READY; hot from arming it keeps a CPU busy for `spin` and
    /// may still see READY a nap late. Off by default.
    pub predict_ready: bool,
    /// Diagnostics only: fill each step without gathering (the slot keeps whatever bytes
    /// it held, so consumers read stale rows). Times the protocol without the host's
    /// gather; never for serving.
    pub skip_gather: bool,
    /// After its hot window with nothing armed, how long the worker naps (sleeps of
    /// [`IDLE_NAP`], looking for an armed step between them) before it blocks. Arming a
    /// napping worker costs the host nothing; arming a blocked one costs a wake-up (a
    /// futex syscall and an interrupt to the worker's core: 5-20 us on the arming thread
    /// on a VM, paid on every step of a serving loop whose steps are longer than `spin`).
    /// A step armed during a nap is seen at most one nap late, long before the GPU can
    /// publish its ids after the launch that follows the arming.
    pub idle_naps: Duration,
    /// How often a blocked worker (past `idle_naps`, nothing armed) wakes to look for a
    /// READY nobody armed it for. Arming wakes it at once whatever this is.
    pub idle_poll: Duration,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            max_ids: 1,
            id_bytes: 8,
            path: PublishPath::Kernel,
            depth: 2,
            spin: DEFAULT_SPIN,
            predict_ready: false,
            skip_gather: false,
            idle_naps: DEFAULT_IDLE_NAPS,
            idle_poll: DEFAULT_IDLE_POLL,
        }
    }
}

/// Default for [`WorkerOptions::idle_naps`]: a serving loop's steps are milliseconds
/// apart; a worker whose engine went quiet blocks after this.
pub const DEFAULT_IDLE_NAPS: Duration = Duration::from_millis(50);

/// One nap of an idle worker ([`WorkerOptions::idle_naps`]).
pub const IDLE_NAP: Duration = Duration::from_micros(50);

/// Default for [`WorkerOptions::idle_poll`].
pub const DEFAULT_IDLE_POLL: Duration = Duration::from_millis(1);

/// Default for [`WorkerOptions::spin`].
pub const DEFAULT_SPIN: Duration = Duration::from_millis(2);
