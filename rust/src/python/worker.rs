//! `ple_memops._native.GatherWorkerCore`: the native half of `ple_memops.GatherWorker`; and
//! `Steps`, a device's tables driven as one (the step policy of every engine integration).

use std::sync::Arc;
use std::time::Duration;

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::table::PyMmapTable;
use super::{counters, secs, stream_of, to_pyerr, IntoPy, PyDeferredRows};
use crate::error::Error;
use crate::worker::{
    GatherWorker, PublishPath, RowMap, RowSource, StepTable, Steps, WorkerOptions, DEFAULT_SPIN,
};

/// The native half of `ple_memops.GatherWorker` (use that class, not this one).
#[pyclass(name = "GatherWorkerCore", module = "ple_memops._native", frozen)]
pub struct PyGatherWorker {
    inner: Arc<GatherWorker>,
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
        Ok(Self {
            inner: Arc::new(inner),
        })
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
                ("ordered_waits", s.ordered_waits),
                ("ordered_wait_ns_total", s.ordered_wait_ns_total),
                ("ordered_passed_over", s.ordered_passed_over),
            ],
        )
    }
}

/// `ple_memops._native.Steps`: [`Steps`] from Python, the one native object an
/// engine integration drives a device's tables through (`ple_memops.steps.Steps` is its
/// Python face). The GIL is kept unless a fill must be waited for (as `complete`): a
/// serving loop completes steps its workers filled long ago, and releasing and retaking
/// a contended interpreter lock costs more than the completion.
#[pyclass(name = "Steps", module = "ple_memops._native", frozen)]
pub struct PySteps {
    inner: Steps,
}

fn waiting(py: Python<'_>) -> impl FnMut(&GatherWorker, Duration) -> crate::error::Result<()> + '_ {
    move |w, t| py.detach(|| w.wait_and_complete(t))
}

#[pymethods]
impl PySteps {
    /// `rows`: every table's rows object; `workers`: each table's worker in the same
    /// order, or empty (the tables gather synchronously). `read_in_order`: each step's
    /// reads from storage taken table by table in this order (needs workers).
    #[new]
    #[pyo3(signature = (rows, workers, depth, timeout_s, read_in_order=false))]
    fn new(
        py: Python<'_>,
        rows: &Bound<'_, PyTuple>,
        workers: &Bound<'_, PyTuple>,
        depth: usize,
        timeout_s: f64,
        read_in_order: bool,
    ) -> PyResult<Self> {
        let timeout = secs(timeout_s, "timeout").py(py)?;
        let rows = rows
            .iter()
            .map(|r| Ok(r.cast_into::<PyDeferredRows>()?.get().rows().clone()))
            .collect::<PyResult<Vec<_>>>()?;
        let workers = workers
            .iter()
            .map(|w| Ok(w.cast_into::<PyGatherWorker>()?.get().inner.clone()))
            .collect::<PyResult<Vec<_>>>()?;
        if !workers.is_empty() && workers.len() != rows.len() {
            return Err(to_pyerr(
                py,
                Error::invalid(format!(
                    "{} workers for {} tables: one each, or none",
                    workers.len(),
                    rows.len()
                )),
            ));
        }
        let mut workers = workers.into_iter();
        let tables = rows
            .into_iter()
            .map(|rows| StepTable {
                rows,
                worker: workers.next(),
            })
            .collect();
        let mut inner = Steps::new(tables, depth, timeout).py(py)?;
        if read_in_order {
            inner = inner.read_in_order().py(py)?;
        }
        Ok(Self { inner })
    }

    /// Arm a step of `rows` rows on every table, completing the oldest steps first while
    /// `depth` are armed. Returns `(steps completed, ns completing, ns arming)`. A row
    /// count out of `1..=max_rows` raises `RowShapeError` and changes nothing; any other
    /// failure aborts every table, then raises.
    #[pyo3(signature = (rows, eager=false))]
    fn __call__(&self, py: Python<'_>, rows: i64, eager: bool) -> PyResult<(usize, u64, u64)> {
        let Ok(n) = usize::try_from(rows) else {
            return Err(to_pyerr(
                py,
                Error::rows(format!("a step has at least 1 row, got {rows}")),
            ));
        };
        let done = self.inner.advance(n, eager, waiting(py)).py(py)?;
        Ok((
            done.completed,
            done.wait.as_nanos() as u64,
            done.arm.as_nanos() as u64,
        ))
    }

    /// Complete the oldest steps until at most `limit` are armed (`0`: drain). Returns the
    /// steps completed; a failure aborts every table, then raises.
    #[pyo3(signature = (limit=0))]
    fn settle(&self, py: Python<'_>, limit: usize) -> PyResult<usize> {
        self.inner.settle(limit, waiting(py)).py(py)
    }

    /// Host-known ids of table `index`'s oldest armed step that has none yet.
    fn publish_host(
        &self,
        py: Python<'_>,
        index: usize,
        ids: PyReadonlyArray1<'_, i64>,
    ) -> PyResult<()> {
        let v = ids
            .as_slice()
            .map_err(|_| to_pyerr(py, Error::rows("ids must be contiguous")))?
            .to_vec();
        let inner = &self.inner;
        py.detach(|| inner.publish_host(index, &v)).py(py)
    }

    /// Release every GPU wait for good and poison every table (idempotent).
    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }

    /// `(table index, cause)` of the first poisoned table, or `None`.
    #[getter]
    fn poison_cause(&self) -> Option<(usize, String)> {
        self.inner.poison_cause()
    }

    /// Drain (bounded; a failure aborts instead of raising), then close. Returns the
    /// failure's text, or `None`.
    fn shutdown(&self, py: Python<'_>) -> Option<String> {
        self.inner.shutdown(waiting(py)).map(|e| e.to_string())
    }

    /// Stop the workers and close every table (idempotent).
    fn close(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.detach(|| inner.close());
    }

    #[getter]
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    /// Steps armed (every table at once), eager forwards' included.
    #[getter]
    fn armed(&self) -> usize {
        self.inner.counts().armed
    }

    /// Of `armed`, eager forwards' steps.
    #[getter]
    fn eager(&self) -> usize {
        self.inner.counts().eager
    }

    #[getter]
    fn completed(&self) -> usize {
        self.inner.counts().completed
    }

    #[getter]
    fn depth(&self) -> usize {
        self.inner.depth()
    }

    #[getter]
    fn timeout(&self) -> f64 {
        self.inner.timeout().as_secs_f64()
    }

    #[getter]
    fn max_rows(&self) -> usize {
        self.inner.max_rows()
    }

    #[getter]
    fn deferred(&self) -> bool {
        self.inner.deferred()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Whether each step's reads from storage are taken in table order.
    #[getter]
    fn reads_in_order(&self) -> bool {
        self.inner.reads_in_order()
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGatherWorker>()?;
    m.add_class::<PySteps>()
}
