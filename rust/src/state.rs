//! The `DeferredRows` lifecycle as a pure state machine (no CUDA, no memory): what each
//! call is allowed to do in each phase. `deferred.rs` applies it under its lock.
//!
//! ```text
//!   Idle --begin(n)--> Pending --fill/prepare_dummy--> Filled --complete--> Idle
//!     any --abort/watchdog--> Poisoned (terminal)      any --close--> Closed (terminal)
//! ```

use crate::error::{Error, Op, Result};

/// Where one object is in its step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// No step in flight; the host owns the slot once the GPU consumed the last fill.
    Idle,
    /// `begin(rows)` was called; waiting for a fill (the GPU may already wait).
    Pending { rows: usize, step: u64 },
    /// The flag says FILLED (or, in the fallback, the staging buffer is written).
    Filled { rows: usize, step: u64, eager_enqueued: bool },
    /// Aborted; carries the first cause.
    Poisoned { cause: String },
    /// Closed by its owner.
    Closed,
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Pending { .. } => "pending",
            Phase::Filled { .. } => "filled",
            Phase::Poisoned { .. } => "poisoned",
            Phase::Closed => "closed",
        }
    }

    /// Terminal phases refuse every call.
    pub fn check_live(&self) -> Result<()> {
        match self {
            Phase::Poisoned { cause } => Err(Error::Poisoned {
                cause: cause.clone(),
            }),
            Phase::Closed => Err(Error::Closed),
            _ => Ok(()),
        }
    }

    /// `begin(rows)`: start a step of `rows` rows (the captured extent).
    pub fn begin(&self, rows: usize, max_rows: usize, step: u64) -> Result<Phase> {
        self.check_live()?;
        if rows == 0 || rows > max_rows {
            return Err(Error::rows(format!(
                "a step has 1..={max_rows} rows, got {rows}"
            )));
        }
        match self {
            Phase::Idle => Ok(Phase::Pending { rows, step }),
            other => Err(Error::state(
                Op::Begin,
                format!("step still {}; call complete() (or abort()) first", other.name()),
            )),
        }
    }

    /// `fill(k rows)` / `prepare_dummy()`: the pending step's rows are ready.
    /// Returns the step's extent (rows to pad to).
    pub fn check_fill(&self, op: Op, k: usize) -> Result<usize> {
        self.check_live()?;
        match self {
            Phase::Pending { rows, .. } if k <= *rows => Ok(*rows),
            Phase::Pending { rows, .. } => Err(Error::rows(format!(
                "{k} rows given but the pending step holds {rows}"
            ))),
            Phase::Idle => Err(Error::state(op, "nothing pending; call begin() first")),
            Phase::Filled { .. } => Err(Error::state(op, "this step was already filled")),
            _ => unreachable!("terminal phases handled by check_live"),
        }
    }

    pub fn filled(&self) -> Phase {
        match self {
            Phase::Pending { rows, step } => Phase::Filled {
                rows: *rows,
                step: *step,
                eager_enqueued: false,
            },
            other => other.clone(),
        }
    }

    /// An eager (non-captured) enqueue. Returns the step's rows. Eager work must never
    /// wait on a later fill (implicit synchronisation would deadlock), so the step must
    /// already be filled.
    pub fn eager_enqueue(&self) -> Result<(usize, Phase)> {
        self.check_live()?;
        match self {
            Phase::Filled {
                rows,
                step,
                eager_enqueued: false,
            } => Ok((
                *rows,
                Phase::Filled {
                    rows: *rows,
                    step: *step,
                    eager_enqueued: true,
                },
            )),
            Phase::Filled { .. } => Err(Error::state(
                Op::Enqueue,
                "already enqueued in this step: a second WAIT would never be released",
            )),
            Phase::Pending { .. } => Err(Error::state(
                Op::Enqueue,
                "eager enqueue before fill: fill() or prepare_dummy() first (only graph replays may defer the fill)",
            )),
            Phase::Idle => Err(Error::state(Op::Enqueue, "nothing pending; call begin() first")),
            _ => unreachable!("terminal phases handled by check_live"),
        }
    }

    /// `complete()`: end the step.
    pub fn complete(&self) -> Result<Phase> {
        self.check_live()?;
        match self {
            Phase::Filled { .. } => Ok(Phase::Idle),
            Phase::Pending { .. } => Err(Error::state(
                Op::Complete,
                "the pending step was neither filled nor given a dummy",
            )),
            Phase::Idle => Err(Error::state(Op::Complete, "nothing pending")),
            _ => unreachable!("terminal phases handled by check_live"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn happy_path() {
        let p = Phase::Idle.begin(4, 8, 1).unwrap();
        assert_eq!(p, Phase::Pending { rows: 4, step: 1 });
        assert_eq!(p.check_fill(Op::Fill, 3).unwrap(), 4);
        let f = p.filled();
        let (rows, f2) = f.eager_enqueue().unwrap();
        assert_eq!(rows, 4);
        assert_eq!(f2.complete().unwrap(), Phase::Idle);
    }

    #[test]
    fn misuse_is_refused() {
        let idle = Phase::Idle;
        assert_eq!(idle.check_fill(Op::Fill, 1).unwrap_err().kind(), ErrorKind::State);
        assert_eq!(idle.complete().unwrap_err().kind(), ErrorKind::State);
        assert_eq!(idle.eager_enqueue().unwrap_err().kind(), ErrorKind::State);
        let p = idle.begin(2, 8, 1).unwrap();
        assert_eq!(p.begin(2, 8, 2).unwrap_err().kind(), ErrorKind::State);
        assert_eq!(p.complete().unwrap_err().kind(), ErrorKind::State);
        assert_eq!(p.eager_enqueue().unwrap_err().kind(), ErrorKind::State);
        assert_eq!(p.check_fill(Op::Fill, 3).unwrap_err().kind(), ErrorKind::RowShape);
        let f = p.filled();
        assert_eq!(f.check_fill(Op::Fill, 1).unwrap_err().kind(), ErrorKind::State);
        let (_, f) = f.eager_enqueue().unwrap();
        assert_eq!(f.eager_enqueue().unwrap_err().kind(), ErrorKind::State);
    }

    #[test]
    fn begin_checks_extent() {
        assert_eq!(Phase::Idle.begin(0, 8, 1).unwrap_err().kind(), ErrorKind::RowShape);
        assert_eq!(Phase::Idle.begin(9, 8, 1).unwrap_err().kind(), ErrorKind::RowShape);
    }

    #[test]
    fn terminal_phases_refuse_everything() {
        let p = Phase::Poisoned {
            cause: "boom".into(),
        };
        for r in [
            p.begin(1, 1, 1).map(|_| ()),
            p.check_fill(Op::Fill, 1).map(|_| ()),
            p.eager_enqueue().map(|_| ()),
            p.complete().map(|_| ()),
        ] {
            let e = r.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Poisoned);
            assert!(e.to_string().contains("boom"));
        }
        assert_eq!(Phase::Closed.complete().unwrap_err().kind(), ErrorKind::Closed);
    }
}
