//! [`MmapTable`]: a 2-D tensor (or a set of row shards) of a safetensors checkpoint,
//! memory-mapped read-only and served row by row by a native gather.
//!
//! * [`discover`]: find the tensor(s) in one file or an indexed directory and validate
//!   them (typed errors naming the file and the tensor; never a panic on hostile input).
//! * [`gather`]: check every id, then copy rows inline or on a small rayon pool.
//! * [`coldread`]: read the rows of a gather that miss the page cache together (io_uring,
//!   `MADV_WILLNEED`, a `pread` pool).
//! * `residency`: which pages the table has read (a gather of those goes straight to the
//!   copy), their access counts, and the clock that evicts the least used under a budget.
//! * [`pagecache`]: random-access advice, prewarm, dropping pages, residency (`mincore`).
//! * `floor` (crate-private): measuring instruments for the benchmarks (storage and memory
//!   latency).
//!
//! The table is immutable once open and cheap to clone (an `Arc`); any number of threads
//! may gather at once.
//!
//! `unsafe` in `table`: mapping the file (`discover`), the page-cache system calls
//! (`pagecache`), the SIGBUS handler (`sigbus`), io_uring submissions (`coldread`,
//! `floor`) and cache prefetch hints (`gather`); none in this file or `residency`.

pub mod coldread;
pub mod discover;
// Measuring instruments for the benchmarks, not part of the table: crate-private, reached
// only through the Python bindings' `_bench_*` functions.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) mod floor;
pub mod gather;
pub mod pagecache;
mod residency;
mod sigbus;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

pub use discover::{scale_candidates, supported_dtype, Selector, INDEX_FILE, SHARD_PLACEHOLDER};
pub use gather::{MAX_GATHER_THREADS, PARALLEL_MIN_BYTES};
pub use safetensors::Dtype;
/// Whether tables' SIGBUS faults are caught now (see `sigbus`): a table has opened and the
/// process's SIGBUS action is still the table's handler.
pub use sigbus::handler_is_current as sigbus_guard_active;

use crate::error::{Error, Result};
use coldread::{ColdRow, Uring};
use discover::Layout;
use gather::{first_bad, Copied, Id, MappedRows};
use residency::PageMap;

/// What an ordered gather calls before it reads rows from storage, with their number
/// ([`MmapTable::gather_into_ordered`]): it may wait, and its error ends the gather unread.
pub type BeforeReads<'a> = &'a mut dyn FnMut(usize) -> Result<()>;

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

/// How the table's rows are expected to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// At random (the default): `MADV_RANDOM` on the mapping and `POSIX_FADV_RANDOM` on
    /// the files, so the kernel reads no neighbouring pages around a cold row (with its
    /// default read-around, one cold row pulled megabytes into the page cache).
    #[default]
    Random,
    /// Leave the kernel's read-around and readahead as they are (for tables read in long
    /// runs of consecutive rows).
    Normal,
}

impl Access {
    pub fn name(self) -> &'static str {
        match self {
            Access::Random => "random",
            Access::Normal => "normal",
        }
    }

    /// Parse `"random"` or `"normal"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "random" => Ok(Access::Random),
            "normal" => Ok(Access::Normal),
            _ => Err(Error::invalid(format!(
                "access must be \"random\" or \"normal\", got {s:?}"
            ))),
        }
    }
}

/// How a gather reads its rows that are not known to be in the page cache (see
/// [`coldread`]). Rows whose pages the table has read before are copied straight from
/// the mapping whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ColdReads {
    /// io_uring where the kernel allows it (probed once per process and verified on the
    /// table's first file at open), else [`ColdReads::WillNeed`].
    #[default]
    Auto,
    /// One buffered read per row through a per-thread io_uring, all submitted together;
    /// I/O errors come back as [`Error::Io`]. Refused at open where io_uring is unavailable.
    Uring,
    /// `MADV_WILLNEED` on each cold row's page(s), then the copy from the mapping.
    WillNeed,
    /// `pread` per cold row on a pool of 32 blocking threads.
    Pool,
    /// No batching: the copy faults each cold page in, one at a time.
    Fault,
}

