//! [`StallClock`]: how long the consumer of deferred rows waited for them, measured on the
//! GPU.
//!
//! Two stamps a step, each a one-thread kernel that writes the GPU's global timer (ns)
//! into a ring in pinned, mapped host memory: *arrived* on the consumer's stream right
//! before it joins the rows (the consumer is ready for them), *copied* on the rows' stream
//! after the wait, the copy and the reset (the rows are in the staging buffer). The
//! consumer's stall is `copied - arrived` when positive, else zero (the rows were there
//! first). Both stamps are captured into a graph like the rest of the step, so every
//! replay is timed with no host involvement; the host drains the ring whenever it likes.
//!
//! Each kind counts its own stamps in device memory, so the two streams never share a
//! counter and step `k`'s stamps pair up by index whatever order they ran in.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::cuda::driver::{DeviceBuffer, DevicePtr, Kernels, RawStream};
use crate::cuda::pinned::PinnedBuf;
use crate::error::Result;

/// Which stamp of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stamp {
    /// The consumer reached its join.
    Arrived = 0,
    /// The rows were copied into the staging buffer.
    Copied = 1,
}

/// Steps the ring holds before the oldest unread one is overwritten.
pub const RING_STEPS: u64 = 8192;

/// Stalls read since the last drain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StallSamples {
    /// One entry a step, oldest first: nanoseconds the consumer waited (0: none).
    pub stalls_ns: Vec<u64>,
    /// Steps whose stamps were overwritten before they were read.
    pub dropped: u64,
}

/// See the module docs.
pub struct StallClock {
    counters: DeviceBuffer,
    ring: PinnedBuf,
    kernels: Kernels,
    /// Steps drained so far.
    read: Mutex<u64>,
    /// A stamp was enqueued: the GPU may still write the memory (see `release`).
    stamped: AtomicBool,
}

impl StallClock {
    /// A clock on device `ordinal`. Needs a current context of that device.
    pub(crate) fn new(ordinal: i32, kernels: Kernels) -> Result<Self> {
        let counters = DeviceBuffer::new(16, ordinal)?;
        counters.zero(16, ordinal)?;
        let ring = PinnedBuf::new((2 + 2 * RING_STEPS as usize) * 8, ordinal)?;
        Ok(Self {
            counters,
            ring,
            kernels,
            read: Mutex::new(0),
            stamped: AtomicBool::new(false),
        })
    }

    /// Enqueue stamp `which` on `stream` (eagerly or into the capture it is under).
    ///
    /// # Safety
    /// `stream` is a live stream of the clock's device, with a current context; once
    /// captured, the clock must be [retained](Self::retain_forever) for the graph's life.
    pub(crate) unsafe fn stamp(&self, stream: RawStream, which: Stamp) -> Result<()> {
        self.stamped.store(true, Ordering::Relaxed);
        let ring: DevicePtr = self.ring.device_ptr();
        // SAFETY: the caller's contract; the counters and ring are sized as the kernel
        // expects and live as long as `self` (or forever once retained).
        unsafe {
            self.kernels
                .stamp(stream, self.counters.ptr, ring, which as u64, RING_STEPS)
        }
    }

    /// Every step both of whose stamps were written since the last drain.
    pub fn drain(&self) -> StallSamples {
        let mut read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        let arrived = self.ring.word64(0).load(Ordering::Acquire);
        let copied = self.ring.word64(8).load(Ordering::Acquire);
        let done = arrived.min(copied);
        let mut out = StallSamples::default();
        if done <= *read {
            return out;
        }
        // Entries older than a full ring ago were overwritten.
        let first = (*read).max(done.saturating_sub(RING_STEPS));
        out.dropped = first - *read;
        out.stalls_ns.reserve((done - first) as usize);
        for k in first..done {
            let at = (2 + 2 * (k % RING_STEPS) as usize) * 8;
            let t_arrived = self.ring.word64(at).load(Ordering::Relaxed);
            let t_copied = self.ring.word64(at + 8).load(Ordering::Relaxed);
            out.stalls_ns.push(t_copied.saturating_sub(t_arrived));
        }
        *read = done;
        out
    }

    /// Never free the counters or the ring: a captured graph may replay against them.
    pub(crate) fn retain_forever(&mut self) {
        self.counters.retain_forever();
        self.ring.retain_forever();
    }

    /// Before the owner drops the clock (with its context current): once any stamp was
    /// enqueued, keep the memory (16 B of device memory, the ring's pinned pages) for the
    /// process's life, since a stamp queued on another stream (an eager consumer's
    /// arrival) may still be in flight and no event orders it before the drop.
    pub(crate) fn release(&mut self) {
        if self.stamped.load(Ordering::Relaxed) {
            self.retain_forever();
        }
    }
}
