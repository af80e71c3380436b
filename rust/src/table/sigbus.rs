//! Surviving a table file that shrinks (or fails) under its mapping.
//!
//! A read through a file mapping of a page past the file's end, or of a page the kernel
//! cannot read (an I/O error), raises SIGBUS on the reading thread; by default that kills
//! the process. Every copy out of a table's mapping runs inside [`guarded`], and this
//! module turns such a fault into lost rows the gather reports as [`crate::Error::Io`]:
//!
//! * [`register`] records each mapped file (address, length, descriptor) in [`SLOTS`], a
//!   fixed array of atomics the handler reads without locks. The first registration
//!   installs [`on_sigbus`] process-wide (once), saving the action that was there.
//! * [`guarded`] sets a thread-local "guarded copy in progress" flag around a copy.
//! * For a fault that the kernel raised (not `kill`) at an address inside a registered
//!   mapping on a thread in a guarded copy, the handler records what is lost in the slot
//!   (everything from the file's new size when the fault lies past it, else the faulting
//!   page), then maps anonymous zero pages over the lost pages of the mapping and returns:
//!   the faulting load re-executes, reads zeros, and the copy runs to its end.
//! * After every copy the gather asks [`Registration::lost`] whether any of its rows lie in
//!   a lost range (one atomic load per file while nothing is lost) and fails with the
//!   file and offset if so, zeroing the destination. Lost ranges stay lost for the life of
//!   the table, so later gathers of them fail too while rows inside the file keep working.
//! * Any other SIGBUS goes to the saved action: a handler is called (with `siginfo` if it
//!   asked for it); `SIG_DFL` is restored and the fault re-executes (or, for a signal
//!   sent with `kill`, is re-raised), so the process dies as it would have without us.
//!
//! Why not `sigsetjmp`/`siglongjmp`: jumping out of a Rust frame skips its destructors
//! and is undefined behaviour; returning from the handler keeps every frame intact.
//!
//! Async-signal safety of the handler: it reads and writes only atomics (lock-free on
//! every target we build for) and one thread-local `Cell` of a `const`-initialised,
//! destructor-free type (a plain TLS slot, no lazy initialisation); it calls only
//! `fstat`, `mmap` and `sigaction` (raw system calls through glibc's thin wrappers; `fstat`
//! and `sigaction` are on POSIX's async-signal-safe list, `mmap` is not on the list but on
//! Linux is the bare system call with no library state), and saves and restores `errno`
//! around them. It allocates nothing, takes no lock and cannot panic. The thread-local
//! is read only for an address inside a registered mapping, i.e. on a thread that ran
//! [`guarded`] before (in a `dlopen`ed library the first TLS access of a thread may
//! allocate; by then it has happened outside the handler).
//!
//! Limits (see README, "When a table file changes under a running server"):
//! * A file cut to a size that is not a multiple of the page size leaves its last page
//!   readable with zeros past the new end, without a fault; rows there read zeros until
//!   a fault elsewhere in the file records the new size (the table makes no system call
//!   on the warm path to notice sooner).
//! * Mappings beyond [`SLOTS`] at once, or a process whose SIGBUS handler could not be
//!   installed, are not guarded: a fault there is SIGBUS as before.
//! * A SIGBUS handler installed after ours that does not chain to the one it replaced
//!   takes the faults first (`faulthandler.enable()` after the first table opened
//!   reports the fault as fatal).
//!
//! All `unsafe` of the crate's SIGBUS handling is in this module.

