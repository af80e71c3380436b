//! The worker thread: wait for an armed step and its READY, map the ids, gather, store
//! FILLED; release what nobody armed.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::options::IDLE_NAP;
use super::pace::{pause, ReadyPredictor, NAP, SLEEP_CHUNK};
use super::shared::{Ctl, Shared};
use super::turn::Waited;
use super::warm::WarmThreads;
use crate::error::{Error, Op, Result};

impl Shared {
    /// The next armed step to fill, with the ids the host expects of it if any (taken
    /// under the same lock); `None` once stopped. While nothing is armed, stay hot for
    /// `spin` (a serving loop arms the next step within milliseconds), nap for
    /// `idle_naps` (arming costs the host no wake-up), then block until armed, waking
    /// every `idle_poll`. Any READY seen meanwhile came from a replay
    /// that nobody armed this worker for: release it (see [`Self::unarmed_replay`]).
    pub(super) fn next_step(&self) -> Option<(u64, Option<Vec<i64>>)> {
        let t0 = Instant::now();
        loop {
            let mut ctl = self.ctl();
            if self.stop.load(Ordering::Acquire) {
                return None;
            }
            if let Some(s) = ctl.next_to_fill() {
                return Some((s, ctl.take_expected(s)));
            }
            // Holding `ctl`, nothing armed: a begin() for the ids now in the mailbox would
            // have had to happen before its replay was launched, i.e. before READY.
            if self.mailbox().is_ready() {
                self.unarmed_replay(&mut ctl);
                continue;
            }
            let waited = t0.elapsed();
            let window = self.opts.spin + self.opts.idle_naps;
            if waited >= window {
                // Set under `ctl`, which begin() holds to arm: it notifies iff it saw this.
                ctl.idle = true;
                let (mut ctl, _) = self
                    .cv
                    .wait_timeout(ctl, self.opts.idle_poll)
                    .unwrap_or_else(|e| e.into_inner());
                ctl.idle = false;
                continue;
            }
            let handled = ctl.handled;
            drop(ctl);
            // Hot, then napping: poll the lock-free words until something changes (or
            // the window ends).
            while self.armed_seq.load(Ordering::Acquire) <= handled
                && !self.mailbox().is_ready()
                && !self.stop.load(Ordering::Acquire)
                && t0.elapsed() < window
            {
                pause(t0.elapsed(), self.opts.spin, IDLE_NAP);
            }
        }
    }

    /// READY with no step armed: take the ids, release the GPU with zero rows, poison the
    /// rows and record the typed error for the next call.
    pub(super) fn unarmed_replay(&self, ctl: &mut Ctl) {
        let mut scratch = Vec::new();
        let count = self.mailbox().take(&mut scratch);
        ctl.stats.unarmed_replays += 1;
        if self.rows.is_released() {
            // Already aborted or closed: the gate is open for good and the cause recorded.
            return;
        }
        let detail = format!(
            "a graph replay published {count} ids with no step armed (replayed without begin()); its consumer was released with zero rows, never another step's"
        );
        self.rows
            .release_unaccounted(&format!("gather worker: {detail}"));
        ctl.stats.failures += 1;
        if ctl.failure.is_none() {
            ctl.failure = Some(Error::UnarmedReplay { detail });
        }
        self.cv.notify_all();
    }

    /// Poll for READY while a step is armed: asleep until `sleep_until` when given (in
    /// chunks of [`SLEEP_CHUNK`], READY checked between them), then hot for `spin`, then
    /// short naps. Returns whether READY came, and whether it came while asleep; not
    /// ready if the rows were released or the worker stopped.
    pub(super) fn wait_ready(&self, sleep_until: Option<Instant>) -> (bool, bool) {
        if let Some(until) = sleep_until {
            loop {
                if self.mailbox().is_ready() {
                    return (true, true);
                }
                if self.stop.load(Ordering::Acquire) || self.rows.is_released() {
                    return (false, false);
                }
                let now = Instant::now();
                if now >= until {
                    break;
                }
                std::thread::sleep((until - now).min(SLEEP_CHUNK));
            }
        }
        (self.wait_ready_hot(), false)
    }

