"""The tables' steps on the host: ``Steps`` over gather workers that feed host rows (the
deferred protocol's host side), the host mode's eager gathers, the settings object and the
one id conversion. tests/test_steps_gpu.py covers the deferred mode on a GPU."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

import ple_memops as pm
from ple_memops import _common, settings
from ple_memops.steps import StepCounters, Steps, StepTable

torch = pytest.importorskip("torch")

ROWS, WIDTH = 64, 16


@pytest.fixture
def table(tmp_path: Path) -> Any:
    data = np.arange(ROWS * WIDTH, dtype=np.uint32).astype(np.uint8).reshape(ROWS, WIDTH)
    path = tmp_path / "t.safetensors"
    save_file({"ple.weight": data.view(np.float16)}, str(path))
    t = pm.MmapTable.open(path, "ple.weight")
    yield t
    t.close()


def _worker_steps(
    table: pm.MmapTable, names: tuple[str, ...] = ("t",), *, depth: int = 2, timeout: float = 5.0
) -> Steps:
    """Steps whose tables are fed by workers on host rows (as the deferred mode is)."""
    made = []
    for name in names:
        rows = pm.DeferredRows(8, table.row_bytes, device="cpu", watchdog=None)
        made.append(StepTable(name, table, rows, pm.GatherWorker(rows, table, depth=2)))
    return Steps(made, "deferred", None, None, depth, timeout)


def _poisoned(steps: Steps) -> bool:
    return all(t.rows.phase == "poisoned" for t in steps)


def test_depth_limits_the_steps_armed_and_settle_completes_the_oldest(table: Any) -> None:
    s = _worker_steps(table)
    assert s.deferred and s.timeout == 5.0 and s.depth == 2 and s.max_rows == 8
    base = s.counters("t")
    s.arm(2)
    s.publish_host("t", [1, 2])
    s.arm(2)
    s.publish_host("t", [3, 4])
    assert s.in_flight == 2 and s.counters().completed == 0
    assert s.arm(2)[0] == 1  # depth reached: the oldest step completes first
    assert s.in_flight == 2
    s.publish_host("t", [5, 6])
    assert s.settle(1) == 1 and s.in_flight == 1
    assert s.drain() == 1 and s.in_flight == 0
    np.testing.assert_array_equal(s.staging("t", 2), table.gather([5, 6]))
    got = s.counters("t").since(base)
    assert (got.armed, got.completed, got.fills, got.eager) == (3, 3, 3, 0)
    assert got.mean_fill_us is not None and got.mean_fill_us >= 0
    assert StepCounters().mean_fill_us is None
    s.shutdown()
    s.shutdown()  # idempotent
    assert s.closed and all(t.rows.phase == "closed" for t in s)
    with pytest.raises(pm.ClosedError):
        s.arm(1)
    with pytest.raises(pm.ClosedError):
        s.drain()


def test_completions_that_wait_for_a_fill_are_counted_and_timed(table: Any) -> None:
    s = _worker_steps(table)
    base = s.counters("t")
    s.arm(2)
    s.publish_host("t", [1, 2])
    deadline = time.monotonic() + 5
    while s.counters("t").since(base).fills < 1:
        assert time.monotonic() < deadline, "the worker never filled"
        time.sleep(0.001)
    s.settle(0)  # filled already: no wait
    assert s.counters("t").since(base).completes_waited == 0
    s.arm(2)
    later = threading.Timer(0.05, lambda: s.publish_host("t", [3, 4]))
    later.start()
    s.settle(0)  # before the ids: waits for the worker (GIL released)
    later.join()
    got = s.counters("t").since(base)
    assert got.completes_waited == 1, got
    assert got.mean_complete_wait_us is not None and got.mean_complete_wait_us >= 20_000, got
    np.testing.assert_array_equal(s.staging("t", 2), table.gather([3, 4]))
    assert StepCounters().mean_complete_wait_us is None
    s.shutdown()


def test_arm_completes_at_depth_then_arms_every_table_timed(table: Any) -> None:
    s = _worker_steps(table, ("a", "b"))
    base = {n: s.counters(n) for n in ("a", "b")}
    done = [s.arm(2)]
    for n in ("a", "b"):
        s.publish_host(n, [1, 2])
    done.append(s.arm(3))
    for n, ids in (("a", [3, 4, 5]), ("b", [6, 7, 8])):
        s.publish_host(n, ids)
    done.append(s.arm(1, True))  # an eager forward's step; depth reached: one completes
    assert [completed for completed, _, _ in done] == [0, 0, 1]
    assert all(wait_ns >= 0 and arm_ns > 0 for _, wait_ns, arm_ns in done)
    assert s.in_flight == 2
    for n in ("a", "b"):
        s.publish_host(n, [9])
    s.drain()
    np.testing.assert_array_equal(s.staging("a", 1), table.gather([9]))
    np.testing.assert_array_equal(s.staging("b", 1), table.gather([9]))
    for n in ("a", "b"):
        got = s.counters(n).since(base[n])
        assert (got.armed, got.completed, got.eager) == (3, 3, 1)
        assert (got.fills, got.eager_fills) == (3, 1)
    # Bad arguments raise typed and lose nothing: the armed step stays, nothing aborted.
    s.arm(2)
    for rows in (0, -1, 9):
        with pytest.raises(pm.RowShapeError, match="rows"):
            s.arm(rows)
    with pytest.raises(TypeError):
        s.arm(2.5)
    assert s.poison_cause is None and s.in_flight == 1 and s.counters().armed == 4
    assert s.step_counts == (4, 1, 3)  # armed, eager, completed: the native counts alone
    for n in ("a", "b"):
        s.publish_host(n, [4, 5])
    s.drain()
    np.testing.assert_array_equal(s.staging("a", 2), table.gather([4, 5]))
    s.shutdown()
    with pytest.raises(pm.ClosedError):
        s.arm(1)


def test_read_in_order_fills_cold_tables_with_their_rows_the_first_never_waiting(
    tmp_path: Path,
) -> None:
    """Each step's reads from storage table by table: every step of tables evicted before
    it gets its rows; the first table never waits for another; the waits are counted per
    worker; host tables (no workers) have no order to keep."""
    rng = np.random.default_rng(5)
    n_rows, width = 8192, 256  # 2 MiB a table: pages POSIX_FADV_DONTNEED can evict
    data = {f"t{i}": rng.integers(0, 255, (n_rows, width), dtype=np.uint8) for i in range(3)}
    path = tmp_path / "three.safetensors"
    save_file({k: v.view(np.float16) for k, v in data.items()}, str(path))
    tables = [pm.MmapTable.open(path, f"t{i}") for i in range(3)]
    made = []
    for i, t in enumerate(tables):
        rows = pm.DeferredRows(64, t.row_bytes, device="cpu", watchdog=None)
        made.append(StepTable(f"t{i}", t, rows, pm.GatherWorker(rows, t, depth=2)))
    s = Steps(made, "deferred", None, None, 1, 5.0, read_in_order=True)
    assert s.reads_in_order
    for _ in range(6):
        for t in tables:
            t.drop_pages()
        ids = {n: rng.integers(0, n_rows, 64) for n in s.names}
        s.arm(64)
        for n in s.names:
            s.publish_host(n, ids[n])
        s.drain()
        for n in s.names:
            np.testing.assert_array_equal(s.staging(n, 64), data[n][ids[n]])
    stats = {n: w for n, (_, w) in s.stats().items()}
    assert stats["t0"].ordered_waits == 0 and stats["t0"].ordered_passed_over == 0
    assert all(t.page_stats()["row_misses"] > 0 for t in tables)
    for n in ("t1", "t2"):
        w = stats[n]
        assert w.ordered_waits + w.ordered_passed_over <= 6, w
        assert (w.ordered_wait_ns_total > 0) == (w.ordered_waits > 0), w
    # A worker already in one order cannot join another.
    with pytest.raises(pm.InvalidArgumentError, match="another step object's order"):
        Steps(made[:2], "deferred", None, None, 1, 5.0, read_in_order=True)
    s.shutdown()
    # Tables that gather on the host have no workers: nothing to order.
    h = Steps.build({"a": tables[0], "b": tables[1]}, max_rows=8, device="cpu", read_in_order=True)
    assert h.mode == "host" and not h.reads_in_order
    h.shutdown()
    for t in tables:
        t.close()


def test_a_failure_aborts_every_table_in_the_native_step(table: Any) -> None:
    """All or none, owned by the native step: a fill that failed in one table completes
    every table's step, poisons all of them and raises the worker's typed error; no caller
    aborts anything."""
    s = _worker_steps(table, ("a", "b"), depth=1)
    s.arm(2)
    s.publish_host("a", [1, ROWS + 3])  # the worker's fill fails: out of range
    s.publish_host("b", [1, 2])
    with pytest.raises(pm.RowIdError):
        s.arm(2)  # completing the failed step
    assert _poisoned(s) and s.in_flight == 0
    assert (s.poison_cause or "").startswith("a: ")
    assert "arming a step of 2 rows" in (s.tables["b"].rows.poison_cause or "")
    with pytest.raises(pm.PoisonedError):
        s.arm(1)
    s.shutdown()
    # A worker closed under open steps: typed, and every table aborts.
    q = _worker_steps(table, ("a", "b"))
    q.tables["b"].worker.close()
    with pytest.raises(pm.ClosedError):
        q.arm(1)
    assert q.tables["a"].rows.phase == "poisoned"
    q.shutdown()


def test_publish_host_later_publishes_from_the_publisher_thread(table: Any) -> None:
    s = _worker_steps(table, depth=1)
    with pytest.raises(pm.StateError, match="arm"):
        s.publish_host_later("t", lambda: [1])
    known = threading.Event()
    s.arm(2)
    s.publish_host_later("t", lambda: (known.wait(5), [7, 8])[1])
    known.set()  # the ids become known after the "launch"
    assert s.settle(0) == 1  # waits for the publish, then completes
    np.testing.assert_array_equal(s.staging("t", 2), table.gather([7, 8]))
    s.arm(1)
    s.publish_host_later("t", lambda: [3])
    s.drain()
    np.testing.assert_array_equal(s.staging("t", 1), table.gather([3]))
    # An arming at depth completes the oldest step while its publish is still to come:
    # the native wait releases the GIL, the publisher thread publishes, the step fills.
    s.arm(2)
    later = threading.Event()
    s.publish_host_later("t", lambda: (later.wait(5), [5, 6])[1])
    threading.Timer(0.05, later.set).start()
    assert s.arm(1)[0] == 1
    np.testing.assert_array_equal(s.staging("t", 2), table.gather([5, 6]))
    s.publish_host("t", [7])
    assert s.drain() == 1
    s.stop_publisher()
    s.shutdown()


def test_a_failed_step_aborts_and_shutdown_never_raises(table: Any) -> None:
    s = _worker_steps(table)
    s.arm(1)
    s.publish_host("t", [ROWS + 1])
    with pytest.raises(pm.RowIdError):
        s.drain()
    with pytest.raises(pm.PoisonedError):
        s.arm(1)
    s.drain_for_shutdown()  # never raises
    s.shutdown()
    # A step whose ids never come: shutdown's drain is bounded by the timeout, aborts, and
    # closes.
    q = _worker_steps(table, timeout=0.05)
    q.arm(1)
    t0 = time.monotonic()
    q.shutdown()
    assert time.monotonic() - t0 < 5 and q.closed


def test_raise_if_failed_stops_a_step_whose_rows_failed(table: Any) -> None:
    """Before an engine hands out a step's output: nothing while the rows are good; once
    a fill failed (its consumer read zeros), the worker's typed error comes out."""
    s = _worker_steps(table)
    s.arm(1)
    s.publish_host("t", [2])
    s.drain()
    s.raise_if_failed()  # good rows: nothing
    assert s.poison_cause is None
    s.arm(1)
    s.publish_host("t", [ROWS + 5])  # the fill fails in the worker
    deadline = time.monotonic() + 5
    while s.poison_cause is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert "out of range" in (s.poison_cause or "")
    with pytest.raises(pm.RowIdError):
        s.raise_if_failed()
    with pytest.raises(pm.PoisonedError):
        s.raise_if_failed()  # and every later check
    s.shutdown()


