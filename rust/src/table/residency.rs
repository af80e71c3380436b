//! What the table believes about its own pages: which are in the page cache ("known
//! resident", one bit a page, set after the table read the page), how hot each is (one
//! byte a page, only under an RSS budget), and the clock that picks which pages to forget
//! or evict. Pure bookkeeping: no system calls here (see `pagecache` for those).
//!
//! A gather whose rows' pages are all known resident copies straight from the mapping;
//! any other gather reads its unknown rows together first (see `coldread`). A known page
//! the kernel evicted behind our back is merely faulted in again by the copy (slower,
//! still correct), which is why the known set is bounded (see [`PageMap::sweep`]).

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::discover::Segment;
use crate::os::page_size;

/// Heat saturates here (a byte; aging halves it).
const HEAT_MAX: u8 = u8::MAX;

/// A run of consecutive pages of one segment: `pages` pages from page-aligned byte offset
/// `offset` of that segment's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub segment: usize,
    pub offset: usize,
    pub pages: usize,
}

pub(crate) struct PageMap {
    /// Global page number of each segment's first page.
    base: Vec<usize>,
    /// Page-aligned file offset of each segment's first page.
    seg_lo: Vec<usize>,
    /// log2 of the page size.
    shift: u32,
    pages: usize,
    known: Box<[AtomicU64]>,
    known_count: AtomicUsize,
    /// Per-page access counts, aged by the clock (only with an RSS budget).
    heat: Option<Box<[AtomicU8]>>,
    /// The clock hand (a global page number); held while sweeping.
    hand: Mutex<usize>,
}

impl PageMap {
    pub fn new(segments: &[Segment], with_heat: bool) -> Self {
        let ps = page_size();
        let mut base = Vec::with_capacity(segments.len());
        let mut seg_lo = Vec::with_capacity(segments.len());
        let mut pages = 0usize;
        for s in segments {
            let lo = s.start - s.start % ps;
            let hi = (s.start + s.len).div_ceil(ps) * ps;
            base.push(pages);
            seg_lo.push(lo);
            pages += (hi - lo) / ps;
        }
        Self {
            base,
            seg_lo,
            shift: ps.trailing_zeros(),
            pages,
            known: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            known_count: AtomicUsize::new(0),
            heat: with_heat.then(|| (0..pages).map(|_| AtomicU8::new(0)).collect()),
            hand: Mutex::new(0),
        }
    }

    /// Pages the table spans (all segments).
    #[cfg(test)]
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// First and last global page (inclusive) of `len > 0` bytes at file offset `off` of
    /// segment `seg`.
    #[inline(always)]
    pub fn span(&self, seg: usize, off: usize, len: usize) -> (usize, usize) {
        let lo = self.seg_lo[seg];
        let b = self.base[seg];
        (
            b + ((off - lo) >> self.shift),
            b + ((off + len - 1 - lo) >> self.shift),
        )
    }

    #[inline(always)]
    fn is_known(&self, p: usize) -> bool {
        self.known
            .get(p / 64)
            .is_some_and(|w| w.load(Ordering::Relaxed) & (1u64 << (p % 64)) != 0)
    }

    /// Whether every page of `first..=last` is known resident.
    #[inline(always)]
    pub fn all_known(&self, (first, last): (usize, usize)) -> bool {
        // A row spans one or two pages unless rows are wider than a page.
        if last <= first + 1 {
            return self.is_known(first) & self.is_known(last);
        }
        (first..=last).all(|p| self.is_known(p))
    }

