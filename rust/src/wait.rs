//! Waiting for a condition another thread (or the GPU) sets: spin, then yield, then short
//! sleeps, bounded by a timeout. Shared by [`deferred`](crate::deferred) (waiting for the
//! GPU's reset of the flag) and [`probe`](mod@crate::probe) (waiting for the live run's
//! stream).

use std::time::{Duration, Instant};

const SPIN: Duration = Duration::from_micros(50);

/// Spin, then yield, then sleep briefly until `ready()` or `timeout`.
pub(crate) fn wait_until(timeout: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    loop {
        if ready() {
            return true;
        }
        let e = t0.elapsed();
        if e >= timeout {
            return false;
        }
        if e < SPIN {
            std::hint::spin_loop();
        } else if e < SPIN * 20 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}
