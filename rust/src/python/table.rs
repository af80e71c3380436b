//! `ple_memops._native.MmapTableCore`: the native half of `ple_memops.MmapTable`.
//!
//! Arguments arrive as numpy arrays (the Python wrapper turns lists and torch CPU tensors
//! into them); every check the gather needs is made here or in the core, every error goes
//! through [`to_pyerr`], and the gather itself runs with the GIL released.

use std::borrow::Cow;
use std::ops::Range;
use std::path::PathBuf;

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{to_pyerr, write_into};
use crate::error::Error;
use crate::table::{floor, Access, ColdReads, MmapTable, RowIds, Selector, TableOptions};

/// Ids borrowed from a numpy array (or copied, when it is strided).
pub(crate) enum Ids<'py> {
    I64(PyReadonlyArray1<'py, i64>),
    I32(PyReadonlyArray1<'py, i32>),
}

impl Ids<'_> {
    fn len(&self) -> usize {
        match self {
            Ids::I64(a) => a.len(),
            Ids::I32(a) => a.len(),
        }
    }

    /// `f` of the ids as the core's [`RowIds`] (borrowed, or a copy of strided ids).
    pub(crate) fn with_row_ids<R>(&self, f: impl FnOnce(RowIds<'_>) -> R) -> R {
        match self {
            Ids::I64(a) => f(RowIds::I64(&slice_or_copy(a))),
            Ids::I32(a) => f(RowIds::I32(&slice_or_copy(a))),
        }
    }
}

fn slice_or_copy<'a, T: numpy::Element + Copy>(a: &'a PyReadonlyArray1<'_, T>) -> Cow<'a, [T]> {
    match a.as_slice() {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(a.as_array().iter().copied().collect()),
    }
}

pub(crate) fn extract_ids<'py>(ids: &Bound<'py, PyAny>) -> Result<Ids<'py>, Error> {
    let borrow = |e: numpy::BorrowError| Error::invalid(format!("ids: {e}"));
    if let Ok(a) = ids.cast::<PyArray1<i64>>() {
        return a.try_readonly().map(Ids::I64).map_err(borrow);
    }
    if let Ok(a) = ids.cast::<PyArray1<i32>>() {
        return a.try_readonly().map(Ids::I32).map_err(borrow);
    }
    Err(Error::invalid(
        "ids must be a 1-D numpy array of int64 or int32",
    ))
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// The native half of `ple_memops.MmapTable` (use that class, not this one).
#[pyclass(name = "MmapTableCore", module = "ple_memops._native", frozen)]
pub struct PyMmapTable {
    inner: MmapTable,
}

impl PyMmapTable {
    /// The Rust table, for other bindings (e.g. `DeferredRows.fill_from`) to gather from.
    pub(crate) fn table(&self) -> &MmapTable {
        &self.inner
    }

    fn run(&self, py: Python<'_>, ids: &Ids<'_>, dst: &mut [u8]) -> PyResult<()> {
        let table = &self.inner;
        ids.with_row_ids(|ids| {
            if overlaps(&ids.byte_range(), &dst.as_ptr_range().into_usize()) {
                Err(Error::invalid("ids and the destination share memory"))
            } else {
                py.detach(|| table.gather_into(ids, dst))
            }
        })
        .map_err(|e| to_pyerr(py, e))
    }
}

trait IntoUsize {
    fn into_usize(self) -> Range<usize>;
}

impl IntoUsize for Range<*const u8> {
    fn into_usize(self) -> Range<usize> {
        self.start as usize..self.end as usize
    }
}