def test_no_armed_step_is_typed_and_leaves_the_steps_usable(table: Any) -> None:
    s = _worker_steps(table)
    with pytest.raises(pm.NoArmedStepError, match="no armed step") as info:
        s.publish_host("t", [1])
    assert isinstance(info.value, pm.StateError) and s.poison_cause is None
    s.arm(1)
    s.publish_host("t", np.array([[9]]))  # any shape, row-major
    s.drain()
    np.testing.assert_array_equal(s.staging("t", 1), table.gather([9]))
    with pytest.raises(pm.InvalidArgumentError, match="no table"):
        s.publish_host("x", [1])
    s.shutdown()


def test_guard_and_abort_on_abort_every_table_logged(
    table: Any, caplog: pytest.LogCaptureFixture
) -> None:
    s = _worker_steps(table, ("a", "b"))
    s.arm(1)
    with caplog.at_level(logging.DEBUG, "ple_memops"):
        with pytest.raises(KeyboardInterrupt), s.guard("the launch"):
            raise KeyboardInterrupt
        s.abort_on("a second scope", ValueError("same failure"))
    assert _poisoned(s)
    assert "the launch" in (s.tables["b"].rows.poison_cause or "")
    errors = [r for r in caplog.records if "aborting deferred PLE rows" in r.getMessage()]
    assert [r.levelno for r in errors] == [logging.ERROR, logging.DEBUG]
    s.shutdown()
    s.abort_on("after shutdown", ValueError("late"))  # nothing once shut down


