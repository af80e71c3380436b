//! The `DeferredRows` lifecycle as a pure state machine (no CUDA, no memory): what each
//! call is allowed to do in each phase. `deferred.rs` applies it under its lock.
//!
//! ```text
//!   Idle --begin(n)--> [step: pending] --fill/prepare_dummy--> [step: filled] --complete--> Idle
//!     any --abort/watchdog--> Poisoned (terminal)      any --close--> Closed (terminal)
//! ```
//!
//! Up to `depth` steps may be in flight at once, oldest first (a worker-fed object under
//! asynchronous scheduling arms step N+1 before step N's fill). Fills go to the oldest
//! unfilled step, `complete` ends the oldest step. Host-fed objects use depth 1.

use std::collections::VecDeque;

use crate::error::{Error, Op, Result};

/// One step in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The step's extent (the captured row count).
    pub rows: usize,
    /// The step's sequence number (1, 2, ...).
    pub seq: u64,
    /// The flag said FILLED for it (or, in the fallback, the staging buffer is written).
    pub filled: bool,
    /// A worker-fed object was enqueued eagerly for it before its fill.
    pub eager_enqueued: bool,
    /// A gather worker armed this step (and will fill it from its own thread).
    pub worker: bool,
}

/// Where one object is in its steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Steps in flight, oldest first; empty when idle.
    Live(VecDeque<Step>),
    /// Aborted; carries the first cause.
    Poisoned { cause: String },
    /// Closed by its owner.
    Closed,
}

impl Default for Phase {
    fn default() -> Self {
        Phase::Live(VecDeque::new())
    }
}

