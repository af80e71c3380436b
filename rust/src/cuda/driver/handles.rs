//! RAII owners of driver objects: each releases what it holds on drop (a primary context,
//! a context binding, an event, a stream, a graph, device memory).

use std::ptr;

use cudarc::driver::sys;

use super::result::{check, device, DevicePtr, RawStream};
use crate::error::Result;

/// A retained primary context (the one torch's runtime uses). Released on drop.
#[derive(Debug)]
pub struct PrimaryContext {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be used from any thread; the driver is thread-safe.
unsafe impl Send for PrimaryContext {}
// SAFETY: as above; `&PrimaryContext` only hands out pushes of the handle.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    pub fn retain(ordinal: i32) -> Result<Self> {
        let dev = device(ordinal)?;
        let mut ctx = ptr::null_mut();
        // SAFETY: valid device and out-pointer.
        check("cuDevicePrimaryCtxRetain", Some(ordinal), unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        Ok(Self { ordinal, dev, ctx })
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Make this context current on the calling thread until the guard drops (a no-op
    /// when it already is, as on a torch thread).
    pub fn bind(&self) -> Result<CtxGuard> {
        let mut cur = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuCtxGetCurrent", Some(self.ordinal), unsafe {
            sys::cuCtxGetCurrent(&mut cur)
        })?;
        if cur == self.ctx {
            return Ok(CtxGuard { pushed: false });
        }
        // SAFETY: self.ctx is a live retained context.
        check("cuCtxPushCurrent_v2", Some(self.ordinal), unsafe {
            sys::cuCtxPushCurrent_v2(self.ctx)
        })?;
        Ok(CtxGuard { pushed: true })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balanced with the retain in `retain`. The result is ignored on purpose:
        // at interpreter exit the driver may already be deinitialised.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// Pops a context pushed by [`PrimaryContext::bind`].
pub struct CtxGuard {
    pushed: bool,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old = ptr::null_mut();
            // SAFETY: balanced with the push in `bind` on this thread.
            let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
        }
    }
}

/// A CUDA event used to learn when an eager copy finished. Destroyed on drop.
#[derive(Debug)]
pub(crate) struct Event {
    ev: sys::CUevent,
    ordinal: i32,
}

// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(ordinal: i32) -> Result<Self> {
        let mut ev = ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer; caller holds a current context.
        check("cuEventCreate", Some(ordinal), unsafe {
            sys::cuEventCreate(&mut ev, flags)
        })?;
        Ok(Self { ev, ordinal })
    }

    /// # Safety
    /// `stream` is a live stream of the event's context that is not capturing.
    pub unsafe fn record(&self, stream: RawStream) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuEventRecord", Some(self.ordinal), unsafe {
            sys::cuEventRecord(self.ev, stream)
        })
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: live event.
        check("cuEventSynchronize", Some(self.ordinal), unsafe {
            sys::cuEventSynchronize(self.ev)
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: live event, destroyed once; failure at exit is harmless.
        let _ = unsafe { sys::cuEventDestroy_v2(self.ev) };
    }
}

/// A private stream (probe and tests). Destroyed on drop.
pub(crate) struct OwnedStream {
    pub raw: RawStream,
    ordinal: i32,
}

impl OwnedStream {
    pub fn new(ordinal: i32) -> Result<Self> {
        let mut s = ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; caller holds a current context.
        check("cuStreamCreate", Some(ordinal), unsafe {
            sys::cuStreamCreate(&mut s, flags)
        })?;
        Ok(Self { raw: s, ordinal })
    }

    /// `Ok(true)` when all work is done, `Ok(false)` while some is pending.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: live stream.
        let r = unsafe { sys::cuStreamQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", Some(self.ordinal), r).map(|_| true)
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: live stream.
        check("cuStreamSynchronize", Some(self.ordinal), unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }

    pub fn begin_capture(&self) -> Result<()> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: live, non-capturing stream.
        check("cuStreamBeginCapture_v2", Some(self.ordinal), unsafe {
            sys::cuStreamBeginCapture_v2(self.raw, mode)
        })
    }

    pub fn end_capture(&self) -> Result<Graph> {
        let mut g = ptr::null_mut();
        // SAFETY: live stream in capture; valid out-pointer.
        check("cuStreamEndCapture", Some(self.ordinal), unsafe {
            sys::cuStreamEndCapture(self.raw, &mut g)
        })?;
        let mut exec = ptr::null_mut();
        // SAFETY: g is the graph just captured; valid out-pointer.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, g, 0) };
        if let Err(e) = check("cuGraphInstantiateWithFlags", Some(self.ordinal), r) {
            // SAFETY: g is live and owned here.
            let _ = unsafe { sys::cuGraphDestroy(g) };
            return Err(e);
        }
        Ok(Graph {
            graph: g,
            exec,
            ordinal: self.ordinal,
        })
    }

    /// Synchronous device-to-host read (tests and probe only).
    pub fn read_device(&self, src: DevicePtr, out: &mut [u8]) -> Result<()> {
        self.synchronize()?;
        // SAFETY: `out` is a valid host buffer of out.len() bytes; src is device memory
        // at least that long (callers allocate it with DeviceBuffer).
        check("cuMemcpyDtoH_v2", Some(self.ordinal), unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, out.len())
        })
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: live stream, destroyed once.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
    }
}

/// An instantiated graph (probe only).
pub(crate) struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ordinal: i32,
}

impl Graph {
    pub fn launch(&self, stream: &OwnedStream) -> Result<()> {
        // SAFETY: live executable graph and stream.
        check("cuGraphLaunch", Some(self.ordinal), unsafe {
            sys::cuGraphLaunch(self.exec, stream.raw)
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles live and owned here.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

/// Device memory (the probe's, the stall clock's counters). Freed on drop unless retained.
pub(crate) struct DeviceBuffer {
    pub ptr: DevicePtr,
    retained: bool,
}

impl DeviceBuffer {
    pub fn new(bytes: usize, ordinal: i32) -> Result<Self> {
        let mut p = 0;
        // SAFETY: valid out-pointer; caller holds a current context.
        check("cuMemAlloc_v2", Some(ordinal), unsafe {
            sys::cuMemAlloc_v2(&mut p, bytes.max(1))
        })?;
        Ok(Self {
            ptr: p,
            retained: false,
        })
    }

    /// `bytes` zero bytes from the start (synchronous). Needs a current context.
    pub fn zero(&self, bytes: usize, ordinal: i32) -> Result<()> {
        // SAFETY: `ptr` is a live allocation of at least `bytes` bytes (the caller sized it).
        check("cuMemsetD8_v2", Some(ordinal), unsafe {
            sys::cuMemsetD8_v2(self.ptr, 0, bytes)
        })
    }

    /// Never free this allocation: a captured graph may still replay against it.
    pub fn retain_forever(&mut self) {
        self.retained = true;
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.retained {
            return;
        }
        // SAFETY: allocated by cuMemAlloc, freed once; owners synchronise before dropping.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}
