"""Stall timing on a real GPU: the consumer's wait for its rows, read from the GPU's own
clock, is what the host made it (a fill late by D after the launch stalls the consumer by
about D; a fill hidden behind GPU work, or done first, stalls it by nothing), one sample a
step, on every path that stamps: a captured side-stream consumer, an inline eager one, a
plan's eager step joined on another stream, and a worker's captured replays.

No test may hang: every wait for the GPU is bounded by ``done()``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from gpu_wait import done
from safetensors.numpy import save_file

import ple_memops as pm
from ple_memops.steps import Steps

pytestmark = pytest.mark.gpu

ROW = 256
N = 64


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> pm.MmapTable:
    data = np.random.default_rng(0).integers(0, 256, (10_000, ROW), dtype=np.uint8)
    path = tmp_path_factory.mktemp("stall") / "model.safetensors"
    save_file({"t.weight": data.view(np.float16)}, str(path))
    t = pm.MmapTable.open(path, "t.weight")
    yield t
    t.close()


def cycles_for(torch, ms: float) -> int:  # type: ignore[no-untyped-def]
    """GPU clock cycles of ``torch.cuda._sleep`` that last about ``ms`` milliseconds."""
    torch.cuda._sleep(1_000)  # the kernel's first launch loads it: not part of the timing
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return int(1_000_000 * ms / start.elapsed_time(end))


class Consumer:
    """A graph: (optionally) GPU work of ``before`` cycles on the main stream beside the
    staged rows' wait and copy, then the join and a copy of the rows into ``out``."""

    def __init__(self, torch, rows: pm.DeferredRows, before: int = 0) -> None:  # type: ignore[no-untyped-def]
        self.torch, self.rows = torch, rows
        self.out = torch.zeros_like(rows.staging)
        rows.begin(N)  # an inline eager warm-up, filled first (one stall sample)
        rows.prepare_dummy()
        rows.enqueue(rows=N)
        self.out.copy_(rows.staging)
        rows.complete()
        torch.cuda.synchronize()
        assert rows.wait_consumed(5.0)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            staged = rows.stage(rows=N)
            if before:
                torch.cuda._sleep(before)
            staged.join()
            self.out.copy_(rows.staging[:N])
        self.end = torch.cuda.Event()

    def step(self, data: np.ndarray, delay: float | None) -> None:
        """One replay; the rows filled before the launch (``delay`` None) or from another
        thread ``delay`` seconds after it (the launching thread never fills)."""
        self.rows.begin(N)
        filler = None
        if delay is None:
            self.rows.fill(data)
        else:

            def late() -> None:
                time.sleep(delay)
                self.rows.fill(data)

            filler = threading.Thread(target=late)
        self.graph.replay()
        self.end.record()
        if filler is not None:
            filler.start()
            filler.join()
        assert done(self.end), "the replay never finished"
        self.rows.complete()
        np.testing.assert_array_equal(self.out.cpu().numpy(), data)


