//! [`ReadOrder`]: a step's cold reads taken table by table, in the order the GPU consumes
//! the tables' rows.
//!
//! A model that publishes every table's ids at the top of its forward (Qwen4Exp stages
//! all its PLE layers there) has every worker reach READY at once. When the tables are
//! cold, every worker then submits its reads at once, and the storage device serves them
//! together: on an NVMe disk 16 random reads take ~180 us, 64 together ~620 us. Yet the
//! GPU needs the first table's rows at once, the next only after the layers between them.
//! Taken in order, the first table's reads finish in the time of its own (~180 us) and
//! the later tables' reads run while the GPU computes the layers before their consumers.
//!
//! The turn gates only cold reads: a worker whose rows are all resident never waits. Only
//! small batches are ordered: an earlier table with more than [`ORDER_MAX_READS`] cold
//! reads is not waited for (the tables reading together get more done than one after
//! another: on the VM's disk, in order, a step of 16 / 128 cold rows a table ran 11-15% /
//! 6-9% shorter, one of 512-1,024 rows 17-22% longer; BENCHMARKS.md, "A step's reads in
//! layer order"). It is bounded and never waits on the GPU: a worker
//! waits for an earlier table only
//!
//! * while that table's worker is filling the same step (it saw that step's READY and
//!   has not finished it) and reads no more than [`ORDER_MAX_READS`] rows from storage,
//!   at most [`TURN_LIMIT`] in all;
//! * or, for [`READY_GRACE`], for that worker to see READY (the tables' publishes come
//!   microseconds apart, and a worker may be napping): a table whose READY has not come
//!   by then is passed over, so a model that publishes a later table's ids before an
//!   earlier one's (or after a consumer of the later) costs at most this a step, never a
//!   wait on the GPU.
//!
//! A worker that gives up on its own step (stopping, its rows released) stops waiting at
//! once. Every step a worker is done with (filled, failed, given up) passes its turn, so
//! the tables' step counts stay in step; after a failure every table is aborted anyway.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::pace::{pause, NAP};

/// The longest a worker waits for earlier tables' reads of a step before reading its own.
pub const TURN_LIMIT: Duration = Duration::from_millis(100);

/// The most cold reads of an earlier table's step that a worker waits for (see the module
/// docs): a decode step of 8 tokens of 16 n-gram heads.
pub const ORDER_MAX_READS: usize = 128;

/// How long a worker waits for an earlier table's worker to see the same step's READY.
pub const READY_GRACE: Duration = Duration::from_micros(500);

/// Spin before napping in a turn's wait (the earlier table's reads take hundreds of
/// microseconds: a nap costs nothing that matters).
const TURN_SPIN: Duration = Duration::from_micros(20);

/// Where one table's worker stands: steps it has seen READY of and steps it is done with
/// (counted from when the order was made), and the cold reads of its step `reads_of - 1`.
#[derive(Debug, Default)]
struct Table {
    seen: AtomicU64,
    done: AtomicU64,
    reads: AtomicU64,
    reads_of: AtomicU64,
}

/// The tables of one step object, in the order their rows are consumed.
#[derive(Debug)]
pub struct ReadOrder {
    tables: Box<[Table]>,
}

impl ReadOrder {
    pub fn new(tables: usize) -> Arc<Self> {
        Arc::new(Self {
            tables: (0..tables).map(|_| Table::default()).collect(),
        })
    }
}

/// One table's place in a [`ReadOrder`] (held by its worker).
#[derive(Debug, Clone)]
pub struct Place {
    order: Arc<ReadOrder>,
    index: usize,
}

/// What a worker's wait for its turn did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Waited {
    /// Time waited (zero when every earlier table was done).
    pub ns: u64,
    /// Whether an earlier table was passed over: its READY did not come within
    /// [`READY_GRACE`], or its reads were not done within [`TURN_LIMIT`].
    pub passed_over: bool,
}

impl Place {
    pub fn new(order: Arc<ReadOrder>, index: usize) -> Self {
        assert!(index < order.tables.len(), "a place inside the order");
        Self { order, index }
    }

    fn me(&self) -> &Table {
        &self.order.tables[self.index]
    }

    /// This worker saw READY of its next step.
    pub(super) fn saw_ready(&self) {
        let me = self.me();
        me.seen
            .fetch_max(me.done.load(Ordering::Relaxed) + 1, Ordering::Release);
    }

    /// This worker is done with its step (filled, failed or given up).
    pub(super) fn done(&self) {
        let me = self.me();
        let n = me.done.load(Ordering::Relaxed) + 1;
        me.seen.fetch_max(n, Ordering::Release);
        me.done.store(n, Ordering::Release);
    }

