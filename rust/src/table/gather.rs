//! The row gather: validate every id, then copy rows from the mapping into the
//! destination, inline for small gathers and above a size threshold on a rayon pool (the
//! table's own or a private shared one) with the calling thread gathering beside it.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::discover::{MappedFile, Segment};

/// Gathers of at least this many bytes run on the pool; smaller ones inline.
///
/// Chosen by measurement (`cargo test --release -- --ignored --nocapture gather_timings`,
/// page-cache-resident 2^20-row table, 160 B and 320 B rows, 2-vCPU x86-64 VM): the pool's
/// fork/join cost 10-30 us there, which it repaid from about 300 KiB on; inline won at
/// 160 KiB and below. See BENCHMARKS.md ("Row gather"); re-tune per host with
/// [`super::TableOptions::parallel_min_bytes`].
pub const PARALLEL_MIN_BYTES: usize = 256 << 10;

/// Most threads the gather pool uses: a gather is memory-bound and a serving process has
/// other work; more threads than this only add fork/join cost.
const MAX_THREADS: usize = 8;

/// The gather pool, built on first use; `None` if the OS refused threads (we then gather
/// inline rather than fail).
pub(crate) fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_THREADS);
        if n < 2 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("ple-gather-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Whether a gather of `rows` rows, `bytes` in all, runs on a pool rather than inline
/// (the one rule for the copy and for the worker's [`crate::worker::WarmThreads`]).
pub(crate) fn goes_parallel(rows: usize, bytes: usize, min_bytes: usize) -> bool {
    rows >= 2 && bytes >= min_bytes
}

/// Most threads a table's own pool may have ([`super::TableOptions::gather_threads`]).
pub const MAX_GATHER_THREADS: usize = 64;

/// A pool of `n` gather threads for one table.
pub(crate) fn own_pool(n: usize) -> crate::error::Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("ple-gather-own-{i}"))
        // The worker keeps these threads awake with 20 us naps while a step is armed
        // (`worker::WarmThreads`); the default 50 us slack would stretch each.
        .start_handler(|_| crate::os::fine_timer_slack())
        .build()
        .map_err(|e| {
            crate::error::Error::unsupported(format!(
                "this process could not start {n} gather threads for the table: {e}"
            ))
        })
}

/// What a copy of rows known resident did ([`MappedRows::copy_if`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Copied {
    /// Every row copied.
    All = 0,
    /// Stopped at a row whose pages are not known resident.
    Unknown = 1,
    /// Stopped because the copy ran far slower than copies of resident pages do: its
    /// pages fault in from storage one at a time (the kernel dropped pages the table
    /// knew resident, e.g. under memory pressure). Its rows are better read together.
    Slow = 2,
}

/// A copy checks its pace before row `PACE_FIRST` and every [`PACE_EVERY`] rows after it
/// (a clock read, 20-50 ns: under 1 ns a row). A decode step of Qwen4Exp at batch 1
/// gathers 16 rows a table, so even such a gather checks once.
const PACE_FIRST: usize = 15;
const PACE_EVERY: usize = 64;

/// Whether the copy checks its pace before row `i`.
#[inline(always)]
fn pace_due(i: usize) -> bool {
    i % PACE_EVERY == PACE_FIRST
}

/// A copy is [`Copied::Slow`] once it took longer than this plus [`SLOW_PER_PAGE`] for
/// every page its rows span. A resident row's copy costs 20-60 ns (a minor fault on first
/// touch about a microsecond), a page faulted in from storage 50-100 us on NVMe and more
/// elsewhere: the first 15 rows of 160 B trip at about 5 pages read one at a time.
const SLOW_BASE: Duration = Duration::from_micros(250);
const SLOW_PER_PAGE: Duration = Duration::from_micros(4);

/// Rows ahead whose pages a copy past its allowance checks (`mincore`, a microsecond
/// each) before it stops: a copy slowed by minor faults (a VM's can cost 10 us) or by a
/// descheduled thread finds them cached and goes on.
const PROBE_ROWS: usize = 8;

/// The clock of one copy: [`Self::slow`] once it ran past its allowance.
struct Pace {
    start: Instant,
    /// The row the clock started at.
    from: usize,
    per_row: Duration,
}

impl Pace {
    #[inline(always)]
    fn start(row_bytes: usize, from: usize) -> Self {
        // A row spans at most this many pages.
        let pages = row_bytes.div_ceil(super::pagecache::page_size()) + 1;
        Self {
            start: Instant::now(),
            from,
            per_row: SLOW_PER_PAGE * u32::try_from(pages).unwrap_or(u32::MAX),
        }
    }