@pytest.fixture
def tables(random_tables: Any) -> Iterator[dict[str, pm.MmapTable]]:
    with random_tables(500, {"layer2": 32, "layer5": 64}) as out:
        yield out


def test_host_steps_gather_the_tables_bytes(
    tables: dict[str, pm.MmapTable], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ple_memops"):
        s = Steps.build(tables, max_rows=16, device="cpu")
    assert s.mode == "host" and not s.deferred
    assert "no CUDA device" in (s.reason or "")
    assert sum("host path" in r.getMessage() for r in caplog.records) == 1
    assert s.names == ["layer2", "layer5"]
    with s:
        rng = np.random.default_rng(1)
        for _ in range(20):
            for name, table in tables.items():
                ids = rng.integers(0, 500, int(rng.integers(1, 17)))
                got = s.gather_now(name, torch.from_numpy(ids), rows=16)
                assert isinstance(got, torch.Tensor) and got.shape == (16, table.row_bytes)
                np.testing.assert_array_equal(got[: len(ids)].numpy(), table.gather(ids))
                assert not got[len(ids) :].any()
        assert s.staging("layer5").shape == (16, 64)
        assert s.dummy_now("layer2", 4).shape == (4, 32)
        # No workers on the host: nothing to arm (typed), settling has nothing to do.
        with pytest.raises(pm.StateError, match="deferred path"):
            s.arm(4)
        assert s.drain() == 0 and s.in_flight == 0
        with pytest.raises(pm.StateError, match="deferred path"):
            s.stage("layer2", torch.zeros(4, dtype=torch.int64), rows=4)
        with pytest.raises(pm.StateError, match="gather_now"):
            s.publish_host("layer2", [1, 2])
        assert s.poison_cause is None
    assert s.closed
    with pytest.raises(pm.ClosedError):
        s.gather_now("layer2", [1])


def test_gather_many_now_gathers_every_table_at_once(tables: dict[str, pm.MmapTable]) -> None:
    """Several tables from host ids, each gathered on a thread of its own: the tables'
    bytes, padded with zeros to the extent; all or none on a bad id; never a device
    synchronisation (ids in a CUDA tensor are refused, here a CPU run can only show the
    host kinds it takes)."""
    with Steps.build(tables, max_rows=16, device="cpu", log_fallback=False) as s:
        rng = np.random.default_rng(4)
        for _ in range(10):
            ids = {name: rng.integers(0, 500, int(rng.integers(1, 17))) for name in tables}
            got = s.gather_many_now(
                {"layer2": torch.from_numpy(ids["layer2"]), "layer5": list(ids["layer5"])},
                rows=16,
            )
            for name, table in tables.items():
                n = len(ids[name])
                np.testing.assert_array_equal(got[name][:n].numpy(), table.gather(ids[name]))
                assert not got[name][n:].any()
                assert got[name].data_ptr() == s.staging(name).data_ptr()
        before = {name: s.staging(name).clone() for name in tables}
        with pytest.raises(pm.RowIdError):
            s.gather_many_now({"layer2": [1, 2], "layer5": [3, 500]})
        for name in tables:  # nothing was written to either table
            assert torch.equal(s.staging(name), before[name])
        with pytest.raises(pm.InvalidArgumentError, match="ids for a step of 1 rows"):
            s.gather_many_now({"layer2": [1, 2]}, rows=1)
        one = s.gather_many_now({"layer5": [7]})  # one table: no thread
        np.testing.assert_array_equal(one["layer5"].numpy(), tables["layer5"].gather([7]))


def test_bad_ids_raise_before_anything_changes(tables: dict[str, pm.MmapTable]) -> None:
    with Steps.build(tables, max_rows=8, device="cpu", log_fallback=False) as s:
        before = s.gather_now("layer2", [1, 2], rows=4).clone()
        with pytest.raises(pm.RowIdError):
            s.gather_now("layer2", [3, 500], rows=4)
        assert torch.equal(s.staging("layer2", 4), before)
        # The table is still usable: the failed step never began.
        np.testing.assert_array_equal(
            s.gather_now("layer2", [4], rows=4)[:1].numpy(), tables["layer2"].gather([4])
        )
        with pytest.raises(pm.InvalidArgumentError, match="ids for a step"):
            s.gather_now("layer2", [1, 2, 3], rows=2)
        with pytest.raises(pm.InvalidArgumentError, match="no table"):
            s.gather_now("layer9", [1])
        assert s.in_flight == 0 and not s.closed


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_rows": 0},
        {"max_rows": True},
        {"max_rows": 4, "timeout": 0.0},
        {"max_rows": 4, "depth": 0},
        {"max_rows": 4, "depth": True},
        {"max_rows": 4, "device": "gpu"},
    ],
)
def test_bad_arguments(tables: dict[str, pm.MmapTable], kwargs: dict[str, object]) -> None:
    with pytest.raises(pm.InvalidArgumentError):
        Steps.build(tables, **kwargs)  # type: ignore[arg-type]


