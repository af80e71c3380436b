//! [`MmapTable`]: a 2-D tensor (or a set of row shards) of a safetensors checkpoint,
//! memory-mapped read-only and served row by row by a native gather.
//!
//! * [`discover`]: find the tensor(s) in one file or an indexed directory and validate
//!   them (typed errors naming the file and the tensor; never a panic on hostile input).
//! * [`gather`]: check every id, then copy rows inline or on a small rayon pool.
//! * [`pagecache`]: prewarm, readahead, an RSS budget and residency (`mincore`), all off
//!   by default.
//!
//! The table is immutable once open and cheap to clone (an `Arc`); any number of threads
//! may gather at once.

pub mod discover;
pub mod gather;
pub mod pagecache;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use discover::{scale_candidates, supported_dtype, Selector, INDEX_FILE, SHARD_PLACEHOLDER};
pub use gather::PARALLEL_MIN_BYTES;
pub use safetensors::Dtype;

use crate::error::{Error, Result};
use discover::Layout;
use gather::{first_bad, RowSource};
use pagecache::Touched;

/// Row ids to gather: `int32` or `int64`, as the caller has them (no conversion copy).
#[derive(Debug, Clone, Copy)]
pub enum RowIds<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl RowIds<'_> {
    pub fn len(&self) -> usize {
        match self {
            RowIds::I32(v) => v.len(),
            RowIds::I64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id at `i`, widened.
    pub fn get(&self, i: usize) -> Option<i64> {
        match self {
            RowIds::I32(v) => v.get(i).map(|&x| i64::from(x)),
            RowIds::I64(v) => v.get(i).copied(),
        }
    }

    /// The ids' memory, for aliasing checks at the FFI boundary.
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        let (p, n) = match self {
            RowIds::I32(v) => (v.as_ptr() as usize, std::mem::size_of_val(*v)),
            RowIds::I64(v) => (v.as_ptr() as usize, std::mem::size_of_val(*v)),
        };
        p..p + n
    }
}

impl<'a> From<&'a [i32]> for RowIds<'a> {
    fn from(v: &'a [i32]) -> Self {
        RowIds::I32(v)
    }
}

impl<'a> From<&'a [i64]> for RowIds<'a> {
    fn from(v: &'a [i64]) -> Self {
        RowIds::I64(v)
    }
}

/// How the table uses the page cache. Everything is off by default: the table then
/// behaves like a plain read-only `mmap` (the kernel faults pages in on first read and
/// keeps them as long as it likes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableOptions {
    /// At open, fault in the table's first `n` bytes (in row order): `MADV_WILLNEED`, then
    /// one read a page, so the first gathers do not wait for the disk.
    pub prewarm_bytes: Option<u64>,
    /// Before each gather, `MADV_WILLNEED` the pages of the rows about to be read, so a
    /// gather from a cold table issues its reads together instead of one fault at a time.
    /// Costs one `madvise` per distinct page a gather touches: meant for tables that do
    /// not stay resident, not for hot ones.
    pub readahead: bool,
    /// Keep the table's pages below about this many bytes: when the distinct pages read
    /// since the last drop exceed it, the gather that crossed it drops them all (see
    /// [`MmapTable::drop_pages`]) before returning. Pages touched are tracked one bit a
    /// page (a 48 GiB table needs 1.5 MiB).
    pub rss_budget_bytes: Option<u64>,
    /// Gathers of at least this many bytes run on the gather pool (default
    /// [`PARALLEL_MIN_BYTES`]; `usize::MAX`: always inline).
    pub parallel_min_bytes: usize,
}

impl Default for TableOptions {
    fn default() -> Self {
        Self {
            prewarm_bytes: None,
            readahead: false,
            rss_budget_bytes: None,
            parallel_min_bytes: PARALLEL_MIN_BYTES,
        }
    }
}

/// Page-cache counters of one table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageStats {
    /// Drops the RSS budget triggered.
    pub budget_drops: u64,
    /// Bytes of distinct pages read since the last drop (0 without an RSS budget).
    pub touched_bytes: u64,
    /// The last failure of a budget drop (a gather does not fail for it; it is reported
    /// here and the next drop tries again).
    pub last_drop_error: Option<String>,
}

struct Inner {
    layout: Layout,
    label: String,
    ends: Vec<u64>,
    opts: TableOptions,
    touched: Option<Touched>,
    budget_drops: AtomicU64,
    /// Serialises drops (a budget drop and an explicit one) and holds the last failure.
    drop_state: Mutex<Option<String>>,
}