    fn wait_ready_hot(&self) -> bool {
        let t0 = Instant::now();
        loop {
            if self.mailbox().is_ready() {
                return true;
            }
            if self.stop.load(Ordering::Acquire) || self.rows.is_released() {
                return false;
            }
            pause(t0.elapsed(), self.opts.spin, NAP);
        }
    }

    /// The wait for this worker's turn among its step object's tables before a step's
    /// reads from storage: once a step (`waited` keeps what it did), nothing without a
    /// place in a read order. A step given up meanwhile (stopping, its rows released) is
    /// not read: the rows' cause is the error.
    fn before_reads<'a>(
        &'a self,
        waited: &'a mut Option<Waited>,
    ) -> impl FnMut(usize) -> Result<()> + 'a {
        move |reads| {
            let Some(place) = self.place.get() else {
                return Ok(());
            };
            if waited.is_none() {
                *waited = Some(place.wait(reads, || self.giving_up()));
            }
            if self.giving_up() {
                return Err(self.given_up());
            }
            Ok(())
        }
    }

    /// Why a step was given up: its rows' abort cause, else closed.
    fn given_up(&self) -> Error {
        self.rows
            .poison_cause()
            .map_or(Error::Closed, |cause| Error::Poisoned { cause })
    }

    /// The worker saw READY of its step (for the tables after it in a read order).
    fn saw_ready(&self) {
        if let Some(p) = self.place.get() {
            p.saw_ready();
        }
    }

    /// The worker is done with its step: mark it handled and pass its turn, under `ctl`.
    fn handled(&self, ctl: &mut Ctl, step: u64, waited: Option<Waited>) {
        ctl.handled = ctl.handled.max(step);
        if let Some(p) = self.place.get() {
            p.done();
        }
        if let Some(w) = waited.filter(|w| w.ns > 0 || w.passed_over) {
            let st = &mut ctl.stats;
            st.ordered_waits += u64::from(w.ns > 0);
            st.ordered_wait_ns_total += w.ns;
            st.ordered_passed_over += u64::from(w.passed_over);
        }
        self.cv.notify_all();
    }

    pub(super) fn fill_step(
        &self,
        ids: &mut Vec<i64>,
        rows: &mut Vec<i64>,
        waited: &mut Option<Waited>,
    ) -> Result<usize> {
        let count = self.mailbox().take(ids);
        let Some(extent) = self.rows.step_rows() else {
            // Aborted (or closed) since READY was seen: the abort's cause is the error,
            // not the ids' count against a step that no longer exists.
            return Err(self.rows.poison_cause().map_or_else(
                || Error::state(Op::Fill, "no step is pending: the rows were released"),
                |cause| Error::Poisoned { cause },
            ));
        };
        if count > ids.len() || count > extent {
            return Err(Error::rows(format!(
                "the GPU published {count} ids but the step holds {extent} rows (mailbox {})",
                ids.len().max(count)
            )));
        }
        self.map
            .map(ids, rows, self.source.rows(), &self.source.name())?;
        let src = &self.source;
        let skip = self.opts.skip_gather;
        let mut before_reads = self.before_reads(waited);
        self.rows
            .fill_with(rows.len(), Duration::from_secs(1), |dst| {
                if skip {
                    return Ok(());
                }
                src.gather_rows_ordered(rows, dst, &mut before_reads)
            })?;
        Ok(count)
    }
}

/// What a fill of a step with expected ids did (see [`Shared::fill_expected`]).
pub(super) struct ExpectedFill {
    count: usize,
    early: usize,
    late: usize,
    wrong: usize,
}

