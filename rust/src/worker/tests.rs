//! The worker's tests (a host-mode rows object; ids published from the host).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::deferred::{Config, CopyPath, DeferredRows, Target};
use crate::error::{ErrorKind, Result};

const T: Duration = Duration::from_secs(5);

struct Counting {
    rows: u64,
    width: usize,
}

impl RowSource for Counting {
    fn rows(&self) -> u64 {
        self.rows
    }
    fn row_bytes(&self) -> usize {
        self.width
    }
    fn name(&self) -> String {
        "counting".into()
    }
    fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
        for (row, id) in dst.chunks_mut(self.width).zip(ids) {
            row.fill((*id % 251) as u8 + 1);
        }
        Ok(())
    }
}

fn opts(max_ids: usize, id_bytes: usize) -> WorkerOptions {
    WorkerOptions {
        max_ids,
        id_bytes,
        ..WorkerOptions::default()
    }
}

fn host_rows(max_rows: usize, width: usize, staging: &mut [u8]) -> DeferredRows {
    watched_rows(max_rows, width, staging, None)
}

fn watched_rows(
    max_rows: usize,
    width: usize,
    staging: &mut [u8],
    watchdog: Option<Duration>,
) -> DeferredRows {
    let cfg = Config {
        max_rows,
        row_bytes: width,
        watchdog,
        track_arrival: false,
        copy: CopyPath::Auto,
        time_stalls: false,
    };
    // SAFETY: `staging` is max_rows * width bytes and outlives the object in each test.
    unsafe {
        DeferredRows::new(
            cfg,
            Target::Host {
                staging: staging.as_mut_ptr(),
            },
        )
    }
    .unwrap()
}

#[test]
fn worker_fills_published_ids_and_surfaces_errors() {
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let src = Arc::new(Counting {
        rows: 100,
        width: 4,
    });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(8, 8)).unwrap();
    for step in 0..50i64 {
        w.begin(8).unwrap();
        let ids: Vec<i64> = (0..(step % 8 + 1)).map(|i| (i * 7 + step) % 100).collect();
        w.publish_from_host(&ids, T).unwrap();
        w.complete(Duration::from_secs(5)).unwrap();
        for (i, id) in ids.iter().enumerate() {
            assert!(staging[i * 4..i * 4 + 4]
                .iter()
                .all(|&b| b == (*id % 251) as u8 + 1));
        }
        assert!(staging[ids.len() * 4..].iter().all(|&b| b == 0));
    }
    assert_eq!(w.stats().fills, 50);
    // A bad id from the "GPU": typed error at complete, then poisoned.
    w.begin(8).unwrap();
    w.publish_from_host(&[1, 200], T).unwrap();
    let e = w.complete(Duration::from_secs(5)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RowId, "{e}");
    assert_eq!(w.begin(8).unwrap_err().kind(), ErrorKind::Poisoned);
    assert!(rows.poison_cause().unwrap().contains("out of range"));
    w.close();
}

/// A source whose every gather takes `delay` (saying on `started`, if given, when one
/// starts).
struct Slow {
    inner: Counting,
    delay: Duration,
    started: Option<std::sync::mpsc::SyncSender<()>>,
}

impl RowSource for Slow {
    fn rows(&self) -> u64 {
        self.inner.rows()
    }
    fn row_bytes(&self) -> usize {
        self.inner.row_bytes()
    }
    fn name(&self) -> String {
        "slow".into()
    }
    fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
        if let Some(started) = &self.started {
            let _ = started.try_send(());
        }
        std::thread::sleep(self.delay);
        self.inner.gather_rows(ids, dst)
    }
}

#[test]
fn the_watchdog_counts_from_the_ids_not_from_begin() {
    let watchdog = Duration::from_millis(60);
    let mut staging = vec![0u8; 4 * 4];
    let rows = watched_rows(4, 4, &mut staging, Some(watchdog));
    let src = Arc::new(Slow {
        inner: Counting { rows: 10, width: 4 },
        delay: Duration::from_millis(5),
        started: None,
    });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8)).unwrap();
    // Armed long before its ids come (the GPU busy with work queued ahead): no wait.
    w.begin(4).unwrap();
    std::thread::sleep(watchdog * 4);
    w.publish_from_host(&[1, 2], T).unwrap();
    w.complete(T).unwrap();
    assert_eq!(rows.stats().watchdog_releases, 0);
    assert!(staging[..4].iter().all(|&b| b == 2));
    // A step whose ids never come (the GPU never reached it) is not released: the
    // host's bounded complete() says so instead.
    w.begin(4).unwrap();
    std::thread::sleep(watchdog * 3);
    assert_eq!(w.complete(watchdog).unwrap_err().kind(), ErrorKind::State);
    assert_eq!(rows.stats().watchdog_releases, 0);
    w.close();
}

/// How long a held gather takes: far above what any check below allows itself.
const HOLD: Duration = Duration::from_secs(2);

/// A worker over `rows` whose gathers each take [`HOLD`], with a step of `ids` armed,
/// published and being gathered when it returns.
fn worker_mid_gather(rows: &DeferredRows, ids: &[i64]) -> GatherWorker {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let src = Arc::new(Slow {
        inner: Counting { rows: 10, width: 4 },
        delay: HOLD,
        started: Some(tx),
    });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8)).unwrap();
    w.begin(4).unwrap();
    w.publish_from_host(ids, T).unwrap();
    rx.recv_timeout(T).expect("the gather never started");
    w
}

#[test]
fn asking_whether_the_rows_failed_never_waits_for_a_gather() {
    // An engine asks before it hands out every step's output, while the worker gathers
    // the next step's rows: the answer must not wait for that gather.
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let w = worker_mid_gather(&rows, &[1, 2]);
    let t0 = Instant::now();
    assert_eq!(rows.poison_cause(), None);
    let asked = t0.elapsed();
    assert!(
        asked < HOLD / 2,
        "poison_cause() waited {asked:?} for the gather"
    );
    w.complete(T).unwrap();
    assert!(staging[..4].iter().all(|&b| b == 2));
    // Once poisoned, the cause is there (read under the lock).
    rows.abort("stop");
    assert_eq!(rows.poison_cause().as_deref(), Some("stop"));
    w.close();
}

