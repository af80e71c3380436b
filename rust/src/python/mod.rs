//! The PyO3 module `ple_memops._native`. The only code in the crate that knows Python:
//! it converts arguments, releases the GIL around anything that can block, and maps
//! [`Error`] to the package's exceptions in exactly one place ([`to_pyerr`]).

mod table;
mod worker;

use std::time::Duration;

use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyType};

use crate::cuda::driver::{self, RawStream, Stream};
use crate::deferred::{Config, Consumer, CopyPath, DeferredRows, Enqueued, Target};
use crate::error::{Error, ErrorKind};

/// The single conversion from the crate's error into the package's exception hierarchy
/// (`ple_memops.errors`, written in Python so classes can also derive from builtins).
pub(crate) fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    let module = MODULE.get_or_try_init(py, || py.import("ple_memops.errors").map(|m| m.unbind()));
    let name = e.kind().python_name();
    match module.and_then(|m| m.bind(py).getattr(name)) {
        Ok(cls) => match cls.cast_into::<PyType>() {
            Ok(t) => PyErr::from_type(t, e.to_string()),
            Err(_) => PyRuntimeError::new_err(e.to_string()),
        },
        Err(_) => PyRuntimeError::new_err(e.to_string()),
    }
}

pub(crate) trait IntoPy<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for crate::error::Result<T> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, e))
    }
}

/// The stream a Python caller passed as a raw handle (torch's `cuda_stream`).
///
/// # Safety
/// As [`Stream::from_raw`]: the Python wrappers pass torch's stream of the object's device
/// (or 0, the legacy default stream), which torch keeps alive while work on it can run.
pub(crate) unsafe fn stream_of(raw: u64) -> Stream {
    // SAFETY: the caller's contract.
    unsafe { Stream::from_raw(raw as usize as RawStream) }
}

/// `f` over `out`'s elements as one mutable slice (refused, typed, when another borrow
/// holds the array or it is not C-contiguous): where a binding writes its result.
pub(crate) fn write_into<T: numpy::Element, D: numpy::ndarray::Dimension, R>(
    py: Python<'_>,
    out: &Bound<'_, numpy::PyArray<T, D>>,
    f: impl FnOnce(&mut [T]) -> PyResult<R>,
) -> PyResult<R> {
    use numpy::PyArrayMethods;
    let mut rw = out
        .try_readwrite()
        .map_err(|e| to_pyerr(py, Error::invalid(format!("out: {e}"))))?;
    let dst = rw
        .as_slice_mut()
        .map_err(|_| to_pyerr(py, Error::invalid("out must be C-contiguous")))?;
    f(dst)
}

pub(crate) fn secs(s: f64, what: &str) -> crate::error::Result<Duration> {
    if !s.is_finite() || s < 0.0 {
        return Err(Error::invalid(format!(
            "{what} must be a finite number of seconds >= 0, got {s}"
        )));
    }
    Ok(Duration::from_secs_f64(s))
}

/// A dict of named counters (the `stats()` methods).
pub(crate) fn counters<'py>(
    py: Python<'py>,
    items: &[(&str, u64)],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in items {
        d.set_item(*k, *v)?;
    }
    Ok(d)
}

/// The native half of `ple_memops.DeferredRows` (use that class, not this one).
#[pyclass(name = "DeferredRowsCore", module = "ple_memops._native", frozen)]
pub struct PyDeferredRows {
    inner: DeferredRows,
    /// The object that owns the staging memory (a tensor or array), kept alive with us.
    #[allow(dead_code)]
    staging_owner: Py<PyAny>,
}

impl PyDeferredRows {
    /// The Rust object, for other bindings (the gather worker).
    pub(crate) fn rows(&self) -> &DeferredRows {
        &self.inner
    }
}

