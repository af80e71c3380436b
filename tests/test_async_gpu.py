"""On a real GPU: replays nobody armed (never a hang, never stale rows, a typed error),
two steps in flight with the host one step ahead (asynchronous scheduling), the staged
consumer on a side branch, and the tables' Steps. Bytes are checked for every step.

No test may hang: every wait for the GPU polls an event with a bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gpu_wait import captured_after_warmup, done, replayed

import ple_memops as pm
from ple_memops.steps import Steps

pytestmark = pytest.mark.gpu

TABLE_ROWS, WIDTH = 50_000, 160
HIST = 512


@pytest.fixture(scope="module")
def table(random_tables: Any) -> Iterator[pm.MmapTable]:
    with random_tables(TABLE_ROWS, {"model": WIDTH}) as tables:
        yield tables["model"]


def ids_for(step: int, n: int, modulo: int = TABLE_ROWS) -> np.ndarray:
    return (step * 7919 + np.arange(n, dtype=np.int64) * 104729) % modulo


class StepGraph:
    """One decode-like step: bump a device step counter, compute ``n`` ids from it on the
    GPU, publish them (inline, or staged on a side branch), run ``work_cycles`` of GPU
    work, consume the rows and append them to a history ring indexed by the device
    counter, so every step's bytes can be checked after the fact even with the host
    running ahead."""

    def __init__(
        self,
        torch: Any,
        worker: pm.GatherWorker,
        n: int,
        *,
        staged: bool = False,
        work_cycles: int = 0,
        pre_cycles: int = 0,
    ) -> None:
        self.torch, self.n = torch, n
        rows = worker.rows
        self.counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.lanes = torch.arange(n, dtype=torch.int64, device="cuda")
        self.ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        self.hist = torch.zeros((HIST, n, WIDTH), dtype=torch.uint8, device="cuda")
        self.end = torch.cuda.Event()

        def body(warm: bool) -> None:
            if pre_cycles and not warm:
                torch.cuda._sleep(pre_cycles)
            self.counter.add_(1)
            self.ids.copy_((self.counter * 7919 + self.lanes * 104729) % TABLE_ROWS)
            if staged:
                st = worker.stage(self.ids, rows=n)
            else:
                worker.publish(self.ids)
            if work_cycles and not warm:
                torch.cuda._sleep(work_cycles)
            if staged:
                st.join()
            else:
                rows.enqueue(rows=n)
            self.hist.index_copy_(0, self.counter % HIST, rows.staging[:n].unsqueeze(0))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            worker.begin(n)
            body(warm=True)
            worker.complete(timeout=10.0)
        torch.cuda.synchronize()
        self.counter.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body(warm=False)

    def replay(self) -> None:
        self.graph.replay()
        self.end.record()

    def check(self, table: pm.MmapTable, steps: range) -> None:
        hist = self.hist.cpu().numpy()
        for i in steps:
            np.testing.assert_array_equal(
                hist[i % HIST], table.gather(ids_for(i, self.n)), err_msg=f"step {i}"
            )


def test_replay_without_begin_is_typed_never_hangs_never_stale(
    torch: Any, table: pm.MmapTable, publish: str
) -> None:
    rows = pm.DeferredRows(16, WIDTH, device=0, watchdog=10.0)
    w = pm.GatherWorker(rows, table, publish=publish)
    g = StepGraph(torch, w, 16)
    for _ in range(3):
        w.begin(16)
        g.replay()
        w.complete(timeout=10.0)
        assert done(g.end)
    g.check(table, range(1, 4))
    g.replay()  # nobody armed the worker for this one
    assert done(g.end), "a replay without begin() hung the GPU"
    assert not g.hist[4].any().item(), "the unarmed replay's consumer must read zeros"
    with pytest.raises(pm.UnarmedReplayError, match=r"without begin\(\)"):
        w.begin(16)
    with pytest.raises(pm.PoisonedError):
        w.begin(16)
    for _ in range(2):  # the gate stays open: later replays never hang
        g.replay()
        assert done(g.end)
    assert w.stats().unarmed_replays >= 1
    w.close()


def test_dummy_prepared_replay_is_typed(torch: Any, table: pm.MmapTable, publish: str) -> None:
    """The runner bug VLLM.md describes: rows.begin + prepare_dummy around a replay of a
    graph that publishes. The dummy's ids must never reach the next armed step."""
    rows = pm.DeferredRows(16, WIDTH, device=0, watchdog=10.0)
    w = pm.GatherWorker(rows, table, publish=publish)
    g = StepGraph(torch, w, 16)
    rows.begin(16)
    rows.prepare_dummy()
    g.replay()
    assert done(g.end), "the dummy replay hung"
    deadline = time.monotonic() + 5.0
    while rows.phase != "poisoned" and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(pm.PoisonedError, match="no step armed"):
        rows.complete()
    with pytest.raises(pm.UnarmedReplayError):
        w.begin(16)
    w.close()


