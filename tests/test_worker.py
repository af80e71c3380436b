"""GatherWorker on the host path: the native worker thread maps and gathers ids published
from the host (as the GPU would publish them), with every failure typed."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import ple_memops as pm

ROWS, WIDTH = 1000, 32


@pytest.fixture
def table(tmp_path: Path) -> pm.MmapTable:
    data = np.random.default_rng(0).integers(0, 256, (ROWS, WIDTH), dtype=np.uint8)
    path = tmp_path / "t.safetensors"
    save_file({"emb.weight": data.view(np.float32)}, str(path))
    t = pm.MmapTable.open(path, "emb.weight")
    yield t
    t.close()


def test_worker_fills_published_ids(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(64, WIDTH, device="cpu")
    with pm.GatherWorker(rows, table) as w:
        rng = np.random.default_rng(1)
        for _ in range(200):
            k = int(rng.integers(1, 65))
            ids = rng.integers(0, ROWS, k)
            w.begin(64)
            w.publish_from_host(ids)
            w.complete()
            np.testing.assert_array_equal(rows.staging[:k], table.gather(ids))
            assert not rows.staging[k:].any()
        s = w.stats()
        assert s.fills == 200 and s.steps == 200 and s.failures == 0
        assert s.ready_to_filled_ns_last > 0
        assert s.eager_fills == 0 and s.eager_fill_ns_total == 0


def test_a_predicted_wait_fills_like_any_other(table: pm.MmapTable) -> None:
    """``predict_ready=True``: once steps were armed ahead of READY the worker sleeps until
    READY is near (counted), and a READY much earlier than predicted is still filled."""
    rows = pm.DeferredRows(64, WIDTH, device="cpu")
    with pm.GatherWorker(rows, table, predict_ready=True) as w:
        rng = np.random.default_rng(2)
        for lead in [0.005] * 6 + [0.0003, 0.005]:
            ids = rng.integers(0, ROWS, 8)
            w.begin(64)
            time.sleep(lead)  # the GPU running the step before
            w.publish_from_host(ids)
            w.complete()
            np.testing.assert_array_equal(rows.staging[:8], table.gather(ids))
        s = w.stats()
        assert s.fills == 8 and s.failures == 0
        assert s.predicted_sleeps >= 3 and s.ready_in_sleep >= 1, s


def test_eager_steps_are_counted_apart(table: pm.MmapTable) -> None:
    """``begin(eager=True)``: the same protocol and rows, its fill counted apart (an
    engine's stats lines keep a prefill chunk's gather out of the replays' mean)."""
    rows = pm.DeferredRows(64, WIDTH, device="cpu")
    with pm.GatherWorker(rows, table) as w:
        for k, eager in enumerate([False, True, True, False, True]):
            ids = np.arange(k, k + 8 * (k + 1)) % ROWS
            w.begin(64, eager=eager)
            w.publish_from_host(ids)
            w.complete()
            np.testing.assert_array_equal(rows.staging[: ids.size], table.gather(ids))
        s = w.stats()
        assert (s.fills, s.eager_fills) == (5, 3)
        assert 0 < s.eager_fill_ns_total < s.ready_to_filled_ns_total


def test_own_gather_threads_are_kept_awake_while_armed(tmp_path: Path) -> None:
    """A table with gather threads of its own: after a fill that ran on them, the next
    armed step keeps them awake until READY (``warmed_steps``); the rows are the same,
    and the table's own gathers are not held up once the step is done."""
    data = np.random.default_rng(2).integers(0, 256, (ROWS, WIDTH), dtype=np.uint8)
    path = tmp_path / "own.safetensors"
    save_file({"emb.weight": data.view(np.float32)}, str(path))
    rows = pm.DeferredRows(64, WIDTH, device="cpu")
    with pm.MmapTable.open(path, "emb.weight", gather_threads=2, parallel_min_bytes=WIDTH * 8) as t:
        with pm.GatherWorker(rows, t) as w:
            sizes = [64, 64, 4, 64, 8]  # 4 rows are copied inline: no warming after them
            for k in sizes:
                ids = np.random.default_rng(k).integers(0, ROWS, k)
                w.begin(64)
                time.sleep(0.002)
                w.publish_from_host(ids)
                w.complete()
                np.testing.assert_array_equal(rows.staging[:k], data[ids])
                t0 = time.perf_counter()
                t.gather(np.arange(64))  # on the same threads
                assert time.perf_counter() - t0 < 0.1
            s = w.stats()
            assert (s.fills, s.warmed_steps) == (5, 3), s


def test_per_head_mapping(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(8, WIDTH, device="cpu")
    offsets, sizes = [0, 500, 900], [500, 400, 100]
    with pm.GatherWorker(rows, table, heads=(offsets, sizes), id_dtype="int32") as w:
        ids = np.array([499, 0, 99, 1, 399, 5], dtype=np.int64)  # two tokens x three heads
        w.begin(6)
        w.publish_from_host(ids)
        w.complete()
        want = np.array([499, 500, 999, 1, 899, 905])
        np.testing.assert_array_equal(rows.staging[:6], table.gather(want))
        w.begin(6)
        w.publish_from_host([0, 400, 0])  # head 1 holds 0..400
        with pytest.raises(pm.RowIdError, match="head 1"):
            w.complete()
        with pytest.raises(pm.PoisonedError, match="out of range"):
            w.begin(6)


def test_bad_id_is_typed_and_writes_nothing(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(8, WIDTH, device="cpu")
    with pm.GatherWorker(rows, table) as w:
        w.begin(8)
        w.publish_from_host([1, 2])
        w.complete()
        before = rows.staging.copy()
        w.begin(8)
        w.publish_from_host([3, ROWS])
        with pytest.raises(pm.RowIdError):
            w.complete()
        np.testing.assert_array_equal(rows.staging, before)
        assert rows.phase == "poisoned"


def test_too_many_ids_for_the_step(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(8, WIDTH, device="cpu")
    with pm.GatherWorker(rows, table) as w:
        w.begin(2)
        w.publish_from_host([1, 2, 3])
        with pytest.raises(pm.RowShapeError, match="step holds 2"):
            w.complete()
        with pytest.raises(pm.RowShapeError):
            w.publish_from_host(list(range(9)))


def test_complete_times_out_without_ids_and_close_releases(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(8, WIDTH, device="cpu", watchdog=None)
    w = pm.GatherWorker(rows, table)
    w.begin(8)
    with pytest.raises(pm.StateError, match="has not published"):
        w.complete(timeout=0.05)
    w.close()
    w.close()
    assert "closed" in (rows.poison_cause or "")
    with pytest.raises(pm.ClosedError):
        w.begin(8)


def test_the_watchdog_counts_from_the_ids_not_from_begin(table: pm.MmapTable) -> None:
    """A worker's step is watched from when its ids arrive (the GPU reached its wait):
    time before that (work queued ahead, a first-time compile) is no wait on the rows."""
    rows = pm.DeferredRows(8, WIDTH, device="cpu", watchdog=0.05)
    with pm.GatherWorker(rows, table) as w:
        w.begin(8)
        time.sleep(0.25)  # five watchdog periods armed without ids
        w.publish_from_host(np.array([3, 1], dtype=np.int64))
        w.complete(timeout=5.0)
        assert rows.stats().watchdog_releases == 0 and rows.poison_cause is None
        # Ids that never come: not released (nothing waits on the device); the host's
        # bounded complete() says so, typed.
        w.begin(8)
        time.sleep(0.25)
        with pytest.raises(pm.StateError, match="has not filled"):
            w.complete(timeout=0.05)
        assert rows.stats().watchdog_releases == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_ids": 9},
        {"max_ids": 0},
        {"id_dtype": "float32"},
        {"heads": ([0, 10], [10])},
        {"heads": ([0], [ROWS + 1])},
        {"publish": "dma"},
    ],
)
def test_bad_worker_arguments(table: pm.MmapTable, kwargs: dict[str, object]) -> None:
    rows = pm.DeferredRows(8, WIDTH, device="cpu")
    with pytest.raises(pm.InvalidArgumentError):
        pm.GatherWorker(rows, table, **kwargs)  # type: ignore[arg-type]


def test_row_width_must_match(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(8, WIDTH * 2, device="cpu")
    with pytest.raises(pm.InvalidArgumentError, match="bytes"):
        pm.GatherWorker(rows, table)


def test_fill_from_gathers_straight_into_the_slot(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(16, WIDTH, device="cpu")
    ids = np.array([0, ROWS - 1, 5, 5, 999], dtype=np.int32)
    rows.begin(8)
    rows.fill_from(table, ids)
    rows.complete()
    np.testing.assert_array_equal(rows.staging[:5], table.gather(ids))
    assert not rows.staging[5:8].any()
    before = rows.staging.copy()
    rows.begin(8)
    with pytest.raises(pm.RowIdError):
        rows.fill_from(table, [1, ROWS])
    np.testing.assert_array_equal(rows.staging, before)
    assert rows.phase == "pending"  # nothing was published; the step can still be filled
    rows.fill_from(table, [2, 3])
    rows.complete()
    with pytest.raises(pm.RowShapeError):
        rows.begin(2)
        rows.fill_from(table, [1, 2, 3])
    narrow = pm.DeferredRows(4, WIDTH // 2, device="cpu")
    narrow.begin(1)
    with pytest.raises(pm.RowShapeError, match="bytes"):
        narrow.fill_from(table, [1])


def test_two_steps_in_flight_host_one_step_ahead(table: pm.MmapTable) -> None:
    """Asynchronous scheduling: the host arms step N+1 before step N's ids arrive; each
    complete() ends the oldest step, after its own rows were gathered."""
    rows = pm.DeferredRows(8, WIDTH, device="cpu")
    rng = np.random.default_rng(3)
    with pm.GatherWorker(rows, table, depth=2) as w:
        assert w.depth == 2
        published: list[np.ndarray] = []
        w.begin(8)
        for _ in range(50):
            w.begin(8)  # one step ahead
            assert w.in_flight == 2
            with pytest.raises(pm.StateError, match="already armed"):
                w.begin(8)
            ids = rng.integers(0, ROWS, int(rng.integers(1, 9)))
            published.append(ids)
            w.publish_from_host(ids)  # the GPU reaches the oldest step's publish
            w.complete()
            np.testing.assert_array_equal(rows.staging[: len(ids)], table.gather(ids))
            assert not rows.staging[len(ids) :].any()
        w.publish_from_host([1])
        w.complete()
        assert w.in_flight == 0
        assert w.stats().fills == 51


def test_host_filled_step_is_refused_while_the_worker_has_steps(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(8, WIDTH, device="cpu")
    with pm.GatherWorker(rows, table) as w:
        w.begin(4)
        with pytest.raises(pm.StateError, match="in flight"):
            rows.begin(4)
        w.publish_from_host([1, 2])
        w.complete()
        rows.begin(4)  # idle again: an eager, host-filled step is fine
        rows.fill_from(table, [7])
        rows.complete()
        np.testing.assert_array_equal(rows.staging[:1], table.gather([7]))


def test_a_publish_nobody_armed_never_feeds_the_next_step(table: pm.MmapTable) -> None:
    """A replay without begin(): the ids it published must not be gathered for the next
    armed step; the consumer reads zeros; the next call raises the typed error."""
    rows = pm.DeferredRows(8, WIDTH, device="cpu")
    w = pm.GatherWorker(rows, table)
    w.begin(8)
    w.publish_from_host([10, 11])
    w.complete()
    with pytest.raises(pm.StateError, match="no armed step"):
        w.publish_from_host([12, 13])  # a host publish is checked...
    w._simulate_replay_publish([12, 13])  # ...a replay nobody armed the worker for is not
    deadline = time.monotonic() + 5.0
    while rows.phase != "poisoned" and time.monotonic() < deadline:
        time.sleep(0.001)
    assert rows.phase == "poisoned"
    assert not rows.staging.any(), "the unarmed consumer must read zeros, not stale rows"
    with pytest.raises(pm.UnarmedReplayError, match=r"without begin\(\)"):
        w.begin(8)
    with pytest.raises(pm.PoisonedError, match="no step armed"):
        w.begin(8)
    assert w.stats().unarmed_replays == 1
    assert issubclass(pm.UnarmedReplayError, pm.StateError)
    w.close()


def test_depth_and_spin_are_validated(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(8, WIDTH, device="cpu")
    for bad in ({"depth": 0}, {"depth": 9}, {"spin": -1.0}, {"spin": float("nan")}):
        with pytest.raises(pm.InvalidArgumentError):
            pm.GatherWorker(rows, table, **bad)  # type: ignore[arg-type]
    with pm.GatherWorker(rows, table, depth=1, spin=0.0) as w:
        w.begin(2)
        with pytest.raises(pm.StateError, match="depth 1"):
            w.begin(2)
        w.publish_from_host([3])
        w.complete()
        np.testing.assert_array_equal(rows.staging[:1], table.gather([3]))


def test_closing_a_worker_that_published_releases_its_rows(table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(8, WIDTH, device="cpu")
    w = pm.GatherWorker(rows, table)
    w.begin(2)
    w.publish_from_host([3])
    w.complete()
    w.close()
    assert rows.phase == "poisoned"
    assert "can no longer be filled" in (rows.poison_cause or "")


def test_staged_rows_hold_the_published_tensors_until_the_join() -> None:
    """Under capture the side stream reads the ids after the capturing stream moved on; the
    handle keeps them alive until join(), then lets them go."""
    import gc
    import weakref

    class Ids:
        pass

    rows = pm.DeferredRows(4, WIDTH, device="cpu")
    ids = Ids()
    ref = weakref.ref(ids)
    staged = pm.StagedRows(rows, None, 3, keep=(ids, None))
    del ids
    gc.collect()
    assert ref() is not None, "the handle must keep the published ids alive"
    assert staged.join().shape == (3, WIDTH)
    gc.collect()
    assert ref() is None, "join() releases them"


def test_expected_ids_are_gathered_early_and_the_published_ids_decide(
    table: pm.MmapTable,
) -> None:
    """``begin(expected=...)``: rows the host expects are gathered before the step's ids
    arrive; at the publish only the unknown (``-1``) and the wrongly expected rows are
    gathered again, and the rows are always the published ids'."""
    rows = pm.DeferredRows(64, WIDTH, device="cpu")
    with pm.GatherWorker(rows, table) as w:
        rng = np.random.default_rng(3)
        for step in range(50):
            k = int(rng.integers(4, 65))
            ids = rng.integers(0, ROWS, k)
            expected = ids.copy()
            expected[: k // 4] = -1  # e.g. decode tokens, known only on the GPU
            expected[k - 1] = (ids[k - 1] + 1) % ROWS  # a wrong expectation
            w.begin(64, eager=step % 2 == 0, expected=expected.tolist())
            w.publish_from_host(ids)
            w.complete()
            np.testing.assert_array_equal(rows.staging[:k], table.gather(ids))
            assert not rows.staging[k:].any()
        s = w.stats()
        assert s.expected_steps == 50 and s.fills == 50 and s.failures == 0
        assert s.expected_rows_late > 0 and s.expected_rows_wrong == 50
        assert s.expected_rows_early + s.expected_rows_late == s.ids_total
        # More expected ids than the step's rows: refused, typed, nothing armed.
        with pytest.raises(pm.RowShapeError, match="65 expected ids for a step of 64 rows"):
            w.begin(64, expected=np.zeros(65, dtype=np.int64))
        assert w.in_flight == 0
        with pytest.raises(pm.RowShapeError, match="integers"):
            w.begin(64, expected=np.array([1.5, 2.0]))
        assert w.in_flight == 0