#[test]
fn arming_the_next_step_never_waits_for_a_gather() {
    // Under asynchronous scheduling the host arms step N+1 while the worker gathers step
    // N's rows: arming must not wait for that gather.
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let w = worker_mid_gather(&rows, &[3]);
    let t0 = Instant::now();
    w.begin(4).unwrap();
    let _ = (rows.stats(), rows.in_flight(), rows.phase_name());
    let took = t0.elapsed();
    assert!(took < HOLD / 2, "arming waited {took:?} for the gather");
    // Both steps still come out right, in order.
    w.complete(T).unwrap();
    assert!(staging[..4].iter().all(|&b| b == 4));
    w.publish_from_host(&[5, 6], T).unwrap();
    w.complete(T).unwrap();
    assert!(staging[..4].iter().all(|&b| b == 6) && staging[4..8].iter().all(|&b| b == 7));
    w.close();
}

#[test]
fn the_watchdog_releases_a_step_whose_gather_stalls() {
    // A read stalled on I/O must not hold the GPU: the watchdog releases the step while
    // the gather is still under way, and the late rows are never published.
    let watchdog = Duration::from_millis(100);
    let mut staging = vec![0u8; 4 * 4];
    let rows = watched_rows(4, 4, &mut staging, Some(watchdog));
    let w = worker_mid_gather(&rows, &[1, 2]);
    let t0 = Instant::now();
    while !rows.is_released() {
        assert!(
            t0.elapsed() < HOLD / 2,
            "the watchdog did not release the step while its gather stalled"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(rows.stats().watchdog_releases, 1);
    let e = w.complete(T).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Poisoned, "{e}");
    assert!(e.to_string().contains("watchdog"), "{e}");
    // The gather finished after the release: its rows never reached the consumer.
    assert!(staging.iter().all(|&b| b == 0));
    assert_eq!(rows.stats().fills, 0);
    w.close();
}

#[test]
fn a_fill_owns_the_slot_until_it_publishes() {
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    rows.begin(2).unwrap();
    rows.fill_with(2, Duration::ZERO, |dst| {
        // A second fill of the step while this one writes: refused, nothing written.
        let e = rows.fill(&[9u8; 8], None, Duration::ZERO).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::State, "{e}");
        dst.fill(5);
        Ok(())
    })
    .unwrap();
    rows.complete().unwrap();
    assert!(staging[..8].iter().all(|&b| b == 5));
    // Aborted while it writes (the watchdog, an abort from another thread): the fill
    // fails with the abort's cause and publishes nothing.
    rows.begin(2).unwrap();
    let e = rows
        .fill_with(2, Duration::ZERO, |dst| {
            rows.abort("cut short");
            dst.fill(7);
            Ok(())
        })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Poisoned, "{e}");
    assert!(e.to_string().contains("cut short"), "{e}");
    assert!(staging[..8].iter().all(|&b| b == 5));
    assert_eq!(rows.stats().fills, 1);
}

#[test]
fn completions_that_wait_for_the_worker_are_counted_and_timed() {
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let src = Arc::new(Slow {
        inner: Counting { rows: 10, width: 4 },
        delay: Duration::from_millis(20),
        started: None,
    });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8)).unwrap();
    // Filled before its completion: no wait counted.
    w.begin(4).unwrap();
    w.publish_from_host(&[1], T).unwrap();
    let t0 = Instant::now();
    while w.stats().fills < 1 {
        assert!(t0.elapsed() < T, "the worker never filled");
        std::thread::sleep(Duration::from_millis(1));
    }
    w.complete(T).unwrap();
    let s = w.stats();
    assert_eq!((s.completes_waited, s.complete_wait_ns_total), (0, 0));
    // Completed while the (20 ms) gather runs: one wait, about as long as the gather.
    w.begin(4).unwrap();
    w.publish_from_host(&[2], T).unwrap();
    w.complete(T).unwrap();
    let s = w.stats();
    assert_eq!(s.completes_waited, 1);
    assert!(
        (5_000_000..5_000_000_000).contains(&s.complete_wait_ns_total),
        "{s:?}"
    );
    assert_eq!(staging[0], 3);
    // A wait that ends in a timeout is counted too.
    w.begin(4).unwrap();
    assert_eq!(
        w.complete(Duration::from_millis(10)).unwrap_err().kind(),
        ErrorKind::State
    );
    assert_eq!(w.stats().completes_waited, 2);
    w.close();
}

#[test]
fn complete_times_out_when_nothing_is_published_and_close_releases() {
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let src = Arc::new(Counting { rows: 10, width: 4 });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 4)).unwrap();
    w.begin(4).unwrap();
    let e = w.complete(Duration::from_millis(30)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::State);
    w.close();
    assert!(rows.poison_cause().unwrap().contains("closed"));
}

#[test]
fn try_complete_never_waits_and_completes_only_a_filled_step() {
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let src = Arc::new(Counting { rows: 10, width: 4 });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 4)).unwrap();
    assert!(
        matches!(w.try_complete(), Some(Err(_))),
        "nothing begun: the rows say so"
    );
    w.begin(4).unwrap();
    w.begin(4).unwrap();
    assert!(
        w.try_complete().is_none(),
        "no ids yet: it would have to wait"
    );
    assert_eq!(w.in_flight(), 2);
    w.publish_from_host(&[3], T).unwrap();
    let t0 = Instant::now();
    while w.stats().fills < 1 {
        assert!(t0.elapsed() < T, "the worker never filled");
        std::thread::yield_now();
    }
    assert!(matches!(w.try_complete(), Some(Ok(()))));
    assert_eq!((w.in_flight(), staging[0]), (1, 4));
    assert!(w.try_complete().is_none(), "the second step has no ids");
    // A failure is returned at once, typed, whatever is armed.
    w.publish_from_host(&[99], T).unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(done) = w.try_complete() {
            assert_eq!(done.unwrap_err().kind(), ErrorKind::RowId);
            break;
        }
        assert!(t0.elapsed() < T, "the failure never surfaced");
        std::thread::yield_now();
    }
    w.close();
}