#[pymethods]
impl PyMmapTable {
    /// Open a table; exactly one of `name` and `pattern`.
    #[new]
    #[pyo3(signature = (path, name=None, pattern=None, prewarm_bytes=None, readahead=false, rss_budget_bytes=None, parallel_min_bytes=None, gather_threads=None, access="random", cold_reads="auto", adopt_resident=true, columns=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        name: Option<String>,
        pattern: Option<String>,
        prewarm_bytes: Option<u64>,
        readahead: bool,
        rss_budget_bytes: Option<u64>,
        parallel_min_bytes: Option<usize>,
        gather_threads: Option<usize>,
        access: &str,
        cold_reads: &str,
        adopt_resident: bool,
        columns: Option<(usize, usize)>,
    ) -> PyResult<Self> {
        let selector = match (name, pattern) {
            (Some(n), None) => Selector::Name(n),
            (None, Some(p)) => Selector::Pattern(p),
            _ => {
                return Err(to_pyerr(
                    py,
                    Error::invalid("give exactly one of name= and pattern="),
                ))
            }
        };
        let access = Access::parse(access).map_err(|e| to_pyerr(py, e))?;
        let cold_reads = ColdReads::parse(cold_reads).map_err(|e| to_pyerr(py, e))?;
        let mut opts = TableOptions {
            prewarm_bytes,
            readahead,
            rss_budget_bytes,
            access,
            cold_reads,
            adopt_resident,
            gather_threads,
            columns,
            ..TableOptions::default()
        };
        if let Some(m) = parallel_min_bytes {
            opts.parallel_min_bytes = m;
        }
        let inner = py
            .detach(|| MmapTable::open(&path, &selector, opts))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(Self { inner })
    }

    #[getter]
    fn gather_threads(&self) -> Option<usize> {
        self.inner.options().gather_threads
    }

    #[getter]
    fn columns(&self) -> Option<(usize, usize)> {
        self.inner.options().columns
    }

    #[getter]
    fn parallel_min_bytes(&self) -> usize {
        self.inner.options().parallel_min_bytes
    }

    #[getter]
    fn rows(&self) -> u64 {
        self.inner.rows()
    }

    #[getter]
    fn row_bytes(&self) -> usize {
        self.inner.row_bytes()
    }

    #[getter]
    fn cols(&self) -> usize {
        self.inner.cols()
    }

    #[getter]
    fn dtype(&self) -> String {
        self.inner.dtype_name()
    }

    #[getter]
    fn scale(&self) -> Option<f64> {
        self.inner.scale()
    }

    #[getter]
    fn scale_tensor(&self) -> Option<String> {
        self.inner.scale_tensor().map(str::to_owned)
    }

    #[getter]
    fn files(&self) -> Vec<PathBuf> {
        self.inner
            .files()
            .into_iter()
            .map(|p| p.to_path_buf())
            .collect()
    }

    #[getter]
    fn shards(&self) -> Vec<(String, u64)> {
        self.inner
            .shards()
            .into_iter()
            .map(|(n, r)| (n.to_owned(), r))
            .collect()
    }

    #[getter]
    fn label(&self) -> String {
        self.inner.label().to_owned()
    }

    /// Another handle serving `columns` of each stored row, sharing this one's mappings.
    #[pyo3(signature = (columns=None, gather_threads=None))]
    fn window(
        &self,
        py: Python<'_>,
        columns: Option<(usize, usize)>,
        gather_threads: Option<usize>,
    ) -> PyResult<Self> {
        let inner = self
            .inner
            .window(columns, gather_threads)
            .map_err(|e| to_pyerr(py, e))?;
        Ok(Self { inner })
    }

    /// The cold-read way in use (`"auto"` resolved).
    #[getter]
    fn cold_reads(&self) -> &'static str {
        self.inner.cold_reads().0.name()
    }

    /// Why `cold_reads="auto"` did not choose io_uring, or `None`.
    #[getter]
    fn cold_reads_reason(&self) -> Option<String> {
        self.inner.cold_reads().1.map(str::to_owned)
    }

    #[getter]
    fn access(&self) -> &'static str {
        self.inner.options().access.name()
    }

    /// Gather rows `ids` (1-D int64/int32 numpy) into `out` (C-contiguous, writable uint8
    /// numpy of shape `[len(ids), row_bytes]`). Nothing is written on any error.
    fn gather_into(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = extract_ids(ids).map_err(|e| to_pyerr(py, e))?;
        let arr = out
            .cast::<PyArray2<u8>>()
            .map_err(|_| to_pyerr(py, Error::invalid("out must be a 2-D numpy uint8 array")))?;
        let n = ids.len();
        let shape = arr.shape();
        if shape != [n, self.inner.row_bytes()] {
            return Err(to_pyerr(
                py,
                Error::invalid(format!(
                    "out has shape {shape:?}; {n} rows of this table need [{n}, {}]",
                    self.inner.row_bytes()
                )),
            ));
        }
        write_into(py, arr, |dst| self.run(py, &ids, dst))
    }

    /// Gather rows `ids` into a new uint8 array `[len(ids), row_bytes]`.
    fn gather<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<u8>>> {
        let ids = extract_ids(ids).map_err(|e| to_pyerr(py, e))?;
        let n = ids.len();
        let out = PyArray2::<u8>::zeros(py, [n, self.inner.row_bytes()], false);
        write_into(py, &out, |dst| self.run(py, &ids, dst))?;
        Ok(out)
    }

    /// Check `ids` against the table without gathering.
    fn check_ids(&self, py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = extract_ids(ids).map_err(|e| to_pyerr(py, e))?;
        ids.with_row_ids(|ids| self.inner.check_ids(ids))
            .map_err(|e| to_pyerr(py, e))
    }

    fn resident_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        let t = &self.inner;
        py.detach(|| t.resident_bytes())
            .map_err(|e| to_pyerr(py, e))
    }

    fn prewarm(&self, py: Python<'_>, budget: u64) -> PyResult<u64> {
        let t = &self.inner;
        py.detach(|| t.prewarm(budget)).map_err(|e| to_pyerr(py, e))
    }

    fn adopt_resident(&self, py: Python<'_>) -> PyResult<u64> {
        let t = &self.inner;
        py.detach(|| t.adopt_resident())
            .map_err(|e| to_pyerr(py, e))
    }

    fn drop_pages(&self, py: Python<'_>) -> PyResult<()> {
        let t = &self.inner;
        py.detach(|| t.drop_pages()).map_err(|e| to_pyerr(py, e))
    }

    fn page_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.page_stats();
        let d = PyDict::new(py);
        d.set_item("budget_drops", s.budget_drops)?;
        d.set_item("touched_bytes", s.touched_bytes)?;
        d.set_item("last_drop_error", s.last_drop_error)?;
        d.set_item("data_bytes", self.inner.data_bytes())?;
        d.set_item("row_hits", s.row_hits)?;
        d.set_item("row_misses", s.row_misses)?;
        d.set_item("pages_read", s.pages_read)?;
        d.set_item("pages_evicted", s.pages_evicted)?;
        d.set_item("pages_forgotten", s.pages_forgotten)?;
        d.set_item("pages_adopted", s.pages_adopted)?;
        d.set_item("cold_fallbacks", s.cold_fallbacks)?;
        d.set_item("slow_copies", s.slow_copies)?;
        d.set_item("last_fallback", s.last_fallback)?;
        Ok(d)
    }
}

