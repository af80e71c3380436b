"""DeferredRows through its public API on the host path (no GPU needed): lifecycle,
misuse, poisoning, the watchdog, bad input and the error mapping."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ple_memops as pm
from ple_memops import _native, errors

ROW = 16


def rows_of(k: int, seed: int = 0, width: int = ROW) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, size=(k, width), dtype=np.uint8)


@pytest.fixture
def dr() -> pm.DeferredRows:
    r = pm.DeferredRows(8, ROW, device="cpu")
    yield r
    r.close()


def test_host_mode_and_staging(dr: pm.DeferredRows) -> None:
    assert dr.mode == "host"
    assert not dr.deferred
    assert dr.fallback_reason
    assert dr.staging.shape == (8, ROW) and dr.staging.dtype == np.uint8
    assert dr.phase == "idle"


def test_full_step_writes_rows_and_zero_padding(dr: pm.DeferredRows) -> None:
    dr.begin(6)
    first = rows_of(6, 1)
    dr.fill(first)
    dr.enqueue()
    dr.complete()
    np.testing.assert_array_equal(dr.staging[:6], first)
    # A shorter fill zeroes the padding up to the step's extent, and leaves rows past
    # the extent alone.
    dr.staging[7] = 99
    dr.begin(6)
    second = rows_of(2, 2)
    dr.fill(second)
    dr.complete()
    np.testing.assert_array_equal(dr.staging[:2], second)
    assert not dr.staging[2:6].any()
    assert (dr.staging[7] == 99).all()


def test_padding_is_zeroed_after_a_larger_earlier_fill(dr: pm.DeferredRows) -> None:
    for k, seed in [(8, 3), (1, 4), (5, 5), (0, 6)]:
        dr.begin(8)
        dr.fill(rows_of(k, seed))
        dr.complete()
        np.testing.assert_array_equal(dr.staging[:k], rows_of(k, seed))
        assert not dr.staging[k:].any()


def test_torch_cpu_tensor_and_non_contiguous_rows(dr: pm.DeferredRows) -> None:
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(rows_of(3, 7))
    dr.begin(3)
    dr.fill(t)
    dr.complete()
    np.testing.assert_array_equal(dr.staging[:3], t.numpy())
    wide = rows_of(3, 8, width=2 * ROW)
    dr.begin(3)
    dr.fill(wide[:, ::2])
    dr.complete()
    np.testing.assert_array_equal(dr.staging[:3], wide[:, ::2])


def test_prepare_dummy_publishes_without_data(dr: pm.DeferredRows) -> None:
    dr.begin(2)
    dr.prepare_dummy()
    dr.enqueue()
    dr.complete()
    s = dr.stats()
    assert (s.dummies, s.fills, s.steps, s.eager_enqueues) == (1, 0, 1, 1)


@pytest.mark.parametrize(
    "calls, bad",
    [
        ([], "fill"),
        ([], "complete"),
        ([], "enqueue"),
        (["begin"], "begin"),
        (["begin"], "complete"),
        (["begin"], "enqueue"),
        (["begin", "fill"], "fill"),
        (["begin", "fill"], "prepare_dummy"),
        (["begin", "fill", "enqueue"], "enqueue"),
    ],
)
def test_misuse_raises_state_error_and_writes_nothing(
    dr: pm.DeferredRows, calls: list[str], bad: str
) -> None:
    do = {
        "begin": lambda: dr.begin(4),
        "fill": lambda: dr.fill(rows_of(4, 9)),
        "prepare_dummy": dr.prepare_dummy,
        "enqueue": dr.enqueue,
        "complete": dr.complete,
    }
    for c in calls:
        do[c]()
    before = dr.staging.copy()
    with pytest.raises(pm.StateError):
        do[bad]()
    np.testing.assert_array_equal(dr.staging, before)


def test_bad_rows_raise_row_shape_error_and_write_nothing(dr: pm.DeferredRows) -> None:
    dr.begin(4)
    before = dr.staging.copy()
    for bad in [
        rows_of(5),  # more rows than the step holds
        rows_of(2, width=ROW + 1),  # wrong width
        rows_of(2).astype(np.float32),  # wrong dtype
        rows_of(2).reshape(-1),  # 1-D
        [[1] * ROW],  # not an array
    ]:
        with pytest.raises(pm.RowShapeError):
            dr.fill(bad)
        assert isinstance(pm.RowShapeError("x"), ValueError)
    np.testing.assert_array_equal(dr.staging, before)
    assert dr.phase == "pending"  # still fillable
    dr.fill(rows_of(4))
    dr.complete()


def test_too_large_or_empty_step_is_refused(dr: pm.DeferredRows) -> None:
    with pytest.raises(pm.RowShapeError):
        dr.begin(9)
    with pytest.raises(pm.RowShapeError):
        dr.begin(0)
    assert dr.phase == "idle"


def test_abort_poisons_every_later_call_with_the_first_cause(dr: pm.DeferredRows) -> None:
    dr.begin(2)
    dr.abort("gather failed: disk on fire")
    dr.abort("second cause is ignored")
    assert dr.phase == "poisoned"
    assert dr.poison_cause == "gather failed: disk on fire"
    for call in [
        lambda: dr.begin(1),
        lambda: dr.fill(rows_of(1)),
        dr.prepare_dummy,
        dr.enqueue,
        dr.complete,
        lambda: dr.wait_consumed(0.01),
    ]:
        with pytest.raises(pm.PoisonedError, match="disk on fire"):
            call()
    assert dr.stats().aborts == 1


def test_watchdog_aborts_an_unfilled_step() -> None:
    with pm.DeferredRows(4, ROW, device="cpu", watchdog=0.05) as r:
        r.begin(2)
        deadline = time.monotonic() + 5
        while r.phase != "poisoned" and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(pm.PoisonedError, match="watchdog"):
            r.complete()
        s = r.stats()
        assert s.watchdog_releases == 1 and s.aborts == 1


def test_watchdog_leaves_filled_steps_alone() -> None:
    with pm.DeferredRows(4, ROW, device="cpu", watchdog=0.05) as r:
        for _ in range(3):
            r.begin(2)
            r.fill(rows_of(2))
            time.sleep(0.08)
            r.complete()
        assert r.stats().watchdog_releases == 0
        assert r.phase == "idle"


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_step_context_aborts_on_any_exception(dr: pm.DeferredRows, exc: BaseException) -> None:
    with pytest.raises(type(exc)), dr.step(3):
        raise exc
    assert dr.phase == "poisoned"
    assert type(exc).__name__ in (dr.poison_cause or "")


def test_step_context_completes(dr: pm.DeferredRows) -> None:
    with dr.step(3):
        dr.fill(rows_of(3))
    assert dr.phase == "idle"
    with pytest.raises(pm.StateError), dr.step(3):
        pass  # no fill: complete() refuses


def test_close_is_idempotent_and_use_after_close_raises() -> None:
    r = pm.DeferredRows(2, ROW, device="cpu")
    r.begin(1)
    r.close()
    r.close()
    assert r.closed and r.phase == "closed"
    with pytest.raises(pm.ClosedError):
        r.begin(1)
    with pytest.raises(pm.ClosedError):
        r.fill(rows_of(1))
    with pm.DeferredRows(2, ROW, device="cpu") as r2:
        assert r2.phase == "idle"
    assert r2.closed


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_rows": 0, "row_bytes": 4},
        {"max_rows": 4, "row_bytes": 0},
        {"max_rows": 4, "row_bytes": 4, "device": "tpu"},
        {"max_rows": 4, "row_bytes": 4, "device": "cpu", "watchdog": -1.0},
        {"max_rows": 4, "row_bytes": 4, "device": "cpu", "copy": "dma"},
        {"max_rows": 4, "row_bytes": 4, "staging": np.zeros((4, 5), np.uint8)},
        {"max_rows": 4, "row_bytes": 4, "staging": np.zeros((4, 4), np.int8)},
        {"max_rows": 4, "row_bytes": 4, "staging": np.zeros((4, 8), np.uint8)[:, ::2]},
    ],
)
def test_bad_construction_raises_invalid_argument(kwargs: dict[str, object]) -> None:
    with pytest.raises(pm.InvalidArgumentError):
        pm.DeferredRows(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_rows": 2**40, "row_bytes": 2**30, "device": "cpu"}, "max_rows * row_bytes"),
        ({"max_rows": 2**40, "row_bytes": 2**30}, "max_rows * row_bytes"),
        ({"max_rows": 4, "row_bytes": 4, "device": -1}, "device"),
    ],
)
def test_impossible_sizes_and_devices_raise_invalid_argument_naming_it(
    kwargs: dict[str, object], named: str
) -> None:
    with pytest.raises(pm.InvalidArgumentError, match=re.escape(named)):
        pm.DeferredRows(**kwargs)  # type: ignore[arg-type]


def test_cuda_device_without_one_is_unsupported() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for device in ("cuda:0", "cuda", 0):
        with pytest.raises(pm.UnsupportedError, match="no CUDA device here"):
            pm.DeferredRows(4, ROW, device=device)


@pytest.mark.parametrize("rows", [-1, -(2**70)])
def test_negative_step_extent_is_refused_naming_rows(dr: pm.DeferredRows, rows: int) -> None:
    with pytest.raises(pm.RowShapeError, match="rows must be between 1 and max_rows"):
        dr.begin(rows)
    with pytest.raises(pm.RowShapeError, match="rows"):
        dr.enqueue(rows=rows)
    assert dr.phase == "idle"


def test_step_extent_that_is_not_an_int_is_refused(dr: pm.DeferredRows) -> None:
    with pytest.raises(pm.InvalidArgumentError, match="rows must be an int"):
        dr.begin(2.5)  # type: ignore[arg-type]
    assert dr.begin(np.int64(3)) >= 0  # numpy ints are ints
    dr.fill(rows_of(3))
    dr.complete()


def test_caller_owned_staging_is_used() -> None:
    buf = np.full((4, ROW), 7, dtype=np.uint8)
    with pm.DeferredRows(4, ROW, staging=buf) as r:
        assert r.staging is buf
        r.begin(4)
        r.fill(rows_of(1))
        r.complete()
        np.testing.assert_array_equal(buf[0], rows_of(1)[0])
        assert not buf[1:].any()


def test_error_mapping_is_pinned() -> None:
    kinds = dict(_native.error_kinds())
    assert kinds == {
        "Unsupported": "UnsupportedError",
        "Driver": "CudaDriverError",
        "Poisoned": "PoisonedError",
        "Closed": "ClosedError",
        "State": "StateError",
        "SlotBusy": "SlotBusyError",
        "RowShape": "RowShapeError",
        "InvalidArgument": "InvalidArgumentError",
        "Table": "TableError",
        "RowId": "RowIdError",
        "Io": "TableIoError",
        "UnarmedReplay": "UnarmedReplayError",
        "NoArmedStep": "NoArmedStepError",
    }
    for kind, cls_name in kinds.items():
        cls = getattr(errors, cls_name)
        assert issubclass(cls, pm.PleMemopsError)
        with pytest.raises(cls) as info:
            _native._raise_kind(kind)
        assert type(info.value) is cls
    assert issubclass(errors.NoArmedStepError, pm.StateError)


def test_probe_without_gpu_says_why() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the GPU tests cover the probe")
    cap = pm.probe(0)
    assert not cap.supported
    assert cap.reason
    assert cap.checks[0].name == "driver" and not cap.checks[0].passed


def test_group_on_host_is_all_host() -> None:
    group = pm.create_group([(4, 16), (8, 32)], device="cpu")
    assert [g.mode for g in group] == ["host", "host"]
    assert [g.staging.shape for g in group] == [(4, 16), (8, 32)]
    for g in group:
        g.close()


def test_abort_from_another_thread_stops_the_stepping_thread(dr: pm.DeferredRows) -> None:
    dr.begin(4)
    t = threading.Thread(target=dr.abort, args=("cancelled by the scheduler",))
    t.start()
    t.join()
    with pytest.raises(pm.PoisonedError, match="scheduler"):
        dr.fill(rows_of(4))


def test_concurrent_steps_and_stats_are_consistent() -> None:
    r = pm.DeferredRows(8, ROW, device="cpu", watchdog=None)
    errors_seen: list[BaseException] = []

    def stepper() -> None:
        try:
            for i in range(300):
                r.begin(8)
                r.fill(rows_of(i % 8 + 1, i))
                r.complete()
        except BaseException as e:  # pragma: no cover - reported below
            errors_seen.append(e)

    def reader() -> None:
        for _ in range(300):
            r.stats()
            _ = r.phase

    ts = [threading.Thread(target=stepper), threading.Thread(target=reader)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors_seen
    assert r.stats().steps == 300 and r.stats().fills == 300
    r.close()


def test_main_job_runs_on_the_host() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ple_memops", "check", "--cpu", "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "20 steps" in out.stdout and "ok" in out.stdout


def test_disable_env_var_forces_the_no_driver_answer() -> None:
    code = "import ple_memops as pm; c = pm.probe(0); print(c.supported, c.reason)"
    env = {**os.environ, "PLE_MEMOPS_DISABLE_CUDA": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False disabled by PLE_MEMOPS_DISABLE_CUDA"


def test_every_copy_path_is_accepted_and_reported() -> None:
    from ple_memops.settings import COPIES

    for copy in COPIES:  # the native parser knows every name the settings allow
        with pm.DeferredRows(2, ROW, device="cpu", copy=copy) as r:
            assert r.copy == copy
