"""The step driver on the host (a plan whose tables have gather workers feeding host rows),
the settings object and the one id conversion. The GPU suites drive it through the
transformers runner."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

import ple_memops as pm
from ple_memops import _common, plan, settings
from ple_memops.plan import PlanLayer, RowsPlan
from ple_memops.steps import StepCounters, StepDriver

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


def _worker_plan(table: pm.MmapTable, *, timeout: float = 5.0) -> RowsPlan:
    """A plan whose one table is fed by a worker on host rows (as the deferred mode is)."""
    rows = pm.DeferredRows(8, table.row_bytes, device="cpu", watchdog=None)
    worker = pm.GatherWorker(rows, table, depth=2)
    return RowsPlan([PlanLayer("t", table, rows, worker)], "deferred", None, None, timeout)


def test_depth_limits_the_steps_armed_and_settle_completes_the_oldest(table: Any) -> None:
    p = _worker_plan(table)
    driver = StepDriver(p, depth=2)
    assert driver.deferred and driver.timeout == 5.0
    base = driver.counters("t")
    driver.arm(2)
    driver.publish_host("t", [1, 2])
    driver.arm(2)
    driver.publish_host("t", [3, 4])
    assert driver.in_flight == 2 and driver.completed_steps == 0
    driver.arm(2)  # depth reached: the oldest step completes first
    assert driver.completed_steps == 1 and driver.in_flight == 2
    driver.publish_host("t", [5, 6])
    driver.settle(1)
    assert driver.in_flight == 1 and driver.completed_steps == 2
    driver.drain()
    assert driver.in_flight == 0 and driver.completed_steps == 3
    np.testing.assert_array_equal(p.staging("t", 2), table.gather([5, 6]))
    got = driver.counters("t").since(base)
    assert (got.armed, got.completed, got.fills) == (3, 3, 3)
    assert got.mean_fill_us is not None and got.mean_fill_us >= 0
    assert StepCounters().mean_fill_us is None
    driver.shutdown()
    driver.shutdown()  # idempotent
    assert driver.closed and p.closed
    with pytest.raises(pm.ClosedError):
        driver.arm(1)


def test_completions_that_wait_for_a_fill_are_counted_and_timed(table: Any) -> None:
    p = _worker_plan(table)
    driver = StepDriver(p)
    base = driver.counters("t")
    driver.arm(2)
    driver.publish_host("t", [1, 2])
    deadline = time.monotonic() + 5
    while driver.counters("t").since(base).fills < 1:
        assert time.monotonic() < deadline, "the worker never filled"
        time.sleep(0.001)
    driver.settle(0)  # filled already: no wait
    assert driver.counters("t").since(base).completes_waited == 0
    driver.arm(2)
    later = threading.Timer(0.05, lambda: driver.publish_host("t", [3, 4]))
    later.start()
    driver.settle(0)  # before the ids: waits for the worker (GIL released)
    later.join()
    got = driver.counters("t").since(base)
    assert got.completes_waited == 1, got
    assert got.mean_complete_wait_us is not None and got.mean_complete_wait_us >= 20_000, got
    np.testing.assert_array_equal(p.staging("t", 2), table.gather([3, 4]))
    assert StepCounters().mean_complete_wait_us is None
    driver.shutdown()


def _two_table_plan(table: pm.MmapTable) -> RowsPlan:
    layers = []
    for name in ("a", "b"):
        rows = pm.DeferredRows(8, table.row_bytes, device="cpu", watchdog=None)
        layers.append(PlanLayer(name, table, rows, pm.GatherWorker(rows, table, depth=2)))
    return RowsPlan(layers, "deferred", None, None, 5.0)


class _Without:
    """A plan without some of ``stepper`` and ``advance`` (any other PlanLike): the driver
    steps it through what is left, down to call by call."""

    def __init__(self, plan: RowsPlan, hidden: tuple[str, ...]) -> None:
        self._plan, self._hidden = plan, hidden

    def __getattr__(self, name: str) -> Any:
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(self._plan, name)


@pytest.mark.parametrize(
    "hidden",
    [(), ("stepper",), ("stepper", "advance")],
    ids=["stepper", "plan-advance", "call-by-call"],
)
def test_advance_completes_at_depth_then_arms_every_table_timed(
    table: Any, hidden: tuple[str, ...]
) -> None:
    p = _two_table_plan(table)
    driver = StepDriver(_Without(p, hidden) if hidden else p, depth=2)  # type: ignore[arg-type]
    assert (driver.stepper is not None) == (not hidden)
    base = {n: driver.counters(n) for n in ("a", "b")}
    done = [driver.advance(2)]
    for n in ("a", "b"):
        driver.publish_host(n, [1, 2])
    done.append(driver.advance(3))
    for n, ids in (("a", [3, 4, 5]), ("b", [6, 7, 8])):
        driver.publish_host(n, ids)
    done.append(driver.advance(1, eager=True))  # depth reached: the oldest completes first
    assert [completed for completed, _, _ in done] == [0, 0, 1]
    assert all(wait_ns >= 0 and arm_ns > 0 for _, wait_ns, arm_ns in done)
    assert driver.in_flight == 2 and (driver.armed_steps, driver.completed_steps) == (3, 1)
    for n in ("a", "b"):
        driver.publish_host(n, [9])
    driver.drain()
    np.testing.assert_array_equal(p.staging("a", 1), table.gather([9]))
    np.testing.assert_array_equal(p.staging("b", 1), table.gather([9]))
    for n in ("a", "b"):
        got = driver.counters(n).since(base[n])
        assert (got.armed, got.completed, got.fills, got.eager_fills) == (3, 3, 3, 1)
    # Bad arguments raise typed and lose nothing: the armed step stays, the plan usable.
    driver.advance(2)
    for rows in (0, -1, 9):
        with pytest.raises(pm.RowShapeError, match=r"1\.\.=8 rows"):
            p.advance(rows, 2)
    with pytest.raises(pm.InvalidArgumentError, match="depth"):
        p.advance(2, 0)
    assert p.poison_cause is None and driver.in_flight == 1
    for n in ("a", "b"):
        driver.publish_host(n, [4, 5])
    driver.drain()
    np.testing.assert_array_equal(p.staging("a", 2), table.gather([4, 5]))
    driver.shutdown()
    with pytest.raises(pm.ClosedError):
        driver.advance(1)
    with pytest.raises(pm.ClosedError):
        p.advance(1, 2)


def test_advance_failure_aborts_the_plan_logged_and_typed(
    table: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p = _two_table_plan(table)
    driver = StepDriver(p, depth=1, log=logging.getLogger("test-advance"))
    driver.advance(2)
    driver.publish_host("a", [1, ROWS + 3])  # the worker's fill fails: out of range
    driver.publish_host("b", [1, 2])
    with caplog.at_level(logging.ERROR, "test-advance"):
        with pytest.raises(pm.RowIdError):
            driver.advance(2)  # completing the failed step
    assert "aborting deferred PLE rows" in caplog.text and "arming a step" in caplog.text
    # Every table is released, nothing stays armed, later steps are refused.
    assert all(layer.rows.phase == "poisoned" for layer in p)
    with pytest.raises(pm.PoisonedError):
        driver.advance(1)
    driver.shutdown()
    # A worker closed under an open plan: typed, and the plan aborts (all or none).
    q = _two_table_plan(table)
    q.layers["b"].worker.close()
    with pytest.raises(pm.ClosedError):
        q.advance(1, 2)
    assert q.layers["a"].rows.phase == "poisoned"
    q.close()


def test_a_plans_stepper_is_advance_in_one_native_call(table: Any) -> None:
    """``RowsPlan.stepper``: ``advance`` with depth and timeout bound, counting its steps;
    bad arguments typed and harmless; a failure raised, the abort left to its caller; closed
    with the plan."""
    p = _two_table_plan(table)
    step = p.stepper(2, timeout=3.0)
    assert (step.depth, step.timeout, step.armed, step.completed) == (2, 3.0, 0, 0)
    assert step(2)[0] == 0 and step(3, True)[0] == 0  # a replay's step, an eager one
    for n, ids in (("a", [1, 2]), ("b", [3, 4])):
        p.publish_host(n, ids)
    completed, wait_ns, arm_ns = step(1)  # depth reached: the oldest completes first
    assert completed == 1 and wait_ns >= 0 and arm_ns > 0
    np.testing.assert_array_equal(p.staging("b", 2), table.gather([3, 4]))
    assert (step.armed, step.completed, p.in_flight) == (3, 1, 2)
    workers = {n: p.layers[n].worker.stats() for n in ("a", "b")}
    assert all((w.fills, w.eager_fills) == (1, 0) for w in workers.values()), workers
    # Bad arguments: typed, before anything is completed or armed.
    for rows in (0, -1, 9):
        with pytest.raises(pm.RowShapeError, match="rows"):
            step(rows)
    with pytest.raises(TypeError):
        step(2.5)  # type: ignore[arg-type]
    with pytest.raises(pm.InvalidArgumentError, match="depth"):
        p.stepper(0)
    assert (step.armed, p.in_flight, p.poison_cause) == (3, 2, None)
    # A failed fill is raised; the stepper does not abort the plan (its caller does).
    for n, ids in (("a", [1, ROWS + 5, 2]), ("b", [1, 2, 3])):
        p.publish_host(n, ids)
    with pytest.raises(pm.RowIdError):
        step(1)
    assert p.layers["b"].rows.phase != "poisoned"
    p.abort("the caller's abort")
    assert all(layer.rows.phase == "poisoned" for layer in p)
    p.close()
    assert step.closed
    with pytest.raises(pm.ClosedError):
        step(1)
    with pytest.raises(pm.ClosedError):
        p.stepper(2)
    # A plan without workers has none.
    with RowsPlan.build({"t": table}, max_rows=8, device="cpu", log_fallback=False) as host:
        with pytest.raises(pm.StateError, match="deferred"):
            host.stepper(2)
        assert StepDriver(host).stepper is None


def test_advance_waits_for_a_pending_host_publish(table: Any) -> None:
    p = _worker_plan(table)
    driver = StepDriver(p, depth=1)
    known = threading.Event()
    driver.advance(2)
    driver.publish_host_later("t", lambda: (known.wait(5), [7, 8])[1])
    known.set()
    done = driver.advance(1)  # completes the step once its publish is in (call by call)
    assert done[0] == 1 and driver.completed_steps == 1
    np.testing.assert_array_equal(p.staging("t", 2), table.gather([7, 8]))
    driver.publish_host("t", [4])
    driver.drain()
    driver.stop_publisher()
    driver.shutdown()


def test_publish_host_later_publishes_from_the_publisher_thread(table: Any) -> None:
    p = _worker_plan(table)
    driver = StepDriver(p)
    with pytest.raises(pm.StateError, match="arm"):
        driver.publish_host_later("t", lambda: [1])
    known = threading.Event()
    driver.arm(2)
    driver.publish_host_later("t", lambda: (known.wait(5), [7, 8])[1])
    known.set()  # the ids become known after the "launch"
    driver.settle(0)  # waits for the publish, then completes
    np.testing.assert_array_equal(p.staging("t", 2), table.gather([7, 8]))
    driver.stop_publisher()
    driver.shutdown()


def test_a_failed_step_aborts_the_plan_and_raises_its_error(table: Any) -> None:
    p = _worker_plan(table)
    driver = StepDriver(p)
    driver.arm(1)
    driver.publish_host("t", [ROWS + 1])
    with pytest.raises(pm.RowIdError):
        driver.drain()
    with pytest.raises(pm.PoisonedError):
        driver.arm(1)
    driver.drain_for_shutdown()  # never raises
    driver.shutdown()


def test_raise_if_failed_stops_a_step_whose_rows_failed(table: Any) -> None:
    """Before an engine hands out a step's output: nothing while the rows are good; once
    a fill failed (its consumer read zeros), the worker's typed error comes out."""
    p = _worker_plan(table)
    driver = StepDriver(p)
    driver.arm(1)
    driver.publish_host("t", [2])
    driver.drain()
    driver.raise_if_failed()  # good rows: nothing
    assert p.poison_cause is None
    driver.arm(1)
    driver.publish_host("t", [ROWS + 5])  # the fill fails in the worker
    deadline = time.monotonic() + 5
    while p.poison_cause is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert "out of range" in (p.poison_cause or "")
    with pytest.raises(pm.RowIdError):
        driver.raise_if_failed()
    with pytest.raises(pm.PoisonedError):
        driver.raise_if_failed()  # and every later check
    driver.shutdown()