#[pymethods]
impl PyDeferredRows {
    #[new]
    #[pyo3(signature = (max_rows, row_bytes, device, staging_ptr, staging_owner, watchdog_s, force_sync=false, track_arrival=false, copy="auto", time_stalls=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_rows: usize,
        row_bytes: usize,
        device: Option<i32>,
        staging_ptr: u64,
        staging_owner: Py<PyAny>,
        watchdog_s: Option<f64>,
        force_sync: bool,
        track_arrival: bool,
        copy: &str,
        time_stalls: bool,
    ) -> PyResult<Self> {
        let copy = match copy {
            "auto" => CopyPath::Auto,
            "kernel" => CopyPath::Kernel,
            "memop" => CopyPath::Memop,
            "kernel-fused" => CopyPath::KernelFused,
            other => {
                return Err(to_pyerr(
                    py,
                    Error::invalid(format!(
                        "copy must be 'auto', 'kernel', 'memop' or 'kernel-fused', got {other:?}"
                    )),
                ))
            }
        };
        let watchdog = match watchdog_s {
            Some(s) if s > 0.0 => Some(secs(s, "watchdog").py(py)?),
            Some(_) => {
                return Err(to_pyerr(
                    py,
                    Error::invalid("watchdog must be > 0 seconds or None"),
                ))
            }
            None => None,
        };
        let cfg = Config {
            max_rows,
            row_bytes,
            watchdog,
            track_arrival,
            copy,
            time_stalls,
        };
        let target = move || match device {
            Some(device) => Target::Cuda {
                device,
                staging: staging_ptr,
                force_sync,
            },
            None => Target::Host {
                staging: staging_ptr as usize as *mut u8,
            },
        };
        // SAFETY: the Python wrapper passes the data pointer of a contiguous uint8 buffer
        // of max_rows * row_bytes bytes (checked there) and `staging_owner`, the object
        // that owns it; we hold that object for as long as we live. Graph-capture
        // lifetime: the wrapper documents that the staging tensor must outlive graphs.
        let inner = py
            .detach(|| unsafe { DeferredRows::new(cfg, target()) })
            .py(py)?;
        Ok(Self {
            inner,
            staging_owner,
        })
    }

    #[getter]
    fn mode(&self) -> &'static str {
        self.inner.mode().name()
    }

    #[getter]
    fn copy(&self) -> &'static str {
        self.inner.copy_path().name()
    }

    #[getter]
    fn kernel_max_bytes(&self) -> usize {
        crate::deferred::KERNEL_MAX_BYTES
    }

    #[getter]
    fn fallback_reason(&self) -> Option<String> {
        self.inner.fallback_reason().map(str::to_owned)
    }

    #[getter]
    fn max_rows(&self) -> usize {
        self.inner.max_rows()
    }

    #[getter]
    fn row_bytes(&self) -> usize {
        self.inner.row_bytes()
    }

    #[getter]
    fn phase(&self) -> &'static str {
        self.inner.phase_name()
    }

    #[getter]
    fn poison_cause(&self) -> Option<String> {
        self.inner.poison_cause()
    }

    #[getter]
    fn was_captured(&self) -> bool {
        self.inner.was_captured()
    }

    #[getter]
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    /// The raw handle of this object's own side stream (created on first use).
    fn side_stream(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = &self.inner;
        py.detach(|| inner.side_stream().map(|s| s as usize as u64))
            .py(py)
    }

    fn begin(&self, py: Python<'_>, rows: usize) -> PyResult<u64> {
        self.inner.begin(rows).py(py)
    }

    #[pyo3(signature = (rows, stream=None, busy_wait_s=0.0))]
    fn fill(
        &self,
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        stream: Option<u64>,
        busy_wait_s: f64,
    ) -> PyResult<()> {
        let wait = secs(busy_wait_s, "busy_wait").py(py)?;
        let arr: PyReadonlyArray2<'_, u8> = rows
            .extract()
            .map_err(|_| to_pyerr(py, Error::rows("rows must be a 2-D numpy uint8 array")))?;
        let shape = arr.shape();
        if shape[1] != self.inner.row_bytes() {
            return Err(to_pyerr(
                py,
                Error::rows(format!(
                    "rows are {} bytes wide, this object's rows are {}",
                    shape[1],
                    self.inner.row_bytes()
                )),
            ));
        }
        let data = arr
            .as_slice()
            .map_err(|_| to_pyerr(py, Error::rows("rows must be C-contiguous")))?;
        let inner = &self.inner;
        // SAFETY: `stream` is a handle torch gave the caller for this object's device (the
        // same contract as `enqueue`'s), or none.
        let stream = stream.map(|s| unsafe { stream_of(s) });
        py.detach(|| inner.fill(data, stream, wait)).py(py)
    }

    /// Gather `ids` (numpy int64/int32) from `table` straight into the slot and publish.
    #[pyo3(signature = (table, ids, stream=None, busy_wait_s=0.0))]
    fn fill_from(
        &self,
        py: Python<'_>,
        table: &Bound<'_, table::PyMmapTable>,
        ids: &Bound<'_, PyAny>,
        stream: Option<u64>,
        busy_wait_s: f64,
    ) -> PyResult<()> {
        let wait = secs(busy_wait_s, "busy_wait").py(py)?;
        let table = table.get().table();
        if table.row_bytes() != self.inner.row_bytes() {
            return Err(to_pyerr(
                py,
                Error::rows(format!(
                    "table rows are {} bytes, this object's rows are {}",
                    table.row_bytes(),
                    self.inner.row_bytes()
                )),
            ));
        }
        let ids = table::extract_ids(ids).py(py)?;
        let inner = &self.inner;
        // SAFETY: as in `fill`.
        let stream = stream.map(|s| unsafe { stream_of(s) });
        ids.with_row_ids(|ids| {
            py.detach(|| {
                inner.fill_with_stream(ids.len(), stream, wait, |dst| table.gather_into(ids, dst))
            })
        })
        .py(py)
    }

    #[pyo3(signature = (stream=None, busy_wait_s=0.0))]
    fn prepare_dummy(&self, py: Python<'_>, stream: Option<u64>, busy_wait_s: f64) -> PyResult<()> {
        let wait = secs(busy_wait_s, "busy_wait").py(py)?;
        let inner = &self.inner;
        // SAFETY: as in `fill`.
        let stream = stream.map(|s| unsafe { stream_of(s) });
        py.detach(|| inner.prepare_dummy(stream, wait)).py(py)
    }

    /// Returns "captured", "eager" or "nothing". `joins`: the consumer runs on another
    /// stream and calls `stamp_arrival` there before joining this one.
    #[pyo3(signature = (stream, rows=None, joins=false))]
    fn enqueue(
        &self,
        py: Python<'_>,
        stream: u64,
        rows: Option<usize>,
        joins: bool,
    ) -> PyResult<&'static str> {
        let consumer = if joins {
            Consumer::Joins
        } else {
            Consumer::Inline
        };
        // SAFETY: the wrapper passes torch's current stream handle for this device (or 0,
        // the legacy stream), which torch keeps alive while work on it can run.
        let stream = unsafe { stream_of(stream) };
        let r = self.inner.enqueue_for(stream, rows, consumer).py(py)?;
        Ok(match r {
            Enqueued::Captured(_) => "captured",
            Enqueued::Eager => "eager",
            Enqueued::Nothing => "nothing",
        })
    }

    /// Stamp a joining consumer's arrival on `stream` (stall timing; see `enqueue`).
    fn stamp_arrival(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        // SAFETY: as for `enqueue`.
        let stream = unsafe { stream_of(stream) };
        self.inner.stamp_arrival(stream).py(py)
    }

    #[getter]
    fn times_stalls(&self) -> bool {
        self.inner.times_stalls()
    }

    /// `(stalls in ns of each step timed since the last call, steps dropped)`.
    fn stall_samples(&self) -> (Vec<u64>, u64) {
        let s = self.inner.stall_samples();
        (s.stalls_ns, s.dropped)
    }

    fn complete(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.complete().py(py)
    }

    fn abort(&self, py: Python<'_>, reason: &str) {
        let inner = &self.inner;
        py.detach(|| inner.abort(reason));
    }

    fn close(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.detach(|| inner.close());
    }

    fn wait_consumed(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        let t = secs(timeout_s, "timeout").py(py)?;
        let inner = &self.inner;
        py.detach(|| inner.wait_consumed(t)).py(py)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        counters(
            py,
            &[
                ("steps", s.steps),
                ("fills", s.fills),
                ("dummies", s.dummies),
                ("aborts", s.aborts),
                ("watchdog_releases", s.watchdog_releases),
                ("eager_enqueues", s.eager_enqueues),
                ("captured_enqueues", s.captured_enqueues),
                ("slot_busy", s.slot_busy),
                ("gpu_waited", s.gpu_waited),
                ("fill_ns_last", s.fill_ns_last),
                ("fill_ns_max", s.fill_ns_max),
                ("fill_ns_total", s.fill_ns_total),
            ],
        )
    }

    fn slot_snapshot(&self) -> Vec<u8> {
        self.inner.slot_snapshot()
    }
}