impl ColdReads {
    pub fn name(self) -> &'static str {
        match self {
            ColdReads::Auto => "auto",
            ColdReads::Uring => "uring",
            ColdReads::WillNeed => "willneed",
            ColdReads::Pool => "pool",
            ColdReads::Fault => "fault",
        }
    }

    /// Parse `"auto"`, `"uring"`, `"willneed"`, `"pool"` or `"fault"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(ColdReads::Auto),
            "uring" => Ok(ColdReads::Uring),
            "willneed" => Ok(ColdReads::WillNeed),
            "pool" => Ok(ColdReads::Pool),
            "fault" => Ok(ColdReads::Fault),
            _ => Err(Error::invalid(format!(
                "cold_reads must be one of \"auto\", \"uring\", \"willneed\", \"pool\", \
                 \"fault\", got {s:?}"
            ))),
        }
    }
}

/// How the table uses the page cache. The defaults suit a table larger than RAM: random
/// access (no read-around), cold rows of a gather read together, pages kept as long as
/// the kernel likes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableOptions {
    /// At open, fault in the table's first `n` bytes (in row order): `MADV_WILLNEED`, then
    /// one read a page, so the first gathers do not wait for the disk.
    pub prewarm_bytes: Option<u64>,
    /// Kept for compatibility: it asked for a gather's cold reads to go out together
    /// (`MADV_WILLNEED` per row), which every [`ColdReads`] but `Fault` now does. With
    /// `Fault` it is refused; otherwise it changes nothing.
    pub readahead: bool,
    /// Keep the table's pages in the page cache below about this many bytes: once the
    /// pages the table has read (and not dropped) exceed it, the gather that crossed it
    /// evicts the least used ones (a CLOCK sweep over per-page access counts with aging)
    /// until under budget, `MADV_DONTNEED` + `POSIX_FADV_DONTNEED` per run of pages. One
    /// bit and one byte per 4 KiB page of bookkeeping (a 48 GiB table needs 14 MiB).
    pub rss_budget_bytes: Option<u64>,
    /// Gathers of at least this many bytes run on the gather pool (default
    /// [`PARALLEL_MIN_BYTES`]; `usize::MAX`: always inline).
    pub parallel_min_bytes: usize,
    /// `None` (default): parallel gathers run on the process's shared gather pool (up to 8
    /// threads, shared by every table). `Some(n)`, 2 to [`MAX_GATHER_THREADS`]: on `n`
    /// threads of the table's own, started at open, so the table's gathers never queue
    /// behind other tables' (an engine's first PLE layer, whose fill the step waits for,
    /// while the later layers gather at the same time).
    pub gather_threads: Option<usize>,
    /// Read-around policy of the mapping and files.
    pub access: Access,
    /// How a gather reads rows that are not known to be resident.
    pub cold_reads: ColdReads,
    /// At open, take the table's pages that are in the page cache already as known
    /// resident ([`MmapTable::adopt_resident`]), so the gathers of a warm host copy them
    /// straight from the mapping instead of reading each one cold first. Ignored under
    /// an RSS budget (the budget accounts for the pages the table read itself).
    pub adopt_resident: bool,
    /// `Some((first, count))`: serve columns `first..first + count` of each row only, as
    /// rows of `count` columns (a gather reads only those bytes of a row, and
    /// [`MmapTable::row_bytes`] and [`MmapTable::cols`] are the window's). Gemma's
    /// per-layer table holds every decoder layer's slice in one row: a window serves one
    /// layer's (or a run of layers') slices as a table of their own. `None` (default):
    /// whole rows.
    pub columns: Option<(usize, usize)>,
}

impl Default for TableOptions {
    fn default() -> Self {
        Self {
            prewarm_bytes: None,
            readahead: false,
            rss_budget_bytes: None,
            parallel_min_bytes: PARALLEL_MIN_BYTES,
            gather_threads: None,
            access: Access::Random,
            cold_reads: ColdReads::Auto,
            adopt_resident: true,
            columns: None,
        }
    }
}

