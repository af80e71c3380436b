//! [`Steps`]: the one object an engine drives a device's deferred rows through, every
//! table at once: arming a step (completing the oldest while `depth` are armed),
//! settling and draining, abort and poison, shutdown and the step counts.
//!
//! The policy lives here, once, for every engine integration:
//!
//! * **Bad arguments change nothing.** A row count out of a table's range, a closed
//!   object: refused, typed, before any step is completed or armed, and nothing is
//!   aborted.
//! * **All or none.** Any other failure (a fill that failed, a completion that timed out,
//!   a worker that refused to arm) aborts every table's rows with the cause, so no
//!   captured consumer waits for a fill that will not come and no step's rows are silently
//!   wrong; then the first error is returned. Every table's oldest step is completed even
//!   after one fails, so each worker's own typed error comes out.
//! * **Bounded.** Every completion waits at most the object's `timeout`; a shutdown
//!   never raises (a failure aborts instead), so it can never leave the GPU waiting.
//!
//! A serving loop pays for each call it makes between two engine steps in cache misses
//! (the engine's own work evicts the caller's code and data), so arming every table for a
//! step is one call ([`Steps::advance`]), not one per table and per phase.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{GatherWorker, Place, ReadOrder};
use crate::deferred::DeferredRows;
use crate::error::{Error, ErrorKind, Op, Result};

/// What [`Steps::advance`] did: the steps it completed and how long each phase took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advanced {
    /// Steps completed (of every table) before arming.
    pub completed: usize,
    /// Time completing them (waiting for fills included).
    pub wait: Duration,
    /// Time arming every table.
    pub arm: Duration,
}

/// The steps a [`Steps`] armed and completed, since it was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepCounts {
    /// Steps armed (every table at once), eager forwards' included.
    pub armed: usize,
    /// Of `armed`, eager forwards' steps (`advance(.., eager = true)`).
    pub eager: usize,
    /// Steps completed (every table at once).
    pub completed: usize,
}

/// One table of a [`Steps`]: its rows object and, where the device defers, its worker.
#[derive(Clone)]
pub struct StepTable {
    pub rows: DeferredRows,
    pub worker: Option<Arc<GatherWorker>>,
}

/// See the module docs. Every method takes `&self`; the object is `Send + Sync`, and is
/// meant to be driven from one thread (as an engine's step loop is).
pub struct Steps {
    rows: Box<[DeferredRows]>,
    /// The tables' workers (all or none: empty for a synchronous or host plan); `None`
    /// once closed. Cloned out of the lock for a call, so a wait never holds it.
    workers: Mutex<Option<Arc<[Arc<GatherWorker>]>>>,
    max_rows: usize,
    depth: usize,
    timeout: Duration,
    armed: AtomicUsize,
    eager: AtomicUsize,
    completed: AtomicUsize,
    ordered: bool,
}

impl Steps {
    /// The steps of `tables`: every table has a worker, or none has (one mode for all).
    /// `depth`: steps armed at once, `1..=` each worker's own depth; `timeout`: the
    /// longest wait of a completion.
    pub fn new(tables: Vec<StepTable>, depth: usize, timeout: Duration) -> Result<Self> {
        if tables.is_empty() {
            return Err(Error::invalid("a step object needs at least one table"));
        }
        let with_worker = tables.iter().filter(|t| t.worker.is_some()).count();
        if with_worker != 0 && with_worker != tables.len() {
            return Err(Error::invalid(format!(
                "every table has a worker or none has: {with_worker} of {} have one",
                tables.len()
            )));
        }
        let most = tables
            .iter()
            .filter_map(|t| t.worker.as_ref().map(|w| w.depth()))
            .min()
            .unwrap_or(usize::MAX);
        if depth == 0 || depth > most {
            return Err(Error::invalid(format!(
                "depth must be 1..={} steps (the workers' own), got {depth}",
                most.min(8)
            )));
        }
        if timeout.is_zero() {
            return Err(Error::invalid("timeout must be above 0 seconds"));
        }
        let max_rows = tables.iter().map(|t| t.rows.max_rows()).min().unwrap_or(0);
        let rows = tables.iter().map(|t| t.rows.clone()).collect();
        let workers: Vec<Arc<GatherWorker>> = tables.into_iter().filter_map(|t| t.worker).collect();
        Ok(Self {
            rows,
            workers: Mutex::new(Some(workers.into())),
            max_rows,
            depth,
            timeout,
            armed: AtomicUsize::new(0),
            eager: AtomicUsize::new(0),
            completed: AtomicUsize::new(0),
            ordered: false,
        })
    }