/// Probe `device`; returns a dict (wrapped in a dataclass by the package).
#[pyfunction]
fn probe<'py>(py: Python<'py>, device: i32) -> PyResult<Bound<'py, PyDict>> {
    let cap = py.detach(|| crate::probe::probe(device)).py(py)?;
    let d = PyDict::new(py);
    d.set_item("device", cap.device)?;
    d.set_item("supported", cap.supported)?;
    d.set_item("reason", cap.reason)?;
    d.set_item("driver_version", cap.driver_version)?;
    let checks = PyList::empty(py);
    for c in cap.checks {
        checks.append((c.name, c.passed, c.detail))?;
    }
    d.set_item("checks", checks)?;
    Ok(d)
}

/// `(version, library, device_count)` of the loaded driver; raises UnsupportedError.
#[pyfunction]
fn driver_info(py: Python<'_>) -> PyResult<(i32, String, i32)> {
    let info = py.detach(driver::driver).py(py)?;
    Ok((info.version, info.library.clone(), info.device_count))
}

/// Bytes of pinned memory kept for captured graphs (never freed before exit).
#[pyfunction]
fn retained_bytes() -> u64 {
    crate::cuda::retained_bytes()
}

/// Whether tables' SIGBUS faults are caught now.
#[pyfunction]
fn sigbus_guard_active() -> bool {
    crate::table::sigbus_guard_active()
}