/// Gather `rows[a..b]` into `dst`'s rows `a..b` for every maximal run of positions where
/// `pick` holds (rows are contiguous per run, so a prompt's chunk is one gather);
/// `before_reads` as for [`super::RowSource::gather_rows_ordered`].
fn gather_runs(
    src: &dyn super::source::RowSource,
    rows: &[i64],
    dst: &mut [u8],
    rb: usize,
    pick: impl Fn(usize) -> bool,
    before_reads: crate::table::BeforeReads<'_>,
) -> Result<usize> {
    let (mut i, mut done) = (0, 0);
    while i < rows.len() {
        if !pick(i) {
            i += 1;
            continue;
        }
        let a = i;
        while i < rows.len() && pick(i) {
            i += 1;
        }
        src.gather_rows_ordered(&rows[a..i], &mut dst[a * rb..i * rb], before_reads)?;
        done += i - a;
    }
    Ok(done)
}

impl Shared {
    /// Whether to give up on the step being waited for (stopping, or its rows released).
    fn giving_up(&self) -> bool {
        self.stop.load(Ordering::Acquire) || self.rows.is_released()
    }

    /// A step's fill failed: release the GPU, count it, keep the first error for the next
    /// call.
    fn fail_step(&self, ctl: &mut Ctl, e: Error) {
        self.rows.abort(&format!("gather worker: {e}"));
        ctl.stats.failures += 1;
        if ctl.failure.is_none() {
            ctl.failure = Some(e);
        }
    }

    /// Fill `step`, begun with `expected` ids: wait for the slot (the GPU consumed the
    /// previous step's rows), then inside one fill gather the expected rows, wait for
    /// READY, and gather the rows whose published id differs or was not expected.
    /// `Ok(None)`: given up before READY (released or stopping), nothing published.
    pub(super) fn fill_expected(
        &self,
        step: u64,
        expected: &[i64],
        ids: &mut Vec<i64>,
        rows: &mut Vec<i64>,
        t_ready: &mut Option<Instant>,
        waited: &mut Option<Waited>,
    ) -> Result<Option<ExpectedFill>> {
        let t0 = Instant::now();
        while !self.rows.slot_free() {
            if self.giving_up() {
                return Ok(None);
            }
            pause(t0.elapsed(), self.opts.spin, NAP);
        }
        let (table_rows, name) = (self.source.rows(), self.source.name());
        let guess: Vec<i64> = expected
            .iter()
            .enumerate()
            .map(|(i, &id)| self.map.row_at(i, id, table_rows).unwrap_or(-1))
            .collect();
        let (k, rb, skip) = (guess.len(), self.rows.row_bytes(), self.opts.skip_gather);
        let src = &*self.source;
        let mut gave_up = false;
        let mut out = ExpectedFill {
            count: 0,
            early: 0,
            late: 0,
            wrong: 0,
        };
        let mut before_reads = self.before_reads(waited);
        let filled = self.rows.fill_with(k, Duration::from_secs(1), |dst| {
            if !skip {
                // Before READY: no turn (the earlier tables may not have theirs yet).
                out.early = gather_runs(src, &guess, dst, rb, |i| guess[i] >= 0, &mut |_| Ok(()))?;
            }
            let t = Instant::now();
            while !self.mailbox().is_ready() {
                if self.giving_up() {
                    gave_up = true;
                    return Err(Error::Closed);
                }
                pause(t.elapsed(), self.opts.spin, NAP);
            }
            *t_ready = Some(Instant::now());
            self.rows.watch(step);
            self.saw_ready();
            let count = self.mailbox().take(ids);
            if count > ids.len() || count > k {
                return Err(Error::rows(format!(
                    "the GPU published {count} ids but the host expected {k} (mailbox {})",
                    ids.len().max(count)
                )));
            }
            self.map.map(ids, rows, table_rows, &name)?;
            let differs = |i: usize| guess[i] != rows[i];
            // Unknown where the host said -1; wrong where it said an id (a row or not)
            // and the GPU published another.
            out.late = (0..count).filter(|&i| expected[i] < 0).count();
            out.wrong = (0..count)
                .filter(|&i| expected[i] >= 0 && differs(i))
                .count();
            out.count = count;
            if !skip {
                gather_runs(src, rows, dst, rb, differs, &mut before_reads)?;
            }
            dst[count * rb..].fill(0);
            Ok(())
        });
        match filled {
            Ok(()) => Ok(Some(out)),
            Err(_) if gave_up => Ok(None),
            Err(e) => Err(e),
        }
    }
}

