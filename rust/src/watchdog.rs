//! One process-wide watchdog thread. A pending step registers a deadline; if the step is
//! still pending when the deadline passes, the watchdog aborts the object, which opens
//! its gate (the GPU runs on) and poisons it with the reason. It holds only weak
//! references, so it never keeps an object alive, and it sleeps while nothing is armed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Instant;

/// Something the watchdog can fire on.
pub trait Watched: Send + Sync {
    /// Called once the deadline of `step` passed. Must do nothing if `step` is no longer
    /// pending.
    fn expire(&self, step: u64);
}

struct Entry {
    deadline: Instant,
    seq: u64,
    step: u64,
    target: Weak<dyn Watched>,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.deadline, self.seq) == (o.deadline, o.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.deadline, self.seq).cmp(&(o.deadline, o.seq))
    }
}

#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Reverse<Entry>>,
    seq: u64,
}

struct Watchdog {
    queue: Mutex<Queue>,
    wake: Condvar,
}

fn watchdog() -> &'static Watchdog {
    static W: OnceLock<&'static Watchdog> = OnceLock::new();
    W.get_or_init(|| {
        let w: &'static Watchdog = Box::leak(Box::new(Watchdog {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("ple-memops-watchdog".into())
            .spawn(move || run(w))
            .expect("spawning the watchdog thread");
        w
    })
}

/// Fire `target.expire(step)` at `deadline` unless the target is gone by then.
pub fn arm(target: &Arc<dyn Watched>, step: u64, deadline: Instant) {
    let w = watchdog();
    let mut q = w.queue.lock().unwrap_or_else(|e| e.into_inner());
    q.seq += 1;
    let seq = q.seq;
    let earliest = q.heap.peek().map(|Reverse(e)| e.deadline);
    q.heap.push(Reverse(Entry {
        deadline,
        seq,
        step,
        target: Arc::downgrade(target),
    }));
    if earliest.is_none_or(|d| deadline < d) {
        w.wake.notify_one();
    }
}

fn run(w: &'static Watchdog) {
    let mut q = w.queue.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let now = Instant::now();
        match q.heap.peek() {
            None => {
                q = w.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            Some(Reverse(e)) if e.deadline <= now => {
                let Reverse(e) = q.heap.pop().expect("peeked");
                // Fire without holding the queue lock: expire() takes the object's lock,
                // and an object's begin() may be arming meanwhile.
                drop(q);
                if let Some(t) = e.target.upgrade() {
                    t.expire(e.step);
                }
                q = w.queue.lock().unwrap_or_else(|e| e.into_inner());
            }
            Some(Reverse(e)) => {
                let wait = e.deadline - now;
                q = w
                    .wake
                    .wait_timeout(q, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    struct Counter(AtomicU64);
    impl Watched for Counter {
        fn expire(&self, step: u64) {
            self.0.store(step, Ordering::SeqCst);
        }
    }

    #[test]
    fn fires_after_deadline_and_not_for_dropped_targets() {
        let c = Arc::new(Counter(AtomicU64::new(0)));
        let t: Arc<dyn Watched> = c.clone();
        arm(&t, 7, Instant::now() + Duration::from_millis(30));
        let gone: Arc<dyn Watched> = Arc::new(Counter(AtomicU64::new(0)));
        arm(&gone, 9, Instant::now() + Duration::from_millis(10));
        drop(gone);
        assert_eq!(c.0.load(Ordering::SeqCst), 0);
        let t0 = Instant::now();
        while c.0.load(Ordering::SeqCst) == 0 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(c.0.load(Ordering::SeqCst), 7);
        assert!(t0.elapsed() >= Duration::from_millis(15));
    }
}
