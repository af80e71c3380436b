//! Everything that talks to the CUDA driver: [`driver`] (the loader, the `Result` wrappers,
//! the RAII handles; the only code that calls cudarc's `sys`), [`pinned`] (page-locked,
//! device-mapped memory) and [`stall`] (the consumer's stall, timed on the GPU).
//!
//! `unsafe` here: every driver call, raw-pointer views of pinned memory, and the
//! `unsafe fn`s that enqueue work on a caller's raw stream. Outside `cuda`, `deferred`,
//! `probe` and `worker` call those `unsafe fn`s, each stating the contract it upholds
//! (see the crate docs).

pub mod driver;
pub mod pinned;
pub mod stall;

pub use pinned::retained_bytes;