use std::cell::Cell;
use std::os::fd::RawFd;
use std::sync::atomic::{compiler_fence, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

/// Mapped files guarded at once (one per file per open table).
const SLOT_COUNT: usize = 1024;

/// Single lost pages (I/O errors inside the file) remembered per file; past this, a lost
/// page makes the rest of the file lost too.
const LOST_PAGES: usize = 8;

const FREE: usize = 0;
const BUSY: usize = 1;
const LIVE: usize = 2;

/// One registered mapping. Offsets are mapping offsets (= file offsets: tables map whole
/// files from offset 0).
struct Slot {
    /// [`FREE`], [`BUSY`] (being set up or torn down: the handler ignores it) or [`LIVE`].
    state: AtomicUsize,
    base: AtomicUsize,
    len: AtomicUsize,
    fd: AtomicUsize,
    /// Nonzero once anything of this mapping is lost (the gathers' fast check).
    lost_any: AtomicUsize,
    /// `usize::MAX - offset` of the first byte lost to a shrink (everything after it is
    /// lost too); 0 for none (so that `fetch_max` keeps the smallest offset).
    lost_from: AtomicUsize,
    /// `page offset + 1` of single lost pages; 0 for an empty entry.
    lost_pages: [AtomicUsize; LOST_PAGES],
}

#[allow(clippy::declare_interior_mutable_const)] // only the array initialiser uses it
const EMPTY: Slot = Slot {
    state: AtomicUsize::new(FREE),
    base: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    fd: AtomicUsize::new(0),
    lost_any: AtomicUsize::new(0),
    lost_from: AtomicUsize::new(0),
    lost_pages: [const { AtomicUsize::new(0) }; LOST_PAGES],
};

/// The registry of guarded mappings (zero-initialised: `.bss`, no start-up cost).
static SLOTS: [Slot; SLOT_COUNT] = [EMPTY; SLOT_COUNT];

/// The page size, read at install (the handler must not call `sysconf`).
static PAGE: AtomicUsize = AtomicUsize::new(0);

/// The SIGBUS action that was in place before ours; set once, before ours is installed.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Whether our handler is installed.
static INSTALLED: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread is inside [`guarded`]. `const`, `Copy`, no destructor: a bare
    /// TLS slot the handler may read.
    static GUARDED: Cell<bool> = const { Cell::new(false) };
}

/// What a registered mapping has lost (mapping offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lost {
    /// Every byte from here on (the file's size when a read past it faulted).
    pub from: Option<usize>,
    /// Single pages the kernel could not read (their page-aligned offsets).
    pub pages: [Option<usize>; LOST_PAGES],
}

impl Lost {
    /// Whether `off..off + len` touches a lost byte; the offset it is lost from if so.
    pub fn hits(&self, off: usize, len: usize, page: usize) -> Option<usize> {
        let end = off + len;
        if let Some(from) = self.from {
            if end > from {
                return Some(off.max(from));
            }
        }
        self.pages
            .iter()
            .flatten()
            .copied()
            .find(|&p| p < end && p + page > off)
    }
}

/// A mapping's place in the registry; dropping it unregisters (before the unmap: keep it
/// ahead of the mapping in its owner's fields).
pub(crate) struct Registration {
    slot: &'static Slot,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("base", &self.slot.base.load(Ordering::Relaxed))
            .finish()
    }
}

impl Registration {
    /// What the mapping has lost, or `None` (the common case: one atomic load).
    #[inline(always)]
    pub fn lost(&self) -> Option<Lost> {
        if self.slot.lost_any.load(Ordering::Acquire) == 0 {
            return None;
        }
        let s = self.slot;
        let from = match s.lost_from.load(Ordering::Acquire) {
            0 => None,
            v => Some(usize::MAX - v),
        };
        let mut pages = [None; LOST_PAGES];
        for (out, p) in pages.iter_mut().zip(&s.lost_pages) {
            *out = p.load(Ordering::Acquire).checked_sub(1);
        }
        Some(Lost { from, pages })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.slot.state.store(BUSY, Ordering::SeqCst);
        self.slot.base.store(0, Ordering::Relaxed);
        self.slot.len.store(0, Ordering::Relaxed);
        self.slot.state.store(FREE, Ordering::Release);
    }
}

/// Guard the mapping `base..base + len` of descriptor `fd` (open for as long as the
/// returned registration lives, and the mapping too). `None` if the handler could not be
/// installed or every slot is taken (the mapping is then unguarded: SIGBUS as before).
pub(crate) fn register(base: *const u8, len: usize, fd: RawFd) -> Option<Registration> {
    if len == 0 || fd < 0 || !install() {
        return None;
    }
    for slot in &SLOTS {
        if slot
            .state
            .compare_exchange(FREE, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            continue;
        }
        slot.base.store(base as usize, Ordering::Relaxed);
        slot.len.store(len, Ordering::Relaxed);
        slot.fd.store(fd as usize, Ordering::Relaxed);
        slot.lost_any.store(0, Ordering::Relaxed);
        slot.lost_from.store(0, Ordering::Relaxed);
        for p in &slot.lost_pages {
            p.store(0, Ordering::Relaxed);
        }
        slot.state.store(LIVE, Ordering::Release);
        return Some(Registration { slot });
    }
    None
}

/// Run `f` (a copy out of registered mappings) with this thread's guard on: a SIGBUS in a
/// registered mapping during it is recorded as lost and the read returns zeros (check
/// [`Registration::lost`] afterwards). Nests.
#[inline(always)]
pub(crate) fn guarded<R>(f: impl FnOnce() -> R) -> R {
    let was = GUARDED.replace(true);
    // The handler runs on this thread between any two instructions of `f`: keep the flag's
    // store before the copy's loads and its reset after them.
    compiler_fence(Ordering::SeqCst);
    let r = f();
    compiler_fence(Ordering::SeqCst);
    GUARDED.set(was);
    r
}

