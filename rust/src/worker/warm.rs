//! [`WarmThreads`]: a source's own gather threads held awake while a step is armed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::pace::NAP;

/// A table's own gather threads held awake while a step is armed, so that the fill after
/// READY does not start by waking them.
///
/// Between two decode steps (milliseconds) a pool's threads go to sleep; the fill that
/// follows READY then wakes them one after another, and on a VM each wake of an idle vCPU
/// costs tens of microseconds. Measured on an H200 host (`bench_fill.py --idle-us
/// 7000`, 1,024 rows of 256 B from one adopted 1 GiB table on the pool): 176 us a gather
/// after 7 ms idle against 34-38 us back to back. So when a step is armed and the previous
/// fill ran on the source's own pool, one job a thread is spawned on that pool that naps
/// (20 us sleeps, no spinning) until the worker has seen READY; the threads are then awake
/// and take the gather at once. The jobs end when this value is dropped, and by themselves
/// after [`WARM_MAX`], so a pool thread is never held by a step the GPU does not reach.
/// Another gather on the same table's threads meanwhile (a direct `gather` from another
/// thread) waits for them: at most until READY or [`WARM_MAX`].
pub struct WarmThreads {
    done: Arc<AtomicBool>,
}

/// The longest a warm job naps on a pool thread waiting for READY.
pub const WARM_MAX: Duration = Duration::from_millis(200);

impl WarmThreads {
    pub(super) fn start(pool: &rayon::ThreadPool) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&done);
        pool.spawn_broadcast(move |_| {
            let t0 = Instant::now();
            while !flag.load(Ordering::Acquire) && t0.elapsed() < WARM_MAX {
                std::thread::sleep(NAP);
            }
        });
        Self { done }
    }
}

impl Drop for WarmThreads {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
    }
}
