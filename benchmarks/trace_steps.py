"""Where a served step's time goes on the GPU, from a torch profiler trace (the Chrome-trace
JSON, plain or gzipped, that vLLM writes with ``--profiler-config`` and ``/start_profile``).

Each FULL graph replay is one ``cudaGraphLaunch`` on the host; CUPTI gives every kernel,
copy and memset the graph ran the launch's correlation id. Per replay this reports:

  span      first GPU activity of the graph to its last (the graph's time on the device)
  busy      the union of those activities (span - busy: the graph's own gaps, e.g. a wait
            for rows that polls nothing, or a branch waiting on another)
  queued    the launch call's start to the graph's first activity (the GPU still busy with
            earlier work, or the launch itself slow)
  period    one launch's start to the next's (the step as the host paces it)
  gpu gap   the previous graph's end to this graph's first activity (the GPU idle between
            replays: the engine's host work between steps, or eager work of its own)

and which kernels take the time (median microseconds a replay, by name). Two traces side by
side (``--against``) show the kernels whose time differs most: one server against another
started with the same settings, or against the GPU table's.

    python benchmarks/trace_steps.py TRACE [--against TRACE] [--top 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Replay", "load_events", "markdown", "replays", "summarize"]

GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Replay:
    """One graph launch and what the GPU ran for it (microseconds, the trace's clock)."""

    launch_us: float
    first_us: float
    last_us: float
    busy_us: float
    kernels: dict[str, float] = field(default_factory=dict)

    @property
    def span_us(self) -> float:
        return self.last_us - self.first_us

    @property
    def queued_us(self) -> float:
        return self.first_us - self.launch_us


def load_events(path: Path) -> list[dict[str, Any]]:
    """The trace's events (``traceEvents``) from a ``.json`` or ``.json.gz`` file."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list")
    return [e for e in events if isinstance(e, dict)]


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def replays(events: list[dict[str, Any]]) -> list[Replay]:
    """Every graph launch with GPU activity, in launch order."""
    launches: dict[int, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in GRAPH_LAUNCHES:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[int(corr)] = float(e["ts"])
    work: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None and int(corr) in launches:
            work.setdefault(int(corr), []).append(e)
    out = []
    for corr, items in work.items():
        spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in items]
        kernels: dict[str, float] = {}
        for e in items:
            kernels[e["name"]] = kernels.get(e["name"], 0.0) + float(e.get("dur", 0.0))
        out.append(
            Replay(
                launch_us=launches[corr],
                first_us=min(a for a, _ in spans),
                last_us=max(b for _, b in spans),
                busy_us=_union(spans),
                kernels=kernels,
            )
        )
    return sorted(out, key=lambda r: r.launch_us)


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(reps: list[Replay], top: int = 12) -> dict[str, Any]:
    """Medians over the replays (see the module) and the ``top`` kernels by median time a
    replay. Replays of the most common kernel count only: a trace that caught a capture
    size change or a partial replay at its edges does not mix shapes."""
    if not reps:
        return {"replays": 0}
    counts: dict[int, int] = {}
    for r in reps:
        counts[len(r.kernels)] = counts.get(len(r.kernels), 0) + 1
    shape = max(counts, key=lambda k: counts[k])
    same = [r for r in reps if len(r.kernels) == shape]
    periods = [b.launch_us - a.launch_us for a, b in itertools.pairwise(same)]
    gaps = [b.first_us - a.last_us for a, b in itertools.pairwise(same)]
    names = {n for r in same for n in r.kernels}
    per_kernel = {n: statistics.median(r.kernels.get(n, 0.0) for r in same) for n in names}
    kernels = dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))
    return {
        "replays": len(same),
        "other_replays": len(reps) - len(same),
        "kernels_a_replay": shape,
        "span_us": _med([r.span_us for r in same]),
        "busy_us": _med([r.busy_us for r in same]),
        "idle_in_span_us": _med([r.span_us - r.busy_us for r in same]),
        "queued_us": _med([r.queued_us for r in same]),
        "period_us": _med(periods),
        "gpu_gap_us": _med(gaps),
        "top": dict(list(kernels.items())[:top]),
        "kernels": kernels,
    }


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def markdown(named: dict[str, dict[str, Any]], top: int = 12) -> str:
    """One row per trace, then (two or more traces) the kernels whose median time a replay
    differs most between the first and each other."""
    lines = [
        "| trace | replays | kernels a replay | span us | busy us | idle in span us | "
        "queued us | period us | GPU gap us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in named.items():
        lines.append(
            f"| {name} | {s['replays']} | {s.get('kernels_a_replay', '-')} | "
            f"{_f(s.get('span_us'))} | {_f(s.get('busy_us'))} | "
            f"{_f(s.get('idle_in_span_us'))} | {_f(s.get('queued_us'))} | "
            f"{_f(s.get('period_us'))} | {_f(s.get('gpu_gap_us'))} |"
        )
    items = list(named.items())
    if len(items) >= 2 and items[0][1].get("replays"):
        base_name, base = items[0]
        for name, s in items[1:]:
            if not s.get("replays"):
                continue
            a, b = base["kernels"], s["kernels"]
            diff = {n: b.get(n, 0.0) - a.get(n, 0.0) for n in set(a) | set(b)}
            worst = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
            lines += [
                "",
                f"Kernels by difference, {name} minus {base_name} (median us a replay):",
                "",
                f"| kernel | {base_name} | {name} | difference |",
                "|---|---|---|---|",
            ]
            for n, d in worst:
                lines.append(
                    f"| `{n[:90]}` | {a.get(n, 0.0):.1f} | {b.get(n, 0.0):.1f} | {d:+.1f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--against", type=Path, action="append", default=[])
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    named = {
        t.name: summarize(replays(load_events(t)), args.top) for t in [args.trace, *args.against]
    }
    print(markdown(named, args.top))
    if args.json:
        args.json.write_text(json.dumps(named, indent=1))
    return 0 if all(s["replays"] for s in named.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
