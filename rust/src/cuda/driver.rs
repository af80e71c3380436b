//! Thin, `Result`-returning wrappers over the CUDA driver API (cudarc's `sys`, loaded at
//! run time). This file and `pinned.rs` hold all of the crate's CUDA `unsafe` code.
//!
//! cudarc panics when `libcuda` cannot be loaded or a symbol is missing. [`driver`]
//! therefore opens the library itself first, with cudarc's own candidate names in
//! cudarc's order (so both land on the same file), checks every symbol this crate calls,
//! and reads the driver version. Only after that succeeds does any cudarc call happen;
//! every wrapper below goes through [`driver`] first, so no cudarc panic is reachable.

use std::ffi::{c_void, CStr};
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{Error, Result};

pub use sys::CUstream as RawStream;
pub type DevicePtr = sys::CUdeviceptr;

/// The oldest driver this crate runs on: the cudarc feature level it was built with
/// (`cuda-12000`), which is also where the `_v2` stream memory operations became default.
pub const MIN_DRIVER_VERSION: i32 = 12000;

/// Every driver symbol the crate calls. Checked up front so that cudarc never panics.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamQuery",
    "cuStreamSynchronize",
    "cuStreamWaitValue64_v2",
    "cuStreamWriteValue32_v2",
    "cuStreamIsCapturing",
    "cuStreamGetCaptureInfo_v2",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

/// What the loader found.
#[derive(Debug, Clone)]
pub struct DriverInfo {
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub version: i32,
    /// The file name that opened.
    pub library: String,
    /// Number of CUDA devices (after `cuInit`).
    pub device_count: i32,
}

static DRIVER: OnceLock<std::result::Result<DriverInfo, String>> = OnceLock::new();

/// Load and initialise the driver once. `Err(Unsupported)` says why it cannot be used.
pub fn driver() -> Result<&'static DriverInfo> {
    DRIVER
        .get_or_init(load_driver)
        .as_ref()
        .map_err(|reason| Error::unsupported(reason.clone()))
}

fn load_driver() -> std::result::Result<DriverInfo, String> {
    if let Ok(v) = std::env::var("PLE_MEMOPS_DISABLE_CUDA") {
        if !v.is_empty() && v != "0" {
            return Err("disabled by PLE_MEMOPS_DISABLE_CUDA".into());
        }
    }
    let mut candidates = cudarc::get_lib_name_candidates("cuda");
    let mut seen = std::collections::HashSet::new();
    candidates.retain(|c| seen.insert(c.clone()));
    let mut opened = None;
    for name in &candidates {
        // SAFETY: loading libcuda runs its initialisers, which have no preconditions; this
        // is the same load cudarc performs, in the same order of names.
        if let Ok(lib) = unsafe { libloading::Library::new(name) } {
            opened = Some((name.clone(), lib));
            break;
        }
    }
    let Some((library, lib)) = opened else {
        return Err(format!(
            "the CUDA driver library (libcuda) could not be loaded; tried {}",
            candidates.join(", ")
        ));
    };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        // SAFETY: only the symbol's presence is checked; the pointer is never called here.
        .filter(|s| unsafe { lib.get::<*const c_void>(s.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "driver {library} lacks {}: it is older than CUDA 12.0",
            missing.join(", ")
        ));
    }
    let mut version = 0;
    // SAFETY: the symbol exists (checked above); the out-pointer is a valid i32.
    let r = unsafe { sys::cuDriverGetVersion(&mut version) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuDriverGetVersion failed: {r:?}"));
    }
    if version < MIN_DRIVER_VERSION {
        return Err(format!(
            "driver version {} is older than the required {}",
            fmt_version(version),
            fmt_version(MIN_DRIVER_VERSION)
        ));
    }
    // SAFETY: cuInit takes a flags word that must be 0.
    let r = unsafe { sys::cuInit(0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "cuInit failed: {} (no usable CUDA device?)",
            error_name(r)
        ));
    }
    let mut count = 0;
    // SAFETY: valid out-pointer; cuInit succeeded.
    let r = unsafe { sys::cuDeviceGetCount(&mut count) };
    if r != sys::CUresult::CUDA_SUCCESS || count == 0 {
        return Err("no CUDA device present".into());
    }
    // Keep the library loaded for the life of the process (cudarc holds its own handle).
    std::mem::forget(lib);
    Ok(DriverInfo {
        version,
        library,
        device_count: count,
    })
}

/// `13000` -> `"13.0"`.
pub fn fmt_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

fn error_name(r: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = ptr::null();
    // SAFETY: only called after the driver library was found to export cuGetErrorName;
    // the out-pointer is valid and, on success, points to a static NUL-terminated string.
    let ok = unsafe { sys::cuGetErrorName(r, &mut p) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: see above; the driver owns the string for the life of the process.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    }
}

fn check(call: &'static str, device: Option<i32>, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver {
            call,
            device,
            code: r as u32,
            name: error_name(r),
        })
    }
}

