//! Loading the driver: open `libcuda` with cudarc's own candidate names in cudarc's order
//! (so both land on the same file), check every symbol this crate calls, read the driver
//! version and call `cuInit`. Only after that succeeds does any other cudarc call happen,
//! so a missing or old driver is an `Unsupported` error, never a cudarc panic.

use std::ffi::{c_void, CStr};
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{Error, Result};

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

pub(super) fn error_name(r: sys::CUresult) -> String {
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