/// Install the handler once; whether it is installed.
fn install() -> bool {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        PAGE.store(crate::os::page_size(), Ordering::Relaxed);
        // SAFETY: an all-zero `sigaction` is a valid value of the C struct (SIG_DFL, empty
        // mask, no flags); it is only an out-parameter here.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: querying the current action (null new action) writes only `old`.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) } != 0 {
            return;
        }
        // Saved before ours goes in, so the handler always finds it.
        let _ = PREVIOUS.set(old);
        // SAFETY: as above, a valid starting value that we fill in.
        let mut new: libc::sigaction = unsafe { std::mem::zeroed() };
        new.sa_sigaction = on_sigbus as *const () as usize;
        // SA_ONSTACK: on a thread with an alternate stack, use it. No SA_NODEFER: a SIGBUS
        // inside the handler itself (a bug) must kill, not recurse. No SA_RESTART needed: a
        // fault interrupts no system call.
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: `new.sa_mask` is ours to initialise.
        unsafe { libc::sigemptyset(&mut new.sa_mask) };
        // SAFETY: installs a handler that is async-signal-safe (module docs); `old` only
        // receives the replaced action, which is the one we saved (nothing else in this
        // process installs SIGBUS actions concurrently with a first table open, and if
        // something did, chaining to the older one is what it would have got anyway).
        if unsafe { libc::sigaction(libc::SIGBUS, &new, &mut old) } == 0 {
            INSTALLED.store(1, Ordering::Release);
        }
    });
    INSTALLED.load(Ordering::Acquire) != 0
}

/// Whether this process's SIGBUS action is ours now (false before the first table
/// opened, and after something replaced it).
pub fn handler_is_current() -> bool {
    // SAFETY: as in `install`: a zeroed out-parameter, and a query that writes only it.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut cur) } != 0 {
        return false;
    }
    cur.sa_sigaction == on_sigbus as *const () as usize
}

/// The live slot holding `addr`, if any (lock-free; the handler's first question).
fn slot_of(addr: usize) -> Option<&'static Slot> {
    SLOTS.iter().find(|s| {
        s.state.load(Ordering::Acquire) == LIVE && {
            let base = s.base.load(Ordering::Relaxed);
            addr >= base && addr - base < s.len.load(Ordering::Relaxed)
        }
    })
}

