"""``benchmarks/trace_steps.py``: a torch profiler trace's graph replays, from a trace laid
out as CUPTI writes one (graph-launched kernels carry their launch's correlation id)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import trace_steps


def _x(cat: str, name: str, ts: float, dur: float, corr: int) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": corr},
    }


def _trace(wait_us: float) -> list[dict[str, Any]]:
    """Three replays 1 ms apart: a GEMM, beside it a polling wait of ``wait_us``, then a
    copy and, after a 10 us gap, a norm; between them eager work of a launch that is not a
    graph's, and a graph launch of another shape at the end."""
    ev: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "args": {}}]
    for i in range(3):
        t, c = 1000.0 * i, 10 + i
        ev += [
            _x("cuda_runtime", "cudaGraphLaunch", t, 40.0, c),
            _x("kernel", "gemm", t + 50, 100.0, c),
            _x("kernel", "ple_wait_copy_reset", t + 60, wait_us, c),
            _x("gpu_memcpy", "Memcpy HtoD", t + 150, 10.0, c),
            _x("kernel", "norm", t + 170, 20.0, c),
            _x("cuda_runtime", "cudaLaunchKernel", t + 500, 5.0, 100 + i),
            _x("kernel", "eager_sample", t + 600, 30.0, 100 + i),
        ]
    ev += [
        _x("cuda_runtime", "cudaGraphLaunch", 3000.0, 40.0, 50),
        _x("kernel", "gemm", 3050, 1, 50),
    ]
    return ev


def test_replays_are_grouped_by_their_launch() -> None:
    reps = trace_steps.replays(_trace(wait_us=30.0))
    assert len(reps) == 4
    r = reps[0]
    assert (r.launch_us, r.first_us, r.last_us) == (0.0, 50.0, 190.0)
    assert r.span_us == 140.0 and r.queued_us == 50.0
    assert r.busy_us == 130.0  # gemm + the wait under it, the copy, the norm; 10 us idle
    assert r.kernels == {"gemm": 100.0, "ple_wait_copy_reset": 30.0, "Memcpy HtoD": 10.0,
                         "norm": 20.0}  # fmt: skip


def test_summary_takes_the_common_shape_and_the_host_pace() -> None:
    s = trace_steps.summarize(trace_steps.replays(_trace(wait_us=30.0)), top=2)
    assert (s["replays"], s["other_replays"], s["kernels_a_replay"]) == (3, 1, 4)
    assert s["span_us"] == 140.0 and s["busy_us"] == 130.0 and s["idle_in_span_us"] == 10.0
    assert s["queued_us"] == 50.0 and s["period_us"] == 1000.0
    assert s["gpu_gap_us"] == 860.0  # one replay's last activity to the next's first
    assert list(s["top"]) == ["gemm", "ple_wait_copy_reset"]
    assert trace_steps.summarize([]) == {"replays": 0}