/// A memory-mapped embedding table; see the module docs. `Clone` shares the mapping.
#[derive(Clone)]
pub struct MmapTable {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MmapTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmapTable")
            .field("table", &self.inner.label)
            .field("dtype", &self.inner.layout.dtype)
            .field("rows", &self.inner.layout.rows)
            .field("cols", &self.inner.layout.cols)
            .field("shards", &self.inner.layout.segments.len())
            .finish()
    }
}

impl MmapTable {
    /// Open the table `selector` names in the checkpoint at `path`: a `.safetensors` file,
    /// a `model.safetensors.index.json`, or a directory holding either (the index wins).
    ///
    /// The checkpoint's files must not be modified or truncated while the table is open
    /// (the usual contract of a memory map: a truncated file faults the reader).
    pub fn open(
        path: impl AsRef<Path>,
        selector: &Selector,
        options: TableOptions,
    ) -> Result<Self> {
        let path = path.as_ref();
        let layout = discover::discover(path, selector)?;
        let label = format!("{:?} in {}", selector.text(), path.display());
        let ends = layout
            .segments
            .iter()
            .map(|s| s.first_row + s.rows)
            .collect();
        let touched = options
            .rss_budget_bytes
            .map(|_| Touched::new(&layout.segments));
        let table = Self {
            inner: Arc::new(Inner {
                layout,
                label,
                ends,
                opts: options,
                touched,
                budget_drops: AtomicU64::new(0),
                drop_state: Mutex::new(None),
            }),
        };
        if let Some(budget) = table.inner.opts.prewarm_bytes {
            table.prewarm(budget)?;
        }
        Ok(table)
    }

    /// Rows in the table (all shards).
    pub fn rows(&self) -> u64 {
        self.inner.layout.rows
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.inner.layout.row_bytes
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.inner.layout.cols
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.inner.layout.dtype
    }

    /// The safetensors name of the element type (`"F8_E4M3"`, `"BF16"`, ...).
    pub fn dtype_name(&self) -> String {
        format!("{:?}", self.inner.layout.dtype)
    }

    /// The scalar dequantization scale of an FP8 table, where the checkpoint has one (see
    /// [`scale_candidates`] for the names looked for).
    pub fn scale(&self) -> Option<f64> {
        self.inner.layout.scale
    }

    /// The name of the tensor [`Self::scale`] came from.
    pub fn scale_tensor(&self) -> Option<&str> {
        self.inner.layout.scale_tensor.as_deref()
    }

    /// The mapped files, in the order their shards first appear.
    pub fn files(&self) -> Vec<&Path> {
        self.inner
            .layout
            .files
            .iter()
            .map(|f| f.path.as_path())
            .collect()
    }

    /// `(tensor name, rows)` of each shard, in row order.
    pub fn shards(&self) -> Vec<(&str, u64)> {
        self.inner
            .layout
            .segments
            .iter()
            .map(|s| (s.tensor.as_str(), s.rows))
            .collect()
    }

    /// What errors call this table: the name or pattern and the checkpoint path.
    pub fn label(&self) -> &str {
        &self.inner.label
    }

    /// Bytes of row data (`rows * row_bytes`).
    pub fn data_bytes(&self) -> u64 {
        self.inner
            .layout
            .segments
            .iter()
            .map(|s| s.len as u64)
            .sum()
    }

    /// Check that every id is a row of the table.
    pub fn check_ids(&self, ids: RowIds<'_>) -> Result<()> {
        let rows = self.rows();
        let bad = match ids {
            RowIds::I32(v) => first_bad(v, rows),
            RowIds::I64(v) => first_bad(v, rows),
        };
        match bad {
            None => Ok(()),
            Some((position, id)) => Err(Error::RowId {
                id,
                position,
                rows,
                table: self.inner.label.clone(),
            }),
        }
    }