    /// Say that this worker's step reads `reads` rows from storage, then wait (bounded, see
    /// the module docs) until every earlier table is done with the same step;
    /// `giving_up` ends the wait at once.
    pub(super) fn wait(&self, reads: usize, giving_up: impl Fn() -> bool) -> Waited {
        let me = self.me();
        let step = me.done.load(Ordering::Relaxed);
        me.reads.store(reads as u64, Ordering::Relaxed);
        me.reads_of.store(step + 1, Ordering::Release);
        let mut out = Waited::default();
        let mut t0 = None;
        for earlier in &self.order.tables[..self.index] {
            loop {
                if earlier.done.load(Ordering::Acquire) > step {
                    break;
                }
                if earlier.reads_of.load(Ordering::Acquire) == step + 1
                    && earlier.reads.load(Ordering::Relaxed) > ORDER_MAX_READS as u64
                {
                    break; // a large batch: read beside it
                }
                let start = *t0.get_or_insert_with(Instant::now);
                let waited = start.elapsed();
                let reading = earlier.seen.load(Ordering::Acquire) > step;
                if (!reading && waited >= READY_GRACE) || waited >= TURN_LIMIT {
                    out.passed_over = true;
                    break;
                }
                if giving_up() {
                    return Waited {
                        ns: waited.as_nanos() as u64,
                        ..out
                    };
                }
                pause(waited, TURN_SPIN, NAP);
            }
        }
        out.ns = t0.map_or(0, |t| t.elapsed().as_nanos() as u64);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_table_never_waits_and_a_done_table_lets_the_next_go() {
        let order = ReadOrder::new(2);
        let (a, b) = (Place::new(order.clone(), 0), Place::new(order, 1));
        assert_eq!(a.wait(16, || false), Waited::default());
        a.saw_ready();
        a.done();
        assert_eq!(b.wait(16, || false), Waited::default());
    }

    /// `b`'s wait for its turn while `a` reads for `ms` more, then is done.
    fn wait_on_reading(a: Place, b: &Place, ms: u64) -> Waited {
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            a.done();
        });
        let w = b.wait(16, || false);
        t.join().unwrap();
        w
    }

    #[test]
    fn a_reading_table_is_waited_for_until_done() {
        let order = ReadOrder::new(2);
        let (a, b) = (Place::new(order.clone(), 0), Place::new(order, 1));
        a.saw_ready();
        let w = wait_on_reading(a, &b, 5);
        assert!(!w.passed_over);
        assert!(w.ns >= 4_000_000, "waited {} ns", w.ns);
    }

    #[test]
    fn an_earlier_table_without_ready_is_passed_over_after_the_grace() {
        let order = ReadOrder::new(3);
        let c = Place::new(order, 2);
        let t0 = Instant::now();
        let w = c.wait(16, || false);
        assert!(w.passed_over);
        assert!(t0.elapsed() >= READY_GRACE);
        // Both earlier tables share one grace, not one each.
        assert!(t0.elapsed() < READY_GRACE * 2 + Duration::from_millis(50));
    }

    #[test]
    fn giving_up_ends_the_wait_at_once() {
        let order = ReadOrder::new(2);
        let (a, b) = (Place::new(order.clone(), 0), Place::new(order, 1));
        a.saw_ready();
        let t0 = Instant::now();
        let w = b.wait(16, || true);
        assert!(t0.elapsed() < Duration::from_millis(50));
        assert!(!w.passed_over);
    }

    #[test]
    fn an_earlier_table_reading_a_large_batch_is_not_waited_for() {
        let order = ReadOrder::new(2);
        let (a, b) = (Place::new(order.clone(), 0), Place::new(order, 1));
        a.saw_ready();
        assert_eq!(a.wait(ORDER_MAX_READS + 1, || false), Waited::default());
        let t0 = Instant::now();
        assert_eq!(b.wait(16, || false), Waited::default());
        assert!(t0.elapsed() < Duration::from_millis(50));
        // The next step's small batch is waited for again (the count is a step's own).
        a.done();
        b.done();
        a.saw_ready();
        assert_eq!(a.wait(ORDER_MAX_READS, || false), Waited::default());
        let w = wait_on_reading(a, &b, 3);
        assert!(!w.passed_over && w.ns >= 2_000_000, "{w:?}");
    }

    #[test]
    fn steps_are_counted_apart() {
        let order = ReadOrder::new(2);
        let (a, b) = (Place::new(order.clone(), 0), Place::new(order, 1));
        // Step 0: both done; table 0 then on step 1, reading.
        a.saw_ready();
        a.done();
        b.done();
        a.saw_ready();
        let w = wait_on_reading(a, &b, 3);
        assert!(!w.passed_over && w.ns >= 2_000_000, "{w:?}");
    }
}