#[test]
fn bad_construction_is_refused() {
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let src: Arc<dyn RowSource> = Arc::new(Counting { rows: 10, width: 4 });
    let wide: Arc<dyn RowSource> = Arc::new(Counting { rows: 10, width: 8 });
    for r in [
        GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(5, 8)),
        GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(4, 2)),
        GatherWorker::new(rows.clone(), wide, RowMap::Identity, opts(4, 8)),
        GatherWorker::new(
            rows.clone(),
            src.clone(),
            RowMap::PerHead {
                offsets: vec![0],
                sizes: vec![11],
            },
            opts(4, 8),
        ),
    ] {
        assert_eq!(r.err().unwrap().kind(), ErrorKind::InvalidArgument);
    }
}

#[test]
fn two_steps_armed_fill_in_order_and_complete_oldest_first() {
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let src = Arc::new(Counting {
        rows: 100,
        width: 4,
    });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(8, 8)).unwrap();
    assert_eq!(w.depth(), 2);
    // Host one step ahead: arm 1 and 2 before either is published.
    w.begin(8).unwrap();
    w.begin(8).unwrap();
    assert_eq!(w.begin(8).unwrap_err().kind(), ErrorKind::State);
    assert_eq!(w.in_flight(), 2);
    for round in 0..20i64 {
        w.publish_from_host(&[round, round + 1], T).unwrap();
        // The oldest step completes once its ids were gathered.
        w.complete(Duration::from_secs(5)).unwrap();
        assert_eq!(staging[0], (round % 251) as u8 + 1);
        assert_eq!(staging[4], ((round + 1) % 251) as u8 + 1);
        w.begin(8).unwrap();
    }
    w.publish_from_host(&[7], T).unwrap();
    w.complete(Duration::from_secs(5)).unwrap();
    w.publish_from_host(&[9], T).unwrap();
    w.complete(Duration::from_secs(5)).unwrap();
    assert_eq!(staging[0], 10);
    assert_eq!(w.in_flight(), 0);
    assert_eq!(w.stats().fills, 22);
    // A host-fed step on the rows object while the worker has steps armed is refused.
    w.begin(8).unwrap();
    assert_eq!(rows.begin(8).unwrap_err().kind(), ErrorKind::State);
    w.publish_from_host(&[1], T).unwrap();
    w.complete(Duration::from_secs(5)).unwrap();
    w.close();
}

/// Rows as [`Counting`]'s, gathered on a pool of its own from 4 rows up.
struct Pooled {
    pool: rayon::ThreadPool,
}

impl RowSource for Pooled {
    fn rows(&self) -> u64 {
        100
    }
    fn row_bytes(&self) -> usize {
        4
    }
    fn name(&self) -> String {
        "pooled".into()
    }
    fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
        use rayon::prelude::*;
        self.pool.install(|| {
            dst.par_chunks_mut(4)
                .zip(ids.par_iter())
                .for_each(|(row, id)| row.fill((*id % 251) as u8 + 1))
        });
        Ok(())
    }
    fn own_pool_for(&self, rows: usize) -> Option<&rayon::ThreadPool> {
        (rows >= 4).then_some(&self.pool)
    }
}

/// How long a trivial job on `pool` waits for a free thread.
fn pool_wait(pool: &rayon::ThreadPool) -> Duration {
    let t0 = Instant::now();
    pool.install(|| ());
    t0.elapsed()
}

#[test]
fn own_gather_threads_are_held_awake_only_while_a_step_is_armed() {
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let src = Arc::new(Pooled {
        pool: rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap(),
    });
    let w = GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(8, 8)).unwrap();
    // The first step has no previous fill to go by; 2 rows stay below the pool.
    for (k, ids) in [
        vec![1, 2],
        vec![3, 4],
        (0..8).collect(),
        (10..18).collect(),
        vec![5],
        (20..28).collect(),
    ]
    .into_iter()
    .enumerate()
    {
        w.begin(8).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        w.publish_from_host(&ids, T).unwrap();
        w.complete(T).unwrap();
        for (i, id) in ids.iter().enumerate() {
            assert!(
                staging[i * 4..i * 4 + 4]
                    .iter()
                    .all(|&b| b == (*id % 251) as u8 + 1),
                "step {k} row {i}"
            );
        }
        // The warm jobs ended with the step: the pool is free long before WARM_MAX.
        let wait = pool_wait(&src.pool);
        assert!(wait < WARM_MAX / 2, "step {k}: the pool was held {wait:?}");
    }
    // Warmed: the steps after an 8-row fill (the 4th and the 5th), not the one after
    // the 1-row fill.
    assert_eq!(w.stats().warmed_steps, 2);
    assert_eq!(w.stats().fills, 6);
    // Armed after an 8-row fill and never published: closing ends the warm jobs too. (The
    // worker must have reached the step before the close for it to count: 50 ms, not 5,
    // as a loaded 2-vCPU machine once took longer.)
    w.begin(8).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    w.close();
    let wait = pool_wait(&src.pool);
    assert!(
        wait < WARM_MAX / 2,
        "after close the pool was held {wait:?}"
    );
    assert_eq!(w.stats().warmed_steps, 3);
}

