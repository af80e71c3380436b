//! The protocol's kernels (`cuda/kernels/rows.cu`, embedded as PTX) and their launches:
//! a handle of the same layer as [`super::handles`], never freed.

use std::ffi::c_void;
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::handles::PrimaryContext;
use super::result::{check, DevicePtr, RawStream};
use crate::error::Result;

/// The protocol's kernels (`kernels/rows.cu`), loaded once per device into its primary
/// context and never unloaded: captured graphs keep launching them for their whole life.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernels {
    wait_copy_reset: sys::CUfunction,
    wait_gate: sys::CUfunction,
    copy_reset: sys::CUfunction,
    publish_ids: sys::CUfunction,
    stamp: sys::CUfunction,
    ordinal: i32,
}

// SAFETY: CUfunction handles may be used from any thread of their context.
unsafe impl Send for Kernels {}
// SAFETY: as above; the handles are immutable.
unsafe impl Sync for Kernels {}

const ROWS_PTX: &str = concat!(include_str!("../kernels/rows.ptx"), "\0");

/// Bytes one block of the grid copy moves (its share of the slot), and the most blocks:
/// 30 blocks for a 64-token Gemma E2B step (960 KiB), 64 for 2 MiB and more.
const GRID_BLOCK_BYTES: usize = 32 * 1024;
const GRID_MAX_BLOCKS: usize = 64;

/// Blocks and threads of the grid copy of `n` bytes (16 bytes a thread an iteration).
pub(crate) fn grid_for(n: usize) -> (u32, u32) {
    let blocks = n.div_ceil(GRID_BLOCK_BYTES).clamp(1, GRID_MAX_BLOCKS);
    (blocks as u32, 512)
}

/// Threads of a single-block launch that moves `n` units.
fn block_for(n: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, 1024) as u32
}

impl Kernels {
    /// The kernels for device `ordinal`, loaded into its primary context on first use.
    pub fn get(ordinal: i32) -> Result<Self> {
        static CACHE: OnceLock<std::sync::Mutex<std::collections::HashMap<i32, Kernels>>> =
            OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = map.get(&ordinal) {
            return Ok(*k);
        }
        // The module lives in the primary context: keep that context alive for the life of
        // the process, or a release to zero (e.g. after the probe, before torch retains it)
        // would destroy the module and leave the cached handles dangling.
        let ctx = PrimaryContext::retain(ordinal)?;
        let _g = ctx.bind()?;
        std::mem::forget(ctx);
        let mut module = ptr::null_mut();
        // SAFETY: ROWS_PTX is NUL-terminated PTX text; valid out-pointer; the context is
        // bound. Loading eagerly here (not on first launch) keeps lazy module loading from
        // synchronising behind a pending wait later.
        check("cuModuleLoadData", Some(ordinal), unsafe {
            sys::cuModuleLoadData(&mut module, ROWS_PTX.as_ptr().cast())
        })?;
        let get = |name: &std::ffi::CStr| -> Result<sys::CUfunction> {
            let mut func = ptr::null_mut();
            // SAFETY: module is live (never unloaded); the name is NUL-terminated.
            check("cuModuleGetFunction", Some(ordinal), unsafe {
                sys::cuModuleGetFunction(&mut func, module, name.as_ptr())
            })?;
            Ok(func)
        };
        let k = Kernels {
            wait_copy_reset: get(c"ple_wait_copy_reset")?,
            wait_gate: get(c"ple_wait_gate")?,
            copy_reset: get(c"ple_copy_reset")?,
            publish_ids: get(c"ple_publish_ids")?,
            stamp: get(c"ple_stamp")?,
            ordinal,
        };
        map.insert(ordinal, k);
        Ok(k)
    }

