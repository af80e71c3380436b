//! The state a [`GatherWorker`](super::GatherWorker) and its thread share.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use super::options::{WorkerOptions, WorkerStats};
use super::row_map::RowMap;
use super::source::RowSource;
use super::turn::Place;
use crate::cuda::driver::{Kernels, PrimaryContext};
use crate::cuda::pinned::IdMailbox;
use crate::deferred::DeferredRows;
use crate::error::Error;

pub(super) struct Ctl {
    /// Steps armed and not yet completed, oldest first.
    pub(super) armed: VecDeque<u64>,
    /// The armed steps begun with
    /// [`GatherWorker::begin_eager`](super::GatherWorker::begin_eager) (a subset of
    /// `armed`).
    pub(super) eager: Vec<u64>,
    /// The newest step the worker is done with (filled, failed or given up).
    pub(super) handled: u64,
    pub(super) failure: Option<Error>,
    pub(super) stats: WorkerStats,
    pub(super) published: bool,
    /// Captures that recorded a publish (one per capture: a second would publish twice a step).
    pub(super) captures: Vec<u64>,
    /// The newest step given ids by
    /// [`GatherWorker::publish_from_host`](super::GatherWorker::publish_from_host).
    pub(super) host_published: u64,
    /// The ids the host expects of armed steps begun with
    /// [`GatherWorker::begin_expecting`](super::GatherWorker::begin_expecting), taken by
    /// the worker when it reaches the step.
    pub(super) expected: Vec<(u64, Vec<i64>)>,
    /// The worker blocks on `cv` for the next armed step (past its hot window): arming
    /// must wake it. Otherwise it polls `armed_seq` and arming costs no syscall.
    pub(super) idle: bool,
}

impl Ctl {
    /// The recorded failure, if any, with every armed step dropped: a failed worker's
    /// steps are over (the GPU was released), and the next call reports why once.
    pub(super) fn take_failure(&mut self) -> Option<Error> {
        let e = self.failure.take()?;
        self.armed.clear();
        self.eager.clear();
        self.expected.clear();
        Some(e)
    }

    /// A filled step's counters: `count` ids, `ns` from READY seen to FILLED, `lead` from
    /// arming to READY.
    pub(super) fn count_fill(&mut self, step: u64, count: usize, ns: u64, lead: Duration) {
        let eager = self.eager.contains(&step);
        let st = &mut self.stats;
        st.fills += 1;
        st.ids_total += count as u64;
        st.ready_to_filled_ns_last = ns;
        st.ready_to_filled_ns_max = st.ready_to_filled_ns_max.max(ns);
        st.ready_to_filled_ns_total += ns;
        if eager {
            st.eager_fills += 1;
            st.eager_fill_ns_total += ns;
        }
        st.armed_to_ready_ns_last = lead.as_nanos() as u64;
    }

    /// The ids expected of `step`, if it was begun with some (removed: taken once).
    pub(super) fn take_expected(&mut self, step: u64) -> Option<Vec<i64>> {
        let at = self.expected.iter().position(|(s, _)| *s == step)?;
        Some(self.expected.swap_remove(at).1)
    }

    pub(super) fn next_to_fill(&self) -> Option<u64> {
        self.armed.iter().copied().find(|&s| s > self.handled)
    }

    /// The oldest armed step that has not been given host ids yet.
    pub(super) fn next_for_host_ids(&self) -> Option<u64> {
        let after = self.handled.max(self.host_published);
        self.armed.iter().copied().find(|&s| s > after)
    }
}

/// Lock order: `ctl` before `mailbox`, never the reverse. The worker checks the mailbox
/// while holding `ctl` (a READY with nothing armed must be judged under `ctl`); a caller
/// that held `mailbox` while taking `ctl` deadlocked with it (a publish under capture
/// against an idle worker: the engine froze at its first CUDA graph capture, the GPU idle).
pub(super) struct Shared {
    pub(super) rows: DeferredRows,
    pub(super) source: Arc<dyn RowSource>,
    pub(super) map: RowMap,
    pub(super) mailbox: Mutex<IdMailbox>,
    pub(super) opts: WorkerOptions,
    pub(super) kernels: Option<Kernels>,
    pub(super) ctx: Option<PrimaryContext>,
    pub(super) ctl: Mutex<Ctl>,
    pub(super) cv: Condvar,
    /// The newest armed step, readable without the lock by the polling worker.
    pub(super) armed_seq: AtomicU64,
    pub(super) stop: AtomicBool,
    /// Serialises host publishers: the mailbox holds one step's ids, and the ids must
    /// enter it in step order.
    pub(super) host_publish: Mutex<()>,
    /// This table's place in its step object's read order, if it has one
    /// ([`Steps::read_in_order`](super::Steps::read_in_order)).
    pub(super) place: OnceLock<Place>,
}

impl Shared {
    pub(super) fn ctl(&self) -> MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn mailbox(&self) -> MutexGuard<'_, IdMailbox> {
        self.mailbox.lock().unwrap_or_else(|e| e.into_inner())
    }
}
