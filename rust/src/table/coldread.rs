//! Reading the cold rows of one gather together, so that a gather of `n` rows that miss
//! the page cache costs about one storage round trip at queue depth `n`, not `n` serial
//! page faults.
//!
//! Four ways, chosen per table with `cold_reads` (see [`super::ColdReads`]):
//!
//! * `uring`: one `IORING_OP_READ` per row (buffered, straight into the destination row)
//!   on a per-thread io_uring, all submitted at once; the kernel's async buffered reads
//!   (ext4, xfs, btrfs, ...) need no worker threads. Reads return errors, never SIGBUS.
//! * `willneed`: one `MADV_WILLNEED` per row's page(s) (the reads go out together), then
//!   the copy from the mapping waits for them.
//! * `pool`: `pread` per row on a pool of blocking threads.
//! * `fault`: no batching: the copy faults each page in, one at a time.
//!
//! Measured side by side on one file, evicted before each gather (2-vCPU VM, virtio disk;
//! `benchmarks/bench_cold.py`, BENCHMARKS.md "Cold tables"): io_uring matched the storage
//! floor (16 random 4 KiB `O_DIRECT` reads submitted together) at 16, 256 and 1024 rows;
//! `willneed` ran 5-10% behind it, the pool 15-80% behind (thread wake-ups), faulting 2.5-5x
//! behind. Hence `auto` = io_uring where the kernel allows it (probed once, and verified on
//! each table's first file at open), else `willneed`, which needs nothing but `madvise`.
//!
//! All `unsafe` of this module is the io_uring submission (the kernel writes into the
//! destination rows until each read completes; see `Inflight`).

use std::cell::RefCell;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

use io_uring::{opcode, types, IoUring, Probe};
use memmap2::Advice;
use rayon::prelude::*;

use super::discover::MappedFile;
use crate::error::{Error, Result};
use crate::os::page_size;

/// Setting this environment variable to anything but `""`/`"0"` makes io_uring count as
/// unavailable (for tests of the fallback, and for hosts where it misbehaves).
pub const DISABLE_IO_URING_ENV: &str = "PLE_MEMOPS_DISABLE_IO_URING";

/// Entries of each thread's ring: reads in flight at once (a gather of more rows keeps
/// this many in flight until all are done). Above any device queue depth we target.
const RING_ENTRIES: u32 = 256;

/// Threads of the `pool` way: reads in flight at once.
const POOL_THREADS: usize = 32;

/// The largest single read submitted (rows are far smaller; a wider row is read in parts).
const MAX_READ: usize = 1 << 30;

/// One row to read: `out.len()` bytes at file offset `off` of `file`.
pub(crate) struct ColdRow<'a> {
    pub out: &'a mut [u8],
    pub file: &'a MappedFile,
    pub off: usize,
}

fn read_error(f: &MappedFile, off: usize, len: usize, e: &io::Error) -> Error {
    Error::Io {
        path: f.path.display().to_string(),
        detail: format!("read of {len} bytes at offset {off}: {e}"),
    }
}

fn truncated(f: &MappedFile, off: usize, len: usize) -> Error {
    Error::Io {
        path: f.path.display().to_string(),
        detail: format!(
            "read of {len} bytes at offset {off} hit the end of the file \
             (the file was truncated while the table was open?)"
        ),
    }
}

fn env_disabled() -> bool {
    std::env::var_os(DISABLE_IO_URING_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

fn new_ring(entries: u32) -> io::Result<IoUring> {
    // Single issuer + deferred task work (Linux 6.1+) suit a ring used by one thread that
    // always waits for its own completions; older kernels refuse the flags: plain ring.
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
        .or_else(|_| IoUring::new(entries))
}

/// Why io_uring cannot be used in this process, or `None` if it can. Probed once: ring
/// setup (refused by old kernels, `kernel.io_uring_disabled`, seccomp filters such as
/// container runtimes', gVisor) and `IORING_OP_READ` (Linux 5.6+).
pub fn uring_unavailable() -> Option<&'static str> {
    static PROBE: OnceLock<Option<String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            if env_disabled() {
                return Some(format!("disabled by {DISABLE_IO_URING_ENV}"));
            }
            let ring = match new_ring(8) {
                Ok(r) => r,
                Err(e) => return Some(format!("io_uring_setup failed: {e}")),
            };
            let mut probe = Probe::new();
            if let Err(e) = ring.submitter().register_probe(&mut probe) {
                return Some(format!(
                    "io_uring opcode probe failed: {e} (kernel older than 5.6?)"
                ));
            }
            if !probe.is_supported(opcode::Read::CODE) {
                return Some("io_uring lacks IORING_OP_READ (kernel older than 5.6)".into());
            }
            None
        })
        .as_deref()
}

