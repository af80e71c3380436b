//! How the worker's threads wait: hot (spinning, then yielding) for a while, then short
//! naps.

use std::time::Duration;

/// Pure spinning before yielding, while hot.
const SPIN_PAUSE: Duration = Duration::from_micros(50);
/// Sleep between READY checks once a step has waited longer than `spin` (with a fine timer
/// slack: see `os::fine_timer_slack`).
pub(super) const NAP: Duration = Duration::from_micros(20);
/// How often an idle (cold) worker looks for a READY nobody armed it for.
pub(super) const IDLE_POLL: Duration = Duration::from_millis(1);

/// Wait politely: spin, then yield, for the first `spin`; then `nap`.
pub(super) fn pause(waited: Duration, spin: Duration, nap: Duration) {
    if waited < SPIN_PAUSE.min(spin) {
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    } else if waited < spin {
        std::thread::yield_now();
    } else {
        std::thread::sleep(nap);
    }
}