impl Phase {
    /// `idle`, `pending` (the oldest step awaits its fill), `filled`, `poisoned`, `closed`.
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Live(steps) => match steps.front() {
                None => "idle",
                Some(s) if s.filled => "filled",
                Some(_) => "pending",
            },
            Phase::Poisoned { .. } => "poisoned",
            Phase::Closed => "closed",
        }
    }

    /// Terminal phases refuse every call.
    pub fn check_live(&self) -> Result<()> {
        self.steps().map(|_| ())
    }

    fn steps(&self) -> Result<&VecDeque<Step>> {
        match self {
            Phase::Live(steps) => Ok(steps),
            Phase::Poisoned { cause } => Err(Error::Poisoned {
                cause: cause.clone(),
            }),
            Phase::Closed => Err(Error::Closed),
        }
    }

    fn steps_mut(&mut self) -> Result<&mut VecDeque<Step>> {
        self.check_live()?;
        match self {
            Phase::Live(steps) => Ok(steps),
            _ => unreachable!("checked live above"),
        }
    }

    /// Steps begun and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.steps().map_or(0, VecDeque::len)
    }

    /// The oldest step that still awaits its fill.
    pub fn oldest_unfilled(&self) -> Option<&Step> {
        self.steps().ok()?.iter().find(|s| !s.filled)
    }

    /// Whether step `seq` is in flight and still awaits its fill.
    pub fn is_unfilled(&self, seq: u64) -> bool {
        self.steps()
            .is_ok_and(|st| st.iter().any(|s| s.seq == seq && !s.filled))
    }

    /// `begin(rows)`: start step `seq` of `rows` rows (the captured extent), with at most
    /// `depth` steps in flight; `worker`: a gather worker armed it.
    pub fn begin(
        &mut self,
        rows: usize,
        max_rows: usize,
        seq: u64,
        depth: usize,
        worker: bool,
    ) -> Result<()> {
        let name = self.name();
        let steps = self.steps_mut()?;
        if rows == 0 || rows > max_rows {
            return Err(Error::rows(format!(
                "a step has 1..={max_rows} rows, got {rows}"
            )));
        }
        if steps.len() >= depth.max(1) {
            let detail = if depth <= 1 {
                format!("step still {name}; call complete() (or abort()) first")
            } else {
                format!(
                    "{} steps already in flight (depth {depth}); complete() the oldest first",
                    steps.len()
                )
            };
            return Err(Error::state(Op::Begin, detail));
        }
        steps.push_back(Step {
            rows,
            seq,
            filled: false,
            eager_enqueued: false,
            worker,
        });
        Ok(())
    }

    /// `fill(k rows)` / `prepare_dummy()`: the oldest unfilled step's rows are ready.
    /// Returns that step's extent (rows to pad to). Changes nothing: see [`Self::mark_filled`].
    pub fn check_fill(&self, op: Op, k: usize) -> Result<usize> {
        let steps = self.steps()?;
        match steps.iter().find(|s| !s.filled) {
            Some(s) if k <= s.rows => Ok(s.rows),
            Some(s) => Err(Error::rows(format!(
                "{k} rows given but the pending step holds {}",
                s.rows
            ))),
            None if steps.is_empty() => {
                Err(Error::state(op, "nothing pending; call begin() first"))
            }
            None => Err(Error::state(op, "this step was already filled")),
        }
    }

    /// Mark the oldest unfilled step filled (after a successful [`Self::check_fill`]).
    pub fn mark_filled(&mut self) {
        if let Ok(steps) = self.steps_mut() {
            if let Some(s) = steps.iter_mut().find(|s| !s.filled) {
                s.filled = true;
            }
        }
    }

    /// An eager (non-captured) enqueue. Returns the step's rows. Eager work must never
    /// wait on a fill that the calling thread makes later (an implicit synchronisation
    /// before it would deadlock), so the step must already be filled, unless a gather
    /// worker armed it: the worker fills it when the GPU publishes its ids, which no host
    /// synchronisation can block.
    ///
    /// It applies to the newest step. A host-filled step must be the only one in flight.
    /// A worker's step may follow older ones (graph replays, earlier eager steps, each
    /// with its consumer already on the stream): enqueued right after its `begin`, its
    /// consumer comes after theirs, and the worker fills the steps in order as the GPU
    /// consumes them, as for consecutive replays.
    pub fn eager_enqueue(&mut self) -> Result<usize> {
        let steps = self.steps_mut()?;
        let n = steps.len();
        let Some(step) = steps.back_mut() else {
            return Err(Error::state(
                Op::Enqueue,
                "nothing pending; call begin() first",
            ));
        };
        if n > 1 && !step.worker {
            return Err(Error::state(
                Op::Enqueue,
                format!("eager enqueue with {n} steps in flight: complete the older steps first"),
            ));
        }
        if step.eager_enqueued {
            return Err(Error::state(
                Op::Enqueue,
                "already enqueued in this step: a second WAIT would never be released",
            ));
        }
        if !step.filled && !step.worker {
            return Err(Error::state(
                Op::Enqueue,
                "eager enqueue before fill: fill() or prepare_dummy() first (only graph replays may defer the fill)",
            ));
        }
        step.eager_enqueued = true;
        Ok(step.rows)
    }

    /// `complete()`: end the oldest step.
    pub fn complete(&mut self) -> Result<Step> {
        let steps = self.steps_mut()?;
        match steps.front() {
            Some(s) if s.filled => Ok(steps.pop_front().expect("front exists")),
            Some(_) => Err(Error::state(
                Op::Complete,
                "the pending step was neither filled nor given a dummy",
            )),
            None => Err(Error::state(Op::Complete, "nothing pending")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn kind<T: std::fmt::Debug>(r: Result<T>) -> ErrorKind {
        r.unwrap_err().kind()
    }

    #[test]
    fn happy_path() {
        let mut p = Phase::default();
        assert_eq!(p.name(), "idle");
        p.begin(4, 8, 1, 1, false).unwrap();
        assert_eq!(p.name(), "pending");
        assert_eq!(p.check_fill(Op::Fill, 3).unwrap(), 4);
        p.mark_filled();
        assert_eq!(p.name(), "filled");
        assert_eq!(p.eager_enqueue().unwrap(), 4);
        assert_eq!(p.complete().unwrap().seq, 1);
        assert_eq!(p, Phase::default());
    }

    #[test]
    fn misuse_is_refused() {
        let mut idle = Phase::default();
        assert_eq!(kind(idle.check_fill(Op::Fill, 1)), ErrorKind::State);
        assert_eq!(kind(idle.complete()), ErrorKind::State);
        assert_eq!(kind(idle.eager_enqueue()), ErrorKind::State);
        let mut p = Phase::default();
        p.begin(2, 8, 1, 1, false).unwrap();
        assert_eq!(kind(p.begin(2, 8, 2, 1, false)), ErrorKind::State);
        assert_eq!(kind(p.complete()), ErrorKind::State);
        assert_eq!(kind(p.eager_enqueue()), ErrorKind::State);
        assert_eq!(kind(p.check_fill(Op::Fill, 3)), ErrorKind::RowShape);
        p.mark_filled();
        assert_eq!(kind(p.check_fill(Op::Fill, 1)), ErrorKind::State);
        p.eager_enqueue().unwrap();
        assert_eq!(kind(p.eager_enqueue()), ErrorKind::State);
    }

    #[test]
    fn worker_steps_may_enqueue_before_the_fill_once() {
        let mut p = Phase::default();
        p.begin(2, 8, 1, 1, true).unwrap();
        assert_eq!(p.eager_enqueue().unwrap(), 2);
        assert_eq!(kind(p.eager_enqueue()), ErrorKind::State);
        p.mark_filled();
        assert_eq!(kind(p.eager_enqueue()), ErrorKind::State);
        p.complete().unwrap();
        assert_eq!(p.in_flight(), 0);
        // A host step on the same object must be filled first, worker or not.
        p.begin(2, 8, 2, 1, false).unwrap();
        assert_eq!(kind(p.eager_enqueue()), ErrorKind::State);
    }

    #[test]
    fn a_worker_step_enqueues_eagerly_behind_older_steps() {
        let mut p = Phase::default();
        // A replay's step (its consumer in the graph), then an eager forward's.
        p.begin(3, 8, 1, 2, true).unwrap();
        p.begin(5, 8, 2, 2, true).unwrap();
        assert_eq!(p.eager_enqueue().unwrap(), 5, "the newest step's rows");
        assert_eq!(kind(p.eager_enqueue()), ErrorKind::State);
        p.mark_filled();
        assert_eq!(p.complete().unwrap().seq, 1);
        p.mark_filled();
        assert_eq!(p.complete().unwrap().seq, 2);
        // A host-filled step behind another must be filled and alone: refused.
        p.begin(3, 8, 3, 2, true).unwrap();
        p.begin(4, 8, 4, 2, false).unwrap();
        assert_eq!(kind(p.eager_enqueue()), ErrorKind::State);
    }

    #[test]
    fn two_steps_in_flight_fill_and_complete_in_order() {
        let mut p = Phase::default();
        p.begin(3, 8, 1, 2, true).unwrap();
        p.begin(5, 8, 2, 2, true).unwrap();
        let e = p.begin(1, 8, 3, 2, true).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::State);
        assert!(e.to_string().contains("2 steps already in flight"), "{e}");
        assert_eq!(p.in_flight(), 2);
        // The fill goes to the oldest unfilled step; its extent bounds the rows.
        assert_eq!(p.check_fill(Op::Fill, 3).unwrap(), 3);
        assert_eq!(kind(p.check_fill(Op::Fill, 4)), ErrorKind::RowShape);
        assert!(p.is_unfilled(1) && p.is_unfilled(2));
        p.mark_filled();
        assert!(!p.is_unfilled(1) && p.is_unfilled(2));
        assert_eq!(p.oldest_unfilled().unwrap().seq, 2);
        assert_eq!(p.check_fill(Op::Fill, 5).unwrap(), 5);
        // An eager enqueue goes to the newest (worker) step, once.
        assert_eq!(p.eager_enqueue().unwrap(), 5);
        assert_eq!(kind(p.eager_enqueue()), ErrorKind::State);
        assert_eq!(p.complete().unwrap().seq, 1);
        // Step 2 is not filled yet.
        assert_eq!(kind(p.complete()), ErrorKind::State);
        p.mark_filled();
        assert_eq!(p.complete().unwrap().seq, 2);
        assert_eq!(p.name(), "idle");
    }

    #[test]
    fn begin_checks_extent() {
        let mut p = Phase::default();
        assert_eq!(kind(p.begin(0, 8, 1, 1, false)), ErrorKind::RowShape);
        assert_eq!(kind(p.begin(9, 8, 1, 1, false)), ErrorKind::RowShape);
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn terminal_phases_refuse_everything() {
        let mut p = Phase::Poisoned {
            cause: "boom".into(),
        };
        let errs = [
            p.clone().begin(1, 1, 1, 1, false).map(|_| ()),
            p.check_fill(Op::Fill, 1).map(|_| ()),
            p.clone().eager_enqueue().map(|_| ()),
            p.clone().complete().map(|_| ()),
        ];
        for r in errs {
            let e = r.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Poisoned);
            assert!(e.to_string().contains("boom"));
        }
        p.mark_filled();
        assert_eq!(p.in_flight(), 0);
        assert_eq!(kind(Phase::Closed.complete()), ErrorKind::Closed);
    }
}