def test_no_armed_step_is_typed_and_leaves_the_plan_usable(table: Any) -> None:
    p = _worker_plan(table)
    with pytest.raises(pm.NoArmedStepError, match="no armed step") as info:
        p.publish_host("t", [1])
    assert isinstance(info.value, pm.StateError)
    driver = StepDriver(p)
    driver.arm(1)
    driver.publish_host("t", np.array([[9]]))  # any shape, row-major
    driver.drain()
    np.testing.assert_array_equal(p.staging("t", 1), table.gather([9]))
    driver.shutdown()


def test_guard_and_launch_abort_on_any_exception(table: Any) -> None:
    p = _worker_plan(table)
    driver = StepDriver(p)

    def launch() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        driver.launch(1, launch)
    assert p.layers["t"].rows.phase == "poisoned"
    assert "launch" in (p.layers["t"].rows.poison_cause or "")
    driver.shutdown()
    q = _worker_plan(table)
    d2 = StepDriver(q)
    with pytest.raises(ValueError), d2.guard("a test"):
        raise ValueError("boom")
    assert "a test" in (q.layers["t"].rows.poison_cause or "")
    d2.shutdown()
    d2.abort_on("after shutdown", ValueError("late"))  # nothing once shut down
    r = _worker_plan(table)
    d3 = StepDriver(r)
    d3.abort_on("a caught failure", RuntimeError("bad"))
    assert "exception in a caught failure: RuntimeError('bad')" in (
        r.layers["t"].rows.poison_cause or ""
    )
    d3.shutdown()


