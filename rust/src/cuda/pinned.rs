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
        assert!(
            offset % 4 == 0 && offset + 4 <= self.len,
            "word out of bounds"
        );
        // SAFETY: in bounds and aligned (asserted; the base is page-aligned); the memory
        // lives as long as `&self`; every host access to these words goes through atomics.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU32) }
    }

    /// The 64-bit word at byte `offset` (8-byte aligned, in bounds) as an atomic.
    pub fn word64(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset % 8 == 0 && offset + 8 <= self.len,
            "word out of bounds"
        );
        // SAFETY: in bounds and aligned (asserted; the base is page-aligned); the memory
        // lives as long as `&self`; every host access to these words goes through atomics.
        unsafe { &*(self.ptr.add(offset) as *const AtomicU64) }
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
/// after its copy), bytes 4..8 `poison` (host only, sticky), bytes 8..12 `arrived` (with
/// arrival tracking, the GPU writes 1 just before the wait and 0 after the copy).
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

    /// Whether the GPU has reached this step's wait: it sets `arrived` just before the
    /// wait and clears it after the copy, so at fill time 1 means "already waiting".
    pub fn gpu_arrived(&self) -> bool {
        self.buf.word(8).load(Ordering::Acquire) != 0
    }

    pub fn retain_forever(&mut self) {
        self.buf.retain_forever();
    }
}

enum MailboxMem {
    Pinned(PinnedBuf),
    /// Host mode (no GPU): plain, 8-byte-aligned heap memory.
    Heap(Box<[u64]>),
}

/// Where the GPU publishes a step's ids for the host: a 64-byte control line (bytes 0..4
/// `ready`, 4..8 `count`) followed by room for `max_ids` ids of `id_bytes` (4 or 8) bytes,
/// in pinned, device-mapped memory (or heap memory in host mode, published from the host).
///
/// Protocol: the GPU writes the ids and the count, fences, stores READY (1); the host
/// sees READY, copies the ids out, stores 0. The GPU cannot publish the next step's ids
/// before the host has filled this step's rows, because its consumer waits on that fill
/// first (same stream), so the host's copy never races the GPU's next write.
pub struct IdMailbox {
    mem: MailboxMem,
    max_ids: usize,
    id_bytes: usize,
    retained: bool,
}

impl std::fmt::Debug for IdMailbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdMailbox")
            .field("max_ids", &self.max_ids)
            .field("id_bytes", &self.id_bytes)
            .finish()
    }
}

impl IdMailbox {
    const HEADER: usize = 64;

    fn bytes_for(max_ids: usize, id_bytes: usize) -> usize {
        Self::HEADER + max_ids * id_bytes
    }

    /// Pinned and mapped for device `ordinal` (needs a current context).
    pub fn pinned(max_ids: usize, id_bytes: usize, ordinal: i32) -> Result<Self> {
        assert!(id_bytes == 4 || id_bytes == 8, "ids are 4 or 8 bytes");
        let buf = PinnedBuf::new(Self::bytes_for(max_ids, id_bytes), ordinal)?;
        Ok(Self {
            mem: MailboxMem::Pinned(buf),
            max_ids,
            id_bytes,
            retained: false,
        })
    }

    /// Heap memory, for host mode (ids published by the host).
    pub fn heap(max_ids: usize, id_bytes: usize) -> Self {
        assert!(id_bytes == 4 || id_bytes == 8, "ids are 4 or 8 bytes");
        let words = Self::bytes_for(max_ids, id_bytes).div_ceil(8);
        Self {
            mem: MailboxMem::Heap(vec![0u64; words].into_boxed_slice()),
            max_ids,
            id_bytes,
            retained: false,
        }
    }

    pub fn max_ids(&self) -> usize {
        self.max_ids
    }

    pub fn id_bytes(&self) -> usize {
        self.id_bytes
    }