    /// Whether the rows before row `i` took longer than they may (checked only where
    /// [`pace_due`]): past the allowance, the next [`PROBE_ROWS`] rows' pages (`row(k)`:
    /// row `k`'s bytes in the mapping) are checked, and the copy is slow only if one of
    /// them is not in the page cache; if all are, the clock starts again here.
    #[inline(always)]
    fn slow<'d>(&mut self, i: usize, ids: usize, row: impl Fn(usize) -> &'d [u8]) -> bool {
        let rows = u32::try_from(i - self.from).unwrap_or(u32::MAX);
        if self.start.elapsed() <= SLOW_BASE + self.per_row * rows {
            return false;
        }
        if (i..ids.min(i + PROBE_ROWS)).any(|k| !super::pagecache::in_page_cache(row(k))) {
            return true;
        }
        self.start = Instant::now();
        self.from = i;
        false
    }
}

/// Rows prefetched ahead of the copy (measured: 4-16 give the same speed-up on x86-64).
const PREFETCH_AHEAD: usize = 8;

/// Bytes of a row prefetched: its first cache lines. A PLE row of one layer (160-320 B)
/// is prefetched whole; of a longer row (Gemma's rows hold every layer's slice, 15-21 KiB)
/// only its start, which starts the miss and the page walk, and the hardware prefetcher
/// streams the rest as the copy reads it. Prefetching such a row whole, 8 rows ahead,
/// issues 240-340 prefetches a row into a 48 KiB L1 (BENCHMARKS.md, "Row gather from a
/// warm table", what it cost); 256 B here made 320 B rows slower.
const PREFETCH_BYTES: usize = 512;

/// Hint the CPU to load the first [`PREFETCH_BYTES`] of row bytes `off..off + len` of
/// `data` (every cache line of a row that short).
#[inline(always)]
fn prefetch_row(data: &[u8], off: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let Some(row) = data.get(off..off.saturating_add(len.min(PREFETCH_BYTES))) else {
            return;
        };
        let mut p = 0;
        while p < row.len() {
            // SAFETY: a prefetch is a hint that never faults and reads nothing into Rust
            // values; the pointer is inside `row` anyway. (The intrinsic is an `unsafe fn`
            // before Rust 1.87, a safe one after: hence the allow.)
            #[allow(unused_unsafe)]
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().add(p).cast::<i8>())
            };
            p += 64;
        }
        if !row.is_empty() && (row.len() % 64 != 0 || off % 64 != 0) {
            // SAFETY: as above; the last byte of the prefetched part (its last line).
            #[allow(unused_unsafe)]
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().add(row.len() - 1).cast::<i8>())
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (data, off, len);
    }
}

/// [`MappedRows::copy_if`] for one shard and rows of exactly `N` bytes, `N` bytes read
/// at byte `skip` of each stored row of `stride` bytes; `start` is the shard's offset in
/// its file (for `known`).
#[inline(always)]
fn copy_fixed<T: Id, const N: usize, K: Fn(usize, usize) -> bool>(
    data: &[u8],
    start: usize,
    (stride, skip): (usize, usize),
    ids: &[T],
    dst: &mut [u8],
    known: &K,
) -> Copied {
    let mut pace = Pace::start(N, 0);
    let row = |k: usize| {
        let off = ids[k].as_i64() as usize * stride + skip;
        &data[off..off + N]
    };
    for (i, (&id, out)) in ids.iter().zip(dst.chunks_exact_mut(N)).enumerate() {
        if let Some(&next) = ids.get(i + PREFETCH_AHEAD) {
            prefetch_row(data, next.as_i64() as usize * stride + skip, N);
        }
        let off = id.as_i64() as usize * stride + skip;
        if !known(0, start + off) {
            return Copied::Unknown;
        }
        if pace_due(i) && pace.slow(i, ids.len(), row) {
            return Copied::Slow;
        }
        let src: &[u8; N] = data[off..off + N].try_into().expect("N-byte row");
        let out: &mut [u8; N] = out.try_into().expect("N-byte row");
        *out = *src;
    }
    Copied::All
}

/// A row id type the gather accepts.
pub(crate) trait Id: Copy + Send + Sync {
    fn as_i64(self) -> i64;
}

impl Id for i32 {
    #[inline(always)]
    fn as_i64(self) -> i64 {
        i64::from(self)
    }
}

impl Id for i64 {
    #[inline(always)]
    fn as_i64(self) -> i64 {
        self
    }
}