/// Record what the fault at mapping offset `off` of `slot` lost and map zeros over it;
/// whether that worked (if not, the fault is not ours to survive).
///
/// # Safety
/// Called only from [`on_sigbus`] for a LIVE slot, whose mapping and descriptor are alive
/// (the registration outlives every guarded copy of its mapping).
unsafe fn absorb(slot: &Slot, off: usize) -> bool {
    let ps = PAGE.load(Ordering::Relaxed);
    let base = slot.base.load(Ordering::Relaxed);
    let len = slot.len.load(Ordering::Relaxed);
    let map_end = len.div_ceil(ps) * ps;
    let page = off - off % ps;
    // SAFETY: an all-zero `stat` is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let fd = slot.fd.load(Ordering::Relaxed) as RawFd;
    // SAFETY: fstat on a descriptor the registration keeps open; writes only `st`.
    let size = if unsafe { libc::fstat(fd, &mut st) } == 0 {
        usize::try_from(st.st_size).ok()
    } else {
        None
    };
    let (lo, hi) = match size {
        // Past the end: the file shrank. Everything from its new size is lost; map zeros
        // over every whole page past it at once (one mapping, not one per faulting page).
        // (A fault on the page that holds the new end, which reads fine up to it, can
        // only be an I/O error: that page goes too.)
        Some(size) if off >= size => {
            let lo = page.min(size.div_ceil(ps) * ps);
            slot.lost_from
                .fetch_max(usize::MAX - size.min(lo), Ordering::SeqCst);
            (lo, map_end)
        }
        // Inside the file (an I/O error, or the file grew back): this page only.
        _ => {
            let tag = page + 1;
            let stored = slot.lost_pages.iter().any(|p| {
                p.load(Ordering::Relaxed) == tag
                    || p.compare_exchange(0, tag, Ordering::SeqCst, Ordering::Relaxed)
                        .is_ok()
            });
            if !stored {
                slot.lost_from
                    .fetch_max(usize::MAX - page, Ordering::SeqCst);
            }
            (page, page + ps)
        }
    };
    // Marked lost before the zeros appear: a gather on another thread that reads them
    // finds the mark when it checks after its copy.
    slot.lost_any.store(1, Ordering::SeqCst);
    if page < lo || page >= hi {
        return false; // unreachable: both ranges above hold the faulting page
    }
    // SAFETY: `base + lo .. base + hi` is page-aligned and inside our mapping (which spans
    // `map_end` bytes from the page-aligned `base`); replacing it with private zero pages
    // only changes what reads of those bytes return (zeros instead of SIGBUS), and every
    // reader checks the lost mark recorded above before using what it read.
    let p = unsafe {
        libc::mmap(
            (base + lo) as *mut libc::c_void,
            hi - lo,
            libc::PROT_READ,
            libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    p != libc::MAP_FAILED
}

/// Pass a SIGBUS we do not handle to the action that was there before ours.
///
/// # Safety
/// Called only from [`on_sigbus`], with its arguments.
unsafe fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let prev = PREVIOUS.get();
    let handler = prev.map_or(libc::SIG_DFL, |p| p.sa_sigaction);
    if handler != libc::SIG_DFL && handler != libc::SIG_IGN {
        let flags = prev.map_or(0, |p| p.sa_flags);
        if flags & libc::SA_SIGINFO != 0 {
            // SAFETY: the saved action said this is a `sa_sigaction` handler.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(handler) };
            f(sig, info, ctx);
        } else {
            // SAFETY: the saved action said this is a `sa_handler` handler.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
            f(sig);
        }
        return;
    }
    // SAFETY: `info` is the kernel's siginfo for this signal.
    let from_kernel = !info.is_null() && unsafe { (*info).si_code } > 0;
    if handler == libc::SIG_IGN && !from_kernel {
        return; // a SIGBUS sent by kill(), which the process had chosen to ignore
    }
    // SIG_DFL (or SIG_IGN for a fault, which cannot be ignored): restore the default and
    // let the signal kill the process as it would have without us. A fault re-executes on
    // return and faults again; a sent signal is sent again (delivered once we return).
    // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask.
    let mut dfl: libc::sigaction = unsafe { std::mem::zeroed() };
    dfl.sa_sigaction = libc::SIG_DFL;
    // SAFETY: sigaction is async-signal-safe; no out-parameter.
    unsafe { libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut()) };
    if !from_kernel {
        // SAFETY: raise is async-signal-safe.
        unsafe { libc::raise(libc::SIGBUS) };
    }
}

/// The process-wide SIGBUS handler (see the module docs).
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is a thread-local int of this thread; we put back what we found.
    let errno = unsafe { *libc::__errno_location() };
    let (code, addr) = if info.is_null() {
        (0, 0)
    } else {
        // SAFETY: `info` is the kernel's siginfo (SA_SIGINFO); si_addr is meaningful for
        // the faults we handle (si_code > 0) and ignored otherwise.
        unsafe { ((*info).si_code, (*info).si_addr() as usize) }
    };
    let ours = code > 0
        && slot_of(addr).is_some_and(|slot| {
            GUARDED.get() && {
                let off = addr - slot.base.load(Ordering::Relaxed);
                // SAFETY: a LIVE slot found for a fault on a thread inside a guarded copy
                // of it: its registration is alive for that copy's length.
                unsafe { absorb(slot, off) }
            }
        });
    if !ours {
        // SAFETY: our own arguments.
        unsafe { chain(sig, info, ctx) };
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_ranges_hit_the_rows_they_cover() {
        let l = Lost {
            from: Some(10_000),
            pages: [Some(4096), None, None, None, None, None, None, None],
        };
        assert_eq!(l.hits(0, 100, 4096), None);
        assert_eq!(l.hits(4000, 100, 4096), Some(4096));
        assert_eq!(l.hits(8191, 1, 4096), Some(4096));
        assert_eq!(l.hits(8192, 100, 4096), None);
        assert_eq!(l.hits(9950, 100, 4096), Some(10_000));
        assert_eq!(l.hits(20_000, 10, 4096), Some(20_000));
    }

    #[test]
    fn registrations_are_released() {
        let fd = 0; // never read: nothing faults in this test
        let regs: Vec<_> = (0..8)
            .map(|i| register((0x1000_0000 + i * 0x10000) as *const u8, 4096, fd))
            .collect();
        assert!(regs.iter().all(Option::is_some));
        assert!(handler_is_current());
        assert!(regs[0].as_ref().is_some_and(|r| r.lost().is_none()));
        assert!(slot_of(0x1000_0000 + 0x10000 + 10).is_some());
        drop(regs);
        assert!(slot_of(0x1000_0000 + 0x10000 + 10).is_none());
    }
}
