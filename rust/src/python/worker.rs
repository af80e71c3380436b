//! `ple_memops._native.GatherWorkerCore`: the native half of `ple_memops.GatherWorker`; and
//! `Stepper` and `advance_workers`, a plan's step over all its workers in one call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::table::PyMmapTable;
use super::{counters, secs, stream_of, to_pyerr, IntoPy, PyDeferredRows};
use crate::error::Error;
use crate::worker::{
    advance, GatherWorker, PublishPath, RowMap, RowSource, WorkerOptions, DEFAULT_SPIN,
};

/// The native half of `ple_memops.GatherWorker` (use that class, not this one).
#[pyclass(name = "GatherWorkerCore", module = "ple_memops._native", frozen)]
pub struct PyGatherWorker {
    inner: GatherWorker,
}

#[pymethods]
impl PyGatherWorker {
    #[new]
    #[pyo3(signature = (rows, table, max_ids, id_bytes, offsets=None, sizes=None, publish="kernel", depth=2, spin_s=None, skip_gather=false, predict_ready=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rows: &Bound<'_, PyDeferredRows>,
        table: &Bound<'_, PyMmapTable>,
        max_ids: usize,
        id_bytes: usize,
        offsets: Option<Vec<i64>>,
        sizes: Option<Vec<i64>>,
        publish: &str,
        depth: usize,
        spin_s: Option<f64>,
        skip_gather: bool,
        predict_ready: bool,
    ) -> PyResult<Self> {
        let path = match publish {
            "kernel" => PublishPath::Kernel,
            "memop" => PublishPath::Memop,
            other => {
                return Err(to_pyerr(
                    py,
                    Error::invalid(format!(
                        "publish must be 'kernel' or 'memop', got {other:?}"
                    )),
                ))
            }
        };
        let map = match (offsets, sizes) {
            (None, None) => RowMap::Identity,
            (Some(offsets), Some(sizes)) => RowMap::PerHead { offsets, sizes },
            _ => {
                return Err(to_pyerr(
                    py,
                    Error::invalid("give both offsets and sizes, or neither"),
                ))
            }
        };
        let spin = match spin_s {
            Some(s) => secs(s, "spin").py(py)?,
            None => DEFAULT_SPIN,
        };
        let opts = WorkerOptions {
            max_ids,
            id_bytes,
            path,
            depth,
            spin,
            predict_ready,
            skip_gather,
            ..WorkerOptions::default()
        };
        let rows = rows.get().rows().clone();
        let source: Arc<dyn RowSource> = Arc::new(table.get().table().clone());
        let inner = py
            .detach(|| GatherWorker::new(rows, source, map, opts))
            .py(py)?;
        Ok(Self { inner })
    }

    #[getter]
    fn max_ids(&self) -> usize {
        self.inner.max_ids()
    }

    #[getter]
    fn depth(&self) -> usize {
        self.inner.depth()
    }

    #[getter]
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    #[pyo3(signature = (rows, eager=false, expected=None))]
    fn begin(
        &self,
        py: Python<'_>,
        rows: usize,
        eager: bool,
        expected: Option<PyReadonlyArray1<'_, i64>>,
    ) -> PyResult<u64> {
        match expected {
            Some(ids) => {
                let v = ids
                    .as_slice()
                    .map_err(|_| to_pyerr(py, Error::rows("expected ids must be contiguous")))?
                    .to_vec();
                self.inner.begin_expecting(rows, eager, v).py(py)
            }
            None if eager => self.inner.begin_eager(rows).py(py),
            None => self.inner.begin(rows).py(py),
        }
    }

    fn complete(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let t: Duration = secs(timeout_s, "timeout").py(py)?;
        let inner = &self.inner;
        // A step already filled completes in microseconds: keep the GIL (another thread
        // of a serving process may hold it for a while once released). Release it only
        // to wait for the worker.
        if let Some(done) = inner.try_complete() {
            return done.py(py);
        }
        py.detach(|| inner.wait_and_complete(t)).py(py)
    }

    /// Enqueue the publish on `stream` (a raw handle).
    fn publish(
        &self,
        py: Python<'_>,
        stream: u64,
        ids_ptr: u64,
        n_ids: usize,
        count_ptr: u64,
    ) -> PyResult<()> {
        // SAFETY: the wrapper passes torch's current stream of the rows' device and the
        // data pointers of CUDA tensors it checked (dtype, shape, device); their owners keep
        // them alive for as long as the graphs that capture the publish (documented).
        unsafe {
            self.inner
                .publish(stream_of(stream), ids_ptr, n_ids, count_ptr)
        }
        .py(py)
    }

    fn publish_from_host(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, i64>,
        timeout_s: f64,
    ) -> PyResult<()> {
        let v = ids
            .as_slice()
            .map_err(|_| to_pyerr(py, Error::rows("ids must be contiguous")))?
            .to_vec();
        let t: Duration = secs(timeout_s, "timeout").py(py)?;
        let inner = &self.inner;
        py.detach(|| inner.publish_from_host(&v, t)).py(py)
    }

    /// Store ids and READY with no checks, as a graph replay would (tests only).
    fn _simulate_replay_publish(&self, ids: PyReadonlyArray1<'_, i64>) -> PyResult<()> {
        let v = ids
            .as_slice()
            .map_err(|_| pyo3::exceptions::PyValueError::new_err("ids must be contiguous"))?;
        self.inner.simulate_replay_publish(v);
        Ok(())
    }

    fn close(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.detach(|| inner.close());
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        counters(
            py,
            &[
                ("steps", s.steps),
                ("fills", s.fills),
                ("failures", s.failures),
                ("ids_total", s.ids_total),
                ("ready_to_filled_ns_last", s.ready_to_filled_ns_last),
                ("ready_to_filled_ns_max", s.ready_to_filled_ns_max),
                ("ready_to_filled_ns_total", s.ready_to_filled_ns_total),
                ("eager_fills", s.eager_fills),
                ("eager_fill_ns_total", s.eager_fill_ns_total),
                ("armed_to_ready_ns_last", s.armed_to_ready_ns_last),
                ("publishes_captured", s.publishes_captured),
                ("publishes_eager", s.publishes_eager),
                ("publishes_host", s.publishes_host),
                ("unarmed_replays", s.unarmed_replays),
                ("warmed_steps", s.warmed_steps),
                ("completes_waited", s.completes_waited),
                ("complete_wait_ns_total", s.complete_wait_ns_total),
                ("predicted_sleeps", s.predicted_sleeps),
                ("ready_in_sleep", s.ready_in_sleep),
                ("expected_steps", s.expected_steps),
                ("expected_rows_early", s.expected_rows_early),
                ("expected_rows_late", s.expected_rows_late),
                ("expected_rows_wrong", s.expected_rows_wrong),
            ],
        )
    }
}