#[test]
fn eager_steps_fills_are_counted_apart_from_replays() {
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let src = Arc::new(Slow {
        inner: Counting {
            rows: 100,
            width: 4,
        },
        delay: Duration::from_millis(20),
        started: None,
    });
    let w = GatherWorker::new(rows, src, RowMap::Identity, opts(8, 8)).unwrap();
    // replay, eager, replay, with two armed at once (the eager one second in line).
    w.begin(8).unwrap();
    w.begin_eager(8).unwrap();
    w.publish_from_host(&[1], T).unwrap();
    w.complete(T).unwrap();
    w.begin(8).unwrap();
    for ids in [[2i64], [3]] {
        w.publish_from_host(&ids, T).unwrap();
        w.complete(T).unwrap();
    }
    let s = w.stats();
    assert_eq!((s.fills, s.eager_fills), (3, 1));
    // Every gather sleeps 20 ms: the eager share of the time is one fill's.
    assert!(s.eager_fill_ns_total >= 20_000_000, "{s:?}");
    assert!(
        s.ready_to_filled_ns_total >= s.eager_fill_ns_total + 40_000_000,
        "{s:?}"
    );
    // A failed eager step leaves no mark on the next steps' accounting.
    w.begin_eager(8).unwrap();
    w.publish_from_host(&[500], T).unwrap();
    assert_eq!(w.complete(T).unwrap_err().kind(), ErrorKind::RowId);
    assert_eq!(w.stats().eager_fills, 1);
    w.close();
}

#[test]
fn a_publish_nobody_armed_is_released_with_zeros_and_typed() {
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let src = Arc::new(Counting { rows: 10, width: 4 });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8)).unwrap();
    w.begin(4).unwrap();
    w.publish_from_host(&[3, 4], T).unwrap();
    w.complete(Duration::from_secs(5)).unwrap();
    assert_eq!(staging[0], 4);
    // A host publish for no armed step is refused, and writes nothing.
    let e = w.publish_from_host(&[5, 6], T).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoArmedStep, "{e}");
    assert!(e.kind().is_state(), "{e}");
    assert_eq!(staging[0], 4);
    // A "replay" without begin(): the worker must not keep the ids for the next step.
    w.simulate_replay_publish(&[5, 6]);
    let t0 = Instant::now();
    while !rows.is_released() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(rows.is_released(), "the unarmed publish was not released");
    assert!(
        staging.iter().all(|&b| b == 0),
        "the consumer must read zeros"
    );
    let e = w.begin(4).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnarmedReplay, "{e}");
    assert!(e.to_string().contains("without begin()"), "{e}");
    assert_eq!(w.begin(4).unwrap_err().kind(), ErrorKind::Poisoned);
    assert_eq!(w.stats().unarmed_replays, 1);
    w.close();
}

#[test]
fn closing_a_worker_that_published_releases_its_rows() {
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let src = Arc::new(Counting { rows: 10, width: 4 });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8)).unwrap();
    w.begin(4).unwrap();
    w.publish_from_host(&[1], T).unwrap();
    w.complete(Duration::from_secs(5)).unwrap();
    assert!(!rows.is_released());
    w.close();
    assert!(rows.is_released());
    assert!(rows
        .poison_cause()
        .unwrap()
        .contains("can no longer be filled"));
}

#[test]
fn host_ids_go_to_armed_steps_in_order_once_each() {
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let src = Arc::new(Counting {
        rows: 1000,
        width: 4,
    });
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 4)).unwrap();
    // Two steps armed, two publishes back to back: the second waits for the worker to
    // take the first ids, then goes to the second step.
    w.begin(4).unwrap();
    w.begin(4).unwrap();
    w.publish_from_host(&[3], T).unwrap();
    w.publish_from_host(&[7], T).unwrap();
    // A third has no armed step to go to.
    let e = w.publish_from_host(&[9], T).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoArmedStep, "{e}");
    assert!(e.kind().is_state(), "{e}");
    assert!(e.to_string().contains("no armed step"), "{e}");
    w.complete(T).unwrap();
    w.complete(T).unwrap();
    assert_eq!(staging[0], 8, "the second step's row");
    assert_eq!(w.stats().publishes_host, 2);
    // int32 ids: a wider id is refused before anything is written, typed.
    w.begin(4).unwrap();
    let e = w.publish_from_host(&[1, 1 << 33], T).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RowId, "{e}");
    w.publish_from_host(&[5], T).unwrap();
    w.complete(T).unwrap();
    assert_eq!(staging[0], 6);
    w.close();
    assert_eq!(
        w.publish_from_host(&[1], T).unwrap_err().kind(),
        ErrorKind::Closed
    );
}

#[test]
fn a_predicted_wait_sleeps_until_ready_is_near_and_still_serves_an_early_ready() {
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let src = Arc::new(Counting {
        rows: 100,
        width: 4,
    });
    let o = WorkerOptions {
        predict_ready: true,
        ..opts(4, 8)
    };
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, o).unwrap();
    let step = |lead: Duration, id: i64| {
        w.begin(4).unwrap();
        std::thread::sleep(lead); // the GPU running the step before
        w.publish_from_host(&[id], T).unwrap();
        w.complete(T).unwrap();
        assert!(staging[..4].iter().all(|&b| b == (id % 251) as u8 + 1));
    };
    for id in 0..6 {
        step(Duration::from_millis(5), id);
    }
    let s = w.stats();
    // Three replays teach it; the later ones sleep first.
    assert!(s.predicted_sleeps >= 2, "{s:?}");
    // A READY far earlier than predicted comes while the worker sleeps: still served.
    step(Duration::from_micros(300), 42);
    let s = w.stats();
    assert_eq!(s.fills, 7, "{s:?}");
    assert!(s.ready_in_sleep >= 1, "{s:?}");
    w.close();
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// A fill racing an abort and the watchdog at any moment: nothing hangs or panics, a
    /// completed step holds its rows, a failed one says it was poisoned.
    #[test]
    fn a_fill_racing_an_abort_or_the_watchdog(
        gather_us in 0u64..3_000,
        abort_us in proptest::option::of(0u64..3_000),
        watchdog_ms in proptest::option::of(1u64..3),
    ) {
        let mut staging = vec![0u8; 4 * 4];
        let rows = watched_rows(4, 4, &mut staging, watchdog_ms.map(Duration::from_millis));
        let src = Arc::new(Slow {
            inner: Counting { rows: 10, width: 4 },
            delay: Duration::from_micros(gather_us),
            started: None,
        });
        let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8)).unwrap();
        w.begin(4).unwrap();
        w.publish_from_host(&[1, 2], T).unwrap();
        let aborter = abort_us.map(|us| {
            let rows = rows.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_micros(us));
                rows.abort("raced");
            })
        });
        let t0 = Instant::now();
        let done = w.complete(T);
        proptest::prop_assert!(t0.elapsed() < T, "complete() ran into its timeout");
        if let Some(a) = aborter {
            a.join().unwrap();
        }
        let _ = rows.slot_snapshot(); // never waits on a fill that is over
        match done {
            Ok(()) => {
                proptest::prop_assert!(staging[..4].iter().all(|&b| b == 2));
                proptest::prop_assert!(staging[4..8].iter().all(|&b| b == 3));
            }
            Err(e) => {
                proptest::prop_assert_eq!(e.kind(), ErrorKind::Poisoned, "{}", e);
                proptest::prop_assert!(rows.poison_cause().is_some());
            }
        }
        w.close();
    }
}

