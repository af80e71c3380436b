"""What a step costs, on the host: the stall summaries and host-time counters the stats
lines print, stall timing's refusal to pretend off a GPU, the gather-free diagnostic
fill (its GPU side runs in ``test_stall_gpu.py``), and the graph clock's arithmetic over
events a fake GPU stamps (its CUDA side runs in ``test_stall_gpu.py`` too)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

import ple_memops as pm
from ple_memops.step_costs import (
    ENGINE_KINDS,
    HOST_KINDS,
    GraphClock,
    HostTime,
    StallSummary,
    percentile,
)

ROWS, WIDTH = 1000, 32


@pytest.fixture
def table(tmp_path: Path) -> pm.MmapTable:
    data = np.random.default_rng(0).integers(1, 256, (ROWS, WIDTH), dtype=np.uint8)
    path = tmp_path / "t.safetensors"
    save_file({"emb.weight": data.view(np.float32)}, str(path))
    t = pm.MmapTable.open(path, "emb.weight")
    yield t
    t.close()


def test_percentile_is_nearest_rank() -> None:
    xs = list(range(1, 101))
    assert percentile(xs, 50) == 50 and percentile(xs, 99) == 99 and percentile(xs, 100) == 100
    assert percentile(xs, 0) == 1 and percentile([7.5], 90) == 7.5
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_stall_summary_of_a_layers_steps() -> None:
    # 90 steps the rows were there first (0 or under 1 us), 10 that waited 100..1000 us.
    ns = [0] * 80 + [500] * 10 + [100_000 * k for k in range(1, 11)]
    s = StallSummary.of(ns, dropped=3)
    assert (s.steps, s.stalled, s.dropped) == (100, 10, 3)
    assert s.p50_us == 0.0 and s.p90_us == 0.5 and s.p99_us == 900.0 and s.max_us == 1000.0
    assert s.mean_us == pytest.approx(sum(ns) / 100 / 1e3)
    assert s.text() == (
        "100 steps, 10 stalled, 3 dropped; us p50 0.0 p90 0.5 p99 900.0 max 1000.0 mean 55.05"
    )
    with pytest.raises(ValueError, match="at least one step"):
        StallSummary.of([])


def test_host_time_per_step_by_hook() -> None:
    h = HostTime(keep=3)
    assert h.summary() == "host us per engine step: no steps"
    for k in range(5):
        h.add("arm", 1000 * (k + 1))
        with h.span("stats"):
            pass
        h.end_step()
    steps = h.take()
    assert len(steps) == 3  # only the newest `keep`
    assert [s["arm"] for s in steps] == [3000, 4000, 5000]
    assert all(set(s) == {*HOST_KINDS, *ENGINE_KINDS} and s["stats"] > 0 for s in steps)
    assert h.take() == []
    # From another thread too (an output check may run off the engine's thread).
    t = threading.Thread(target=h.add, args=("check", 2500))
    t.start()
    t.join()
    # The graph's launch and the wait for a step's results are the engine's: counted
    # apart, not in our total.
    h.add("launch", 9000)
    h.add("results", 450_000)
    h.end_step()
    line = h.summary()
    assert line.startswith("host us per engine step over 1: total p50 2.5 p99 2.5")
    assert "check p50 2.5 p99 2.5" in line and "arm p50 0.0" in line
    assert line.endswith(
        "stats p50 0.0 p99 0.0; graph launch p50 9.0 p99 9.0, results wait p50 450.0 p99 450.0"
    )
    with pytest.raises(KeyError):
        h.add("sleep", 1)
    # Closing a step can count a last part of it in the same call.
    h.add("arm", 1000)
    h.end_step("step", 4000)
    h.end_step()
    first, second = h.take()
    assert (first["arm"], first["step"]) == (1000, 4000) and not any(second.values())
    # A replay's three kinds in one call, added to what the step has.
    h.add("arm", 500)
    h.add_replay(200, 1500, 7000)
    h.end_step()
    (replay,) = h.take()
    assert (replay["wait"], replay["arm"], replay["launch"]) == (200, 2000, 7000)
    assert sum(replay.values()) == 9200


def test_stall_timing_off_a_gpu_times_nothing() -> None:
    rows = pm.DeferredRows(8, WIDTH, device="cpu", time_stalls=True)
    assert not rows.times_stalls
    assert rows.stall_samples() == pm.StallSamples((), 0)
    with rows.step(8):
        rows.fill(np.ones((8, WIDTH), np.uint8))
        rows.enqueue()
    assert rows.stall_samples().ns == ()
    rows.close()
    with pytest.raises(pm.ClosedError):
        rows.stall_samples()


def test_skip_gather_fills_without_reading_the_table(table: pm.MmapTable) -> None:
    """The diagnostic fill: every step completes as usual, the slot is never written, so
    the consumer reads the bytes it held (zeros here), not the table's rows (never 0)."""
    rows = pm.DeferredRows(16, WIDTH, device="cpu")
    with pm.GatherWorker(rows, table, skip_gather=True) as w:
        for k in (16, 4, 9):
            w.begin(16)
            w.publish_from_host(np.arange(k))
            w.complete()
            assert not rows.staging.any()
        s = w.stats()
        assert s.fills == 3 and s.failures == 0
        # Ids are still checked: a bad one fails the step, typed, as it would in serving.
        w.begin(16)
        w.publish_from_host([ROWS + 1])
        with pytest.raises(pm.RowIdError):
            w.complete()
    # The same table, gathered: the rows arrive.
    rows2 = pm.DeferredRows(16, WIDTH, device="cpu")
    with pm.GatherWorker(rows2, table) as w:
        w.begin(16)
        w.publish_from_host(np.arange(4))
        w.complete()
        np.testing.assert_array_equal(rows2.staging[:4], table.gather(np.arange(4)))


