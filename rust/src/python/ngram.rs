//! `ple_memops._native.NGramHashCore`: the native half of
//! `ple_memops.vllm.ngram_ids.HostNGramIds` (the Python wrapper makes every argument a
//! C-contiguous int64 array).

use numpy::{PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::{to_pyerr, write_into};
use crate::error::Error;
use crate::ngram::NGramHash;

#[pyclass(name = "NGramHashCore", module = "ple_memops._native", frozen)]
pub(crate) struct PyNGramHash {
    inner: NGramHash,
}

fn contiguous<'a>(
    py: Python<'_>,
    a: &'a PyReadonlyArray1<'_, i64>,
    what: &str,
) -> PyResult<&'a [i64]> {
    a.as_slice()
        .map_err(|_| to_pyerr(py, Error::invalid(format!("{what} must be C-contiguous"))))
}

/// A fresh `int64 [tokens, heads]` array filled by `fill` with the GIL released.
fn ids_array<'py>(
    py: Python<'py>,
    tokens: usize,
    heads: usize,
    fill: impl FnOnce(&mut [i64]) -> crate::error::Result<()> + Send,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let out = PyArray2::<i64>::zeros(py, [tokens, heads], false);
    write_into(py, &out, |dst| {
        py.detach(|| fill(dst)).map_err(|e| to_pyerr(py, e))
    })?;
    Ok(out)
}

#[pymethods]
impl PyNGramHash {
    #[new]
    fn new(
        py: Python<'_>,
        multipliers: Vec<i64>,
        sizes: Vec<i64>,
        offsets: Vec<i64>,
        eos: i64,
        heads_per_ngram: usize,
    ) -> PyResult<Self> {
        NGramHash::new(multipliers, sizes, offsets, eos, heads_per_ngram)
            .map(|inner| Self { inner })
            .map_err(|e| to_pyerr(py, e))
    }

    #[getter]
    fn heads(&self) -> usize {
        self.inner.heads()
    }

    /// `int64 [tokens, heads]`, computed with the GIL released.
    fn ids<'py>(
        &self,
        py: Python<'py>,
        tokens: PyReadonlyArray1<'py, i64>,
        query_start_loc: PyReadonlyArray1<'py, i64>,
        context: PyReadonlyArray1<'py, i64>,
    ) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let (t, q, c) = (
            contiguous(py, &tokens, "tokens")?,
            contiguous(py, &query_start_loc, "query_start_loc")?,
            contiguous(py, &context, "ngram_context")?,
        );
        let inner = &self.inner;
        ids_array(py, t.len(), inner.heads(), |dst| inner.ids(t, q, c, dst))
    }

    /// `int64 [requests, heads]`: each request's token at `positions[i]` of `history` row
    /// `rows[i]` (`int32 [requests, width]`, C-contiguous: vLLM's `all_token_ids`), with
    /// the tokens before it; the GIL released.
    fn ids_at<'py>(
        &self,
        py: Python<'py>,
        history: PyReadonlyArray2<'py, i32>,
        rows: PyReadonlyArray1<'py, i64>,
        positions: PyReadonlyArray1<'py, i64>,
    ) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let width = history.shape()[1];
        let hist = history
            .as_slice()
            .map_err(|_| to_pyerr(py, Error::invalid("history must be C-contiguous")))?;
        let (r, p) = (
            contiguous(py, &rows, "rows")?,
            contiguous(py, &positions, "positions")?,
        );
        let inner = &self.inner;
        ids_array(py, r.len(), inner.heads(), |dst| {
            inner.ids_at(hist, width, r, p, dst)
        })
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNGramHash>()
}