/// [`Counting`]'s rows, recording every gathered row id in order.
struct Recording {
    inner: Counting,
    gathered: std::sync::Mutex<Vec<i64>>,
}

impl RowSource for Recording {
    fn rows(&self) -> u64 {
        self.inner.rows()
    }
    fn row_bytes(&self) -> usize {
        self.inner.row_bytes()
    }
    fn name(&self) -> String {
        "recording".into()
    }
    fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
        self.gathered.lock().unwrap().extend_from_slice(ids);
        self.inner.gather_rows(ids, dst)
    }
}

fn recording() -> Arc<Recording> {
    Arc::new(Recording {
        inner: Counting {
            rows: 100,
            width: 4,
        },
        gathered: std::sync::Mutex::new(Vec::new()),
    })
}

fn wait_for(what: &str, done: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < T, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn expected_rows_are_gathered_before_ready_and_the_published_ids_win() {
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let src = recording();
    let w = GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(8, 8)).unwrap();
    // Six rows: two unknown to the host (-1), one it expects wrongly (40, the GPU says 41).
    let expected = vec![10, 11, -1, 40, -1, 13];
    let published = [10, 11, 20, 41, 21, 13];
    w.begin_expecting(8, true, expected).unwrap();
    // Before any id is published, the worker gathered every expected row.
    wait_for("the expected rows", || {
        src.gathered.lock().unwrap().len() == 4
    });
    assert_eq!(*src.gathered.lock().unwrap(), vec![10, 11, 40, 13]);
    assert!(w.try_complete().is_none(), "filled before READY");
    w.publish_from_host(&published, T).unwrap();
    w.complete(T).unwrap();
    // After READY only the unknown and the wrong rows were gathered.
    assert_eq!(
        *src.gathered.lock().unwrap(),
        vec![10, 11, 40, 13, 20, 41, 21]
    );
    for (i, id) in published.iter().enumerate() {
        assert!(
            staging[i * 4..i * 4 + 4]
                .iter()
                .all(|&b| b == (*id % 251) as u8 + 1),
            "row {i}"
        );
    }
    assert!(staging[published.len() * 4..].iter().all(|&b| b == 0));
    let st = w.stats();
    assert_eq!(
        (
            st.expected_steps,
            st.expected_rows_early,
            st.expected_rows_late,
            st.expected_rows_wrong
        ),
        (1, 4, 2, 1)
    );
    assert_eq!((st.fills, st.eager_fills, st.ids_total), (1, 1, 6));
    w.close();
}

#[test]
fn steps_with_and_without_expected_ids_fill_in_order() {
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let src = recording();
    let w = GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(8, 8)).unwrap();
    // Two steps in flight: a replay (ids from the GPU only), then a prefill the host knows.
    w.begin(8).unwrap();
    w.begin_expecting(8, true, vec![30, 31, 32]).unwrap();
    for round in 0..10i64 {
        // The expected step waits behind the published one: nothing of it is gathered yet.
        std::thread::sleep(Duration::from_millis(2));
        assert!(src.gathered.lock().unwrap().is_empty());
        w.publish_from_host(&[round], T).unwrap();
        w.complete(T).unwrap();
        assert_eq!(staging[0], (round % 251) as u8 + 1);
        wait_for("the expected rows", || {
            src.gathered.lock().unwrap().len() == 4
        });
        w.publish_from_host(&[30, 31, 32], T).unwrap();
        w.complete(T).unwrap();
        assert_eq!(
            &staging[..12],
            &[31, 31, 31, 31, 32, 32, 32, 32, 33, 33, 33, 33]
        );
        src.gathered.lock().unwrap().clear();
        w.begin(8).unwrap();
        w.begin_expecting(8, true, vec![30, 31, 32]).unwrap();
    }
    let st = w.stats();
    assert_eq!(
        (st.fills, st.expected_steps, st.expected_rows_early),
        (20, 10, 30)
    );
    assert_eq!((st.expected_rows_late, st.expected_rows_wrong), (0, 0));
    w.close();
}

#[test]
fn expected_ids_that_cannot_be_served_are_refused_or_typed() {
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let src = recording();
    let w = GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(8, 8)).unwrap();
    // More ids than the step's rows: refused, nothing armed.
    let e = w.begin_expecting(4, false, vec![1; 5]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RowShape, "{e}");
    assert_eq!(w.in_flight(), 0);
    // An expected id outside the table is no fault (the GPU's ids decide) ...
    w.begin_expecting(8, false, vec![1, 500, 2]).unwrap();
    w.publish_from_host(&[1, 3, 2], T).unwrap();
    w.complete(T).unwrap();
    assert_eq!(w.stats().expected_rows_wrong, 1);
    assert_eq!(staging[4], 4);
    // ... a published one is, typed, as for any step.
    w.begin_expecting(8, false, vec![1, 2]).unwrap();
    w.publish_from_host(&[1, 200], T).unwrap();
    assert_eq!(w.complete(T).unwrap_err().kind(), ErrorKind::RowId);
    w.close();
    // More ids published than expected: typed, the step released.
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let w = GatherWorker::new(rows.clone(), recording(), RowMap::Identity, opts(8, 8)).unwrap();
    w.begin_expecting(8, false, vec![1, 2]).unwrap();
    w.publish_from_host(&[1, 2, 3], T).unwrap();
    let e = w.complete(T).unwrap_err();
    assert!(e.to_string().contains("host expected 2"), "{e}");
    assert!(rows.is_released());
    w.close();
}