@pytest.mark.parametrize("copy", ["kernel", "memop"])
def test_a_late_fill_stalls_the_consumer_by_its_lateness(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(N, ROW, device=0, watchdog=10.0, copy=copy, time_stalls=True)
    assert rows.times_stalls
    g = Consumer(torch, rows)
    warm = rows.stall_samples()
    assert len(warm.ns) == 1 and warm.dropped == 0  # the inline warm-up
    rng = np.random.default_rng(1)
    for _ in range(5):
        g.step(rng.integers(0, 256, (N, ROW), dtype=np.uint8), None)
    first = rows.stall_samples().ns
    for _ in range(5):
        g.step(rng.integers(0, 256, (N, ROW), dtype=np.uint8), 0.004)
    late = rows.stall_samples().ns
    print(f"\n{copy}: filled first {[t / 1e3 for t in first]} us; 4 ms late {late}")
    assert len(first) == 5 and len(late) == 5
    # Filled before the launch: the rows were copied before the consumer got there, or
    # within the copy's few microseconds.
    assert max(first) < 100_000, first
    # 4 ms after the launch (the replay's launch returns within ~0.1 ms): about 4 ms, less
    # the time the GPU took to reach the join, more the thread's start.
    assert all(2_500_000 < t < 40_000_000 for t in late), late
    rows.close()


def test_gpu_work_before_the_join_hides_the_fill(torch) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(N, ROW, device=0, watchdog=10.0, time_stalls=True)
    g = Consumer(torch, rows, before=cycles_for(torch, 20.0))
    rows.stall_samples()
    rng = np.random.default_rng(2)
    for _ in range(4):  # the fill comes 2 ms into 20 ms of GPU work before the consumer
        g.step(rng.integers(0, 256, (N, ROW), dtype=np.uint8), 0.002)
    ns = rows.stall_samples().ns
    print(f"\nhidden: {[t / 1e3 for t in ns]} us")
    assert len(ns) == 4 and max(ns) < 100_000, ns
    rows.close()


def test_without_stall_timing_nothing_is_stamped(torch) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(N, ROW, device=0, watchdog=10.0)
    assert not rows.times_stalls
    g = Consumer(torch, rows)
    g.step(np.ones((N, ROW), np.uint8), 0.001)
    assert rows.stall_samples() == pm.StallSamples((), 0)
    rows.close()
    sync = pm.DeferredRows(N, ROW, device=0, force_sync=True, time_stalls=True)
    assert sync.mode == "sync" and not sync.times_stalls  # no wait, nothing to time
    sync.close()


def test_a_plans_replays_and_eager_steps_are_timed(torch, table: pm.MmapTable) -> None:  # type: ignore[no-untyped-def]
    """Worker-fed steps: the graph computes and publishes its ids, the worker gathers; an
    eager step's consumer joins from the current stream (its arrival stamped there). One
    sample a step, each far below the watchdog; the rows are the table's."""
    plan = Steps.build({"t": table}, max_rows=N, device=0, time_stalls=True, watchdog=10.0)
    try:
        assert plan.deferred, plan.reason
        counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        lanes = torch.arange(N, dtype=torch.int64, device="cuda")
        ids = torch.zeros(N, dtype=torch.int64, device="cuda")
        out = torch.zeros((N, ROW), dtype=torch.uint8, device="cuda")
        end = torch.cuda.Event()

        def want(i: int) -> np.ndarray:
            return table.gather((i * 31 + np.arange(N) * 97) % table.rows)

        def compute_ids() -> None:
            counter.add_(1)
            ids.copy_((counter * 31 + lanes * 97) % table.rows)

        # Eager steps through the plan: a side stream per table, joined here.
        for i in (1, 2):
            plan.arm(N, True)
            compute_ids()
            plan.stage_eager("t", ids, rows=N).join()
            out.copy_(plan.staging("t", N))
            end.record()
            assert done(end)
            plan.settle(0)
            np.testing.assert_array_equal(out.cpu().numpy(), want(i))
        assert len(plan.stall_samples()["t"].ns) == 2
        # Captured: publish + wait/copy on the rows' side stream, joined before the copy.
        counter.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compute_ids()
            staged = plan.stage("t", ids, rows=N)
            torch.cuda._sleep(10_000)  # a little work beside the gather
            staged.join()
            out.copy_(plan.staging("t", N))
        counter.zero_()
        for i in range(1, 201):
            plan.arm(N)
            graph.replay()
            end.record()
            assert done(end), f"replay {i} never finished"
            plan.settle(0)
            np.testing.assert_array_equal(out.cpu().numpy(), want(i))
        ns = plan.stall_samples()["t"].ns
        print(
            f"\nworker replays: p50 {np.percentile(ns, 50) / 1e3:.1f} us, max {max(ns) / 1e3:.1f}"
        )
        assert len(ns) == 200 and max(ns) < 1_000_000_000, ns
    finally:
        plan.shutdown()


def test_the_graph_clock_tells_a_graphs_span_from_the_gpu_idle_between(torch) -> None:  # type: ignore[no-untyped-def]
    """``GraphClock`` on real replays of a captured ~1 ms graph: the span is the graph's
    time (as one eager pair of events measures it); launched back to back (the host ahead)
    the device is busy between graphs (outside ~0), launched 3 ms apart with the host
    asleep in between it is idle ~2 ms."""
    from ple_memops.step_costs import GraphClock

    cycles = cycles_for(torch, 1.0)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            torch.cuda._sleep(cycles)
    stream.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        graph.replay()
        end.record()
    assert done(end)
    alone_us = start.elapsed_time(end) * 1e3

    clock = GraphClock()
    with torch.cuda.stream(stream):
        for _ in range(20):  # back to back: the host queues all 20 within ~1 ms
            clock.around(graph.replay)
    last = torch.cuda.Event()
    last.record(stream)
    assert done(last)
    busy = clock.summary()
    with torch.cuda.stream(stream):
        for _ in range(10):  # each launch after the last finished, then 2 ms of idle
            clock.around(graph.replay)
            stream.synchronize()
            time.sleep(0.002)
    last.record(stream)
    assert done(last)
    idle = clock.summary()
    assert busy is not None and idle is not None
    assert busy.launches == 20 and idle.launches == 10
    for t in (busy, idle):
        assert abs(t.span_p50_us - alone_us) < 0.1 * alone_us, (t, alone_us)
    assert busy.outside_p50_us is not None and busy.outside_p50_us < 50, busy
    assert idle.outside_p50_us is not None and idle.outside_p50_us > 1_800, idle
    assert idle.period_p50_us is not None and idle.period_p50_us > alone_us + 1_800