def test_names_must_be_unique_and_present(tables: dict[str, pm.MmapTable]) -> None:
    t = tables["layer2"]
    with pytest.raises(pm.InvalidArgumentError, match="unique"):
        Steps.build([("a", t), ("a", t)], max_rows=4, device="cpu")
    with pytest.raises(pm.InvalidArgumentError, match="at least one"):
        Steps.build({}, max_rows=4, device="cpu")


def test_the_native_step_refuses_a_depth_its_workers_cannot_hold(table: Any) -> None:
    with pytest.raises(pm.InvalidArgumentError, match="depth"):
        _worker_steps(table, depth=3)  # the workers hold 2


def test_settings_are_the_one_source_of_defaults() -> None:
    d = settings.DEFAULTS
    assert (settings.DEFAULT_TIMEOUT, settings.DEFAULT_WATCHDOG) == (d.timeout, d.watchdog)
    assert (settings.DEFAULT_TIMEOUT, settings.DEPTH) == (30.0, 2)
    assert d.replace(depth=3).depth == 3 and d.depth == 2
    for bad in ({"depth": 0}, {"timeout": -1.0}, {"copy": "dma"}, {"publish": "x"}):
        with pytest.raises(pm.InvalidArgumentError):
            d.replace(**bad)
    with pytest.raises(pm.InvalidArgumentError, match="unknown"):
        d.replace(depht=3)