#[test]
fn a_step_with_expected_ids_released_before_ready_never_hangs() {
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let src = recording();
    let w = GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(8, 8)).unwrap();
    w.begin_expecting(8, true, vec![5, 6]).unwrap();
    wait_for("the expected rows", || {
        src.gathered.lock().unwrap().len() == 2
    });
    // The engine aborts while the worker waits for READY inside the fill.
    rows.abort("the engine stopped");
    let t0 = Instant::now();
    let e = w.complete(T).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert_eq!(e.kind(), ErrorKind::Poisoned, "{e}");
    assert!(e.to_string().contains("the engine stopped"), "{e}");
    assert_eq!(
        w.stats().failures,
        0,
        "giving up is not the worker's failure"
    );
    // Closing while a step with expected ids waits for READY returns at once too.
    let mut staging = vec![0u8; 8 * 4];
    let rows = host_rows(8, 4, &mut staging);
    let w = GatherWorker::new(rows.clone(), recording(), RowMap::Identity, opts(8, 8)).unwrap();
    w.begin_expecting(8, true, vec![5, 6]).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let t0 = Instant::now();
    w.close();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(rows.is_released());
}

/// Two tables, each with its own host rows (staging `4 x 4` bytes each) and worker.
fn two_tables(staging: &mut [Vec<u8>; 2], src: Arc<dyn RowSource>) -> Vec<StepTable> {
    staging
        .iter_mut()
        .map(|s| {
            let rows = host_rows(4, 4, s);
            let w = GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, opts(4, 8));
            StepTable {
                rows,
                worker: Some(Arc::new(w.unwrap())),
            }
        })
        .collect()
}

fn workers_of(tables: &[StepTable]) -> Vec<Arc<GatherWorker>> {
    tables.iter().map(|t| t.worker.clone().unwrap()).collect()
}

fn never(_: &GatherWorker, _: Duration) -> Result<()> {
    panic!("nothing should wait")
}

fn waits(w: &GatherWorker, t: Duration) -> Result<()> {
    w.wait_and_complete(t)
}

#[test]
fn steps_complete_the_oldest_step_of_every_table_at_depth_then_arm_all() {
    let mut staging = [vec![0u8; 16], vec![0u8; 16]];
    let tables = two_tables(&mut staging, Arc::new(Counting { rows: 10, width: 4 }));
    let ws = workers_of(&tables);
    let steps = Steps::new(tables.clone(), 2, T).unwrap();
    // Below depth: arms only.
    let a = steps.advance(2, false, never).unwrap();
    assert_eq!(
        (a.completed, ws[0].in_flight(), ws[1].in_flight()),
        (0, 1, 1)
    );
    for (i, ids) in [[1i64, 2], [1, 2]].iter().enumerate() {
        steps.publish_host(i, ids).unwrap();
    }
    let a = steps.advance(3, false, never).unwrap();
    assert_eq!((a.completed, steps.in_flight()), (0, 2));
    for i in 0..2 {
        steps.publish_host(i, &[3, 4, 5]).unwrap();
    }
    // At depth: the first step of each is completed (filled: no wait), then both armed.
    wait_for("both fills", || ws.iter().all(|w| w.stats().fills == 2));
    let a = steps.advance(1, true, never).unwrap();
    assert_eq!(a.completed, 1);
    assert_eq!((ws[0].in_flight(), ws[1].in_flight()), (2, 2));
    assert_eq!((ws[0].stats().steps, ws[1].stats().steps), (1, 1));
    // Settling to 0 completes both remaining steps... once the third has its ids.
    for i in 0..2 {
        steps.publish_host(i, &[6]).unwrap();
    }
    assert_eq!(steps.settle(0, waits).unwrap(), 2);
    assert_eq!(steps.in_flight(), 0);
    assert_eq!(ws[0].stats().eager_fills, 1);
    assert_eq!(
        steps.counts(),
        StepCounts {
            armed: 3,
            eager: 1,
            completed: 3
        }
    );
    assert!(a.wait >= Duration::ZERO && a.arm > Duration::ZERO);
    // A row count out of range changes nothing and aborts nothing.
    steps.advance(1, false, never).unwrap();
    for rows in [0, 5] {
        let e = steps.advance(rows, false, never).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RowShape, "{e}");
    }
    assert_eq!((steps.in_flight(), steps.counts().armed), (1, 4));
    assert!(steps.poison_cause().is_none());
    // Shutdown drains (bounded: the step's ids never come, so it times out), aborts
    // instead of raising, and closes: later calls are refused, typed.
    let steps = Steps::new(tables.clone(), 2, Duration::from_millis(50)).unwrap();
    let failed = steps
        .shutdown(waits)
        .expect("the unpublished step times out");
    assert_eq!(failed.kind(), ErrorKind::State, "{failed}");
    assert!(steps.is_closed() && ws.iter().all(|w| w.is_closed()));
    assert_eq!(
        steps.advance(1, false, never).unwrap_err().kind(),
        ErrorKind::Closed
    );
    assert!(steps.shutdown(waits).is_none(), "idempotent");
}