def _launch(clock: GraphClock, gpu: Any, span: float, after: float) -> None:
    """A graph that runs ``span`` us on the GPU, then ``after`` us before the next."""

    def run() -> None:
        gpu.now += span

    clock.around(run)
    gpu.now += after


def test_graph_clock_spans_periods_and_time_outside(fake_stream: Any) -> None:
    gpu = fake_stream
    clock = GraphClock(event=gpu.event)
    for span in (100.0, 110.0, 120.0):
        _launch(clock, gpu, span, after=30.0)
    got = clock.take()
    assert got == [
        (pytest.approx(100.0), None),
        (pytest.approx(110.0), pytest.approx(130.0)),
        (pytest.approx(120.0), pytest.approx(140.0)),
    ]
    assert clock.take() == []  # read once
    # The next launch's period reaches back to the last one read.
    _launch(clock, gpu, 50.0, after=0.0)
    s = clock.summary()
    assert s is not None and s.launches == 1 and s.span_p50_us == pytest.approx(50.0)
    assert s.period_p50_us == pytest.approx(150.0)
    assert s.outside_p50_us == pytest.approx(30.0)  # 150 less the previous launch's 120
    assert "1 graphs on the GPU: span us p50 50.0" in s.text()
    assert "outside the graph p50 30.0" in s.text()
    assert clock.summary() is None


def test_graph_clock_reads_only_what_the_gpu_finished_and_recycles_events(
    fake_stream: Any,
) -> None:
    gpu = fake_stream
    clock = GraphClock(event=gpu.event)
    _launch(clock, gpu, 100.0, after=10.0)
    gpu.done = gpu.now  # the GPU has finished the first launch only
    _launch(clock, gpu, 100.0, after=10.0)
    assert [s for s, _ in clock.take()] == [pytest.approx(100.0)]
    gpu.done = float("inf")
    assert clock.take() == [(pytest.approx(100.0), pytest.approx(110.0))]
    made = gpu.made
    for _ in range(50):  # steady state: read events come back for new launches
        _launch(clock, gpu, 100.0, after=10.0)
        clock.take()
    assert gpu.made - made <= 2


def test_graph_clock_drops_the_oldest_beyond_its_window(fake_stream: Any) -> None:
    gpu = fake_stream
    gpu.done = -1.0  # nothing finishes
    clock = GraphClock(window=3, event=gpu.event)
    for _ in range(5):
        _launch(clock, gpu, 10.0, after=1.0)
    gpu.done = float("inf")
    s = clock.summary()
    assert s is not None and s.launches == 3 and s.dropped == 2
    assert "2 dropped" in s.text()
    with pytest.raises(ValueError, match="at least 2"):
        GraphClock(window=1)


def test_graph_clock_gives_each_keys_span(fake_stream: Any) -> None:
    """Launches timed with a key (a FULL graph's batch size): the summary's p50 mixes
    them, ``by_key`` gives each key's span p50 (``percentile``'s, the lower of two) and
    count, most launches first, and the line says them; launches without a key count
    only in the mix."""
    gpu = fake_stream
    clock = GraphClock(event=gpu.event)
    for span, key in ((100.0, 8), (300.0, 64), (110.0, 8), (120.0, 8), (310.0, 64), (50.0, None)):
        clock.around(lambda span=span: setattr(gpu, "now", gpu.now + span), key=key)
        gpu.now += 10.0
    s = clock.summary()
    assert s is not None and s.launches == 6
    assert s.by_key == ((8, 3, pytest.approx(110.0)), (64, 2, pytest.approx(300.0)))
    assert s.text().endswith("; span p50 by size: 8 x3 110.0, 64 x2 300.0")
    clock.around(lambda: None)
    s = clock.summary()
    assert s is not None and s.by_key == () and "by size" not in s.text()


def test_graph_clock_times_the_launch_call_and_the_wait_for_results(fake_stream: Any) -> None:
    """On the host's side: each launch call's own time (not its events' records), and
    the engine's wait for a step's results through :meth:`GraphClock.results`; both
    drained by the summary, ``None`` where nothing was timed."""
    gpu = fake_stream
    clock = GraphClock(event=gpu.event)
    for ms in (1, 3):
        clock.around(lambda ms=ms: time.sleep(ms / 1e3))
    get = clock.results(lambda: (time.sleep(0.004), "tokens")[1])
    assert get() == "tokens"
    s = clock.summary()
    assert s is not None and s.launch_host_us is not None and s.results_us is not None
    assert 1_000 <= s.launch_host_us[0] < 3_000 <= s.launch_host_us[1]
    assert s.results_us[0] == s.results_us[1] >= 4_000
    assert "; host launch us p50 " in s.text() and "; results wait us p50 " in s.text()
    # Drained with the launches: the next interval's own, none without a wait.
    clock.around(lambda: None)
    s = clock.summary()
    assert s is not None and s.launch_host_us is not None and s.launch_host_us[0] < 1_000
    assert s.results_us is None and "results wait" not in s.text()
    # While no launch has finished on the GPU, the host's times wait with them.
    gpu.done = -1.0
    clock.around(lambda: None)
    clock.results(lambda: None)()
    assert clock.summary() is None
    gpu.done = float("inf")
    s = clock.summary()
    assert s is not None and s.launches == 1 and s.results_us is not None