/// True for the result codes that mean "this cannot work here" rather than a fault.
pub fn is_unsupported_code(e: &Error) -> bool {
    matches!(e, Error::Driver { name, .. } if matches!(name.as_str(),
        "CUDA_ERROR_NOT_SUPPORTED" | "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
        | "CUDA_ERROR_NOT_PERMITTED" | "CUDA_ERROR_INVALID_DEVICE"))
}

/// A device attribute we read. With CUDA 12 headers the memop attributes are the `_v2` ones
/// (122, 123); the `_V1` numbers 92..94 describe the retired v1 API and read 0 on Hopper.
#[derive(Debug, Clone, Copy)]
pub enum Attr {
    CanMapHostMemory,
    UnifiedAddressing,
    HostPointerForRegisteredMem,
    StreamMemOps64,
    WaitValueNor,
}

impl Attr {
    fn raw(self) -> sys::CUdevice_attribute {
        use sys::CUdevice_attribute as A;
        match self {
            Attr::CanMapHostMemory => A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY,
            Attr::UnifiedAddressing => A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
            Attr::HostPointerForRegisteredMem => {
                A::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
            }
            Attr::StreamMemOps64 => A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
            Attr::WaitValueNor => A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR,
        }
    }
}

/// Read one attribute of device `ordinal`.
pub fn attribute(ordinal: i32, attr: Attr) -> Result<i32> {
    let dev = device(ordinal)?;
    let mut v = 0;
    // SAFETY: valid device handle and out-pointer.
    check("cuDeviceGetAttribute", Some(ordinal), unsafe {
        sys::cuDeviceGetAttribute(&mut v, attr.raw(), dev)
    })?;
    Ok(v)
}

fn device(ordinal: i32) -> Result<sys::CUdevice> {
    let info = driver()?;
    if ordinal < 0 || ordinal >= info.device_count {
        return Err(Error::invalid(format!(
            "device cuda:{ordinal} does not exist ({} device(s) present)",
            info.device_count
        )));
    }
    let mut dev = 0;
    // SAFETY: ordinal in range; valid out-pointer.
    check("cuDeviceGet", Some(ordinal), unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
}

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

/// Allocate `bytes` of page-locked host memory mapped into every context's address space.
/// Needs a current context.
pub(crate) fn host_alloc_mapped(bytes: usize, ordinal: i32) -> Result<*mut u8> {
    let mut p: *mut c_void = ptr::null_mut();
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    // SAFETY: valid out-pointer; the caller holds a current context.
    check("cuMemHostAlloc", Some(ordinal), unsafe {
        sys::cuMemHostAlloc(&mut p, bytes.max(1), flags)
    })?;
    Ok(p.cast())
}

/// # Safety
/// `p` came from [`host_alloc_mapped`], is freed once, and nothing (a queued copy, a
/// live graph) can still read it.
pub(crate) unsafe fn host_free(p: *mut u8) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemFreeHost", None, unsafe {
        sys::cuMemFreeHost(p.cast())
    })
}

/// The device address of mapped host memory.
pub(crate) fn host_device_pointer(p: *mut u8, ordinal: i32) -> Result<DevicePtr> {
    let mut d: DevicePtr = 0;
    // SAFETY: p is a mapped pinned allocation; valid out-pointer; flags must be 0.
    check("cuMemHostGetDevicePointer_v2", Some(ordinal), unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut d, p.cast(), 0)
    })?;
    Ok(d)
}

/// Enqueue `WAIT until (*addr & mask) != 0` (64-bit) on `stream`.
///
/// # Safety
/// `addr` is a device address of memory that outlives every execution of this operation
/// (including replays of any graph the stream is capturing into).
pub(crate) unsafe fn wait_any_bit64(
    stream: RawStream,
    addr: DevicePtr,
    mask: u64,
    ordinal: i32,
) -> Result<()> {
    let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_AND as u32;
    // SAFETY: the caller's contract; stream is a live handle owned by the caller.
    check("cuStreamWaitValue64_v2", Some(ordinal), unsafe {
        sys::cuStreamWaitValue64_v2(stream, addr, mask, flags)
    })
}

/// Enqueue a 32-bit write of `value` to `addr`, ordered after prior work on `stream`.
///
/// # Safety
/// As for [`wait_any_bit64`].
pub(crate) unsafe fn write_u32(
    stream: RawStream,
    addr: DevicePtr,
    value: u32,
    ordinal: i32,
) -> Result<()> {
    let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // SAFETY: the caller's contract.
    check("cuStreamWriteValue32_v2", Some(ordinal), unsafe {
        sys::cuStreamWriteValue32_v2(stream, addr, value, flags)
    })
}

/// Enqueue an asynchronous copy of `bytes` from pinned host memory to device memory.
///
/// # Safety
/// `src` is pinned and `bytes` long, `dst` is device memory `bytes` long, and both outlive
/// every execution of the copy (graph replays included).
pub(crate) unsafe fn copy_h2d_async(
    dst: DevicePtr,
    src: *const u8,
    bytes: usize,
    stream: RawStream,
    ordinal: i32,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemcpyHtoDAsync_v2", Some(ordinal), unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream)
    })
}