/// `[(kind, python class name)]`: pins the error mapping in tests.
#[pyfunction]
fn error_kinds() -> Vec<(String, &'static str)> {
    ErrorKind::ALL
        .iter()
        .map(|k| (format!("{k:?}"), k.python_name()))
        .collect()
}

/// Raise the exception that `kind` maps to (tests of the mapping).
#[pyfunction]
fn _raise_kind(py: Python<'_>, kind: &str) -> PyResult<()> {
    let e = match kind {
        "Unsupported" => Error::unsupported("test"),
        "Driver" => Error::Driver {
            call: "cuTest",
            device: Some(0),
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
        },
        "Poisoned" => Error::Poisoned {
            cause: "test".into(),
        },
        "Closed" => Error::Closed,
        "State" => Error::state(crate::error::Op::Fill, "test"),
        "SlotBusy" => Error::SlotBusy,
        "RowShape" => Error::rows("test"),
        "InvalidArgument" => Error::invalid("test"),
        "Table" => Error::Table {
            file: "f".into(),
            detail: "test".into(),
        },
        "RowId" => Error::RowId {
            id: 9,
            position: 0,
            rows: 1,
            table: "t".into(),
        },
        "Io" => Error::Io {
            path: "p".into(),
            detail: "test".into(),
        },
        "UnarmedReplay" => Error::UnarmedReplay {
            detail: "test".into(),
        },
        "NoArmedStep" => Error::NoArmedStep {
            op: crate::error::Op::Fill,
            detail: "test".into(),
        },
        other => return Err(PyRuntimeError::new_err(format!("unknown kind {other}"))),
    };
    Err(to_pyerr(py, e))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDeferredRows>()?;
    m.add_function(wrap_pyfunction!(probe, m)?)?;
    m.add_function(wrap_pyfunction!(driver_info, m)?)?;
    m.add_function(wrap_pyfunction!(retained_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(sigbus_guard_active, m)?)?;
    m.add_function(wrap_pyfunction!(error_kinds, m)?)?;
    m.add_function(wrap_pyfunction!(_raise_kind, m)?)?;
    table::register(m)?;
    worker::register(m)?;
    Ok(())
}