/// This thread's ring, made on first use; remembers a failure to make one.
enum Slot {
    Empty,
    Ready { ring: Box<IoUring>, pid: u32 },
    Failed(String),
}

thread_local! {
    static RING: RefCell<Slot> = const { RefCell::new(Slot::Empty) };
}

/// How a batch of io_uring reads went.
pub(crate) enum Uring {
    /// The reads ran; `Err` is the first read's error (every read finished either way).
    Done(Result<()>),
    /// io_uring cannot be used on this thread (why); nothing was read or run.
    Unavailable(String),
}

/// Read `rows` through this thread's io_uring, all submitted together. `overlap` (if
/// `Some`) is taken and run once the reads are submitted, while they are in flight.
pub(crate) fn read_uring<F: FnOnce()>(rows: &mut [ColdRow<'_>], overlap: &mut Option<F>) -> Uring {
    if let Some(why) = uring_unavailable() {
        return Uring::Unavailable(why.to_string());
    }
    RING.with(|cell| {
        let Ok(mut slot) = cell.try_borrow_mut() else {
            return Uring::Unavailable("this thread's ring is in use".into());
        };
        let pid = std::process::id();
        // A ring inherited through fork() belongs to the parent: make our own.
        if matches!(&*slot, Slot::Ready { pid: p, .. } if *p != pid) {
            *slot = Slot::Empty;
        }
        if matches!(&*slot, Slot::Empty) {
            *slot = match new_ring(RING_ENTRIES) {
                Ok(ring) => Slot::Ready {
                    ring: Box::new(ring),
                    pid,
                },
                Err(e) => Slot::Failed(format!("io_uring_setup on this thread failed: {e}")),
            };
        }
        match &mut *slot {
            Slot::Ready { ring, .. } => Uring::Done(run_reads(ring, rows, overlap)),
            Slot::Failed(why) => Uring::Unavailable(why.clone()),
            Slot::Empty => Uring::Unavailable("no ring".into()),
        }
    })
}

/// Reads submitted to a ring and not yet completed. Dropping it waits for all of them:
/// the kernel writes into the destination rows until each read completes, so nothing may
/// return (or unwind) past the rows' borrow before that.
struct Inflight<'r> {
    ring: &'r mut IoUring,
    n: usize,
}

impl Inflight<'_> {
    /// Submit what is queued and wait for at least `want` completions. Retries
    /// what a valid ring can report transiently (a signal, a momentary shortage); any other
    /// failure of `io_uring_enter` leaves reads in flight that we can neither wait for nor
    /// cancel while their buffers are borrowed, so it aborts the process (unreachable
    /// with a ring this module built and entries it filled).
    fn enter(&mut self, want: usize) {
        loop {
            let r = if want > 0 {
                self.ring.submit_and_wait(want)
            } else {
                self.ring.submit()
            };
            match r {
                Ok(_) => return,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY | libc::ENOMEM)
                    ) =>
                {
                    std::thread::yield_now();
                }
                Err(e) => {
                    eprintln!(
                        "ple_memops: io_uring_enter failed with {} reads in flight: {e}; \
                         aborting (their buffers cannot be released safely)",
                        self.n
                    );
                    std::process::abort();
                }
            }
        }
    }
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        while self.n > 0 {
            self.enter(1);
            let n = self.ring.completion().count();
            self.n = self.n.saturating_sub(n);
        }
    }
}