/// Capture state of a stream: `None` when not capturing, else the capture's id.
///
/// # Safety
/// `stream` is a live stream handle (or null for the legacy stream) of a current context.
pub(crate) unsafe fn capture_id(stream: RawStream, ordinal: i32) -> Result<Option<u64>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: u64 = 0;
    // SAFETY: the caller's contract; the optional out-pointers may be null.
    check("cuStreamGetCaptureInfo_v2", Some(ordinal), unsafe {
        sys::cuStreamGetCaptureInfo_v2(
            stream,
            &mut status,
            &mut id,
            ptr::null_mut(),
            ptr::null_mut(),
            ptr::null_mut(),
        )
    })?;
    match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(None),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(Some(id)),
        _ => Err(Error::Driver {
            call: "cuStreamGetCaptureInfo_v2",
            device: Some(ordinal),
            code: sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED as u32,
            name: "capture on this stream was invalidated".into(),
        }),
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

/// The protocol's kernels (`kernels/rows.cu`), loaded once per device into its primary
/// context and never unloaded: captured graphs keep launching them for their whole life.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernels {
    wait_copy_reset: sys::CUfunction,
    publish_ids: sys::CUfunction,
    stamp: sys::CUfunction,
    ordinal: i32,
}

// SAFETY: CUfunction handles may be used from any thread of their context.
unsafe impl Send for Kernels {}
// SAFETY: as above; the handles are immutable.
unsafe impl Sync for Kernels {}

const ROWS_PTX: &str = concat!(include_str!("kernels/rows.ptx"), "\0");

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
            publish_ids: get(c"ple_publish_ids")?,
            stamp: get(c"ple_stamp")?,
            ordinal,
        };
        map.insert(ordinal, k);
        Ok(k)
    }

    /// # Safety
    /// `params` point at values matching the kernel's parameters; the caller's contract of
    /// the public launch functions holds.
    unsafe fn launch(
        &self,
        f: sys::CUfunction,
        threads: u32,
        stream: RawStream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract; the driver copies the parameter values.
        check("cuLaunchKernel", Some(self.ordinal), unsafe {
            sys::cuLaunchKernel(
                f,
                1,
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
    /// as one single-block kernel on `stream`.
    ///
    /// # Safety
    /// `src` (the slot's device address) and `dst` hold `n` bytes and are 16-byte aligned;
    /// `gate` is the flag line's device address; all outlive every execution of the launch
    /// (graph replays included); `stream` is live.
    pub unsafe fn wait_copy_reset(
        &self,
        stream: RawStream,
        src: DevicePtr,
        dst: DevicePtr,
        n: usize,
        gate: DevicePtr,
        mask: u64,
    ) -> Result<()> {
        let (mut a, mut b, mut c, mut d, mut e) = (src, dst, n as u64, gate, mask);
        let mut params: [*mut c_void; 5] = [
            (&mut a as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut c as *mut u64).cast(),
            (&mut d as *mut u64).cast(),
            (&mut e as *mut u64).cast(),
        ];
        // SAFETY: five 8-byte parameters, as the kernel declares; the rest is the caller's.
        unsafe {
            self.launch(
                self.wait_copy_reset,
                block_for(n.div_ceil(16)),
                stream,
                &mut params,
            )
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
        let (mut a, mut b, mut c, mut d) = (ids, max_ids as u64, count_dev, elem as u64);
        let (mut e, mut f, mut g) = (mailbox_ids, mailbox_count, ready);
        let mut params: [*mut c_void; 7] = [
            (&mut a as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut c as *mut u64).cast(),
            (&mut d as *mut u64).cast(),
            (&mut e as *mut u64).cast(),
            (&mut f as *mut u64).cast(),
            (&mut g as *mut u64).cast(),
        ];
        // SAFETY: seven 8-byte parameters, as the kernel declares; the rest is the caller's.
        unsafe {
            self.launch(
                self.publish_ids,
                block_for(max_ids * elem / 4),
                stream,
                &mut params,
            )
        }
    }
}

impl Kernels {
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
        let (mut a, mut b, mut c, mut d) = (counters, ring, which, cap);
        let mut params: [*mut c_void; 4] = [
            (&mut a as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut c as *mut u64).cast(),
            (&mut d as *mut u64).cast(),
        ];
        // SAFETY: four 8-byte parameters, as the kernel declares; the rest is the caller's.
        unsafe { self.launch(self.stamp, 32, stream, &mut params) }
    }
}

/// Enqueue an asynchronous copy of `bytes` from device memory to mapped pinned memory.
///
/// # Safety
/// `dst` is pinned host memory and `src` device memory, both `bytes` long, outliving every
/// execution of the copy (graph replays included); `stream` is live.
pub(crate) unsafe fn copy_d2h_async(
    dst: *mut u8,
    src: DevicePtr,
    bytes: usize,
    stream: RawStream,
    ordinal: i32,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemcpyDtoHAsync_v2", Some(ordinal), unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream)
    })
}