def test_two_traces_side_by_side_name_the_kernel_that_differs(tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.pt.trace.json.gz"
    fast.write_text(json.dumps({"traceEvents": _trace(wait_us=30.0)}))
    slow.write_bytes(gzip.compress(json.dumps({"traceEvents": _trace(wait_us=500.0)}).encode()))
    assert trace_steps.main([str(fast), "--against", str(slow), "--json", str(tmp_path / "o")]) == 0
    named = json.loads((tmp_path / "o").read_text())
    assert named[slow.name]["span_us"] == 510.0  # the wait outlasts everything after it
    text = trace_steps.markdown(named, top=1)
    assert f"Kernels by difference, {slow.name} minus {fast.name}" in text
    assert "| `ple_wait_copy_reset` | 30.0 | 500.0 | +470.0 |" in text


def test_a_trace_without_graph_launches_fails(tmp_path: Path) -> None:
    path = tmp_path / "eager.json"
    path.write_text(json.dumps([_x("kernel", "k", 0, 1, 1)]))
    assert trace_steps.main([str(path)]) == 1
    (tmp_path / "bad.json").write_text(json.dumps({"traceEvents": 3}))
    with pytest.raises(ValueError, match="no traceEvents"):
        trace_steps.load_events(tmp_path / "bad.json")


def _chain(gap: float, stall_before: int | None = None, ours: bool = False) -> list[dict[str, Any]]:
    """Two replays of one graph: 40 kernels of 2 us in a chain, ``gap`` us apart; with
    ``stall_before`` the kernel of that index starts 300 us late; with ``ours`` a publish
    kernel runs first."""
    ev: list[dict[str, Any]] = []
    for r in range(2):
        t0, c = 10_000.0 * r, 1 + r
        ev.append(_x("cuda_runtime", "cudaGraphLaunch", t0, 5.0, c))
        t = t0 + 10
        if ours:
            ev.append(_x("kernel", "ple_publish_ids", t, 3.0, c))
            t += 3 + gap
        for i in range(40):
            if i == stall_before:
                t += 300
            ev.append(_x("kernel", f"layer_op_{i % 4}", t, 2.0, c))
            t += 2 + gap
    return ev


def test_align_names_a_stall_and_what_only_the_other_graph_runs() -> None:
    base = trace_steps.replays(_chain(gap=0.1))
    slow = trace_steps.replays(_chain(gap=0.1, stall_before=20, ours=True))
    al = trace_steps.align(base, slow, top=2)
    assert al["matched"] == 40 and al["activities"] == (40, 41)
    assert al["drift_us"] == pytest.approx(303.1)  # our kernel and its gap, then the stall
    (jump,) = al["jumps"]  # nothing else rises
    assert jump["rise_us"] == pytest.approx(300.0)
    assert (jump["before"], jump["after"]) == ("layer_op_3", "layer_op_0")
    assert jump["at_us"] == pytest.approx(3.1 + 20 * 2.1 + 300)
    assert al["spread_us"] == pytest.approx(0.0, abs=1e-6)
    assert [(n, t, d) for n, t, d in al["extra"]] == [("ple_publish_ids", 0.0, 3.0)]
    text = trace_steps.align_markdown("base", "slow", al)
    assert "| +300.0 | 345.1 | `layer_op_3` | `layer_op_0` |" in text
    assert "Only in slow: `ple_publish_ids` at 0.0 us (3.0 us)" in text


def test_align_tells_a_cost_spread_over_every_kernel(tmp_path: Path) -> None:
    base, spread = tmp_path / "base.json", tmp_path / "spread.json"
    base.write_text(json.dumps({"traceEvents": _chain(gap=0.1)}))
    spread.write_text(json.dumps({"traceEvents": _chain(gap=0.4)}))
    out = tmp_path / "o.json"
    assert (
        trace_steps.main([str(base), "--against", str(spread), "--align", "--json", str(out)]) == 0
    )
    al = json.loads(out.read_text())[spread.name]["align"]
    assert al["drift_us"] == pytest.approx(39 * 0.3)
    assert al["median_gap_us"] == pytest.approx([0.1, 0.4])
    # Every step rises alike: the top jumps hold a few of them, the spread the rest.
    assert al["spread_us"] == pytest.approx((39 - 12) * 0.3)
    assert al["extra"] == []
    assert trace_steps.align([], trace_steps.replays(_chain(gap=0.1))) == {"matched": 0}


def test_align_follows_a_side_branch_kernel_that_starts_in_another_place_each_replay() -> None:
    """Our wait (200 us, a side stream) starts beside different main-stream kernels from
    one replay to the next: it is the same activity in every replay, reported with its own
    duration, not whichever kernel took its place."""
    ev: list[dict[str, Any]] = []
    for r, beside in enumerate((2, 5, 5)):
        t0, c = 10_000.0 * r, 1 + r
        ev.append(_x("cuda_runtime", "cudaGraphLaunch", t0, 5.0, c))
        t = t0 + 10
        for i in range(8):
            ev.append(_x("kernel", f"layer_op_{i}", t, 2.0, c))
            if i == beside:
                ev.append(_x("kernel", "ple_wait_copy_reset", t + 0.5, 200.0, c))
            t += 2.1
    base = trace_steps.replays([e for e in ev if e["name"] != "ple_wait_copy_reset"])
    ours = trace_steps.replays(ev)
    al = trace_steps.align(base, ours)
    assert al["matched"] == 8
    ((name, _at, took),) = al["extra"]
    assert name == "ple_wait_copy_reset" and took == pytest.approx(200.0)
    assert al["drift_us"] == pytest.approx(0.0, abs=1e-6)
