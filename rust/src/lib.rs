//! ple-memops: let a captured CUDA graph consume embedding rows that the host gathers
//! after the graph was launched.
//!
//! Crate organisation (raw FFI -> thin wrappers -> safe types -> bindings):
//!
//! * [`cuda`]: all CUDA `unsafe` code: the driver loader and `Result`-returning
//!   wrappers over cudarc's `sys`, and the pinned, device-mapped memory types.
//! * [`state`]: the lifecycle as a pure state machine.
//! * [`probe`]: the per-device capability probe.
//! * [`deferred`]: [`DeferredRows`], the safe type the bindings use.
//! * [`table`]: [`MmapTable`], a memory-mapped safetensors table and the native row
//!   gather.
//! * `python` (feature `python`): the PyO3 module `ple_memops._native`; nothing else in
//!   the crate knows about Python.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod cuda;
pub mod deferred;
pub mod error;
mod os;
pub mod probe;
pub mod state;
pub mod table;
mod wait;
pub mod watchdog;
pub mod worker;

#[cfg(feature = "python")]
mod python;

pub use cuda::stall::StallSamples;
pub use deferred::{
    Config, Consumer, CopyPath, DeferredRows, Enqueued, Mode, Stats, Target, KERNEL_MAX_BYTES,
};
pub use error::{Error, ErrorKind, Result};
pub use probe::{probe, Capability, Check};
pub use table::{MmapTable, RowIds, Selector, TableOptions};
pub use worker::{GatherWorker, PublishPath, RowMap, RowSource, WorkerOptions, WorkerStats};