    /// Take each step's reads from storage table by table, in the order the tables were
    /// given (which must be the order the GPU consumes their rows): see
    /// [`super::ReadOrder`]. For a model that publishes every table's ids of a step
    /// before any table's rows are consumed (bounded either way: a table whose READY is
    /// late is passed over). Refused for tables without workers, with a step in flight,
    /// or with a worker already in another order.
    pub fn read_in_order(self) -> Result<Self> {
        let workers = self.deferred_workers("reading in order")?;
        if workers.iter().any(|w| w.in_flight() > 0) {
            return Err(Error::state(
                Op::Begin,
                "reading in order starts with no step in flight; complete them first",
            ));
        }
        if workers.iter().any(|w| w.shared.place.get().is_some()) {
            return Err(Error::invalid(
                "a worker of these tables already reads in another step object's order",
            ));
        }
        let twice = workers
            .iter()
            .enumerate()
            .any(|(i, w)| workers[..i].iter().any(|v| Arc::ptr_eq(v, w)));
        if twice {
            return Err(Error::invalid(
                "a worker appears twice among the tables of one step object",
            ));
        }
        let order = ReadOrder::new(workers.len());
        for (i, w) in workers.iter().enumerate() {
            if w.shared.place.set(Place::new(order.clone(), i)).is_err() {
                return Err(Error::invalid(
                    "a worker of these tables joined another step object's order meanwhile",
                ));
            }
        }
        Ok(Self {
            ordered: true,
            ..self
        })
    }

