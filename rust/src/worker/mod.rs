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
//!
//! The parts, one file each:
//!
//! * `source.rs`: [`RowSource`], where rows come from (a [`crate::MmapTable`] or any
//!   other gather).
//! * `row_map.rs`: [`RowMap`], how a published id becomes a table row.
//! * `options.rs`: [`WorkerOptions`], [`PublishPath`] and [`WorkerStats`].
//! * `gather_worker.rs`: [`GatherWorker`], the handle: construction, `begin`, `complete`,
//!   `close`.
//! * `steps.rs`: [`Steps`], a device's tables driven as one: arming a step, completing,
//!   abort and poison, shutdown, counts (the policy every engine integration shares).
//! * `mailbox.rs`: putting a step's ids into the mailbox, from the GPU (`publish`) or the
//!   host (`publish_from_host`).
//! * `shared.rs`: the state the handle and the thread share, and its lock order.
//! * `thread.rs`: the worker thread's loop: wait for a step and its READY, map, gather,
//!   fill.
//! * `turn.rs`: [`ReadOrder`], a step's cold reads taken table by table in the order the
//!   GPU consumes the tables.
//! * `warm.rs`: [`WarmThreads`], a source's own gather threads held awake while a step
//!   is armed.
//! * `pace.rs`: how the worker waits (spin, yield, nap).
//!
//! [`IdMailbox`]: crate::cuda::pinned::IdMailbox
//! [`DeferredRows`]: crate::DeferredRows

mod gather_worker;
mod mailbox;
mod options;
mod pace;
mod row_map;
mod shared;
mod source;
mod steps;
mod thread;
mod turn;
mod warm;

#[cfg(test)]
mod tests;

pub use gather_worker::GatherWorker;
pub use options::{
    PublishPath, WorkerOptions, WorkerStats, DEFAULT_IDLE_NAPS, DEFAULT_IDLE_POLL, DEFAULT_SPIN,
    IDLE_NAP,
};
pub use row_map::RowMap;
pub use source::RowSource;
pub use steps::{Advanced, StepCounts, StepTable, Steps};
pub use turn::{Place, ReadOrder, ORDER_MAX_READS, READY_GRACE, TURN_LIMIT};
pub use warm::{WarmThreads, WARM_MAX};