/// Page-cache counters of one table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageStats {
    /// Eviction passes the RSS budget triggered.
    pub budget_drops: u64,
    /// Bytes of the pages the table has read and not dropped since ("known resident").
    pub touched_bytes: u64,
    /// The last failure of a budget eviction (a gather does not fail for it; it is
    /// reported here and the next eviction tries again).
    pub last_drop_error: Option<String>,
    /// Rows gathered whose pages were all known resident (copied straight from the map).
    pub row_hits: u64,
    /// Rows gathered through a cold read.
    pub row_misses: u64,
    /// Pages that became known resident through cold reads.
    pub pages_read: u64,
    /// Pages the RSS budget evicted.
    pub pages_evicted: u64,
    /// Pages forgotten (not evicted) to bound the known set without a budget: their next
    /// read goes through a cold read, which costs little if the page is still cached.
    pub pages_forgotten: u64,
    /// Pages taken as known resident because they were in the page cache already
    /// ([`MmapTable::adopt_resident`]).
    pub pages_adopted: u64,
    /// Cold gathers that could not use io_uring on their thread and used `willneed`.
    pub cold_fallbacks: u64,
    /// Warm copies that stopped because pages known resident were being faulted in from
    /// storage (the kernel dropped them: memory pressure, another process's eviction);
    /// each such gather then read all its rows together, and so did the table's gathers
    /// for the next [`DISTRUST`] (250 ms).
    pub slow_copies: u64,
    /// Why the last such gather fell back.
    pub last_fallback: Option<String>,
}

#[derive(Default)]
struct Counters {
    budget_drops: AtomicU64,
    row_hits: AtomicU64,
    row_misses: AtomicU64,
    pages_read: AtomicU64,
    pages_evicted: AtomicU64,
    pages_forgotten: AtomicU64,
    pages_adopted: AtomicU64,
    cold_fallbacks: AtomicU64,
    slow_copies: AtomicU64,
}

/// What every handle of one opened table shares ([`MmapTable::window`]): the mappings,
/// the known-resident pages, the counters.
struct Inner {
    layout: Layout,
    /// The selector and the checkpoint, as a label names them.
    names: (String, String),
    ends: Vec<u64>,
    opts: TableOptions,
    /// The cold-read way in use (never `Auto`).
    cold: ColdReads,
    /// Why `Auto` did not choose io_uring.
    cold_reason: Option<String>,
    pages: PageMap,
    /// Most pages kept known: the RSS budget (evicted beyond it), or without one half the
    /// machine's memory (forgotten beyond it: see [`PageStats::pages_forgotten`]).
    known_limit: usize,
    counters: Counters,
    last_fallback: Mutex<Option<String>>,
    /// Serialises drops and evictions and holds the last eviction failure.
    drop_state: Mutex<Option<String>>,
    /// Until this instant ([`epoch_ns`]) gathers read every row, known or not: a copy
    /// found known pages being faulted in (see [`DISTRUST`]).
    distrust_until: AtomicU64,
}

/// How long after a slow copy ([`Copied::Slow`]) the table's gathers read every row
/// rather than copy rows it knows resident: pages were being dropped behind its back, so
/// the next gathers' known rows would likely fault too, and a gather of a few rows would
/// fault most of them before its copy could tell. Then the copy is tried again. A read of
/// a page still cached costs ~1-2 us against a copy's 20-60 ns, so a copy slow for any
/// other reason (a descheduled thread) costs a few such gathers, not the table's speed.
const DISTRUST: std::time::Duration = std::time::Duration::from_millis(250);

