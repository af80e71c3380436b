//! The CUDA driver API (cudarc's `sys`, loaded at run time), in three layers as cudarc
//! arranges its own (`sys` -> `result` -> `safe`):
//!
//! * [`loader`]: opens `libcuda` itself, checks every symbol the crate calls and the
//!   driver version, and calls `cuInit` ([`driver`]). cudarc panics when the library or a
//!   symbol is missing; every call below goes through [`driver`] first, so no cudarc
//!   panic is reachable.
//! * [`result`]: thin wrappers that turn each driver call's status into [`crate::Error`]
//!   (device attributes, mapped host memory, the stream memory operations, async copies,
//!   capture state). Those that enqueue work on a raw stream are `unsafe fn`s: the caller
//!   vouches for the stream and for the memory outliving every execution.
//! * [`handles`] and [`kernels`]: RAII owners of driver objects (the retained primary
//!   context and its binding guard, events, private streams, graphs, device buffers) and
//!   the protocol's kernels, loaded once per device.
//!
//! Only these files call cudarc's `sys`. The crate's other `unsafe` code that touches
//! driver-owned memory or streams (`pinned`, `stall`, and outside `cuda`: `deferred`,
//! `probe`, `worker`) calls the wrappers here and states at each call the contract it
//! upholds.

pub mod handles;
pub mod kernels;
pub mod loader;
pub mod result;

pub use handles::{CtxGuard, PrimaryContext};
pub(crate) use handles::{DeviceBuffer, Event, OwnedStream};
pub(crate) use kernels::Kernels;
pub use loader::{driver, fmt_version, DriverInfo, MIN_DRIVER_VERSION};
pub use result::{attribute, is_unsupported_code, Attr, DevicePtr, RawStream, Stream};
pub(crate) use result::{
    capture_id, copy_d2h_async, copy_h2d_async, host_alloc_mapped, host_device_pointer, host_free,
    wait_any_bit64, write_u32,
};
