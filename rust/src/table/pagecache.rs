//! Page-cache control for a mapped table: random-access advice at open, measure residency
//! (`mincore`), prewarm within a byte budget (`MADV_WILLNEED` plus a read of every page),
//! and dropping pages (`MADV_DONTNEED` on our read-only mapping, then
//! `POSIX_FADV_DONTNEED` on the file so clean pages leave the page cache too: cgroup
//! memory accounting counts the page cache, so unmapping alone would not shrink it), for
//! the whole table or for runs of pages the RSS budget evicts.
//!
//! All `unsafe` of this module is the libc calls and memmap2's unchecked advice.
//! (`in_page_cache` is the one `mincore` the gather itself makes: see `gather::Pace`.)

use std::os::fd::AsRawFd;
use std::path::Path;

use memmap2::{Advice, UncheckedAdvice};

use super::discover::{MappedFile, Segment};
use crate::error::{Error, Result};

/// The system page size (one place for the whole crate: [`crate::os::page_size`]).
pub use crate::os::page_size;

/// The machine's physical memory in bytes (`sysconf`; 0 if unknown).
pub fn physical_memory_bytes() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    u64::try_from(pages).unwrap_or(0) * page_size() as u64
}

pub(crate) fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        detail: format!("{what}: {e}"),
    }
}

/// `[first page, end page)` of `start..start+len`, as page-aligned byte offsets.
fn page_span(start: usize, len: usize) -> (usize, usize) {
    let ps = page_size();
    let lo = start - start % ps;
    let end = start.saturating_add(len);
    let hi = end.div_ceil(ps).saturating_mul(ps);
    (lo, hi)
}

/// Bytes of the table's pages that are in the page cache (page-granular: a page shared
/// with a neighbouring tensor counts whole).
pub(crate) fn resident_bytes(files: &[MappedFile], segments: &[Segment]) -> Result<u64> {
    let mut pages = 0u64;
    resident_runs(files, segments, |_, _, n| pages += n as u64)?;
    Ok(pages * page_size() as u64)
}