@pytest.mark.parametrize("staged", [False, True])
def test_host_one_step_ahead_every_step_checked(
    torch: Any, table: pm.MmapTable, publish: str, staged: bool
) -> None:
    """Asynchronous scheduling: step i+1 is armed and launched before step i's ids exist
    (the GPU is kept busy before each publish); complete() ends the oldest step without
    waiting for the newer one. 300 steps, bytes checked for every one."""
    rows = pm.DeferredRows(64, WIDTH, device=0, watchdog=10.0, track_arrival=True)
    w = pm.GatherWorker(rows, table, publish=publish, depth=2)
    g = StepGraph(torch, w, 48, staged=staged, pre_cycles=200_000, work_cycles=100_000)
    steps = 300
    ends = [torch.cuda.Event() for _ in range(steps + 1)]
    w.begin(48)
    g.graph.replay()
    ends[1].record()
    for i in range(2, steps + 1):
        w.begin(48)  # step i armed while step i-1 may not be published yet
        g.graph.replay()
        ends[i].record()
        assert done(ends[i - 1]), f"step {i - 1} never finished"
        w.complete(timeout=10.0)  # completes step i-1
        if i % 100 == 0:
            assert done(ends[i])
            g.check(table, range(max(1, i - 99), i))
    w.complete(timeout=10.0)
    assert done(ends[steps])
    g.check(table, range(1, steps + 1))
    assert w.in_flight == 0
    s = w.stats()
    assert s.fills == steps + 1 and s.failures == 0  # + the eager warm-up
    w.close()


def test_staged_consumer_matches_inline(torch: Any, table: pm.MmapTable) -> None:
    rows_a = pm.DeferredRows(32, WIDTH, device=0, watchdog=10.0)
    rows_b = pm.DeferredRows(32, WIDTH, device=0, watchdog=10.0)
    wa = pm.GatherWorker(rows_a, table)
    wb = pm.GatherWorker(rows_b, table)
    ga = StepGraph(torch, wa, 32, staged=False, work_cycles=50_000)
    gb = StepGraph(torch, wb, 32, staged=True, work_cycles=50_000)
    for _ in range(200):
        for w, g in ((wa, ga), (wb, gb)):
            w.begin(32)
            g.replay()
        for w, g in ((wa, ga), (wb, gb)):
            w.complete(timeout=10.0)
            assert done(g.end)
    assert torch.equal(ga.hist, gb.hist)
    gb.check(table, range(1, 201))
    wa.close()
    wb.close()