    /// Whether the tables read in order ([`Self::read_in_order`]).
    pub fn reads_in_order(&self) -> bool {
        self.ordered
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The most rows a step may have (the smallest table's).
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Whether the tables have workers (the deferred protocol).
    pub fn deferred(&self) -> bool {
        self.workers().is_ok_and(|w| !w.is_empty())
    }

    pub fn is_closed(&self) -> bool {
        self.lock().is_none()
    }

    pub fn counts(&self) -> StepCounts {
        StepCounts {
            armed: self.armed.load(Ordering::Relaxed),
            eager: self.eager.load(Ordering::Relaxed),
            completed: self.completed.load(Ordering::Relaxed),
        }
    }

    /// Steps armed and not yet completed (the most of any table).
    pub fn in_flight(&self) -> usize {
        match self.workers() {
            Ok(w) if !w.is_empty() => w.iter().map(|w| w.in_flight()).max().unwrap_or(0),
            _ => self.rows.iter().map(|r| r.in_flight()).max().unwrap_or(0),
        }
    }

    /// Complete the oldest steps of every table while `depth` or more are armed, then arm
    /// every table's worker for a step of `rows` rows (`eager`: an eager forward's step,
    /// see [`GatherWorker::begin_eager`]). A step its worker has filled completes without
    /// blocking; one it has not is left to `wait_for(worker, timeout)` (which calls
    /// [`GatherWorker::wait_and_complete`], e.g. after releasing an interpreter lock).
    /// Policy: see the module docs.
    pub fn advance(
        &self,
        rows: usize,
        eager: bool,
        mut wait_for: impl FnMut(&GatherWorker, Duration) -> Result<()>,
    ) -> Result<Advanced> {
        let t0 = Instant::now();
        let workers = self.deferred_workers("arming a step")?;
        if rows == 0 || rows > self.max_rows {
            return Err(Error::rows(format!(
                "a step has 1..={} rows, got {rows}",
                self.max_rows
            )));
        }
        if workers.iter().any(|w| w.is_closed()) {
            // A table that can no longer be filled: every table stops (all or none).
            self.abort("a table's gather worker was closed under its steps");
            return Err(Error::Closed);
        }
        let armed = workers.iter().map(|w| w.in_flight()).max().unwrap_or(0);
        let completed = self
            .complete_down_to(&workers, armed, self.depth - 1, &mut wait_for)
            .inspect_err(|e| self.abort(&format!("arming a step of {rows} rows: {e}")))?;
        let t1 = Instant::now();
        for w in workers.iter() {
            let began = if eager {
                w.begin_eager(rows)
            } else {
                w.begin(rows)
            };
            if let Err(e) = began {
                self.abort(&format!("arming a step of {rows} rows: {e}"));
                return Err(e);
            }
        }
        self.armed.fetch_add(1, Ordering::Relaxed);
        if eager {
            self.eager.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Advanced {
            completed,
            wait: t1 - t0,
            arm: t1.elapsed(),
        })
    }

    /// Complete the oldest steps of every table until at most `limit` are armed (after a
    /// launch: `0` under synchronous scheduling, `depth - 1` under asynchronous); `0`
    /// drains. Returns the steps completed. A failure aborts every table (module docs).
    pub fn settle(
        &self,
        limit: usize,
        mut wait_for: impl FnMut(&GatherWorker, Duration) -> Result<()>,
    ) -> Result<usize> {
        let workers = self.workers()?;
        if workers.is_empty() {
            return Ok(0);
        }
        let armed = workers.iter().map(|w| w.in_flight()).max().unwrap_or(0);
        self.complete_down_to(&workers, armed, limit, &mut wait_for)
            .inspect_err(|e| self.abort(&format!("completing a step: {e}")))
    }

    /// Publish host-known ids for table `index`'s oldest armed step that has none yet
    /// (see [`GatherWorker::publish_from_host`]). A failure aborts every table, except
    /// `NoArmedStep` (nothing was written and no step waits for it: the caller's misuse).
    pub fn publish_host(&self, index: usize, ids: &[i64]) -> Result<()> {
        let workers = self.deferred_workers("publishing host ids")?;
        let Some(w) = workers.get(index) else {
            return Err(Error::invalid(format!(
                "no table {index}: this step object has {}",
                workers.len()
            )));
        };
        w.publish_from_host(ids, self.timeout).inspect_err(|e| {
            if e.kind() != ErrorKind::NoArmedStep {
                self.abort(&format!("publishing host ids of table {index}: {e}"));
            }
        })
    }

    /// Release every table's GPU waits for good and poison every table (idempotent):
    /// later steps raise `Poisoned` with `cause`.
    pub fn abort(&self, cause: &str) {
        for r in self.rows.iter() {
            r.abort(cause);
        }
    }

    /// The first poisoned table's index and cause, or `None` while every table is usable.
    pub fn poison_cause(&self) -> Option<(usize, String)> {
        self.rows
            .iter()
            .enumerate()
            .find_map(|(i, r)| r.poison_cause().map(|c| (i, c)))
    }

    /// Complete every armed step (bounded by the timeout); a failure aborts every table
    /// instead of being raised and is returned; then stop the workers and close every
    /// table (idempotent: `None` once closed). Nothing the GPU may still wait on is left
    /// waiting.
    pub fn shutdown(
        &self,
        wait_for: impl FnMut(&GatherWorker, Duration) -> Result<()>,
    ) -> Option<Error> {
        let failed = match self.settle(0, wait_for) {
            Ok(_) | Err(Error::Closed) => None,
            Err(e) => Some(e), // settle aborted every table
        };
        self.close();
        failed
    }

    /// Stop the workers and close every table (idempotent); later calls raise `Closed`.
    pub fn close(&self) {
        let gone = self.lock().take();
        if let Some(workers) = gone {
            for w in workers.iter() {
                w.close();
            }
        }
        for r in self.rows.iter() {
            r.close();
        }
    }

    // -- helpers ------------------------------------------------------------------------

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<[Arc<GatherWorker>]>>> {
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn workers(&self) -> Result<Arc<[Arc<GatherWorker>]>> {
        self.lock().clone().ok_or(Error::Closed)
    }

    fn deferred_workers(&self, what: &str) -> Result<Arc<[Arc<GatherWorker>]>> {
        let workers = self.workers()?;
        if workers.is_empty() {
            return Err(Error::state(
                Op::Begin,
                format!("{what} needs the deferred path; these tables gather synchronously"),
            ));
        }
        Ok(workers)
    }

    /// Complete the oldest step of every table until `armed` is at most `limit`.
    fn complete_down_to(
        &self,
        workers: &[Arc<GatherWorker>],
        mut armed: usize,
        limit: usize,
        wait_for: &mut impl FnMut(&GatherWorker, Duration) -> Result<()>,
    ) -> Result<usize> {
        let mut completed = 0;
        while armed > limit {
            let mut first = None;
            for w in workers {
                let done = match w.try_complete() {
                    Some(done) => done,
                    None => wait_for(w, self.timeout),
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
            self.completed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(completed)
    }
}