/// [`advance`] over `workers` from Python: the GIL is kept unless a fill must be waited
/// for (as `complete`).
fn advance_py(
    py: Python<'_>,
    workers: &[&GatherWorker],
    rows: usize,
    eager: bool,
    depth: usize,
    timeout: Duration,
) -> PyResult<(usize, u64, u64)> {
    let done = advance(workers, rows, eager, depth, |w| {
        py.detach(|| w.wait_and_complete(timeout))
    })
    .py(py)?;
    Ok((
        done.completed,
        done.wait.as_nanos() as u64,
        done.arm.as_nanos() as u64,
    ))
}

/// One engine step for every worker of a plan (`crate::worker::advance`): complete the
/// oldest steps while `depth` are armed, then arm each for `rows` rows. Returns `(steps
/// completed, ns completing, ns arming)`. The GIL is kept unless a fill must be waited
/// for (as `complete`).
#[pyfunction]
#[pyo3(signature = (workers, rows, eager, depth, timeout_s))]
fn advance_workers(
    py: Python<'_>,
    workers: &Bound<'_, PyTuple>,
    rows: usize,
    eager: bool,
    depth: usize,
    timeout_s: f64,
) -> PyResult<(usize, u64, u64)> {
    let t: Duration = secs(timeout_s, "timeout").py(py)?;
    let bound = workers
        .iter()
        .map(|w| w.cast_into::<PyGatherWorker>().map_err(PyErr::from))
        .collect::<PyResult<Vec<_>>>()?;
    let inner: Vec<&GatherWorker> = bound.iter().map(|w| &w.get().inner).collect();
    advance_py(py, &inner, rows, eager, depth, t)
}