/// Call `found(segment index, page-aligned file offset, pages)` for every run of the
/// table's pages that is in the page cache now (`mincore`, one call per 256 MiB).
pub(crate) fn resident_runs(
    files: &[MappedFile],
    segments: &[Segment],
    mut found: impl FnMut(usize, usize, usize),
) -> Result<()> {
    const CHUNK_PAGES: usize = 1 << 16;
    let ps = page_size();
    let mut vec = vec![0u8; CHUNK_PAGES];
    for (si, seg) in segments.iter().enumerate() {
        let f = &files[seg.file];
        let (lo, hi) = page_span(seg.start, seg.len);
        let hi = hi.min(f.map.len().div_ceil(ps) * ps);
        let mut off = lo;
        while off < hi {
            let pages = ((hi - off) / ps).min(CHUNK_PAGES);
            // SAFETY: `off` is a page-aligned offset inside our live mapping (the mapping
            // starts on a page boundary and `hi` is clipped to its page-rounded length), so
            // `ptr + off .. + pages * ps` lies within it; `vec` holds `pages` bytes.
            let rc = unsafe {
                libc::mincore(
                    f.map.as_ptr().add(off) as *mut libc::c_void,
                    pages * ps,
                    vec.as_mut_ptr(),
                )
            };
            if rc != 0 {
                return Err(io_err(&f.path, "mincore", std::io::Error::last_os_error()));
            }
            let mut i = 0;
            while i < pages {
                if vec[i] & 1 == 0 {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < pages && vec[i] & 1 != 0 {
                    i += 1;
                }
                found(si, off + start * ps, i - start);
            }
            off += pages * ps;
        }
    }
    Ok(())
}

/// Whether every page under `bytes` (a slice of a live mapping of a file) is in the page
/// cache now (`mincore`; a failure counts as not). One system call.
pub(crate) fn in_page_cache(bytes: &[u8]) -> bool {
    if bytes.is_empty() {
        return true;
    }
    let ps = page_size();
    let addr = bytes.as_ptr() as usize;
    let lo = addr - addr % ps;
    let pages = (addr + bytes.len() - lo).div_ceil(ps);
    let mut vec = [0u8; 8];
    if pages > vec.len() {
        return bytes.chunks(ps * (vec.len() - 1)).all(in_page_cache);
    }
    // SAFETY: `lo..lo + pages * ps` is the page-aligned span of `bytes`, which lies in a
    // live mapping (mappings start and end on page boundaries, so the span does too);
    // `vec` holds `pages` bytes (checked above). mincore reads nothing through the
    // pointer and faults nothing in.
    let rc = unsafe { libc::mincore(lo as *mut libc::c_void, pages * ps, vec.as_mut_ptr()) };
    rc == 0 && vec[..pages].iter().all(|v| v & 1 != 0)
}

/// Fault in the table's pages, in row order, until `budget` bytes; returns the bytes
/// warmed. `mark` is told each warmed span (for the RSS budget's accounting).
pub(crate) fn prewarm(
    files: &[MappedFile],
    segments: &[Segment],
    budget: u64,
    mut mark: impl FnMut(usize, usize, usize),
) -> Result<u64> {
    let ps = page_size();
    let mut left = budget;
    let mut warmed = 0u64;
    for (si, seg) in segments.iter().enumerate() {
        if left == 0 {
            break;
        }
        let f = &files[seg.file];
        let len = seg.len.min(usize::try_from(left).unwrap_or(usize::MAX));
        if len == 0 {
            continue;
        }
        // Start the reads for the whole span at once, then touch each page so the call
        // returns with the pages resident (WILLNEED alone is asynchronous).
        f.map
            .advise_range(Advice::WillNeed, seg.start, len)
            .map_err(|e| io_err(&f.path, "madvise(WILLNEED)", e))?;
        let data = &f.map[seg.start..seg.start + len];
        let first = ps - seg.start % ps;
        let mut sum = 0u8;
        sum ^= data[0];
        let mut i = first;
        while i < len {
            sum ^= data[i];
            i += ps;
        }
        sum ^= data[len - 1];
        std::hint::black_box(sum);
        mark(si, 0, len);
        warmed += len as u64;
        left -= len as u64;
    }
    Ok(warmed)
}

/// Drop the table's pages: unmap them from this process and evict the clean ones from
/// the page cache. Later gathers read them back from the file.
pub(crate) fn drop_pages(files: &[MappedFile], segments: &[Segment]) -> Result<()> {
    for seg in segments {
        if seg.len == 0 {
            continue;
        }
        let (lo, hi) = page_span(seg.start, seg.len);
        drop_range(&files[seg.file], lo, hi - lo)?;
    }
    Ok(())
}

/// Drop `len` bytes of `f` from page-aligned offset `lo` (clipped to the file): unmap
/// them from this process, then evict the clean pages from the page cache.
pub(crate) fn drop_range(f: &MappedFile, lo: usize, len: usize) -> Result<()> {
    let end = lo.saturating_add(len).min(f.map.len());
    if end <= lo {
        return Ok(());
    }
    // SAFETY: the mapping is read-only and file-backed (MAP_SHARED, never written), so
    // MADV_DONTNEED only discards page-table entries: the next access re-reads the same
    // bytes from the file, and no `&[u8]` into the map ever observes a change.
    unsafe {
        f.map
            .unchecked_advise_range(UncheckedAdvice::DontNeed, lo, end - lo)
    }
    .map_err(|e| io_err(&f.path, "madvise(DONTNEED)", e))?;
    // The page cache is dropped whole pages at a time: round the end up (the last page of
    // the file may be partial).
    let hi = end.div_ceil(page_size()) * page_size();
    let (Ok(off), Ok(n)) = (libc::off_t::try_from(lo), libc::off_t::try_from(hi - lo)) else {
        return Ok(());
    };
    // SAFETY: `f.file` is an open descriptor we own for the table's life; fadvise
    // touches no memory of ours.
    let rc = unsafe { libc::posix_fadvise(f.file.as_raw_fd(), off, n, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(io_err(
            &f.path,
            "posix_fadvise(DONTNEED)",
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(())
}

/// Give `f`'s mapping back the kernel's default read-around (`access="normal"`; the
/// mapping was opened with random access for reading headers).
pub(crate) fn advise_normal(f: &MappedFile) -> Result<()> {
    if f.map.is_empty() {
        return Ok(());
    }
    f.map
        .advise(Advice::Normal)
        .map_err(|e| io_err(&f.path, "madvise(NORMAL)", e))
}

/// Advise the kernel that `f` is read at random: no read-around on a fault of the
/// mapping (`MADV_RANDOM`) and no readahead on reads through the descriptor
/// (`POSIX_FADV_RANDOM`), so a cold row costs one read of its page(s).
pub(crate) fn advise_random(f: &MappedFile) -> Result<()> {
    if f.map.is_empty() {
        return Ok(());
    }
    f.map
        .advise(Advice::Random)
        .map_err(|e| io_err(&f.path, "madvise(RANDOM)", e))?;
    // SAFETY: an open descriptor we own; fadvise touches no memory of ours.
    let rc = unsafe { libc::posix_fadvise(f.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    if rc != 0 {
        return Err(io_err(
            &f.path,
            "posix_fadvise(RANDOM)",
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(())
}