def test_rows_stage_for_host_known_ids(torch: Any, table: pm.MmapTable) -> None:
    rows = pm.DeferredRows(16, WIDTH, device=0, watchdog=10.0)
    out = torch.zeros_like(rows.staging)
    rows.begin(16)
    rows.prepare_dummy()
    st = rows.stage(rows=16)
    st.join()
    out.copy_(rows.staging)
    rows.complete()
    torch.cuda.synchronize()
    assert rows.wait_consumed(5.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        st = rows.stage(rows=16)
        torch.cuda._sleep(20_000)
        st.join()
        out.copy_(rows.staging)
    end = torch.cuda.Event()
    rng = np.random.default_rng(2)
    for _ in range(100):
        ids = rng.integers(0, TABLE_ROWS, 16)
        rows.begin(16)
        graph.replay()
        end.record()
        rows.fill_from(table, ids, busy_wait=5.0)
        rows.complete()
        assert done(end)
        np.testing.assert_array_equal(out.cpu().numpy(), table.gather(ids))


def test_plan_deferred_and_eager_give_the_same_bytes(torch: Any, table: pm.MmapTable) -> None:
    with Steps.build({"a": table, "b": table}, max_rows=32, device=0, timeout=10.0) as plan:
        assert plan.mode == "deferred" and plan.reason is None
        n = 24
        ids = {k: torch.zeros(n, dtype=torch.int64, device="cuda") for k in "ab"}
        counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        lanes = torch.arange(n, device="cuda")
        outs = {k: torch.zeros((n, WIDTH), dtype=torch.uint8, device="cuda") for k in "ab"}

        def body() -> None:
            counter.add_(1)
            ids["a"].copy_((counter * 7919 + lanes * 104729) % TABLE_ROWS)
            ids["b"].copy_((counter * 31 + lanes * 7) % TABLE_ROWS)
            staged = {k: plan.stage(k, ids[k], rows=n) for k in "ab"}
            torch.cuda._sleep(50_000)
            for k in "ab":
                staged[k].join()
                outs[k].copy_(plan.staging(k, n))

        driver = plan
        arm, settle = (lambda: driver.arm(n)), (lambda: driver.settle(0))
        graph = captured_after_warmup(torch, body, arm, settle, reset=counter.zero_)
        end = torch.cuda.Event()
        for i in replayed(graph, 100, arm, settle, end):
            want_a = (i * 7919 + np.arange(n) * 104729) % TABLE_ROWS
            want_b = (i * 31 + np.arange(n) * 7) % TABLE_ROWS
            np.testing.assert_array_equal(outs["a"].cpu().numpy(), table.gather(want_a))
            np.testing.assert_array_equal(outs["b"].cpu().numpy(), table.gather(want_b))
            if i % 25 == 0:
                # An eager step in between (a prefill): the driver drains, then gathers
                # now: the same bytes.
                got = driver.gather_now("a", torch.from_numpy(want_a).cuda())
                np.testing.assert_array_equal(got.cpu().numpy(), table.gather(want_a))


def test_plan_sync_fallback_refuses_stage(torch: Any, table: pm.MmapTable) -> None:
    with Steps.build({"a": table}, max_rows=8, device=0, deferred=False) as plan:
        assert plan.mode == "sync" and "deferred=False" in (plan.reason or "")
        with pytest.raises(pm.StateError, match="deferred path"):
            plan.stage("a", torch.zeros(8, dtype=torch.int64, device="cuda"))
        got = plan.gather_now("a", torch.arange(8, device="cuda"))
        torch.cuda.synchronize()
        np.testing.assert_array_equal(got.cpu().numpy(), table.gather(np.arange(8)))


@pytest.mark.parametrize("copy", ["kernel", "memop"])
@pytest.mark.parametrize("with_worker", [False, True])
def test_staged_host_fill_after_launch(
    torch: Any, table: pm.MmapTable, copy: str, with_worker: bool
) -> None:
    """Host-known ids with a staged consumer, on both device paths, with and without a
    worker attached to the rows (a plan builds one; host-filled steps must still work):
    eager warm-ups (fill, then the inline consumer), a capture, then replays filled from
    the host right after each launch. No step may wait for its fill past a bound."""
    n, width = 8, 15360  # 120 KiB a step: the memop path under copy="auto" too
    data = np.random.default_rng(4).integers(0, 256, (64, width), dtype=np.uint8)
    rows = pm.DeferredRows(n, width, device=0, watchdog=10.0, copy=copy, track_arrival=True)
    worker = None
    if with_worker:
        import tempfile

        from safetensors.numpy import save_file as save

        tmp = tempfile.mkdtemp()
        save({"t.weight": data.view(np.float16)}, f"{tmp}/t.safetensors")
        worker = pm.GatherWorker(rows, pm.MmapTable.open(f"{tmp}/t.safetensors", "t.weight"))
    out = torch.zeros_like(rows.staging)
    for i in range(2):
        rows.begin(n)
        rows.fill(data[i : i + n], busy_wait=5.0)
        st = rows.stage(rows=n)
        st.join()
        out.copy_(rows.staging)
        rows.complete()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(), data[i : i + n])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        st = rows.stage(rows=n)
        torch.cuda._sleep(20_000)
        st.join()
        out.copy_(rows.staging)
    end = torch.cuda.Event()
    for i in range(30):
        rows.begin(n)
        graph.replay()
        end.record()
        k = i % (64 - n)
        t0 = time.monotonic()
        rows.fill(data[k : k + n], busy_wait=5.0)
        assert time.monotonic() - t0 < 5.0, f"replay {i}: the fill waited for the slot"
        rows.complete()
        assert done(end), f"replay {i} never finished"
        np.testing.assert_array_equal(out.cpu().numpy(), data[k : k + n], err_msg=f"replay {i}")
    if worker is not None:
        worker.close()