/// The first id outside `0..rows`, as `(position, id)`.
#[inline]
pub(crate) fn first_bad<T: Id>(ids: &[T], rows: u64) -> Option<(usize, i64)> {
    // Branch-free scan first (vectorises); locate the culprit only on failure.
    let bad = ids
        .iter()
        .fold(false, |acc, &id| acc | (id.as_i64() as u64 >= rows));
    if !bad {
        return None;
    }
    ids.iter()
        .position(|&id| id.as_i64() as u64 >= rows)
        .map(|p| (p, ids[p].as_i64()))
}

/// A table's rows as they lie in its mapped files: one byte range per shard, by first
/// row. (Not [`crate::worker::RowSource`], the worker's trait for anything that gathers.)
pub(crate) struct MappedRows<'a> {
    pub files: &'a [MappedFile],
    pub segments: &'a [Segment],
    /// `ends[i]` is one past segment i's last table row.
    pub ends: &'a [u64],
    /// Bytes a row is read: the stored row, or its column window
    /// ([`super::TableOptions::columns`]).
    pub row_bytes: usize,
    /// Bytes a row is stored in (`row_bytes` without a window).
    pub stride: usize,
    /// Where the bytes read begin in a stored row (0 without a window).
    pub skip: usize,
}

impl MappedRows<'_> {
    /// Segment index and byte offset (in its file's mapping) of row `id`'s bytes to read
    /// (`id` in range).
    #[inline(always)]
    pub fn locate(&self, id: u64) -> (usize, usize) {
        let si = if self.segments.len() == 1 {
            0
        } else {
            self.ends.partition_point(|&e| e <= id)
        };
        let seg = &self.segments[si];
        // id - first_row < seg.rows, rows * stride == seg.len fits usize (checked at open)
        // and skip + row_bytes <= stride, so neither the cast nor the sum can overflow.
        let off = seg.start + (id - seg.first_row) as usize * self.stride + self.skip;
        (si, off)
    }

    /// Copy rows `ids` (all in range) into `dst` (`ids.len() * row_bytes` bytes) while
    /// `known(segment, file offset)` holds for each row; stop at the first row for which
    /// it does not ([`Copied::Unknown`]: rows before it are copied, the rest are not). The
    /// check is fused into the copy loop so that it overlaps the rows' cache misses; with
    /// a constant `true` it compiles away. Every [`PACE_EVERY`] rows the copy also checks
    /// its pace, and past its allowance (see [`SLOW_BASE`]) whether the next rows' pages
    /// are cached; it stops ([`Copied::Slow`]) once they are plainly being faulted in
    /// from storage: the caller then reads the rows together instead.
    ///
    /// The copy is guarded (see `sigbus`): a SIGBUS on the mapping reads zeros and marks
    /// the file's range lost; the caller checks for lost rows afterwards.
    #[inline]
    pub fn copy_if<T: Id, K: Fn(usize, usize) -> bool>(
        &self,
        ids: &[T],
        dst: &mut [u8],
        known: &K,
    ) -> Copied {
        super::sigbus::guarded(|| self.copy_if_unguarded(ids, dst, known))
    }

    #[inline(always)]
    fn copy_if_unguarded<T: Id, K: Fn(usize, usize) -> bool>(
        &self,
        ids: &[T],
        dst: &mut [u8],
        known: &K,
    ) -> Copied {
        let (rb, stride, skip) = (self.row_bytes, self.stride, self.skip);
        if let [seg] = self.segments {
            let data = &self.files[seg.file].map[seg.start..seg.start + seg.len];
            // The PLE row widths (160 B FP8, 320 B BF16) get a copy of a compile-time size:
            // inlined vector moves instead of a memcpy call per row.
            let at = (stride, skip);
            match rb {
                160 => return copy_fixed::<T, 160, K>(data, seg.start, at, ids, dst, known),
                320 => return copy_fixed::<T, 320, K>(data, seg.start, at, ids, dst, known),
                _ => {}
            }
            // One shard (the common case): no search, one bounds-checked slice.
            let mut pace = Pace::start(rb, 0);
            let row = |k: usize| {
                let off = ids[k].as_i64() as usize * stride + skip;
                &data[off..off + rb]
            };
            for (i, (&id, out)) in ids.iter().zip(dst.chunks_exact_mut(rb)).enumerate() {
                // Random rows of a large table miss every cache level (and the TLB);
                // prefetching a few rows ahead keeps several misses in flight.
                if let Some(&next) = ids.get(i + PREFETCH_AHEAD) {
                    prefetch_row(data, next.as_i64() as usize * stride + skip, rb);
                }
                let off = id.as_i64() as usize * stride + skip;
                if !known(0, seg.start + off) {
                    return Copied::Unknown;
                }
                if pace_due(i) && pace.slow(i, ids.len(), row) {
                    return Copied::Slow;
                }
                out.copy_from_slice(&data[off..off + rb]);
            }
            return Copied::All;
        }
        let mut pace = Pace::start(rb, 0);
        let row = |k: usize| {
            let (si, off) = self.locate(ids[k].as_i64() as u64);
            &self.files[self.segments[si].file].map[off..off + rb]
        };
        for (i, (&id, out)) in ids.iter().zip(dst.chunks_exact_mut(rb)).enumerate() {
            if let Some(&next) = ids.get(i + PREFETCH_AHEAD) {
                let (si, off) = self.locate(next.as_i64() as u64);
                prefetch_row(&self.files[self.segments[si].file].map, off, rb);
            }
            let (si, off) = self.locate(id.as_i64() as u64);
            if !known(si, off) {
                return Copied::Unknown;
            }
            if pace_due(i) && pace.slow(i, ids.len(), row) {
                return Copied::Slow;
            }
            let map = &self.files[self.segments[si].file].map;
            out.copy_from_slice(&map[off..off + rb]);
        }
        Copied::All
    }

    /// As [`Self::copy_if`], split across a pool (`own`, else the shared one) when `dst`
    /// is at least `min_bytes`; each chunk stops as `copy_if` does, and the result is the
    /// worst chunk's ([`Copied::Slow`] over [`Copied::Unknown`] over [`Copied::All`]).
    ///
    /// The calling thread gathers too: it spawns one helper a pool thread and claims
    /// chunks from a shared counter with them until none is left, so the gather starts at
    /// once instead of after a sleeping pool thread wakes, and the caller does not sleep
    /// on a latch while the pool works (what `ThreadPool::install` from a thread outside
    /// the pool does: one wake to start, another to finish). A helper that wakes after
    /// the last chunk was claimed finds nothing and returns; the scope still waits for
    /// it. On the 2-vCPU VM, 1,024 x 256 B rows after 2 ms idle: 134-144 us at p50
    /// against `install`'s 147-175, alternated (BENCHMARKS.md, "The caller joins its
    /// pool's gather").
    pub fn copy_if_maybe_parallel<T: Id, K: Fn(usize, usize) -> bool + Sync>(
        &self,
        ids: &[T],
        dst: &mut [u8],
        min_bytes: usize,
        own: Option<&rayon::ThreadPool>,
        known: &K,
    ) -> Copied {
        let rb = self.row_bytes;
        let pool = if goes_parallel(ids.len(), dst.len(), min_bytes) {
            match own {
                Some(p) => Some(p),
                None => pool(),
            }
        } else {
            None
        };
        let Some(pool) = pool else {
            return self.copy_if(ids, dst, known);
        };
        // Two chunks a participant: even work (rows are equal-sized), a little slack for
        // a helper that starts late. Each chunk is taken once (the counter hands out each
        // index once; the mutex only makes the hand-over safe Rust, never contended).
        let helpers = pool.current_num_threads();
        let per = ids.len().div_ceil((helpers + 1) * 2).max(1);
        type Chunk<'a, T> = Mutex<Option<(&'a mut [u8], &'a [T])>>;
        let chunks: Vec<Chunk<'_, T>> = dst
            .chunks_mut(per * rb)
            .zip(ids.chunks(per))
            .map(|c| Mutex::new(Some(c)))
            .collect();
        let next = AtomicUsize::new(0);
        let worst = AtomicU8::new(Copied::All as u8);
        let work = || {
            while let Some(chunk) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                if worst.load(Ordering::Relaxed) != Copied::All as u8 {
                    // A chunk stopped, so the caller gathers every row again: copying
                    // (or faulting in) more chunks here would be for nothing.
                    break;
                }
                let taken = chunk.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some((d, i)) = taken {
                    let got = self.copy_if(i, d, known);
                    if got != Copied::All {
                        worst.fetch_max(got as u8, Ordering::Relaxed);
                    }
                }
            }
        };
        // The scope returns once every helper has run (their writes visible here).
        pool.in_place_scope(|s| {
            for _ in 0..helpers {
                s.spawn(|_| work());
            }
            work();
        });
        match worst.load(Ordering::Relaxed) {
            0 => Copied::All,
            1 => Copied::Unknown,
            _ => Copied::Slow,
        }
    }
}
