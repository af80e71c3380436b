//! Thin, `Result`-returning wrappers over single driver calls. Each checks the call's
//! status and names the call and the device in its error; none owns anything (see
//! [`super::handles`] for the owners).

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;

use super::loader::{driver, error_name};
use crate::error::{Error, Result};

pub use sys::CUstream as RawStream;
pub type DevicePtr = sys::CUdeviceptr;

/// A CUDA stream its holder vouches for: built once, unsafely, from a raw handle (torch's
/// stream, say), so that the methods taking it ([`crate::DeferredRows::enqueue`],
/// [`crate::DeferredRows::fill`], ...) are safe. Copy it freely; it owns nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream(RawStream);

// SAFETY: a stream handle is an opaque driver handle that any thread of its context may
// use (the driver synchronises its own state); `Stream` owns nothing and never frees it.
unsafe impl Send for Stream {}
// SAFETY: as above; the handle is never written through.
unsafe impl Sync for Stream {}

impl Stream {
    /// The legacy default stream (a null handle): always live.
    pub const LEGACY_DEFAULT: Stream = Stream(ptr::null_mut());

    /// # Safety
    /// `raw` is a live stream (or null, the legacy default stream) of the device of every
    /// object it is passed to, and stays live while work enqueued on it through them can
    /// still run (a graph captured on it: for the graph's life).
    pub unsafe fn from_raw(raw: RawStream) -> Self {
        Self(raw)
    }

    /// The raw handle.
    pub fn raw(self) -> RawStream {
        self.0
    }
}

pub(super) fn check(call: &'static str, device: Option<i32>, r: sys::CUresult) -> Result<()> {
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

pub(super) fn device(ordinal: i32) -> Result<sys::CUdevice> {
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
/// The write is preceded by a memory barrier (system scope, for the stream): the v2 API
/// has no write without it (`CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER` is v1 only, and the
/// H200's driver offers no v1 stream memory operations).
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