/// `ple_memops._native.Stepper`: [`advance`] over a plan's workers with the depth and
/// timeout bound once, for the one call a serving loop makes every step
/// (`RowsPlan.stepper`). Each call checks less than `advance_workers` (nothing to cast,
/// no timeout to parse: a cold call between two engine steps pays for every line it
/// touches) and counts the steps it armed and completed. `close` drops the workers (the
/// plan's close): later calls raise `ClosedError`.
#[pyclass(name = "Stepper", module = "ple_memops._native", frozen)]
pub struct PyStepper {
    /// `None` once closed. Cloned out of the lock before a call, so a wait for a fill
    /// never holds it.
    workers: Mutex<Option<Arc<[Py<PyGatherWorker>]>>>,
    depth: usize,
    timeout: Duration,
    armed: AtomicUsize,
    completed: AtomicUsize,
}

#[pymethods]
impl PyStepper {
    #[new]
    fn new(
        py: Python<'_>,
        workers: &Bound<'_, PyTuple>,
        depth: usize,
        timeout_s: f64,
    ) -> PyResult<Self> {
        if depth == 0 {
            return Err(to_pyerr(
                py,
                Error::invalid("depth must be at least 1 step"),
            ));
        }
        let timeout = secs(timeout_s, "timeout").py(py)?;
        let workers = workers
            .iter()
            .map(|w| Ok(w.cast_into::<PyGatherWorker>()?.unbind()))
            .collect::<PyResult<Vec<_>>>()?;
        if workers.is_empty() {
            return Err(to_pyerr(
                py,
                Error::invalid("a stepper needs at least one worker"),
            ));
        }
        Ok(Self {
            workers: Mutex::new(Some(workers.into())),
            depth,
            timeout,
            armed: AtomicUsize::new(0),
            completed: AtomicUsize::new(0),
        })
    }

    /// Complete the oldest steps while `depth` are armed, then arm every worker for
    /// `rows` rows (`eager`: an eager forward's step). Returns `(steps completed, ns
    /// completing, ns arming)`. A row count below 1 or above a worker's `max_rows` is
    /// refused (`RowShapeError`) before anything is completed or armed.
    #[pyo3(signature = (rows, eager=false))]
    fn __call__(&self, py: Python<'_>, rows: i64, eager: bool) -> PyResult<(usize, u64, u64)> {
        let Ok(n) = usize::try_from(rows) else {
            return Err(to_pyerr(
                py,
                Error::rows(format!("a step has at least 1 row, got {rows}")),
            ));
        };
        let workers = self
            .workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| to_pyerr(py, Error::Closed))?;
        let inner: Vec<&GatherWorker> = workers.iter().map(|w| &w.get().inner).collect();
        let done = advance_py(py, &inner, n, eager, self.depth, self.timeout)?;
        self.completed.fetch_add(done.0, Ordering::Relaxed);
        self.armed.fetch_add(1, Ordering::Relaxed);
        Ok(done)
    }

    /// Steps armed through this stepper.
    #[getter]
    fn armed(&self) -> usize {
        self.armed.load(Ordering::Relaxed)
    }

    /// Steps completed through this stepper.
    #[getter]
    fn completed(&self) -> usize {
        self.completed.load(Ordering::Relaxed)
    }

    #[getter]
    fn depth(&self) -> usize {
        self.depth
    }

    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    /// Drop the workers (idempotent); later calls raise `ClosedError`.
    fn close(&self) {
        let gone = self
            .workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        drop(gone);
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGatherWorker>()?;
    m.add_class::<PyStepper>()?;
    m.add_function(wrap_pyfunction!(advance_workers, m)?)
}