    /// Launch `f` as `blocks` blocks of `threads` with `args`, one 8-byte value per kernel
    /// parameter, in order (every kernel of `rows.cu` takes 8-byte parameters only).
    ///
    /// # Safety
    /// `args` match the kernel's parameters in number and meaning; the caller's contract
    /// of the public launch functions holds.
    unsafe fn launch<const N: usize>(
        &self,
        f: sys::CUfunction,
        blocks: u32,
        threads: u32,
        stream: RawStream,
        args: &mut [u64; N],
    ) -> Result<()> {
        let mut params: [*mut c_void; N] = args.each_mut().map(|a| (a as *mut u64).cast());
        // SAFETY: the caller's contract; `params` points at `args`, alive through the call
        // (the driver copies the parameter values).
        check("cuLaunchKernel", Some(self.ordinal), unsafe {
            sys::cuLaunchKernel(
                f,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }

    /// Enqueue `wait until (gate & mask) != 0 ; copy n bytes src -> dst ; filled = EMPTY`
    /// on `stream`: with `grid_done` `None`, as one single-block kernel (lowest latency);
    /// with `Some(done)`, as one warp that polls and then a grid of `grid_for(n)` blocks
    /// that copy, the last of which resets the flag and puts the device counter `done`
    /// back to zero (for steps above one block's bandwidth).
    ///
    /// # Safety
    /// `src` (the slot's device address) and `dst` hold `n` bytes and are 16-byte aligned;
    /// `gate` is the flag line's device address; `done` is a zeroed device `u32` no other
    /// launch uses while this one runs (one per flag: a flag's steps never overlap); all
    /// outlive every execution of the launch (graph replays included); `stream` is live.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn wait_copy_reset(
        &self,
        stream: RawStream,
        src: DevicePtr,
        dst: DevicePtr,
        n: usize,
        gate: DevicePtr,
        mask: u64,
        grid_done: Option<DevicePtr>,
    ) -> Result<()> {
        let n64 = n as u64;
        // SAFETY: (all) the parameters as the kernels declare them; the rest is the caller's.
        unsafe {
            let Some(done) = grid_done else {
                let threads = block_for(n.div_ceil(16));
                let mut args = [src, dst, n64, gate, mask];
                return self.launch(self.wait_copy_reset, 1, threads, stream, &mut args);
            };
            self.launch(self.wait_gate, 1, 32, stream, &mut [gate, mask])?;
            let (blocks, threads) = grid_for(n);
            let mut args = [src, dst, n64, gate, done];
            self.launch(self.copy_reset, blocks, threads, stream, &mut args)
        }
    }

    /// Enqueue `copy count ids (elem bytes each) -> mailbox ; store count ; ready = 1`, where
    /// `count` is `*count_dev` (clamped) when non-zero, else `max_ids`.
    ///
    /// # Safety
    /// `ids` holds `max_ids` ids of `elem` (4 or 8) bytes, 4-byte aligned; `count_dev` is 0
    /// or a device `int32`; the mailbox addresses are mapped pinned memory large enough;
    /// all outlive every execution (graph replays included); `stream` is live.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn publish_ids(
        &self,
        stream: RawStream,
        ids: DevicePtr,
        max_ids: usize,
        count_dev: DevicePtr,
        elem: usize,
        mailbox_ids: DevicePtr,
        mailbox_count: DevicePtr,
        ready: DevicePtr,
    ) -> Result<()> {
        let threads = block_for(max_ids * elem / 4);
        let (m, e) = (max_ids as u64, elem as u64);
        let mut args = [ids, m, count_dev, e, mailbox_ids, mailbox_count, ready];
        // SAFETY: the parameters as the kernel declares them; the rest is the caller's.
        unsafe { self.launch(self.publish_ids, 1, threads, stream, &mut args) }
    }

    /// Enqueue `ring[2 + 2 * (k % cap) + which] = globaltimer ; counters[which] = k + 1 ;
    /// ring[which] = k + 1` where `k = counters[which]` (see `kernels/rows.cu`).
    ///
    /// # Safety
    /// `counters` is device memory of two u64; `ring` the device address of mapped pinned
    /// memory of `2 + 2 * cap` u64; both outlive every execution of the launch (graph
    /// replays included); `which` is 0 or 1, `cap` > 0; `stream` is live.
    pub unsafe fn stamp(
        &self,
        stream: RawStream,
        counters: DevicePtr,
        ring: DevicePtr,
        which: u64,
        cap: u64,
    ) -> Result<()> {
        let mut args = [counters, ring, which, cap];
        // SAFETY: the parameters as the kernel declares them; the rest is the caller's.
        unsafe { self.launch(self.stamp, 1, 32, stream, &mut args) }
    }
}
