//! Measuring instruments for the benchmarks (not used by the table): the storage floor
//! (random 4 KiB reads of a file through io_uring, `O_DIRECT` by default, at a given
//! queue depth; what `fio --rw=randread --bs=4k --ioengine=io_uring --direct=1` measures,
//! for hosts without fio) and the memory-latency floor (a dependent pointer chase over a
//! buffer far larger than the last-level cache: one cache-line miss per hop).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

use io_uring::{opcode, types, IoUring};

use crate::error::{Error, Result};

const BLOCK: usize = 4096;

fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        detail: format!("{what}: {e}"),
    }
}

/// xorshift64*: a fast, seedable generator (quality is irrelevant here).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A file opened for the probe, with a private ring and a 4 KiB-aligned buffer per slot.
struct Probe {
    path: std::path::PathBuf,
    file: File,
    blocks: u64,
    ring: IoUring,
    buf: Vec<u8>,
    base: usize,
    direct: bool,
    /// Reads queued or in flight.
    pending: usize,
}

impl Probe {
    fn open(path: &Path, depth: usize, direct: bool) -> Result<Self> {
        if depth == 0 || depth > 4096 {
            return Err(Error::invalid(format!(
                "depth must be 1..=4096, got {depth}"
            )));
        }
        let mut o = OpenOptions::new();
        o.read(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let file = o
            .open(path)
            .map_err(|e| io_err(path, if direct { "open(O_DIRECT)" } else { "open" }, e))?;
        let len = file.metadata().map_err(|e| io_err(path, "stat", e))?.len();
        let blocks = len / BLOCK as u64;
        if blocks == 0 {
            return Err(Error::invalid(format!(
                "{} is smaller than one {BLOCK}-byte block",
                path.display()
            )));
        }
        let ring = IoUring::new(depth.next_power_of_two() as u32)
            .map_err(|e| io_err(path, "io_uring_setup", e))?;
        let buf = vec![0u8; (depth + 1) * BLOCK];
        let base = buf.as_ptr().align_offset(BLOCK);
        Ok(Self {
            path: path.to_path_buf(),
            file,
            blocks,
            ring,
            buf,
            base,
            direct,
            pending: 0,
        })
    }

    fn evict(&self) {
        if !self.direct {
            // SAFETY: our descriptor; fadvise touches no memory of ours.
            unsafe { libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }

    /// Queue a read of a random block into buffer slot `slot`.
    fn push(&mut self, slot: usize, rng: &mut Rng) -> Result<()> {
        let off = rng.below(self.blocks) * BLOCK as u64;
        let ptr = self.buf[self.base + slot * BLOCK..].as_mut_ptr();
        let e = opcode::Read::new(types::Fd(self.file.as_raw_fd()), ptr, BLOCK as u32)
            .offset(off)
            .build()
            .user_data(slot as u64);
        // SAFETY: slot `slot` of `self.buf` (BLOCK bytes, in bounds: the buffer holds
        // depth + 1 blocks and `base < BLOCK`) is written only by this read, and its slot
        // is reused only after `reap` returned it; `Drop for Probe` waits for every read
        // (or leaks the buffer) before the buffer is freed.
        unsafe { self.ring.submission().push(&e) }
            .map_err(|_| Error::invalid("submission queue full"))?;
        self.pending += 1;
        Ok(())
    }

    fn submit(&mut self) -> Result<()> {
        self.ring
            .submit()
            .map(drop)
            .map_err(|e| io_err(&self.path, "io_uring_enter", e))
    }

    /// Wait for one completion; returns its slot.
    fn reap(&mut self) -> Result<usize> {
        loop {
            if let Some(c) = self.ring.completion().next() {
                self.pending -= 1;
                if c.result() != BLOCK as i32 {
                    let e = if c.result() < 0 {
                        std::io::Error::from_raw_os_error(-c.result())
                    } else {
                        std::io::Error::other(format!("short read: {} bytes", c.result()))
                    };
                    return Err(io_err(&self.path, "read", e));
                }
                return Ok(c.user_data() as usize);
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => return Err(io_err(&self.path, "io_uring_enter", e)),
            }
        }
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        // An error path may leave reads in flight: wait for them before the buffer goes,
        // or leak it if the ring cannot tell us.
        while self.pending > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(_) => {
                    std::mem::forget(std::mem::take(&mut self.buf));
                    return;
                }
            }
            let n = self.ring.completion().count();
            self.pending = self.pending.saturating_sub(n);
        }
    }
}

/// `batches` rounds of `depth` random 4 KiB reads of `path` submitted together; returns
/// each round's wall time in seconds (submit to last completion). With `direct=false`
/// the file's pages are evicted before each round (buffered reads).
pub fn read_batches(
    path: &Path,
    depth: usize,
    batches: usize,
    direct: bool,
    seed: u64,
) -> Result<Vec<f64>> {
    let mut p = Probe::open(path, depth, direct)?;
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(batches);
    for _ in 0..batches {
        p.evict();
        let t0 = Instant::now();
        for slot in 0..depth {
            p.push(slot, &mut rng)?;
        }
        p.submit()?;
        while p.pending > 0 {
            p.reap()?;
        }
        out.push(t0.elapsed().as_secs_f64());
    }
    Ok(out)
}

/// `reads` random 4 KiB reads of `path` with `depth` always in flight; returns the wall
/// time in seconds (throughput = reads / time).
pub fn read_sustained(
    path: &Path,
    depth: usize,
    reads: usize,
    direct: bool,
    seed: u64,
) -> Result<f64> {
    let mut p = Probe::open(path, depth, direct)?;
    let mut rng = Rng::new(seed);
    p.evict();
    let t0 = Instant::now();
    let first = depth.min(reads);
    for slot in 0..first {
        p.push(slot, &mut rng)?;
    }
    let mut issued = first;
    p.submit()?;
    while p.pending > 0 {
        let slot = p.reap()?;
        if issued < reads {
            p.push(slot, &mut rng)?;
            issued += 1;
            p.submit()?;
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// Nanoseconds per hop of a dependent pointer chase through `bytes` of memory, one
/// 64-byte line per hop in a random single cycle (Sattolo's shuffle), `hops` hops after
/// one warm-up pass over at most a million lines.
pub fn memory_latency_ns(bytes: usize, hops: usize, seed: u64) -> Result<f64> {
    const LINE: usize = 64 / std::mem::size_of::<u64>();
    let lines = bytes / 64;
    if lines < 2 || hops == 0 {
        return Err(Error::invalid(
            "need at least two 64-byte lines and one hop",
        ));
    }
    let mut rng = Rng::new(seed);
    let mut order: Vec<u32> = (0..lines as u32).collect();
    for i in (1..lines).rev() {
        let j = rng.below(i as u64) as usize; // j < i: one cycle through every line
        order.swap(i, j);
    }
    let mut buf = vec![0u64; lines * LINE];
    // order[] as a permutation: line i points at line order[i]
    for (i, &next) in order.iter().enumerate() {
        buf[i * LINE] = u64::from(next) * LINE as u64;
    }
    drop(order);
    let mut at = 0usize;
    for _ in 0..lines.min(1 << 20) {
        at = buf[at] as usize;
    }
    let t0 = Instant::now();
    for _ in 0..hops {
        at = buf[at] as usize;
    }
    let ns = t0.elapsed().as_nanos() as f64 / hops as f64;
    std::hint::black_box(at);
    Ok(ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floors_run_on_a_small_file() {
        let d = crate::table::tests::TempDir::new();
        let p = d.write("f.bin", &vec![7u8; 64 * BLOCK]);
        // O_DIRECT may be refused by the temp filesystem (tmpfs): buffered then.
        let direct = read_batches(&p, 4, 2, true, 1).is_ok();
        let b = read_batches(&p, 4, 3, direct, 1).unwrap();
        assert_eq!(b.len(), 3);
        assert!(b.iter().all(|&t| t > 0.0));
        assert!(read_sustained(&p, 8, 100, direct, 2).unwrap() > 0.0);
        assert!(read_batches(&p, 0, 1, direct, 1).is_err());
        assert!(memory_latency_ns(1 << 16, 1000, 3).unwrap() > 0.0);
    }
}
