//! Everything that talks to the CUDA driver. The crate's CUDA `unsafe` code lives here.

pub mod driver;
pub mod pinned;
pub mod stall;

pub use pinned::retained_bytes;
