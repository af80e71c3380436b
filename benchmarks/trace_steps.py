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

``--align`` says where a slower graph loses its time against the first trace's: it aligns
the two graphs' sequences of GPU work (same kernels in the same order, ours left over) and
follows the drift, how much later each matched kernel starts in the other graph (median
over the replays). A drift that jumps at one kernel is a stall there (the kernel before
it and after it are named); a drift that grows a little at every kernel is a cost spread
over the graph (the median gap between consecutive kernels says how much each pays).

    python benchmarks/trace_steps.py TRACE [--against TRACE] [--top 12] [--align] [--json out.json]
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Replay", "align", "load_events", "markdown", "replays", "summarize"]

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
    # (start, end, name) of every kernel, copy and memset, by start.
    work: list[tuple[float, float, str]] = field(default_factory=list)

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
                work=sorted((a, b, e["name"]) for (a, b), e in zip(spans, items, strict=True)),
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


def _common(reps: list[Replay]) -> list[Replay]:
    """The replays of the most common number of activities (one graph's shape)."""
    counts: dict[int, int] = {}
    for r in reps:
        counts[len(r.work)] = counts.get(len(r.work), 0) + 1
    if not counts:
        return []
    shape = max(counts, key=lambda k: counts[k])
    return [r for r in reps if len(r.work) == shape]


def _keys(r: Replay) -> list[tuple[str, int]]:
    """``r``'s activities in start order as (name, how many of that name came before)."""
    seen: dict[str, int] = {}
    out = []
    for _, _, name in r.work:
        out.append((name, seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return out


def _keyed(r: Replay) -> dict[tuple[str, int], tuple[float, float]]:
    """``r``'s activities by :func:`_keys`: (start, end) from the replay's first start."""
    t0 = r.work[0][0]
    return {k: (s - t0, e - t0) for k, (s, e, _) in zip(_keys(r), r.work, strict=True)}


def _median_gap(reps: list[Replay]) -> float | None:
    """Median over the replays of the median gap from one activity's start to the latest
    end of the activities before it (negative: they overlap)."""
    per = []
    for r in reps:
        gaps, end = [], float("-inf")
        for a, b, _ in r.work:
            if end > float("-inf"):
                gaps.append(a - end)
            end = max(end, b)
        if gaps:
            per.append(statistics.median(gaps))
    return _med(per)


def align(base: list[Replay], other: list[Replay], top: int = 5) -> dict[str, Any]:
    """Where ``other``'s graph spends the time ``base``'s does not (see the module): both
    traces' common-shape replays, their activities aligned by name; ``drift_us`` at the
    end, the ``top`` largest ``jumps`` (the drift's rise from one matched activity to the
    next: a stall before ``after``), what the rest of the drift adds up to (``spread_us``),
    each graph's ``median_gap_us``, and the activities only ``other`` runs (``extra``:
    name, median start in the replay, median duration)."""
    a, b = _common(base), _common(other)
    if not a or not b:
        return {"matched": 0}
    # An activity is known by its name and how many of that name came before it in its
    # replay: kernels of two streams may start in another order from one replay to the next,
    # so a position in one replay is not the same activity in another.
    ka, kb = _keys(a[0]), _keys(b[0])
    ta, tb = [_keyed(r) for r in a], [_keyed(r) for r in b]
    na, nb = [k[0] for k in ka], [k[0] for k in kb]
    pairs = [
        (m.a + i, m.b + i)
        for m in difflib.SequenceMatcher(a=na, b=nb, autojunk=False).get_matching_blocks()
        for i in range(m.size)
    ]
    if not pairs:
        return {"matched": 0}

    def offset(keyed: list[dict[tuple[str, int], tuple[float, float]]], key: Any) -> float:
        return statistics.median(t[key][0] for t in keyed if key in t)

    def took(keyed: list[dict[tuple[str, int], tuple[float, float]]], key: Any) -> float:
        return statistics.median(t[key][1] - t[key][0] for t in keyed if key in t)

    drift = [offset(tb, kb[j]) - offset(ta, ka[i]) for i, j in pairs]
    steps = [
        (drift[k] - drift[k - 1], nb[pairs[k - 1][1]], nb[pairs[k][1]], offset(tb, kb[pairs[k][1]]))
        for k in range(1, len(pairs))
    ]
    worst = sorted(steps, key=lambda s: -s[0])[:top]
    matched_b = {j for _, j in pairs}
    extra = [
        (nb[j], offset(tb, kb[j]), took(tb, kb[j])) for j in range(len(nb)) if j not in matched_b
    ]
    # Rises under a nanosecond (the trace's resolution) are rounding, not time.
    jumps = [
        {"rise_us": d, "before": x, "after": y, "at_us": t} for d, x, y, t in worst if d > 1e-3
    ]
    return {
        "matched": len(pairs),
        "activities": (len(na), len(nb)),
        "drift_us": drift[-1],
        "first_drift_us": drift[0],
        "jumps": jumps,
        "spread_us": drift[-1] - drift[0] - sum(j["rise_us"] for j in jumps),
        "median_gap_us": (_median_gap(a), _median_gap(b)),
        "extra": extra,
    }


def align_markdown(base_name: str, name: str, al: dict[str, Any]) -> str:
    """:func:`align`'s report as text."""
    if not al.get("matched"):
        return f"{name} against {base_name}: nothing to align"
    ga, gb = al["median_gap_us"]
    lines = [
        f"{name} against {base_name}: {al['matched']} of {al['activities'][1]} activities "
        f"matched; drift at the end {al['drift_us']:+,.1f} us (at the first "
        f"{al['first_drift_us']:+,.1f}); median gap between activities {_f(ga)} / {_f(gb)} us; "
        f"drift outside the jumps below {al['spread_us']:+,.1f} us",
        "",
        "| rise us | at us (in the replay) | the last on time | the first late |",
        "|---|---|---|---|",
    ]
    for j in al["jumps"]:
        lines.append(
            f"| {j['rise_us']:+,.1f} | {j['at_us']:,.1f} | `{j['before'][:60]}` | "
            f"`{j['after'][:60]}` |"
        )
    lines += ["", f"Only in {name}: " + (", ".join(
        f"`{n[:40]}` at {t:,.1f} us ({d:,.1f} us)" for n, t, d in al["extra"]
    ) or "nothing")]  # fmt: skip
    return "\n".join(lines)


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
    p.add_argument("--align", action="store_true", help="where each --against graph loses time")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    loaded = {t.name: replays(load_events(t)) for t in [args.trace, *args.against]}
    named: dict[str, Any] = {n: summarize(r, args.top) for n, r in loaded.items()}
    print(markdown(named, args.top))
    if args.align:
        base = args.trace.name
        for other in list(loaded)[1:]:
            al = align(loaded[base], loaded[other], args.top)
            print()
            print(align_markdown(base, other, al))
            named[other]["align"] = al
    if args.json:
        args.json.write_text(json.dumps(named, indent=1))
    return 0 if all(s["replays"] for s in named.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