#[test]
fn a_failure_in_one_table_completes_every_table_then_aborts_all() {
    let mut staging = [vec![0u8; 16], vec![0u8; 16]];
    let tables = two_tables(&mut staging, Arc::new(Counting { rows: 10, width: 4 }));
    let ws = workers_of(&tables);
    let steps = Steps::new(tables.clone(), 1, T).unwrap();
    steps.advance(2, false, never).unwrap();
    steps.publish_host(0, &[1, 99]).unwrap(); // 99: out of range
    steps.publish_host(1, &[1, 2]).unwrap();
    let e = steps.advance(2, false, waits).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RowId, "{e}");
    // The second table's step was completed too, nothing new was armed, and every
    // table is poisoned (all or none): the second one's cause names the first failure.
    assert_eq!((ws[1].in_flight(), ws[1].stats().steps), (0, 1));
    let (first, cause) = steps.poison_cause().unwrap();
    assert_eq!(first, 0);
    assert!(cause.contains("out of range"), "{cause}");
    let second = tables[1].rows.poison_cause().unwrap();
    assert!(second.contains("arming a step of 2 rows"), "{second}");
    assert_eq!(
        steps.advance(1, false, never).unwrap_err().kind(),
        ErrorKind::Poisoned
    );
    steps.close();
}

#[test]
fn steps_refuse_bad_construction_and_misuse_typed() {
    let mut staging = [vec![0u8; 16], vec![0u8; 16]];
    let tables = two_tables(&mut staging, Arc::new(Counting { rows: 10, width: 4 }));
    let kind = |r: Result<Steps>| r.err().map(|e| e.kind());
    assert_eq!(
        kind(Steps::new(vec![], 1, T)),
        Some(ErrorKind::InvalidArgument)
    );
    assert_eq!(
        kind(Steps::new(tables.clone(), 0, T)),
        Some(ErrorKind::InvalidArgument)
    );
    // opts(4, 8): the workers allow 2 steps in flight.
    assert_eq!(
        kind(Steps::new(tables.clone(), 3, T)),
        Some(ErrorKind::InvalidArgument)
    );
    assert_eq!(
        kind(Steps::new(tables.clone(), 1, Duration::ZERO)),
        Some(ErrorKind::InvalidArgument)
    );
    let mixed = vec![
        tables[0].clone(),
        StepTable {
            rows: tables[1].rows.clone(),
            worker: None,
        },
    ];
    assert_eq!(
        kind(Steps::new(mixed, 1, T)),
        Some(ErrorKind::InvalidArgument)
    );
    // Synchronous tables: no step to arm (typed), settling is a no-op, abort poisons.
    let sync: Vec<StepTable> = tables
        .iter()
        .map(|t| StepTable {
            rows: t.rows.clone(),
            worker: None,
        })
        .collect();
    let steps = Steps::new(sync, 1, T).unwrap();
    assert!(!steps.deferred());
    assert_eq!(
        steps.advance(1, false, never).unwrap_err().kind(),
        ErrorKind::State
    );
    assert_eq!(steps.settle(0, never).unwrap(), 0);
    // A host publish with no armed step: typed, and nothing is aborted.
    let deferred = Steps::new(tables.clone(), 1, T).unwrap();
    let e = deferred.publish_host(0, &[1]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoArmedStep);
    assert!(deferred.poison_cause().is_none());
    assert_eq!(
        deferred.publish_host(2, &[1]).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    steps.abort("test");
    assert_eq!(steps.poison_cause().unwrap(), (0, "test".to_string()));
    deferred.close();
}

#[test]
fn arming_wakes_a_blocked_worker_and_a_napping_one_sees_it_unwoken() {
    // No hot window, and an idle poll far beyond the completions' timeout: a step is
    // filled in time only if begin() wakes the blocked worker.
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let o = WorkerOptions {
        spin: Duration::ZERO,
        idle_naps: Duration::ZERO,
        idle_poll: Duration::from_secs(60),
        ..opts(4, 8)
    };
    let src = Arc::new(Counting { rows: 10, width: 4 });
    let w = GatherWorker::new(rows.clone(), src.clone(), RowMap::Identity, o).unwrap();
    for step in 0..20i64 {
        // Give the worker time to block (it may also be armed while still looking).
        std::thread::sleep(Duration::from_millis(2));
        w.begin(4).unwrap();
        w.publish_from_host(&[step % 10], T).unwrap();
        w.complete(Duration::from_secs(5)).unwrap();
        assert!(staging[..4].iter().all(|&b| b == (step % 10) as u8 + 1));
    }
    w.close();
    // A hot or napping worker (no hot window: naps only) is armed without a wake and
    // still fills.
    let mut staging = vec![0u8; 4 * 4];
    let rows = host_rows(4, 4, &mut staging);
    let o = WorkerOptions {
        spin: Duration::ZERO,
        idle_naps: Duration::from_secs(60),
        idle_poll: Duration::from_secs(60),
        ..opts(4, 8)
    };
    let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, o).unwrap();
    for step in 0..20i64 {
        std::thread::sleep(Duration::from_millis(1));
        w.begin(4).unwrap();
        w.publish_from_host(&[step % 10], T).unwrap();
        w.complete(Duration::from_secs(5)).unwrap();
    }
    assert_eq!(w.stats().fills, 20);
    w.close();
}

/// A source whose every gather "reads from storage": `before_reads`, then `read` of
/// sleep, logging when its read started and ended (table `tag`).
struct Reading {
    tag: usize,
    read: Duration,
    log: ReadLog,
}

impl RowSource for Reading {
    fn rows(&self) -> u64 {
        10
    }
    fn row_bytes(&self) -> usize {
        4
    }
    fn name(&self) -> String {
        format!("reading{}", self.tag)
    }
    fn gather_rows(&self, ids: &[i64], dst: &mut [u8]) -> Result<()> {
        self.gather_rows_ordered(ids, dst, &mut |_| Ok(()))
    }
    fn gather_rows_ordered(
        &self,
        ids: &[i64],
        dst: &mut [u8],
        before_reads: crate::table::BeforeReads<'_>,
    ) -> Result<()> {
        before_reads(ids.len())?;
        let at = {
            let mut log = self.log.lock().unwrap();
            log.push((self.tag, Instant::now(), None));
            log.len() - 1
        };
        std::thread::sleep(self.read);
        for (row, id) in dst.chunks_mut(4).zip(ids) {
            row.fill(*id as u8 + 10 * self.tag as u8);
        }
        self.log.lock().unwrap()[at].2 = Some(Instant::now());
        Ok(())
    }
}

