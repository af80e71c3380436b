//! Page-locked, device-mapped host memory: the row slot and the flag line.
//!
//! # Lifetime and captured graphs
//!
//! A graph that captured a WAIT, a copy or a WRITE holds raw addresses of this memory and
//! replays them for as long as the graph lives, which Rust cannot see. So an owner that
//! ever enqueued these addresses under capture must not free them on drop: it calls
//! [`PinnedBuf::retain_forever`], which hands the allocation to the process (the driver
//! reclaims it at exit) and counts it in [`retained_bytes`]. Memory that was only used
//! eagerly is freed once the owner has waited for its last eager copy.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::cuda::driver::{self, DevicePtr};
use crate::error::Result;

static RETAINED: AtomicU64 = AtomicU64::new(0);

/// Bytes of pinned memory kept alive because a graph may still replay against it.
pub fn retained_bytes() -> u64 {
    RETAINED.load(Ordering::Relaxed)
}

/// A pinned, device-mapped host allocation. Freed exactly once, on drop, unless retained.
#[derive(Debug)]
pub struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    device_ptr: DevicePtr,
    ordinal: i32,
    retained: bool,
}

// SAFETY: the allocation is plain memory usable from any thread; access is synchronised by
// the owner (the slot behind a mutex, the flag through atomics).
unsafe impl Send for PinnedBuf {}
// SAFETY: as above; shared access only reads through atomics or under the owner's lock.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    /// Allocate `len` zeroed bytes. Needs a current context of device `ordinal`.
    pub fn new(len: usize, ordinal: i32) -> Result<Self> {
        let ptr = driver::host_alloc_mapped(len, ordinal)?;
        // SAFETY: `ptr` is a fresh allocation of at least `len` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len.max(1)) };
        let mut buf = Self {
            ptr,
            len,
            device_ptr: 0,
            ordinal,
            retained: false,
        };
        buf.device_ptr = driver::host_device_pointer(ptr, ordinal)?;
        Ok(buf)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host address (what copies read from).
    pub fn host_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Device address (what stream memory operations target).
    pub fn device_ptr(&self) -> DevicePtr {
        self.device_ptr
    }

    /// Exclusive host view. The caller's protocol guarantees no GPU operation reads or
    /// writes these bytes meanwhile (for the slot: the flag says EMPTY).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of `len` bytes; `&mut self` excludes other
        // host access; the GPU side is excluded by the protocol stated above.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Shared host view.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: live allocation of `len` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Never free this allocation: a captured graph may still replay against it.
    pub fn retain_forever(&mut self) {
        if !self.retained {
            self.retained = true;
            RETAINED.fetch_add(self.len as u64, Ordering::Relaxed);
        }
    }

    /// The 32-bit word at byte `offset` (4-byte aligned, in bounds) as an atomic.
    pub fn word(&self, offset: usize) -> &AtomicU32 {
        assert!(offset % 4 == 0 && offset + 4 <= self.len, "word out of bounds");
        // SAFETY: in bounds and aligned (asserted; the base is page-aligned); the memory
        // lives as long as `&self`; every host access to these words goes through atomics.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU32) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.retained {
            return;
        }
        // SAFETY: allocated by host_alloc_mapped and freed only here, once. Owners retain
        // the buffer instead whenever a graph may replay against it, and wait for their
        // eager copies before dropping. An error (driver already shut down at exit) is
        // ignored: there is nothing left to free then.
        let _ = unsafe { driver::host_free(self.ptr) };
        let _ = self.ordinal;
    }
}

/// The flag line of one `DeferredRows`: a 64-byte region in pinned, device-mapped memory.
///
/// Layout (little-endian): bytes 0..4 `filled` (host stores FILLED, the GPU writes EMPTY
/// after its copy), bytes 4..8 `poison` (host only, sticky), bytes 8..12 `arrived` (the
/// GPU writes 1 when it reaches the WAIT, when arrival tracking is on).
///
/// The GPU waits with one 64-bit `(word & mask) != 0` on bytes 0..8, so setting `poison`
/// opens the gate for this and every later replay, while the GPU's 32-bit EMPTY write can
/// clear only `filled`. A poisoned or dropped object therefore can never strand a graph.
#[derive(Debug)]
pub struct HostFlag {
    buf: PinnedBuf,
}

#[cfg(not(target_endian = "little"))]
compile_error!("HostFlag's 64-bit gate assumes a little-endian host");

impl HostFlag {
    pub const EMPTY: u32 = 0;
    pub const FILLED: u32 = 1;
    /// The mask the GPU waits on: any bit of `filled` or `poison`.
    pub const WAIT_MASK: u64 = 0x0000_0001_0000_0001;
    const LINE: usize = 64;

    pub fn new(ordinal: i32) -> Result<Self> {
        Ok(Self {
            buf: PinnedBuf::new(Self::LINE, ordinal)?,
        })
    }

    /// Device address of the 64-bit gate (bytes 0..8) and of the `filled` word.
    pub fn gate_device_ptr(&self) -> DevicePtr {
        self.buf.device_ptr()
    }

    /// Device address of the `arrived` word.
    pub fn arrived_device_ptr(&self) -> DevicePtr {
        self.buf.device_ptr() + 8
    }

    pub fn filled(&self) -> u32 {
        self.buf.word(0).load(Ordering::Acquire)
    }

    /// Publish the slot: every earlier write to the slot becomes visible first.
    pub fn store_filled(&self) {
        fence(Ordering::SeqCst);
        self.buf.word(0).store(Self::FILLED, Ordering::SeqCst);
    }

    /// Host-side reset (probe only; in the protocol the GPU resets).
    pub fn store_empty(&self) {
        self.buf.word(0).store(Self::EMPTY, Ordering::SeqCst);
    }

    pub fn is_poisoned(&self) -> bool {
        self.buf.word(4).load(Ordering::Acquire) != 0
    }

    /// Open the gate for good.
    pub fn store_poison(&self) {
        fence(Ordering::SeqCst);
        self.buf.word(4).store(1, Ordering::SeqCst);
    }

    /// Read and clear the `arrived` word.
    pub fn take_arrived(&self) -> bool {
        self.buf.word(8).swap(0, Ordering::AcqRel) != 0
    }

    pub fn retain_forever(&mut self) {
        self.buf.retain_forever();
    }
}
