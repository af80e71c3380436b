//! ple-memops: let a captured CUDA graph consume embedding rows that the host gathers
//! after the graph was launched.
//!
//! Crate organisation (raw FFI -> thin wrappers -> safe types -> bindings):
//!
//! * [`cuda`]: everything that talks to the CUDA driver: the loader, the `Result`
//!   wrappers over cudarc's `sys` and the RAII handles ([`cuda::driver`]), the pinned,
//!   device-mapped memory types, the stall clock.
//! * [`state`]: the lifecycle as a pure state machine.
//! * [`probe`](mod@probe): the per-device capability probe.
//! * [`deferred`]: [`DeferredRows`], the safe type the bindings use.
//! * [`worker`]: [`GatherWorker`], device-produced ids gathered on a native thread.
//! * [`table`]: [`MmapTable`], a memory-mapped safetensors table and the native row
//!   gather.
//! * [`watchdog`], [`error`], and two private helpers: `os` (the page size, the timer
//!   slack) and `wait` (a bounded spin-yield-sleep wait).
//! * `python` (feature `python`): the PyO3 module `ple_memops._native`; nothing else in
//!   the crate knows about Python.
//!
//! # Where the `unsafe` code is
//!
//! Every `unsafe` block carries a `// SAFETY:` comment (`clippy::undocumented_unsafe_blocks`
//! is denied) and `unsafe fn` bodies still need blocks (`unsafe_op_in_unsafe_fn` is
//! denied). It lives in:
//!
//! * `cuda`: every driver call (`cuda::driver`, the only code that calls cudarc's `sys`),
//!   `Send`/`Sync` for driver handles, raw-pointer views of pinned memory
//!   (`cuda::pinned`), the stall clock's launches (`cuda::stall`).
//! * The edges of the safe types, where the caller vouches for what Rust cannot check:
//!   [`Stream::from_raw`] (a raw stream handle, vouched for once: every method taking a
//!   [`Stream`] is then safe), [`DeferredRows::new`] (a raw staging buffer) and
//!   [`GatherWorker::publish`] (device addresses of ids), and the driver calls and staging
//!   writes behind them (`deferred`, which also declares its shared state `Send`/`Sync`
//!   and writes a fill's rows into the slot outside its lock, and `worker`'s
//!   `mailbox.rs`); the probe's live run on its own stream (`probe`).
//! * `table`: mapping the file (`discover`), page-cache system calls (`pagecache`), the
//!   SIGBUS handler (`sigbus`), io_uring submissions (`coldread`; `floor`'s benchmark
//!   instruments, with `posix_fadvise`), cache prefetch hints (`gather`).
//! * `os`: `sysconf` and `prctl`.
//! * `python`: the streams and pointers torch hands over, made [`Stream`]s (`stream_of`)
//!   and passed to those `unsafe fn`s.
//!
//! None in `state`, `watchdog`, `wait`, `error`, `table`'s `mod.rs` and `residency`, or
//! `worker` outside `mailbox.rs` (and its tests' host buffers).

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

pub use cuda::driver::Stream;
pub use cuda::stall::StallSamples;
pub use deferred::{
    Config, Consumer, CopyPath, DeferredRows, Enqueued, Mode, Stats, Target, KERNEL_MAX_BYTES,
};
pub use error::{Error, ErrorKind, Result};
pub use probe::{probe, Capability, Check};
pub use table::{MmapTable, RowIds, Selector, TableOptions};
pub use worker::{
    Advanced, GatherWorker, PublishPath, RowMap, RowSource, StepCounts, StepTable, Steps,
    WorkerOptions, WorkerStats,
};