type ReadLog = Arc<std::sync::Mutex<Vec<(usize, Instant, Option<Instant>)>>>;

/// Three tables of [`Reading`] sources (`read` each), staging `4 x 4` bytes each.
fn reading_tables(staging: &mut [Vec<u8>; 3], read: Duration) -> (Vec<StepTable>, ReadLog) {
    let log: ReadLog = Arc::default();
    let tables = staging
        .iter_mut()
        .enumerate()
        .map(|(tag, s)| {
            let rows = host_rows(4, 4, s);
            let src = Arc::new(Reading {
                tag,
                read,
                log: log.clone(),
            });
            let w = GatherWorker::new(rows.clone(), src, RowMap::Identity, opts(4, 8));
            StepTable {
                rows,
                worker: Some(Arc::new(w.unwrap())),
            }
        })
        .collect();
    (tables, log)
}

/// One step: table 0's ids first and, once its read started, the others' (later first).
fn publish_step(steps: &Steps, log: &ReadLog, step: usize) {
    steps.advance(2, false, never).unwrap();
    steps.publish_host(0, &[1, 2]).unwrap();
    wait_for("table 0's read", || {
        log.lock().unwrap().len() > step * 3 || steps.in_flight() == 0
    });
    std::thread::sleep(Duration::from_millis(1));
    steps.publish_host(2, &[3]).unwrap();
    steps.publish_host(1, &[4, 5]).unwrap();
    steps.settle(0, waits).unwrap();
}

#[test]
fn reading_in_order_takes_a_steps_reads_table_by_table() {
    let read = Duration::from_millis(8);
    // Unordered: the later tables read while table 0 still reads.
    let mut staging = [vec![0u8; 16], vec![0u8; 16], vec![0u8; 16]];
    let (tables, log) = reading_tables(&mut staging, read);
    let steps = Steps::new(tables.clone(), 1, T).unwrap();
    assert!(!steps.reads_in_order());
    // Table 0's read starts only once the others' ids are in (its gather logs at the end).
    publish_step(&steps, &log, 0);
    let l = log.lock().unwrap().clone();
    let start = |tag: usize| l.iter().find(|e| e.0 == tag).unwrap().1;
    let end = |tag: usize| l.iter().find(|e| e.0 == tag).unwrap().2.unwrap();
    assert!(
        start(1) < end(0) && start(2) < end(0),
        "unordered reads overlap"
    );
    steps.close();
    // In order: each table's read starts after the one before it ended, step after step,
    // and the waits are counted.
    let mut staging = [vec![0u8; 16], vec![0u8; 16], vec![0u8; 16]];
    let (tables, log) = reading_tables(&mut staging, read);
    let ws = workers_of(&tables);
    let steps = Steps::new(tables.clone(), 1, T)
        .unwrap()
        .read_in_order()
        .unwrap();
    assert!(steps.reads_in_order());
    for step in 0..3 {
        publish_step(&steps, &log, step);
        let l = log.lock().unwrap().clone();
        let this = &l[step * 3..];
        let at = |tag: usize| *this.iter().find(|e| e.0 == tag).unwrap();
        assert!(
            at(1).1 >= at(0).2.unwrap() && at(2).1 >= at(1).2.unwrap(),
            "step {step}: {this:?}"
        );
    }
    assert_eq!(staging[1][..8], [14, 14, 14, 14, 15, 15, 15, 15]);
    let st: Vec<WorkerStats> = ws.iter().map(|w| w.stats()).collect();
    assert_eq!(st[0].ordered_waits, 0, "the first table never waits");
    for s in &st[1..] {
        assert_eq!((s.ordered_waits, s.ordered_passed_over), (3, 0), "{s:?}");
        assert!(s.ordered_wait_ns_total >= 3 * 5_000_000, "{s:?}");
    }
    // Refused: twice, and once closed.
    let e = Steps::new(tables.clone(), 1, T)
        .unwrap()
        .read_in_order()
        .err()
        .unwrap();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    steps.close();
}

#[test]
fn a_table_whose_ready_never_comes_is_passed_over_and_an_abort_ends_a_wait() {
    let mut staging = [vec![0u8; 16], vec![0u8; 16], vec![0u8; 16]];
    let (tables, log) = reading_tables(&mut staging, Duration::from_millis(1));
    let ws = workers_of(&tables);
    let steps = Steps::new(tables.clone(), 1, T)
        .unwrap()
        .read_in_order()
        .unwrap();
    steps.advance(2, false, never).unwrap();
    // Table 0's ids never come: tables 1 and 2 read after the grace, not after the GPU.
    let t0 = Instant::now();
    steps.publish_host(1, &[1]).unwrap();
    steps.publish_host(2, &[1]).unwrap();
    wait_for("two reads", || log.lock().unwrap().len() == 2);
    assert!(t0.elapsed() < TURN_LIMIT, "{:?}", t0.elapsed());
    wait_for("both counted", || {
        ws[1..].iter().all(|w| w.stats().ordered_passed_over == 1)
    });
    steps.abort("test");
    steps.close();
    // A wait for a table that is reading ends at an abort of the waiting table's rows.
    let mut staging = [vec![0u8; 16], vec![0u8; 16], vec![0u8; 16]];
    let (tables, log) = reading_tables(&mut staging, Duration::from_millis(1500));
    let steps = Steps::new(tables.clone(), 1, T)
        .unwrap()
        .read_in_order()
        .unwrap();
    steps.advance(2, false, never).unwrap();
    steps.publish_host(0, &[1]).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    steps.publish_host(1, &[1]).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let t0 = Instant::now();
    tables[1].rows.abort("test");
    tables[1].worker.as_ref().unwrap().close();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(
        log.lock().unwrap().iter().all(|e| e.0 != 1),
        "table 1 never read"
    );
    steps.abort("done");
    steps.close();
}
