//! [`advance`]: one engine step for every table's worker at once (a model's PLE layers):
//! complete the oldest steps while `depth` are armed, then arm every worker for the next.
//!
//! The same as a caller looping over the workers' [`GatherWorker::complete`] and
//! [`GatherWorker::begin`], in one call: a serving loop's host pays for each call it makes
//! between two steps in cache misses (the engine's own work evicts the caller's code and
//! data), so the step's bookkeeping is one call, not one per worker and per phase.

use std::time::{Duration, Instant};

use super::GatherWorker;
use crate::error::{Error, Result};

/// What [`advance`] did: the steps it completed and how long each phase took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advanced {
    /// Steps completed (of every worker) before arming.
    pub completed: usize,
    /// Time completing them (waiting for fills included).
    pub wait: Duration,
    /// Time arming every worker.
    pub arm: Duration,
}

/// Complete the oldest armed step of every worker while `depth` or more are armed, then
/// arm every worker for a step of `rows` rows (`eager`: an eager forward's step, see
/// [`GatherWorker::begin_eager`]).
///
/// A row count out of any worker's range or a zero `depth` is refused before anything
/// is completed or armed. A step the worker has filled completes without blocking; one it has not is left to
/// `wait_for` (which calls [`GatherWorker::wait_and_complete`], e.g. after releasing an
/// interpreter lock). Every worker's oldest step is completed even after one fails, and
/// the first error is returned; arming stops at the first refusal. Either way the caller
/// aborts the steps of every worker (the rows objects), so no consumer waits: this
/// function does not, because the caller owns the tables' failure policy.
pub fn advance(
    workers: &[&GatherWorker],
    rows: usize,
    eager: bool,
    depth: usize,
    mut wait_for: impl FnMut(&GatherWorker) -> Result<()>,
) -> Result<Advanced> {
    let t0 = Instant::now();
    // Bad arguments change nothing: checked before any step is completed.
    if depth == 0 {
        return Err(Error::invalid("depth must be at least 1 step"));
    }
    if let Some(w) = workers
        .iter()
        .find(|w| rows == 0 || rows > w.rows().max_rows())
    {
        return Err(Error::rows(format!(
            "a step has 1..={} rows, got {rows}",
            w.rows().max_rows()
        )));
    }
    if workers.iter().any(|w| w.is_closed()) {
        return Err(Error::Closed);
    }
    let mut armed = workers.iter().map(|w| w.in_flight()).max().unwrap_or(0);
    let mut completed = 0;
    while armed >= depth {
        let mut first = None;
        for w in workers {
            let done = match w.try_complete() {
                Some(done) => done,
                None => wait_for(w),
            };
            if let Err(e) = done {
                first.get_or_insert(e);
            }
        }
        if let Some(e) = first {
            return Err(e);
        }
        armed -= 1;
        completed += 1;
    }
    let t1 = Instant::now();
    for w in workers {
        if eager {
            w.begin_eager(rows)?;
        } else {
            w.begin(rows)?;
        }
    }
    Ok(Advanced {
        completed,
        wait: t1 - t0,
        arm: t1.elapsed(),
    })
}