    /// The warm path's per-row check for a table of one segment without access counts:
    /// `(segment, file offset) -> all of the row's pages known`, with everything that
    /// does not change per row hoisted out (measured: the general check cost ~3.5 ns a
    /// row, half the copy of a resident 160 B row).
    #[inline(always)]
    pub fn single_segment_check(
        &self,
        row_bytes: usize,
    ) -> Option<impl Fn(usize, usize) -> bool + Sync + '_> {
        if self.heat.is_some() || self.seg_lo.len() != 1 {
            return None;
        }
        let lo = self.seg_lo[0];
        let (shift, words, last) = (self.shift, &self.known[..], row_bytes - 1 - lo);
        let bit = move |p: usize| {
            words
                .get(p >> 6)
                .map_or(0, |w| w.load(Ordering::Relaxed) >> (p & 63))
        };
        let mask = (1usize << shift) - 1;
        Some(move |_: usize, off: usize| {
            let rel = off - lo;
            let p0 = rel >> shift;
            // Most rows lie within one page: one bit to test.
            if (rel & mask) + row_bytes <= mask + 1 {
                return bit(p0) & 1 != 0;
            }
            let p1 = (off + last) >> shift;
            (p0..=p1).all(|p| bit(p) & 1 != 0)
        })
    }

    /// Whether every page is known resident and no access counts are kept: a gather
    /// then needs no per-row check at all.
    #[inline(always)]
    pub fn all_known_uncounted(&self) -> bool {
        self.heat.is_none() && self.known_count.load(Ordering::Relaxed) == self.pages
    }

    /// Count an access to `first..=last` (with an RSS budget; else nothing).
    #[inline(always)]
    pub fn touch(&self, (first, last): (usize, usize)) {
        let Some(heat) = &self.heat else { return };
        for p in first..=last {
            if let Some(h) = heat.get(p) {
                // Racy increments may be lost; the count is a hint.
                let v = h.load(Ordering::Relaxed);
                if v < HEAT_MAX {
                    h.store(v + 1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Mark `first..=last` known resident; returns how many were not already.
    pub fn mark(&self, (first, last): (usize, usize)) -> usize {
        let mut new = 0;
        for p in first..=last {
            let Some(w) = self.known.get(p / 64) else {
                break;
            };
            let bit = 1u64 << (p % 64);
            if w.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
                new += 1;
            }
        }
        if new > 0 {
            self.known_count.fetch_add(new, Ordering::Relaxed);
        }
        new
    }

    fn unmark(&self, p: usize) -> bool {
        let bit = 1u64 << (p % 64);
        let was = self.known[p / 64].fetch_and(!bit, Ordering::Relaxed) & bit != 0;
        if was {
            self.known_count.fetch_sub(1, Ordering::Relaxed);
        }
        was
    }

    /// Pages known resident now.
    pub fn known_pages(&self) -> usize {
        self.known_count.load(Ordering::Relaxed)
    }

    /// Forget every page (after the table dropped them all).
    pub fn clear(&self) {
        for w in self.known.iter() {
            let n = w.swap(0, Ordering::Relaxed).count_ones() as usize;
            if n > 0 {
                self.known_count.fetch_sub(n, Ordering::Relaxed);
            }
        }
        if let Some(heat) = &self.heat {
            for h in heat.iter() {
                h.store(0, Ordering::Relaxed);
            }
        }
    }

    /// Pick up to `want` known pages to give up, forget them, and return them as runs of
    /// consecutive pages (for dropping from the page cache in as few calls as possible).
    ///
    /// A CLOCK sweep: the hand walks the known pages; with access counts (an RSS budget) a
    /// page whose count is non-zero has it halved and is passed over (so a page read `c`
    /// times since survives about `log2(c) + 1` sweeps without further use: frequency with
    /// aging), a page at zero is taken. Without counts the hand takes pages in order. The
    /// sweep stops after a bounded number of passes even if hot pages keep it from finding
    /// `want` (the rest is taken on a later call).
    pub fn sweep(&self, want: usize) -> Vec<Run> {
        if want == 0 || self.pages == 0 {
            return Vec::new();
        }
        let mut hand = self.hand.lock().unwrap_or_else(|e| e.into_inner());
        let slots = self.known.len() * 64;
        // Nine passes halve any count (<= 255) to zero.
        let limit = slots.saturating_mul(10);
        let mut scanned = 0usize;
        let mut victims = Vec::with_capacity(want.min(1 << 16));
        while victims.len() < want && scanned < limit {
            let p = *hand % slots;
            let word = self.known[p / 64].load(Ordering::Relaxed) >> (p % 64);
            if word == 0 {
                let step = 64 - p % 64;
                *hand = (p + step) % slots;
                scanned += step;
                continue;
            }
            let skip = word.trailing_zeros() as usize;
            let q = p + skip;
            *hand = (q + 1) % slots;
            scanned += skip + 1;
            if let Some(heat) = &self.heat {
                let h = heat[q].load(Ordering::Relaxed);
                if h > 0 {
                    heat[q].store(h / 2, Ordering::Relaxed);
                    continue;
                }
            }
            if self.unmark(q) {
                victims.push(q);
            }
        }
        drop(hand);
        victims.sort_unstable();
        self.runs(&victims)
    }

    /// Sorted global pages as runs within segments.
    fn runs(&self, pages: &[usize]) -> Vec<Run> {
        let ps = page_size();
        let mut out: Vec<Run> = Vec::new();
        let mut last: Option<usize> = None;
        for &p in pages {
            let seg = self.base.partition_point(|&b| b <= p) - 1;
            if let (Some(prev), Some(run)) = (last, out.last_mut()) {
                if prev + 1 == p && run.segment == seg {
                    run.pages += 1;
                    last = Some(p);
                    continue;
                }
            }
            out.push(Run {
                segment: seg,
                offset: self.seg_lo[seg] + (p - self.base[seg]) * ps,
                pages: 1,
            });
            last = Some(p);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(file: usize, start: usize, len: usize) -> Segment {
        Segment {
            file,
            tensor: "t".into(),
            first_row: 0,
            rows: 1,
            start,
            len,
        }
    }

    #[test]
    fn spans_and_marks() {
        let ps = page_size();
        // Two segments: 3 pages from an unaligned start, then 2 pages in another file.
        let m = PageMap::new(&[seg(0, 100, 2 * ps), seg(1, ps, 2 * ps)], true);
        assert_eq!(m.pages(), 5);
        assert_eq!(m.span(0, 100, 10), (0, 0));
        assert_eq!(m.span(0, ps - 5, 10), (0, 1));
        assert_eq!(m.span(1, ps, 1), (3, 3));
        assert_eq!(m.span(1, 3 * ps - 1, 1), (4, 4));
        assert!(!m.all_known((0, 1)));
        assert_eq!(m.mark((0, 1)), 2);
        assert_eq!(m.mark((1, 2)), 1);
        assert!(m.all_known((0, 2)) && !m.all_known((2, 3)));
        assert_eq!(m.known_pages(), 3);
        m.clear();
        assert_eq!(m.known_pages(), 0);
        assert!(!m.all_known((0, 0)));
    }

    #[test]
    fn sweep_takes_cold_pages_first_and_returns_runs() {
        let ps = page_size();
        let m = PageMap::new(&[seg(0, 0, 200 * ps)], true);
        for p in 0..200 {
            m.mark((p, p));
        }
        // Pages 10..20 are hot.
        for _ in 0..50 {
            for p in 10..20 {
                m.touch((p, p));
            }
        }
        let runs = m.sweep(150);
        let taken: usize = runs.iter().map(|r| r.pages).sum();
        assert_eq!(taken, 150);
        assert_eq!(m.known_pages(), 50);
        assert!(
            (10..20).all(|p| m.all_known((p, p))),
            "a hot page was taken"
        );
        // Runs are maximal and page-aligned.
        assert_eq!(
            runs[0],
            Run {
                segment: 0,
                offset: 0,
                pages: 10
            }
        );
        assert!(runs
            .windows(2)
            .all(|w| w[0].offset + w[0].pages * ps < w[1].offset));
    }

    #[test]
    fn sweep_without_heat_takes_in_clock_order_and_terminates() {
        let ps = page_size();
        let m = PageMap::new(&[seg(0, 0, 130 * ps), seg(0, 130 * ps, ps)], false);
        for p in [3, 64, 65, 129, 130] {
            m.mark((p, p));
        }
        let runs = m.sweep(2);
        assert_eq!(runs.iter().map(|r| r.pages).sum::<usize>(), 2);
        assert_eq!(runs[0].offset, 3 * ps);
        // Asking for more than exists takes what there is and stops.
        let rest = m.sweep(100);
        assert_eq!(rest.iter().map(|r| r.pages).sum::<usize>(), 3);
        // 129 and 130 are consecutive pages but in different segments: two runs.
        assert!(rest
            .iter()
            .any(|r| r.segment == 1 && r.offset == 130 * ps && r.pages == 1));
        assert_eq!(m.known_pages(), 0);
        assert!(m.sweep(1).is_empty());
    }

    #[test]
    fn all_hot_pages_still_yield_after_aging() {
        let ps = page_size();
        let m = PageMap::new(&[seg(0, 0, 64 * ps)], true);
        for p in 0..64 {
            m.mark((p, p));
            for _ in 0..300 {
                m.touch((p, p)); // saturates at 255
            }
        }
        let runs = m.sweep(8);
        assert_eq!(runs.iter().map(|r| r.pages).sum::<usize>(), 8);
    }
}