fn run_reads<F: FnOnce()>(
    ring: &mut IoUring,
    rows: &mut [ColdRow<'_>],
    overlap: &mut Option<F>,
) -> Result<()> {
    let cap = (ring.params().sq_entries() as usize).min(ring.params().cq_entries() as usize);
    let n = rows.len();
    let mut done = vec![0usize; n];
    let mut again: Vec<usize> = Vec::new();
    let mut next = 0usize;
    let mut first_err: Option<Error> = None;
    let mut fl = Inflight { ring, n: 0 };
    loop {
        if first_err.is_none() {
            let Inflight { ring, n: inflight } = &mut fl;
            let mut sq = ring.submission();
            while *inflight < cap {
                let i = match again.pop() {
                    Some(i) => i,
                    None if next < n => {
                        next += 1;
                        next - 1
                    }
                    None => break,
                };
                let r = &mut rows[i];
                let left = &mut r.out[done[i]..];
                let len = left.len().min(MAX_READ) as u32;
                let entry =
                    opcode::Read::new(types::Fd(r.file.file.as_raw_fd()), left.as_mut_ptr(), len)
                        .offset((r.off + done[i]) as u64)
                        .build()
                        .user_data(i as u64);
                // SAFETY: the entry reads `len` bytes into `left`, which lies inside
                // `rows[i].out`, a `&mut [u8]` that outlives this function and is not
                // touched by us until the read completes; the descriptor is the table's,
                // open for its life (the table outlives the gather). `fl` (dropped on every
                // path out of this function, unwinding included) waits for every
                // submitted read before the borrow of `rows` ends.
                if unsafe { sq.push(&entry) }.is_err() {
                    again.push(i);
                    break;
                }
                *inflight += 1;
            }
        }
        if fl.n == 0 {
            break;
        }
        if let Some(f) = overlap.take() {
            fl.enter(0);
            f();
        }
        // Wait for everything in flight when nothing is left to submit: one wake-up per
        // gather instead of one per read (measured: 16 cold rows took 60-70 us longer
        // waking per completion). With more reads queued, refill once a quarter is back.
        let queued = first_err.is_none() && (next < n || !again.is_empty());
        let ready = fl.ring.completion().len();
        let want = if queued { (fl.n / 4).max(1) } else { fl.n };
        fl.enter(want.saturating_sub(ready));
        let Inflight { ring, n: inflight } = &mut fl;
        for cqe in ring.completion() {
            *inflight -= 1;
            let i = cqe.user_data() as usize;
            let Some(r) = rows.get(i) else { continue };
            let res = cqe.result();
            if res < 0 {
                if matches!(-res, libc::EINTR | libc::EAGAIN) {
                    again.push(i);
                } else if first_err.is_none() {
                    let e = io::Error::from_raw_os_error(-res);
                    first_err = Some(read_error(r.file, r.off, r.out.len(), &e));
                }
            } else if res == 0 {
                first_err.get_or_insert_with(|| truncated(r.file, r.off, r.out.len()));
            } else {
                done[i] += res as usize;
                if done[i] < r.out.len() {
                    again.push(i);
                }
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Read one byte of `f` through io_uring: `None` if that works, else why not (some
/// filesystems refuse what the kernel offers).
pub(crate) fn verify_uring(f: &MappedFile) -> Option<String> {
    if f.map.is_empty() {
        return None;
    }
    let mut b = [0u8; 1];
    let mut rows = [ColdRow {
        out: &mut b,
        file: f,
        off: 0,
    }];
    match read_uring(&mut rows, &mut None::<fn()>) {
        Uring::Done(Ok(())) => None,
        Uring::Done(Err(e)) => Some(format!("a test read through io_uring failed: {e}")),
        Uring::Unavailable(why) => Some(why),
    }
}

fn read_pool_threads() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(POOL_THREADS)
            .thread_name(|i| format!("ple-read-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Read `rows` with `pread` on a pool of blocking threads (inline if the OS refused the
/// threads).
pub(crate) fn read_pool(rows: &mut [ColdRow<'_>]) -> Result<()> {
    let read = |r: &mut ColdRow<'_>| {
        let (file, off, len) = (r.file, r.off, r.out.len());
        r.file
            .file
            .read_exact_at(r.out, off as u64)
            .map_err(|e| match e.kind() {
                io::ErrorKind::UnexpectedEof => truncated(file, off, len),
                _ => read_error(file, off, len, &e),
            })
    };
    match read_pool_threads() {
        Some(pool) if rows.len() > 1 => {
            pool.install(|| rows.par_iter_mut().with_max_len(1).try_for_each(read))
        }
        _ => rows.iter_mut().try_for_each(read),
    }
}

/// Start the reads of `rows` together (`MADV_WILLNEED` on each row's page(s); a run of
/// rows on one page asks once); the caller's copy from the mapping then waits for them.
pub(crate) fn will_need(rows: &[ColdRow<'_>]) {
    let ps = page_size();
    let mut last: Option<(*const MappedFile, usize, usize)> = None;
    for r in rows {
        let key = (
            r.file as *const MappedFile,
            r.off / ps,
            (r.off + r.out.len().max(1) - 1) / ps,
        );
        if last == Some(key) {
            continue;
        }
        last = Some(key);
        // Advisory: an error only means this row is faulted in by the copy instead.
        let _ = r
            .file
            .map
            .advise_range(Advice::WillNeed, r.off, r.out.len());
    }
}
