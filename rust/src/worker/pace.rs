//! How the worker's threads wait: hot (spinning, then yielding) for a while, then short
//! naps.

use std::time::Duration;

/// Pure spinning before yielding, while hot.
const SPIN_PAUSE: Duration = Duration::from_micros(50);
/// Sleep between READY checks once a step has waited longer than `spin` (with a fine timer
/// slack: see `os::fine_timer_slack`).
pub(super) const NAP: Duration = Duration::from_micros(20);
/// The sleeps of a predicted wait (`WorkerOptions::predict_ready`): a READY that comes
/// while the worker sleeps is seen at most this late.
pub(super) const SLEEP_CHUNK: Duration = Duration::from_micros(100);

/// When a step's READY is expected (`WorkerOptions::predict_ready`): the arm-to-READY
/// times of the last replays. The worker sleeps until a little before the earliest of
/// them, so a READY earlier than any recent one is the only kind it sees late (by at most
/// [`SLEEP_CHUNK`]), and the next prediction starts from it.
#[derive(Debug, Default)]
pub(super) struct ReadyPredictor {
    leads: [Duration; Self::KEEP],
    len: usize,
    next: usize,
}

impl ReadyPredictor {
    const KEEP: usize = 8;
    /// Replays seen before predicting at all.
    const MIN_SAMPLES: usize = 3;

    pub(super) fn record(&mut self, lead: Duration) {
        self.leads[self.next] = lead;
        self.next = (self.next + 1) % Self::KEEP;
        self.len = (self.len + 1).min(Self::KEEP);
    }

    /// How long after arming to sleep before the hot wait: nine tenths of the earliest
    /// recent lead less 100 us, or `None` (no sleep) with too few samples or under two
    /// sleep chunks to sleep.
    pub(super) fn sleep_for(&self) -> Option<Duration> {
        if self.len < Self::MIN_SAMPLES {
            return None;
        }
        let earliest = self.leads[..self.len].iter().min()?;
        let sleep = earliest
            .mul_f64(0.9)
            .saturating_sub(Duration::from_micros(100));
        (sleep >= 2 * SLEEP_CHUNK).then_some(sleep)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn predicts_only_from_enough_replays() {
        let mut p = ReadyPredictor::default();
        p.record(5 * MS);
        p.record(5 * MS);
        assert_eq!(p.sleep_for(), None);
        p.record(5 * MS);
        assert_eq!(p.sleep_for(), Some(Duration::from_micros(4400)));
    }

    #[test]
    fn the_earliest_recent_lead_rules_and_ages_out() {
        let mut p = ReadyPredictor::default();
        for _ in 0..3 {
            p.record(5 * MS);
        }
        p.record(2 * MS); // one early READY: the next waits sleep less
        assert_eq!(p.sleep_for(), Some(Duration::from_micros(1700)));
        for _ in 0..ReadyPredictor::KEEP - 1 {
            p.record(5 * MS);
        }
        assert_eq!(p.sleep_for(), Some(Duration::from_micros(1700)));
        p.record(5 * MS); // eight later, it is forgotten
        assert_eq!(p.sleep_for(), Some(Duration::from_micros(4400)));
    }

    #[test]
    fn no_sleep_when_the_host_is_not_ahead() {
        let mut p = ReadyPredictor::default();
        for lead in [5 * MS, 5 * MS, Duration::from_micros(150)] {
            p.record(lead);
        }
        assert_eq!(p.sleep_for(), None); // READY came almost at arming: nothing to sleep
    }
}
