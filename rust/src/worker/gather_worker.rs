//! [`GatherWorker`]: the handle. Construction, arming steps, completing them, closing.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::options::{WorkerOptions, WorkerStats};
use super::row_map::RowMap;
use super::shared::{Ctl, Shared};
use super::source::RowSource;
use super::thread::run;
use crate::cuda::driver::{Kernels, PrimaryContext};
use crate::cuda::pinned::IdMailbox;
use crate::deferred::{DeferredRows, Mode};
use crate::error::{Error, Op, Result};

/// See the module docs. Every method takes `&self`; the object is `Send + Sync`.
pub struct GatherWorker {
    pub(super) shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

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
                expected: Vec::new(),
                idle: false,
            }),
            cv: Condvar::new(),
            armed_seq: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            host_publish: Mutex::new(()),
            place: OnceLock::new(),
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
        self.begin_step(rows, false, None)
    }

    /// [`Self::begin`] for an eager forward's step: the same protocol, its fill counted
    /// apart in [`WorkerStats`] (`eager_fills`), so a replay's fill time is not averaged
    /// with a prefill chunk's.
    pub fn begin_eager(&self, rows: usize) -> Result<u64> {
        self.begin_step(rows, true, None)
    }

    /// [`Self::begin`] (or [`Self::begin_eager`]) for a step whose ids the host expects
    /// before the GPU publishes them (a prefill chunk's, computed from the prompt):
    /// `expected[i]` is the id the step will publish at position `i`, or `-1` where the
    /// host cannot know it (a decode token's). The worker gathers the expected rows into
    /// the slot as soon as the GPU has consumed the previous step's, while the GPU still
    /// runs the work before this step; at the step's READY it compares the published ids
    /// with the expected ones and gathers only the rows that differ or were unknown. The
    /// rows delivered are always the published ids' rows: an expectation only moves the
    /// gather earlier (a wrong one costs a late gather and counts in
    /// [`WorkerStats::expected_rows_wrong`]). The graph publishes its ids as usual.
    /// `expected.len()` must not exceed `rows` or the mailbox's `max_ids`.
    pub fn begin_expecting(&self, rows: usize, eager: bool, expected: Vec<i64>) -> Result<u64> {
        if expected.len() > rows || expected.len() > self.max_ids() {
            return Err(Error::rows(format!(
                "{} expected ids for a step of {rows} rows (the mailbox holds {})",
                expected.len(),
                self.max_ids()
            )));
        }
        self.begin_step(rows, eager, Some(expected))
    }

    fn begin_step(&self, rows: usize, eager: bool, expected: Option<Vec<i64>>) -> Result<u64> {
        let sh = &self.shared;
        let mut ctl = sh.ctl();
        if let Some(e) = ctl.take_failure() {
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
        if let Some(ids) = expected {
            // Under the lock that armed the step: the worker reaches it knowing.
            ctl.expected.push((step, ids));
        }
        let idle = ctl.idle;
        // Signalled after unlocking: a polling worker that sees `armed_seq` takes `ctl`
        // at once, and finding it held would make the unlock a futex wake (a syscall and
        // an interrupt to its core, paid here on the engine's thread). A worker blocked
        // on `cv` (it set `idle` under `ctl` before waiting) is woken; a polling one sees
        // `armed_seq`, and a notify would be a syscall for nobody.
        drop(ctl);
        // The newest, even if another thread's begin() stored after us.
        sh.armed_seq.fetch_max(step, Ordering::Release);
        if idle {
            sh.cv.notify_all();
        }
        Ok(step)
    }

    /// Wait (at most `timeout`) for the worker to fill the oldest armed step, then
    /// complete it. Returns the worker's error, typed, if a gather failed (the GPU was
    /// released) or a replay published ids nobody armed the worker for.
    pub fn complete(&self, timeout: Duration) -> Result<()> {
        match self.try_complete() {
            Some(done) => done,
            None => self.wait_and_complete(timeout),
        }
    }

    /// [`Self::complete`] for a step [`Self::try_complete`] found unfilled: wait for the
    /// worker (at most `timeout`), counted in the stats (`completes_waited`,
    /// `complete_wait_ns_total`).
    pub fn wait_and_complete(&self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        let done = self.complete_waiting(timeout);
        let waited = t0.elapsed().as_nanos() as u64;
        let mut ctl = self.shared.ctl();
        ctl.stats.completes_waited += 1;
        ctl.stats.complete_wait_ns_total += waited;
        done
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
        if let Some(e) = ctl.take_failure() {
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
        if let Some(e) = ctl.take_failure() {
            return Err(e);
        }
        ctl.stats.steps += 1;
        drop(ctl);
        sh.rows.complete()
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
        {
            // Decide under `ctl` before the worker can see `stop`: a worker that saw it
            // first would mark its pending step handled (nothing to fill), and the step
            // would then escape the abort below (a flaky test caught it, 1 run in 30).
            let ctl = sh.ctl();
            sh.stop.store(true, Ordering::Release);
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