class _FakeCudaIds:
    """A tensor-like object on a CUDA device (no GPU needed)."""

    device = SimpleNamespace(type="cuda")

    def __init__(self, values: list[int]) -> None:
        self._t = torch.tensor(values)

    def detach(self) -> Any:
        return self

    def reshape(self, *shape: int) -> Any:
        return self

    def to(self, device: str) -> Any:
        return self._t

    def numpy(self) -> Any:  # pragma: no cover - a CUDA tensor has no host view
        raise AssertionError("read without a copy")


def test_host_ids_policy_is_explicit() -> None:
    arr = np.array([1, 2], np.int64)
    assert _common.host_ids(arr, allow_device_sync=False) is arr
    with pytest.raises(pm.InvalidArgumentError, match="on the host"):
        _common.host_ids(_FakeCudaIds([1]), allow_device_sync=False)
    with pytest.raises(pm.RowShapeError, match="on the host"):
        _common.host_ids(_FakeCudaIds([1]), allow_device_sync=False, error=pm.RowShapeError)
    got = _common.host_ids(_FakeCudaIds([4, 5]), allow_device_sync=True, dtype=np.int64)
    assert got.dtype == np.int64 and got.tolist() == [4, 5]
    flat = _common.host_ids([[1], [2]], allow_device_sync=False, flatten=True)
    assert flat.tolist() == [1, 2]
    with pytest.raises(pm.RowShapeError, match="1-D"):
        _common.host_ids([[1]], allow_device_sync=False, error=pm.RowShapeError)
    assert _common.host_ids([], allow_device_sync=False).dtype == np.int64
    with pytest.raises(pm.RowIdError):
        _common.host_ids(np.array([2**63], np.uint64), allow_device_sync=False)
    assert _common.plan_device(None) in (0, "cpu")
    assert _common.plan_device(torch.device("cpu")) == "cpu"
    assert _common.plan_device(torch.device("cuda")) == 0
    assert not _common.capturing(torch.zeros(1))


def test_the_stats_line_says_which_completions_waited(table: Any) -> None:
    from ple_memops.vllm.hooks import PleRunnerHooks

    hk = PleRunnerHooks(_worker_steps(table), rows_per_token=1)
    try:
        driver = hk.steps
        hk.log_stats(force=True)
        driver.arm(2)
        driver.publish_host("t", [1, 2])
        driver.settle(0)  # may or may not wait for the fill
        first = hk.log_stats(force=True)
        driver.arm(2)
        later = threading.Timer(0.05, lambda: driver.publish_host("t", [3, 4]))
        later.start()
        driver.settle(0)  # waits for the worker
        later.join()
        line = hk.log_stats(force=True)
        assert line is not None and first is not None
        assert "rows read cold and completes that waited: t 1 fills" in line, line
        waited = re.search(r", 1 completes waited ([\d.]+) us", line)
        assert waited and float(waited.group(1)) >= 20_000, line
    finally:
        hk.shutdown()