    fn source(&self) -> RowSource<'_> {
        RowSource {
            files: &self.inner.layout.files,
            segments: &self.inner.layout.segments,
            ends: &self.inner.ends,
            row_bytes: self.inner.layout.row_bytes,
        }
    }

    /// Copy rows `ids` into `dst`, row `i` at `dst[i * row_bytes..]`. `dst` must be
    /// exactly `ids.len() * row_bytes` bytes. Every id is checked before anything is
    /// written: on error `dst` is untouched. Duplicate ids are fine. No allocation; runs
    /// on the calling thread below [`TableOptions::parallel_min_bytes`], on the gather
    /// pool above.
    pub fn gather_into(&self, ids: RowIds<'_>, dst: &mut [u8]) -> Result<()> {
        let rb = self.row_bytes();
        if Some(dst.len()) != ids.len().checked_mul(rb) {
            return Err(Error::invalid(format!(
                "destination is {} bytes; {} rows of {rb} bytes need {}",
                dst.len(),
                ids.len(),
                ids.len().saturating_mul(rb)
            )));
        }
        self.check_ids(ids)?;
        let src = self.source();
        let min = self.inner.opts.parallel_min_bytes;
        if self.inner.opts.readahead {
            self.readahead(&src, ids);
        }
        match ids {
            RowIds::I32(v) => src.copy_maybe_parallel(v, dst, min),
            RowIds::I64(v) => src.copy_maybe_parallel(v, dst, min),
        }
        if self.inner.touched.is_some() {
            self.account(&src, ids);
        }
        Ok(())
    }

    /// [`Self::gather_into`] into a new buffer.
    pub fn gather(&self, ids: RowIds<'_>) -> Result<Vec<u8>> {
        self.check_ids(ids)?;
        let n = ids
            .len()
            .checked_mul(self.row_bytes())
            .ok_or_else(|| Error::invalid("gather size overflows"))?;
        let mut out = vec![0u8; n];
        self.gather_into(ids, &mut out)?;
        Ok(out)
    }

    fn readahead(&self, src: &RowSource<'_>, ids: RowIds<'_>) {
        let ps = pagecache::page_size();
        let rb = src.row_bytes;
        let mut last: Option<(usize, usize)> = None;
        for i in 0..ids.len() {
            let Some(id) = ids.get(i) else { break };
            let (si, off) = src.locate(id as u64);
            let page = (si, off / ps);
            if last == Some(page) && (off + rb - 1) / ps == page.1 {
                continue;
            }
            last = Some(page);
            pagecache::will_need(&src.files[src.segments[si].file], off, rb);
        }
    }

    /// RSS budget: record the pages this gather read; drop everything once over budget.
    fn account(&self, src: &RowSource<'_>, ids: RowIds<'_>) {
        let (Some(t), Some(budget)) = (&self.inner.touched, self.inner.opts.rss_budget_bytes)
        else {
            return;
        };
        for i in 0..ids.len() {
            let Some(id) = ids.get(i) else { break };
            let (si, off) = src.locate(id as u64);
            let seg = &src.segments[si];
            t.mark(si, seg.start, off - seg.start, src.row_bytes);
        }
        if t.bytes() > budget {
            // One dropper at a time; a gather that finds a drop under way goes on.
            if let Ok(mut last_err) = self.inner.drop_state.try_lock() {
                if t.bytes() > budget {
                    self.inner.budget_drops.fetch_add(1, Ordering::Relaxed);
                    t.reset();
                    if let Err(e) =
                        pagecache::drop_pages(&self.inner.layout.files, &self.inner.layout.segments)
                    {
                        *last_err = Some(e.to_string());
                    }
                }
            }
        }
    }

    /// Bytes of the table's pages in the page cache now (`mincore`, page-granular).
    pub fn resident_bytes(&self) -> Result<u64> {
        pagecache::resident_bytes(&self.inner.layout.files, &self.inner.layout.segments)
    }

    /// Fault in the first `budget` bytes of the table (row order; capped by the RSS
    /// budget if one is set). Returns the bytes warmed.
    pub fn prewarm(&self, budget: u64) -> Result<u64> {
        let budget = match self.inner.opts.rss_budget_bytes {
            Some(b) => budget.min(b),
            None => budget,
        };
        let t = self.inner.touched.as_ref();
        let segs = &self.inner.layout.segments;
        pagecache::prewarm(&self.inner.layout.files, segs, budget, |si, off, len| {
            if let Some(t) = t {
                t.mark(si, segs[si].start, off, len);
            }
        })
    }

    /// Drop the table's pages now: `MADV_DONTNEED` on the mapping (this process's RSS
    /// shrinks), then `POSIX_FADV_DONTNEED` on the files (clean pages leave the page cache
    /// unless another process maps them). Data is unaffected: later gathers read it back.
    pub fn drop_pages(&self) -> Result<()> {
        let mut last_err = self
            .inner
            .drop_state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(t) = &self.inner.touched {
            t.reset();
        }
        let r = pagecache::drop_pages(&self.inner.layout.files, &self.inner.layout.segments);
        if r.is_ok() {
            *last_err = None;
        }
        r
    }

    /// Page-cache counters.
    pub fn page_stats(&self) -> PageStats {
        let last_drop_error = self
            .inner
            .drop_state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        PageStats {
            budget_drops: self.inner.budget_drops.load(Ordering::Relaxed),
            touched_bytes: self.inner.touched.as_ref().map_or(0, Touched::bytes),
            last_drop_error,
        }
    }

    /// The options the table was opened with.
    pub fn options(&self) -> &TableOptions {
        &self.inner.opts
    }
}

#[cfg(test)]
mod tests;