pub(super) fn run(sh: &Shared) {
    crate::os::fine_timer_slack();
    let max_ids = sh.mailbox().max_ids();
    let mut ids = Vec::with_capacity(max_ids);
    let mut rows = Vec::with_capacity(max_ids);
    // Rows of the last fill: the next step's size is most likely the same (decode batches).
    let mut last_rows = 0usize;
    let mut predictor = ReadyPredictor::default();
    while let Some((step, expected)) = sh.next_step() {
        let armed_at = Instant::now();
        if let Some(expected) = expected {
            run_expected(sh, step, &expected, &mut ids, &mut rows, armed_at);
            last_rows = expected.len();
            continue;
        }
        // A replay's READY is predicted from the last replays'; an eager step publishes
        // right after its arming and is neither predicted nor recorded.
        let predicted = sh.opts.predict_ready && !sh.ctl().eager.contains(&step);
        let sleep = predicted.then(|| predictor.sleep_for()).flatten();
        let warm = sh.source.own_pool_for(last_rows).map(WarmThreads::start);
        // Counted under the `ctl` lock each way below takes anyway.
        let warmed = u64::from(warm.is_some());
        let (ready, in_sleep) = sh.wait_ready(sleep.map(|d| armed_at + d));
        drop(warm);
        if !ready {
            // Released or stopping: nothing to fill. Mark the step handled so a waiting
            // complete() returns (it then reports the rows' own state).
            let mut ctl = sh.ctl();
            ctl.stats.warmed_steps += warmed;
            sh.handled(&mut ctl, step, None);
            continue;
        }
        let t_ready = Instant::now();
        if predicted {
            predictor.record(t_ready - armed_at);
        }
        // The GPU reached the step: from now on it may be waiting for these rows.
        sh.rows.watch(step);
        sh.saw_ready();
        let mut waited = None;
        // A panic here (a bug) must still release the GPU: it becomes the step's error.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sh.fill_step(&mut ids, &mut rows, &mut waited)
        }))
        .unwrap_or_else(|_| {
            Err(Error::state(
                Op::Fill,
                "the gather worker panicked while filling this step",
            ))
        });
        let ns = t_ready.elapsed().as_nanos() as u64;
        last_rows = rows.len();
        let mut ctl = sh.ctl();
        ctl.stats.warmed_steps += warmed;
        ctl.stats.predicted_sleeps += u64::from(sleep.is_some());
        ctl.stats.ready_in_sleep += u64::from(in_sleep);
        match result {
            Ok(count) => ctl.count_fill(step, count, ns, t_ready - armed_at),
            Err(e) => sh.fail_step(&mut ctl, e),
        }
        sh.handled(&mut ctl, step, waited);
    }
}

/// One step begun with expected ids: [`Shared::fill_expected`], then the same accounting
/// as a published step's (its READY -> FILLED time counts only what followed READY).
fn run_expected(
    sh: &Shared,
    step: u64,
    expected: &[i64],
    ids: &mut Vec<i64>,
    rows: &mut Vec<i64>,
    armed_at: Instant,
) {
    let (mut t_ready, mut waited) = (None, None);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sh.fill_expected(step, expected, ids, rows, &mut t_ready, &mut waited)
    }))
    .unwrap_or_else(|_| {
        Err(Error::state(
            Op::Fill,
            "the gather worker panicked while filling this step",
        ))
    });
    let mut ctl = sh.ctl();
    match result {
        Ok(Some(done)) => {
            let t_ready = t_ready.unwrap_or(armed_at);
            let ns = t_ready.elapsed().as_nanos() as u64;
            ctl.count_fill(step, done.count, ns, t_ready - armed_at);
            let st = &mut ctl.stats;
            st.expected_steps += 1;
            st.expected_rows_early += done.early as u64;
            st.expected_rows_late += done.late as u64;
            st.expected_rows_wrong += done.wrong as u64;
        }
        Ok(None) => {} // released or stopping before READY: nothing to fill
        Err(e) => sh.fail_step(&mut ctl, e),
    }
    sh.handled(&mut ctl, step, waited);
}