def test_eager_steps_through_the_driver_on_a_host_plan(table: Any) -> None:
    with RowsPlan.build({"t": table}, max_rows=8, device="cpu", log_fallback=False) as p:
        driver = StepDriver(p)
        assert driver.mode == "host" and not driver.deferred
        got = driver.gather_now("t", torch.tensor([3, 4]), rows=4)
        np.testing.assert_array_equal(got[:2].numpy(), table.gather([3, 4]))
        assert not got[2:].any()
        assert driver.dummy_now("t", 2).shape == (2, WIDTH)
        driver.arm(2)  # no workers on the host: a no-op
        driver.settle(0)
        assert driver.staging("t", 3).shape == (3, WIDTH)


def test_bad_driver_arguments(table: Any) -> None:
    with RowsPlan.build({"t": table}, max_rows=8, device="cpu", log_fallback=False) as p:
        for kwargs in ({"depth": 0}, {"depth": True}, {"timeout": 0.0}):
            with pytest.raises(pm.InvalidArgumentError):
                StepDriver(p, **kwargs)  # type: ignore[arg-type]


def test_settings_are_the_one_source_of_defaults() -> None:
    d = settings.DEFAULTS
    assert (plan.DEFAULT_TIMEOUT, plan.DEFAULT_WATCHDOG) == (d.timeout, d.watchdog)
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

    hk = PleRunnerHooks(_worker_plan(table), rows_per_token=1)
    try:
        driver = hk.driver
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