    fn base(&self) -> *mut u8 {
        match &self.mem {
            MailboxMem::Pinned(p) => p.host_ptr() as *mut u8,
            MailboxMem::Heap(h) => h.as_ptr() as *mut u8,
        }
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset + 4 <= Self::HEADER);
        // SAFETY: the header is 64 bytes inside a live allocation (page-aligned when pinned,
        // 8-byte aligned on the heap), so the 4-aligned offset is in bounds and aligned; the
        // word lives as long as `&self`; the host touches it only through atomics.
        unsafe { AtomicU32::from_ptr(self.base().add(offset).cast()) }
    }

    /// Device addresses `(ids, count, ready)` (pinned mailboxes only).
    pub fn device_ptrs(&self) -> Option<(DevicePtr, DevicePtr, DevicePtr)> {
        match &self.mem {
            MailboxMem::Pinned(p) => {
                let d = p.device_ptr();
                Some((d + Self::HEADER as u64, d + 4, d))
            }
            MailboxMem::Heap(_) => None,
        }
    }

    /// Host address of the count word (for a copy-engine publish).
    pub fn count_host_ptr(&self) -> *mut u8 {
        // SAFETY: offset 4 is inside the 64-byte header.
        unsafe { self.base().add(4) }
    }

    /// Host address of the ids area (for a copy-engine publish).
    pub fn ids_host_ptr(&self) -> *mut u8 {
        // SAFETY: HEADER is within the allocation (bytes_for adds it).
        unsafe { self.base().add(Self::HEADER) }
    }

    pub fn is_ready(&self) -> bool {
        self.word(0).load(Ordering::Acquire) != 0
    }

    /// Copy the published ids (as i64) into `out` and clear READY. Returns the count the
    /// publisher stored, which the caller must check against its limits (only the first
    /// `min(count, max_ids)` ids are copied).
    pub fn take(&self, out: &mut Vec<i64>) -> usize {
        fence(Ordering::Acquire);
        let count = self.word(4).load(Ordering::Acquire) as usize;
        let n = count.min(self.max_ids);
        out.clear();
        let p = self.ids_host_ptr();
        // SAFETY: the ids area holds max_ids * id_bytes bytes >= n ids; the publisher wrote
        // them before storing READY (seen above, after the acquire fence) and writes them
        // again only after this step's fill (see the type's docs). Unaligned reads are used
        // so no alignment assumption is needed.
        unsafe {
            if self.id_bytes == 8 {
                out.extend((0..n).map(|i| std::ptr::read_unaligned((p as *const i64).add(i))));
            } else {
                out.extend(
                    (0..n).map(|i| i64::from(std::ptr::read_unaligned((p as *const i32).add(i)))),
                );
            }
        }
        self.word(0).store(0, Ordering::Release);
        count
    }

    /// Publish from the host (host mode, and tests): write the ids and the count, then READY.
    pub fn publish_from_host(&self, ids: &[i64]) {
        let n = ids.len().min(self.max_ids);
        let p = self.ids_host_ptr();
        // SAFETY: n ids fit in the ids area; nobody reads it until READY is stored below.
        unsafe {
            for (i, &v) in ids[..n].iter().enumerate() {
                if self.id_bytes == 8 {
                    std::ptr::write_unaligned((p as *mut i64).add(i), v);
                } else {
                    std::ptr::write_unaligned((p as *mut i32).add(i), v as i32);
                }
            }
        }
        self.word(4).store(n as u32, Ordering::Release);
        fence(Ordering::SeqCst);
        self.word(0).store(1, Ordering::SeqCst);
    }

    /// Never free the memory: a captured graph (or a queued publish) may still write it.
    pub fn retain_forever(&mut self) {
        if let MailboxMem::Pinned(p) = &mut self.mem {
            p.retain_forever();
        }
        self.retained = true;
    }
}

// SAFETY: the memory is plain host memory; concurrent access follows the protocol above
// (atomics for the control words, ids read only after READY).
unsafe impl Send for IdMailbox {}
// SAFETY: as above.
unsafe impl Sync for IdMailbox {}