// The benchmarks' instruments (`table::floor`), bound with a leading underscore: they are
// not the public API.

/// Benchmark instrument: `batches` rounds of `depth` random 4 KiB reads of `path`
/// submitted together through io_uring (`O_DIRECT` unless `direct=False`); each round's
/// seconds.
#[pyfunction]
#[pyo3(name = "_bench_read_batches", signature = (path, depth, batches, direct=true, seed=0))]
fn bench_read_batches(
    py: Python<'_>,
    path: PathBuf,
    depth: usize,
    batches: usize,
    direct: bool,
    seed: u64,
) -> PyResult<Vec<f64>> {
    py.detach(|| floor::read_batches(&path, depth, batches, direct, seed))
        .map_err(|e| to_pyerr(py, e))
}

/// Benchmark instrument: `reads` random 4 KiB reads of `path` with `depth` in flight;
/// the seconds they took.
#[pyfunction]
#[pyo3(name = "_bench_read_sustained", signature = (path, depth, reads, direct=true, seed=0))]
fn bench_read_sustained(
    py: Python<'_>,
    path: PathBuf,
    depth: usize,
    reads: usize,
    direct: bool,
    seed: u64,
) -> PyResult<f64> {
    py.detach(|| floor::read_sustained(&path, depth, reads, direct, seed))
        .map_err(|e| to_pyerr(py, e))
}

/// Benchmark instrument: nanoseconds per hop of a dependent pointer chase over
/// `buffer_bytes` (one cache-line miss per hop when far larger than the last-level cache).
#[pyfunction]
#[pyo3(name = "_bench_memory_latency_ns", signature = (buffer_bytes, hops, seed=0))]
fn bench_memory_latency_ns(
    py: Python<'_>,
    buffer_bytes: usize,
    hops: usize,
    seed: u64,
) -> PyResult<f64> {
    py.detach(|| floor::memory_latency_ns(buffer_bytes, hops, seed))
        .map_err(|e| to_pyerr(py, e))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMmapTable>()?;
    m.add_function(wrap_pyfunction!(bench_read_batches, m)?)?;
    m.add_function(wrap_pyfunction!(bench_read_sustained, m)?)?;
    m.add_function(wrap_pyfunction!(bench_memory_latency_ns, m)?)?;
    Ok(())
}