/// Nanoseconds since the first call in this process (a monotonic clock).
fn epoch_ns() -> u64 {
    static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();
    let e = *EPOCH.get_or_init(std::time::Instant::now);
    u64::try_from(e.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A handle's label: the tensor, its columns when windowed, the checkpoint.
fn label_of((what, path): &(String, String), columns: Option<(usize, usize)>) -> String {
    match columns {
        None => format!("{what} in {path}"),
        Some((first, count)) => format!("{what} columns {first}..{} in {path}", first + count),
    }
}

/// The gather threads of a handle's own ([`TableOptions::gather_threads`]), checked.
fn own_pool_of(threads: Option<usize>) -> Result<Option<Arc<rayon::ThreadPool>>> {
    match threads {
        None => Ok(None),
        Some(n) if (2..=MAX_GATHER_THREADS).contains(&n) => {
            Ok(Some(Arc::new(gather::own_pool(n)?)))
        }
        Some(n) => Err(Error::invalid(format!(
            "gather_threads must be 2 to {MAX_GATHER_THREADS} (or None: the shared pool), got {n}"
        ))),
    }
}

/// The part of each stored row a table serves: `bytes` bytes from byte `skip`, `cols`
/// columns (the whole row without [`TableOptions::columns`]).
#[derive(Debug, Clone, Copy)]
struct RowView {
    skip: usize,
    bytes: usize,
    cols: usize,
}

impl RowView {
    /// The view of `layout`'s rows that `columns` asks for; `Error::InvalidArgument` for a
    /// window that is empty or not inside the row.
    fn new(layout: &Layout, columns: Option<(usize, usize)>) -> Result<Self> {
        let Some((first, count)) = columns else {
            return Ok(Self {
                skip: 0,
                bytes: layout.row_bytes,
                cols: layout.cols,
            });
        };
        if count == 0 || first >= layout.cols || count > layout.cols - first {
            return Err(Error::invalid(format!(
                "columns=({first}, {count}) is not a non-empty window of the table's {} \
                 columns (first column, column count)",
                layout.cols
            )));
        }
        let size = layout.row_bytes / layout.cols;
        Ok(Self {
            skip: first * size,
            bytes: count * size,
            cols: count,
        })
    }
}

/// A memory-mapped embedding table; see the module docs. `Clone` shares the mapping, and
/// so does [`MmapTable::window`].
#[derive(Clone)]
pub struct MmapTable {
    inner: Arc<Inner>,
    /// The bytes of a stored row this handle serves ([`TableOptions::columns`]).
    view: RowView,
    /// This handle's own gather threads ([`TableOptions::gather_threads`]).
    own_pool: Option<Arc<rayon::ThreadPool>>,
    /// The options as this handle was opened (`columns` and `gather_threads` its own).
    opts: TableOptions,
    label: String,
}

impl std::fmt::Debug for MmapTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmapTable")
            .field("table", &self.label)
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
    /// The checkpoint's files should not be modified while the table is open. A file that
    /// shrinks (or fails) under it makes the lost rows [`Error::Io`] (see `sigbus`); a
    /// file rewritten in place serves the new bytes. Replace files by rename instead.
    pub fn open(
        path: impl AsRef<Path>,
        selector: &Selector,
        options: TableOptions,
    ) -> Result<Self> {
        let path = path.as_ref();
        let layout = discover::discover(path, selector)?;
        let view = RowView::new(&layout, options.columns)?;
        let names = (format!("{:?}", selector.text()), path.display().to_string());
        let label = label_of(&names, options.columns);
        let own_pool = own_pool_of(options.gather_threads)?;
        if options.readahead && options.cold_reads == ColdReads::Fault {
            return Err(Error::invalid(
                "readahead=True asks for a gather's cold reads to go out together; \
                 cold_reads=\"fault\" reads one page at a time",
            ));
        }
        for f in &layout.files {
            match options.access {
                Access::Random => pagecache::advise_random(f)?,
                Access::Normal => pagecache::advise_normal(f)?,
            }
        }
        let (cold, cold_reason) = match options.cold_reads {
            ColdReads::Auto | ColdReads::Uring => {
                let why = coldread::uring_unavailable()
                    .map(str::to_owned)
                    .or_else(|| layout.files.first().and_then(coldread::verify_uring));
                match (why, options.cold_reads) {
                    (None, _) => (ColdReads::Uring, None),
                    (Some(why), ColdReads::Uring) => {
                        return Err(Error::Io {
                            path: path.display().to_string(),
                            detail: format!(
                                "cold_reads=\"uring\": io_uring cannot be used: {why} \
                                 (cold_reads=\"auto\" falls back to \"willneed\")"
                            ),
                        })
                    }
                    (Some(why), _) => (ColdReads::WillNeed, Some(why)),
                }
            }
            other => (other, None),
        };
        let ends = layout
            .segments
            .iter()
            .map(|s| s.first_row + s.rows)
            .collect();
        let pages = PageMap::new(&layout.segments, options.rss_budget_bytes.is_some());
        let ps = pagecache::page_size() as u64;
        let known_limit = match options.rss_budget_bytes {
            Some(b) => usize::try_from(b / ps).unwrap_or(usize::MAX),
            None => usize::try_from(pagecache::physical_memory_bytes() / 2 / ps)
                .unwrap_or(usize::MAX)
                .max(1 << 16),
        };
        let handle_opts = options.clone();
        let table = Self {
            inner: Arc::new(Inner {
                layout,
                names,
                ends,
                opts: options,
                cold,
                cold_reason,
                pages,
                known_limit,
                counters: Counters::default(),
                last_fallback: Mutex::new(None),
                drop_state: Mutex::new(None),
                distrust_until: AtomicU64::new(0),
            }),
            view,
            own_pool,
            opts: handle_opts,
            label,
        };
        if let Some(budget) = table.inner.opts.prewarm_bytes {
            table.prewarm(budget)?;
        }
        if table.inner.opts.adopt_resident && table.inner.opts.rss_budget_bytes.is_none() {
            table.adopt_resident()?;
        }
        Ok(table)
    }

    /// Another handle on this table, serving `columns` of each stored row (`None`: whole
    /// rows; see [`TableOptions::columns`]) with `gather_threads` of its own (see
    /// [`TableOptions::gather_threads`]). It shares this table's mappings, its known
    /// pages and its counters: a process that serves one tensor as several windows maps
    /// it once. Lives on after this handle is dropped.
    pub fn window(
        &self,
        columns: Option<(usize, usize)>,
        gather_threads: Option<usize>,
    ) -> Result<Self> {
        let view = RowView::new(&self.inner.layout, columns)?;
        let own_pool = own_pool_of(gather_threads)?;
        let mut opts = self.inner.opts.clone();
        opts.columns = columns;
        opts.gather_threads = gather_threads;
        Ok(Self {
            inner: Arc::clone(&self.inner),
            view,
            own_pool,
            opts,
            label: label_of(&self.inner.names, columns),
        })
    }

    /// The cold-read way in use (`Auto` resolved), and why `Auto` did not take io_uring.
    pub fn cold_reads(&self) -> (ColdReads, Option<&str>) {
        (self.inner.cold, self.inner.cold_reason.as_deref())
    }

    /// Rows in the table (all shards).
    pub fn rows(&self) -> u64 {
        self.inner.layout.rows
    }

    /// Bytes per row (of the column window, with [`TableOptions::columns`]).
    pub fn row_bytes(&self) -> usize {
        self.view.bytes
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.view.cols
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
        &self.label
    }

    /// Bytes of the stored rows in the files (every column, whatever
    /// [`TableOptions::columns`] serves).
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
                table: self.label.clone(),
            }),
        }
    }

    /// The table's rows where they lie: its shards' byte ranges in the mapped files.
    fn mapped_rows(&self) -> MappedRows<'_> {
        MappedRows {
            files: &self.inner.layout.files,
            segments: &self.inner.layout.segments,
            ends: &self.inner.ends,
            row_bytes: self.view.bytes,
            stride: self.inner.layout.row_bytes,
            skip: self.view.skip,
        }
    }

    /// The table's own gather threads if a gather of `rows` rows would run on them (at
    /// least two rows and [`TableOptions::parallel_min_bytes`]; `None` without
    /// [`TableOptions::gather_threads`]).
    pub fn own_pool_for(&self, rows: usize) -> Option<&rayon::ThreadPool> {
        let bytes = rows.saturating_mul(self.row_bytes());
        self.own_pool
            .as_deref()
            .filter(|_| gather::goes_parallel(rows, bytes, self.inner.opts.parallel_min_bytes))
    }

    /// Copy rows `ids` into `dst`, row `i` at `dst[i * row_bytes..]`. `dst` must be
    /// exactly `ids.len() * row_bytes` bytes. Every id is checked before anything is
    /// written: on an id or size error `dst` is untouched. Duplicate ids are fine.
    ///
    /// Rows whose pages the table has read before are copied straight from the mapping
    /// (no allocation, no system call; inline below [`TableOptions::parallel_min_bytes`],
    /// on the gather pool above). The other rows are read together (see [`ColdReads`])
    /// while the known ones are copied. A cold read's I/O error returns [`Error::Io`];
    /// so does a row in a range a SIGBUS on the mapping lost (a file that shrank under
    /// the table, an I/O error on a mapped page: see `sigbus`), on every way. On any
    /// [`Error::Io`] `dst` is zeroed.
    pub fn gather_into(&self, ids: RowIds<'_>, dst: &mut [u8]) -> Result<()> {
        self.gather_gated(ids, dst, None)
    }

    /// [`Self::gather_into`], calling `before_reads` (which may wait: a worker's turn among
    /// a step's tables, see [`crate::worker::ReadOrder`]) with the number of cold rows
    /// before they are read (the rows known resident are copied while the reads are in
    /// flight, as ever); its error is returned without reading (`dst` zeroed). A gather
    /// whose rows are all known resident never calls it.
    pub fn gather_into_ordered(
        &self,
        ids: RowIds<'_>,
        dst: &mut [u8],
        before_reads: BeforeReads<'_>,
    ) -> Result<()> {
        self.gather_gated(ids, dst, Some(before_reads))
    }

    fn gather_gated(
        &self,
        ids: RowIds<'_>,
        dst: &mut [u8],
        before_reads: Option<BeforeReads<'_>>,
    ) -> Result<()> {
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
        let r = match ids {
            RowIds::I32(v) => self.gather_checked(v, dst, before_reads),
            RowIds::I64(v) => self.gather_checked(v, dst, before_reads),
        };
        if r.is_err() {
            // An I/O error: nothing in `dst` that could pass for rows.
            dst.fill(0);
        }
        r
    }

    /// `Err` (naming the file and offset) if a row of `ids` lies in a range of a file that
    /// a SIGBUS on the mapping lost (see `sigbus`). Run after every copy: a row the copy
    /// read as zeros is caught here. While nothing is lost, one atomic load per file.
    #[inline]
    fn check_lost<T: Id>(&self, ids: &[T]) -> Result<()> {
        let files = &self.inner.layout.files;
        if files.iter().all(|f| f.lost().is_none()) {
            return Ok(());
        }
        let src = self.mapped_rows();
        for &id in ids {
            let (si, off) = src.locate(id.as_i64() as u64);
            let f = &files[src.segments[si].file];
            f.check_range(off, src.row_bytes, &format!("row {}", id.as_i64()))?;
        }
        Ok(())
    }

    fn gather_checked<T: Id>(
        &self,
        ids: &[T],
        dst: &mut [u8],
        before_reads: Option<BeforeReads<'_>>,
    ) -> Result<()> {
        let src = self.mapped_rows();
        let pm = &self.inner.pages;
        let rb = src.row_bytes;
        let distrust = self.inner.distrust_until.load(Ordering::Relaxed);
        if distrust != 0 && epoch_ns() < distrust {
            // A copy was slow a moment ago: read every row.
            return self.gather_cold(&src, ids, dst, true, before_reads);
        }
        // The warm path: copy while every row's pages are known resident (a bit test or
        // two a row, fused into the copy loop; access counts only under a budget).
        let known = |si: usize, off: usize| {
            let span = pm.span(si, off, rb);
            pm.touch(span);
            pm.all_known(span)
        };
        let min = self.inner.opts.parallel_min_bytes;
        let own = self.own_pool.as_deref();
        let warm = if pm.all_known_uncounted() {
            // The whole table is known resident (e.g. prewarmed): no check at all.
            src.copy_if_maybe_parallel(ids, dst, min, own, &|_, _| true)
        } else if let Some(check) = pm.single_segment_check(rb) {
            src.copy_if_maybe_parallel(ids, dst, min, own, &check)
        } else {
            src.copy_if_maybe_parallel(ids, dst, min, own, &known)
        };
        match warm {
            Copied::All => {
                self.inner
                    .counters
                    .row_hits
                    .fetch_add(ids.len() as u64, Ordering::Relaxed);
                self.check_lost(ids)
            }
            // Some row is cold: start over with the cold path (rows already copied are
            // copied again, for nothing next to the reads; their access counts are
            // counted twice).
            Copied::Unknown => self.gather_cold(&src, ids, dst, false, before_reads),
            // Rows known resident are being faulted in from storage one page at a time:
            // the kernel dropped them behind the table's back. Read every row of the
            // gather together instead (a page still cached completes at once).
            Copied::Slow => {
                self.note_slow_copy();
                self.gather_cold(&src, ids, dst, true, before_reads)
            }
        }
    }

    /// A copy of known rows ran slow: count it, and read every row for [`DISTRUST`].
    fn note_slow_copy(&self) {
        let inner = &*self.inner;
        inner.counters.slow_copies.fetch_add(1, Ordering::Relaxed);
        let until = epoch_ns().saturating_add(DISTRUST.as_nanos() as u64);
        inner.distrust_until.store(until, Ordering::Relaxed);
    }

    /// A gather with at least one row not known resident: read those together while
    /// copying the others, then record their pages as known. `all_cold`: read every row
    /// (a warm copy found pages it knew resident being faulted in: [`Copied::Slow`]).
    ///
    /// No residency check (`mincore`, `RWF_NOWAIT`) comes first: a read of a page that is
    /// cached after all completes at submission without I/O, so checking would only add a
    /// system call per row to every cold gather. A known page the kernel dropped behind our
    /// back is copied here, faulted in (slower, still correct); a warm copy that meets
    /// many such pages stops and comes back with `all_cold`, and the known set is bounded
    /// (see [`PageStats::pages_forgotten`]).
    ///
    /// `before_reads`, if given, runs (with the number of cold rows) before any read; its
    /// error is returned at once.
    fn gather_cold<T: Id>(
        &self,
        src: &MappedRows<'_>,
        ids: &[T],
        dst: &mut [u8],
        all_cold: bool,
        before_reads: Option<BeforeReads<'_>>,
    ) -> Result<()> {
        let pm = &self.inner.pages;
        let rb = src.row_bytes;
        let mut hits: Vec<(&mut [u8], &[u8])> = Vec::new();
        let mut cold: Vec<ColdRow<'_>> = Vec::new();
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for (&id, out) in ids.iter().zip(dst.chunks_exact_mut(rb)) {
            let (si, off) = src.locate(id.as_i64() as u64);
            let span = pm.span(si, off, rb);
            pm.touch(span);
            let file = &src.files[src.segments[si].file];
            if !all_cold && pm.all_known(span) {
                hits.push((out, &file.map[off..off + rb]));
            } else {
                cold.push(ColdRow { out, file, off });
                spans.push(span);
            }
        }
        let (n_hits, n_cold) = (hits.len() as u64, cold.len() as u64);
        // Every copy out of the mapping is guarded (a SIGBUS becomes lost rows, checked
        // below).
        let copy_hits = move || {
            sigbus::guarded(|| {
                for (out, row) in hits {
                    out.copy_from_slice(row);
                }
            })
        };
        let from_map = |cold: &mut [ColdRow<'_>]| {
            sigbus::guarded(|| {
                for r in cold {
                    r.out.copy_from_slice(&r.file.map[r.off..r.off + rb]);
                }
            })
        };
        let mut copy_hits = Some(copy_hits);
        if let Some(wait) = before_reads {
            if !cold.is_empty() {
                wait(cold.len())?;
            }
        }
        let res = match self.inner.cold {
            ColdReads::Uring => match coldread::read_uring(&mut cold, &mut copy_hits) {
                Uring::Done(r) => r,
                Uring::Unavailable(why) => {
                    self.inner
                        .counters
                        .cold_fallbacks
                        .fetch_add(1, Ordering::Relaxed);
                    *self
                        .inner
                        .last_fallback
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
                    coldread::will_need(&cold);
                    from_map(&mut cold);
                    Ok(())
                }
            },
            ColdReads::WillNeed => {
                coldread::will_need(&cold);
                if let Some(f) = copy_hits.take() {
                    f();
                }
                from_map(&mut cold);
                Ok(())
            }
            ColdReads::Pool => coldread::read_pool(&mut cold),
            ColdReads::Fault | ColdReads::Auto => {
                from_map(&mut cold);
                Ok(())
            }
        };
        if let Some(f) = copy_hits.take() {
            f();
        }
        let c = &self.inner.counters;
        c.row_hits.fetch_add(n_hits, Ordering::Relaxed);
        c.row_misses.fetch_add(n_cold, Ordering::Relaxed);
        let res = res.and_then(|()| self.check_lost(ids));
        if res.is_ok() {
            let new: usize = spans.iter().map(|&s| pm.mark(s)).sum();
            c.pages_read.fetch_add(new as u64, Ordering::Relaxed);
            self.enforce_limit();
        }
        res
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

    /// Keep the known pages within their limit: under an RSS budget evict the least used
    /// (dropping them from this process and the page cache); without one only forget them.
    fn enforce_limit(&self) {
        let inner = &*self.inner;
        let limit = inner.known_limit;
        if inner.pages.known_pages() <= limit {
            return;
        }
        // One sweeper at a time; a gather that finds one under way goes on.
        let Ok(mut last_err) = inner.drop_state.try_lock() else {
            return;
        };
        let known = inner.pages.known_pages();
        if known <= limit {
            return;
        }
        let runs = inner.pages.sweep(known - limit);
        let n: usize = runs.iter().map(|r| r.pages).sum();
        if inner.opts.rss_budget_bytes.is_none() {
            inner
                .counters
                .pages_forgotten
                .fetch_add(n as u64, Ordering::Relaxed);
            return;
        }
        inner.counters.budget_drops.fetch_add(1, Ordering::Relaxed);
        inner
            .counters
            .pages_evicted
            .fetch_add(n as u64, Ordering::Relaxed);
        let ps = pagecache::page_size();
        for run in runs {
            let f = &inner.layout.files[inner.layout.segments[run.segment].file];
            if let Err(e) = pagecache::drop_range(f, run.offset, run.pages * ps) {
                *last_err = Some(e.to_string());
            }
        }
    }

    /// Bytes of the table's pages in the page cache now (`mincore`, page-granular).
    pub fn resident_bytes(&self) -> Result<u64> {
        pagecache::resident_bytes(&self.inner.layout.files, &self.inner.layout.segments)
    }

    /// Fault in the first `budget` bytes of the table (row order; capped by the RSS
    /// budget if one is set). Returns the bytes warmed; their pages count as known
    /// resident (with no accesses: the first an RSS budget evicts if they stay unused).
    pub fn prewarm(&self, budget: u64) -> Result<u64> {
        let budget = match self.inner.opts.rss_budget_bytes {
            Some(b) => budget.min(b),
            None => budget,
        };
        let pm = &self.inner.pages;
        let segs = &self.inner.layout.segments;
        let files = &self.inner.layout.files;
        let warmed = sigbus::guarded(|| {
            pagecache::prewarm(files, segs, budget, |si, off, len| {
                let f = &files[segs[si].file];
                // A page lost while warming is not known resident (the gather of it fails).
                if f.check_range(segs[si].start + off, len, "prewarm").is_ok() {
                    pm.mark(pm.span(si, segs[si].start + off, len));
                }
            })
        })?;
        for f in files {
            f.check_range(0, f.map.len(), "prewarm")?;
        }
        self.enforce_limit();
        Ok(warmed)
    }

    /// Take the table's pages that are in the page cache now as known resident (one
    /// `mincore` per 256 MiB of table): gathers then copy their rows straight from the
    /// mapping (a minor fault the first time a page is touched) where they would read
    /// each one cold first, which on a warm host costs several times the copy. A page
    /// the kernel evicts later is faulted back in by the copy (slower, still correct), as
    /// for any known page. Returns the bytes adopted (pages not known before), within
    /// the known set's limit (half the machine's memory without an RSS budget; under a
    /// budget, what is left of it). Open does this by default
    /// ([`TableOptions::adopt_resident`], not under a budget).
    pub fn adopt_resident(&self) -> Result<u64> {
        let inner = &*self.inner;
        let pm = &inner.pages;
        let segs = &inner.layout.segments;
        let ps = pagecache::page_size();
        let mut room = inner.known_limit.saturating_sub(pm.known_pages());
        let mut adopted = 0usize;
        pagecache::resident_runs(&inner.layout.files, segs, |si, off, pages| {
            let take = pages.min(room);
            if take == 0 {
                return;
            }
            // The run's pages, clipped to the segment's bytes (the first and last page
            // may hold a neighbouring tensor's bytes too).
            let lo = off.max(segs[si].start);
            let hi = (off + take * ps).min(segs[si].start + segs[si].len);
            if hi > lo {
                let new = pm.mark(pm.span(si, lo, hi - lo));
                adopted += new;
                room = room.saturating_sub(new);
            }
        })?;
        inner
            .counters
            .pages_adopted
            .fetch_add(adopted as u64, Ordering::Relaxed);
        Ok(adopted as u64 * ps as u64)
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
        self.inner.pages.clear();
        let r = pagecache::drop_pages(&self.inner.layout.files, &self.inner.layout.segments);
        if r.is_ok() {
            *last_err = None;
        }
        r
    }

    /// Page-cache counters.
    pub fn page_stats(&self) -> PageStats {
        let inner = &*self.inner;
        let lock = |m: &Mutex<Option<String>>| {
            m.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        };
        let c = &inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PageStats {
            budget_drops: get(&c.budget_drops),
            touched_bytes: inner.pages.known_pages() as u64 * pagecache::page_size() as u64,
            last_drop_error: lock(&inner.drop_state),
            row_hits: get(&c.row_hits),
            row_misses: get(&c.row_misses),
            pages_read: get(&c.pages_read),
            pages_evicted: get(&c.pages_evicted),
            pages_forgotten: get(&c.pages_forgotten),
            pages_adopted: get(&c.pages_adopted),
            cold_fallbacks: get(&c.cold_fallbacks),
            slow_copies: get(&c.slow_copies),
            last_fallback: lock(&inner.last_fallback),
        }
    }

    /// The options the table was opened with (a [`Self::window`]'s `columns` and
    /// `gather_threads` its own).
    pub fn options(&self) -> &TableOptions {
        &self.opts
    }
}

#[cfg(test)]
mod tests;
