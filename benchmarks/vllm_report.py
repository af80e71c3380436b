"""The report of ``bench_vllm.py``: what an mmap server's ``ple-memops stats`` lines say
about a load (``delivery_stats``, ``cost_stats``) and what any plugin server's graph lines
say (``graph_stats``: spans, and by batch size), the medians over repeats
(``summarize``), each backend paired against the reference round by round, or with
``--solo`` against the reference's median (``paired``), the markdown tables
(``markdown``, ``breakdown_markdown``, ``sizes_markdown``, ``cli_markdown``), the
``verdict`` line, and ``report``, which prints them and writes ``--markdown`` and
``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

import trace_steps
from vllm_probes import page_cache
from vllm_servers import Server, base_backend, family, server_resources

# -- stats lines ------------------------------------------------------------------------------


_STATS = re.compile(
    r"ple-memops stats, last ([\d.]+) s: (\d+) deferred steps \((\d+) replays, (\d+) eager\), "
    r"(\d+) synchronous replays; per layer, fills, mean READY -> FILLED[^:]*: (.*)$"
)
# "layers.0 120 fills, 160.7 us (110 replays 35.2 us, 10 eager 1375.0 us), 0.0% rows cold,
# 3 completes waited 41.0 us"; lines of older wheels lack the parenthesis and the completes,
# and those of wheels with expect_prefill / expect_decode (removed) end with "10 steps
# expected (20480 rows early, 0 wrong)".
_LAYER_STATS = re.compile(
    r"(\S+) (\d+) fills(?:, ([\d.]+) us)?"
    r"(?: \((\d+) replays(?: ([\d.]+) us)?, (\d+) eager(?: ([\d.]+) us)?\))?"
    r"(?:, ([\d.]+)% rows cold)?(?:, (\d+) completes waited ([\d.]+) us)?"
    r"(?:, (\d+) steps expected \((\d+) rows early, (\d+) wrong\))?"
)


# "host us per engine step over 812: total p50 41.2 p99 95.0, step p50 6.1 p99 9.0, arm p50
# 20.3 p99 40.2, wait p50 0.4 p99 30.1, check p50 3.0 p99 5.2, stats p50 0.2 p99 0.5; graph
# launch p50 12.0 p99 20.1, results wait p50 21.0 p99 900.3" (wheels with expect_prefill /
# expect_decode, removed: ", expect p50 30.1 p99 50.2" before the launch; older wheels: no
# results wait, no expect, no launch)
_HOST = re.compile(
    r"host us per engine step over (\d+): total p50 ([\d.]+) p99 ([\d.]+), "
    r"step p50 ([\d.]+) p99 [\d.]+, arm p50 ([\d.]+) p99 [\d.]+, "
    r"wait p50 ([\d.]+) p99 ([\d.]+), check p50 ([\d.]+) p99 [\d.]+, stats p50 ([\d.]+)"
    r"(?: p99 [\d.]+)?(?:, expect p50 ([\d.]+) p99 [\d.]+)?(?:; graph launch p50 ([\d.]+))?"
    r"(?: p99 [\d.]+, results wait p50 ([\d.]+) p99 ([\d.]+))?"
)
# "GPU stall per step: layers.0 812 steps, 40 stalled; us p50 0.0 p90 2.1 p99 61.0 max 90.2
# mean 1.20; layers.6 ..."
_STALL = re.compile(
    r"(\S+) (\d+) steps, (\d+) stalled(?:, \d+ dropped)?; us p50 ([\d.]+) p90 [\d.]+ "
    r"p99 ([\d.]+) max ([\d.]+) mean ([\d.]+)"
)
# "ple-memops graphs, last 2.0 s: 401 graphs on the GPU: span us p50 4883.2 p99 4901.7; period
# p50 4935.0; outside the graph p50 52.1" (time_graphs; any engine with the plugin)
_GRAPHS = re.compile(
    r"ple-memops graphs, last [\d.]+ s: (\d+) graphs on the GPU: span us p50 ([\d.]+) "
    r"p99 ([\d.]+)(?:; period p50 ([\d.]+); outside the graph p50 (-?[\d.]+))?"
)
GRAPH_FIELDS = ("span_p50_us", "span_p99_us", "period_p50_us", "outside_p50_us")
# "...; host launch us p50 80.1 p99 140.2; results wait us p50 20.3 p99 3900.0" (the host's
# side of the same line: the launch call, and the engine's wait for a step's results)
_GRAPH_HOST = {
    ("launch_host_p50_us", "launch_host_p99_us"): re.compile(
        r"; host launch us p50 ([\d.]+) p99 ([\d.]+)"
    ),
    ("results_p50_us", "results_p99_us"): re.compile(
        r"; results wait us p50 ([\d.]+) p99 ([\d.]+)"
    ),
}
GRAPH_HOST_FIELDS = tuple(f for pair in _GRAPH_HOST for f in pair)
# "...; span p50 by size: 16 x120 4950.1, 24 x80 5101.2" (each FULL graph's batch size)
_BY_SIZE = re.compile(r"span p50 by size: ((?:\d+ x\d+ [\d.]+(?:, )?)+)")
_SIZE = re.compile(r"(\d+) x(\d+) ([\d.]+)")
HOST_FIELDS = (
    "total_p50", "total_p99", "step", "arm", "wait", "wait_p99", "check", "stats", "expect",
    "launch", "results", "results_p99",
)  # fmt: skip


def cost_stats(lines: list[str]) -> dict[str, Any]:
    """What the stats lines say of a step's costs: our host time per engine step (p50s by
    hook, step-weighted over the lines) and each layer's GPU stall (steps, share stalled,
    step-weighted p50 / p99 / mean, the worst max)."""
    out: dict[str, Any] = {}
    host = [(int(m.group(1)), [float(x or "nan") for x in m.groups()[1:]]) for ln in lines
            if (m := _HOST.search(ln))]  # fmt: skip
    n = sum(k for k, _ in host)
    if n:
        out["host_us"] = {f: sum(k * v[i] for k, v in host) / n for i, f in enumerate(HOST_FIELDS)}
    stall: dict[str, list[tuple[int, int, float, float, float, float]]] = {}
    for ln in lines:
        _, sep, tail = ln.partition("GPU stall per step: ")
        if not sep:
            continue
        for name, steps, stalled, p50, p99, top, mean in _STALL.findall(tail):
            stall.setdefault(name, []).append(
                (int(steps), int(stalled), float(p50), float(p99), float(top), float(mean))
            )
    if stall:
        out["stall"] = {}
        for name, v in stall.items():
            k = sum(x[0] for x in v) or 1
            out["stall"][name] = {
                "steps": sum(x[0] for x in v),
                "stalled_pct": 100 * sum(x[1] for x in v) / k,
                "p50_us": sum(x[0] * x[2] for x in v) / k,
                "p99_us": sum(x[0] * x[3] for x in v) / k,
                "max_us": max(x[4] for x in v),
                "mean_us": sum(x[0] * x[5] for x in v) / k,
            }
    return out


def sizes_of(line: str) -> dict[int, tuple[int, float]]:
    """A ``ple-memops graphs`` line's replays by batch size: size -> (launches, span p50
    us); empty for a line without sizes."""
    m = _BY_SIZE.search(line)
    if not m:
        return {}
    return {int(size): (int(k), float(span)) for size, k, span in _SIZE.findall(m.group(1))}


def graph_stats(text: str) -> dict[str, Any]:
    """What a server's ``ple-memops graphs`` lines (``time_graphs``) say about one load:
    its FULL replays' span on the GPU, the period between launches and the device's time
    outside the graphs (launch-weighted means of the lines' p50s; the first line after a
    load starts covers the end of the previous load, so it is dropped), and, where the
    lines give it, each batch size's span p50 (``by_size``: size -> [launches, span])."""
    matched = [(ln, m) for ln in text.splitlines() if (m := _GRAPHS.search(ln))][1:]
    lines, found = [ln for ln, _ in matched], [m for _, m in matched]
    if not found:
        return {}
    n = sum(int(m.group(1)) for m in found)
    out: dict[str, Any] = {"launches": n}
    for i, f in enumerate(GRAPH_FIELDS, start=2):
        got = [(int(m.group(1)), float(m.group(i))) for m in found if m.group(i) is not None]
        k = sum(c for c, _ in got)
        out[f] = sum(c * x for c, x in got) / k if k else None
    for fields, pattern in _GRAPH_HOST.items():
        host = [(int(m.group(1)), h) for ln, m in matched if (h := pattern.search(ln))]
        k = sum(c for c, _ in host)
        for i, f in enumerate(fields, start=1):
            out[f] = sum(c * float(h.group(i)) for c, h in host) / k if k else None
    sizes: dict[int, list[tuple[int, float]]] = {}
    for ln in lines:
        for size, got in sizes_of(ln).items():
            sizes.setdefault(size, []).append(got)
    if sizes:
        out["by_size"] = {
            size: [sum(k for k, _ in v), sum(k * x for k, x in v) / sum(k for k, _ in v)]
            for size, v in sorted(sizes.items())
        }
    return {"graphs": out}


_DISK = re.compile(
    r"ple-bench disk: steps (\d+), stage p50 (\d+) p99 (\d+) us, reads p50 (\d+) p99 (\d+) us"
)
DISK_FIELDS = ("stage_p50_us", "stage_p99_us", "reads_p50_us", "reads_p99_us")


def disk_stats(text: str) -> dict[str, Any]:
    """What a ``disk`` server's timer lines (``benchmarks/vllm_disk_timer.py``) say about one
    load: steps, and the engine thread's time a step in vLLM's staging call and in its
    reads (p50 and p99, weighted by the lines' steps). The first line after a load starts
    covers the end of the server's previous load, so it is dropped."""
    lines = [m for ln in text.splitlines() if (m := _DISK.search(ln))][1:]
    if not lines:
        return {}
    steps = [int(m.group(1)) for m in lines]
    total = sum(steps) or 1
    out: dict[str, Any] = {"steps": sum(steps)}
    for i, f in enumerate(DISK_FIELDS, start=2):
        out[f] = sum(int(m.group(i)) * n for m, n in zip(lines, steps, strict=True)) / total
    return {"disk": out}


def delivery_stats(text: str) -> dict[str, Any]:
    """What an mmap server's ``ple-memops stats`` lines (``--stats-every``) say about one
    load: deferred steps, replays, eager steps, synchronous replays, and each layer's
    fill-weighted mean READY -> FILLED (the host gather of a step's rows), over all fills
    and over replays' and eager steps' apart. The first line after a load starts covers
    the end of the server's previous load, so it is dropped."""
    graphs = graph_stats(text)
    raw = [ln for ln in text.splitlines() if _STATS.search(ln)][1:]
    lines = [m for ln in raw if (m := _STATS.search(ln))]
    if not lines:
        return graphs
    out: dict[str, Any] = {
        "ple_steps": sum(int(m.group(2)) for m in lines),
        "ple_replays": sum(int(m.group(3)) for m in lines),
        "ple_eager": sum(int(m.group(4)) for m in lines),
        "ple_sync_replays": sum(int(m.group(5)) for m in lines),
    }
    fills: dict[str, list[tuple[int, float]]] = {}
    replay: dict[str, list[tuple[int, float]]] = {}
    eager: dict[str, list[tuple[int, float]]] = {}
    cold: dict[str, list[tuple[int, float]]] = {}
    late: dict[str, list[tuple[int, float]]] = {}
    expected: dict[str, list[int]] = {}
    for m in lines:
        for found in _LAYER_STATS.findall(m.group(6)):
            name, n, us, nr, rus, ne, eus, pct, nl, lus, ns, early, wrong = found
            if nl:
                late.setdefault(name, []).append((int(nl), float(lus)))
            if ns:
                got = expected.setdefault(name, [0, 0, 0])
                for i, x in enumerate((ns, early, wrong)):
                    got[i] += int(x)
            for d, count, x in (
                (fills, n, us),
                (replay, nr, rus),
                (eager, ne, eus),
                (cold, n, pct),
            ):
                if x:
                    d.setdefault(name, []).append((int(count), float(x)))

    def weighted(d: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
        return {k: sum(n * x for n, x in v) / max(1, sum(n for n, _ in v)) for k, v in d.items()}

    out["fill_us"], out["cold_pct"] = weighted(fills), weighted(cold)
    # Host completions that found their step unfilled: how many, and their mean wait.
    out["late_completes"] = {k: sum(n for n, _ in v) for k, v in late.items()}
    out["late_complete_us"] = weighted(late)
    if replay or eager:
        out["replay_fill_us"], out["eager_fill_us"] = weighted(replay), weighted(eager)
    if expected:
        # Logs of wheels with expect_prefill (removed): eager steps armed with the host's
        # ids, rows gathered early, and rows the host expected wrongly (each layer's totals
        # over the lines).
        out["expected"] = {k: dict(zip(("steps", "early", "wrong"), v, strict=True))
                           for k, v in expected.items()}  # fmt: skip
    return out | cost_stats(raw) | graphs


# -- the report -------------------------------------------------------------------------------


def _busy(s: dict[str, Any]) -> str:
    """GPU busy and, where sampled, the SM clock (its median; its lowest sample too when
    it fell more than 5% under the median at some point)."""
    out = f"{_f(s.get('gpu_busy_pct'), 0)}%"
    mhz, low = s.get("sm_mhz_p50"), s.get("sm_mhz_min")
    if mhz is not None:
        out += f" @ {mhz:.0f} MHz"
        if low is not None and low < 0.95 * mhz:
            out += f" (min {low:.0f})"
    return out


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None and r.get("ok")]
    return statistics.median(xs) if xs else None


def summarize(
    rows: list[dict[str, Any]], backends: list[str]
) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    loads = list(dict.fromkeys(r["load"] for r in rows))
    for load in loads:
        for b in backends:
            rs = [r for r in rows if r["load"] == load and r["backend"] == b]
            if not rs:
                continue
            good = [r for r in rs if r.get("ok")]
            s: dict[str, Any] = {"n": len(good), "failed_runs": len(rs) - len(good)}
            for k in ("tok_s", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms",
                      "ttft_p50_ms", "ttft_p99_ms", "gpu_busy_pct", "sm_mhz_p50",
                      "power_w_p50"):  # fmt: skip
                s[k] = _med(rs, k)
            lows = [r["sm_mhz_min"] for r in good if r.get("sm_mhz_min") is not None]
            s["sm_mhz_min"] = min(lows) if lows else None
            toks = [r["tok_s"] for r in good]
            s["tok_s_range"] = (min(toks), max(toks)) if toks else None
            s["ttft_of"] = rs[0].get("ttft_of", "all")
            s["failed_requests"] = sum(r.get("failed", 0) for r in rs)
            for k in ("ple_steps", "ple_replays", "ple_eager", "ple_sync_replays"):
                s[k] = _med(rs, k)
            for key in ("fill_us", "replay_fill_us", "eager_fill_us"):
                layers = list(dict.fromkeys(n for r in good for n in r.get(key, {})))
                s[key] = {
                    n: statistics.median(r[key][n] for r in good if n in r.get(key, {}))
                    for n in layers
                }
            hosts = [r["host_us"] for r in good if r.get("host_us")]
            if hosts:
                s["host_us"] = {
                    f: statistics.median(h.get(f, math.nan) for h in hosts) for f in HOST_FIELDS
                }
            graphs = [r["graphs"] for r in good if r.get("graphs")]
            if graphs:
                s["graphs"] = {
                    f: _median_of([g.get(f) for g in graphs])
                    for f in ("launches", *GRAPH_FIELDS, *GRAPH_HOST_FIELDS)
                }
                # Keyed by batch size; a run's JSON read back has the sizes as strings.
                by = [{int(k): v for k, v in g["by_size"].items()}
                      for g in graphs if g.get("by_size")]  # fmt: skip
                if by:  # each size: launches summed over the repeats, the spans' median
                    sizes = sorted({k for d in by for k in d})
                    s["graphs"]["by_size"] = {
                        k: [sum(d[k][0] for d in by if k in d),
                            statistics.median(d[k][1] for d in by if k in d)]
                        for k in sizes
                    }  # fmt: skip
            disks = [r["disk"] for r in good if r.get("disk")]
            if disks:
                s["disk"] = {f: statistics.median(d[f] for d in disks) for f in DISK_FIELDS}
            stalls = [r["stall"] for r in good if r.get("stall")]
            if stalls:
                names = list(dict.fromkeys(n for st in stalls for n in st))
                s["stall"] = {
                    n: {
                        k: statistics.median(st[n][k] for st in stalls if n in st)
                        for k in ("steps", "stalled_pct", "p50_us", "p99_us", "max_us", "mean_us")
                    }
                    for n in names
                }
            for k in ("cpu_cores", "cpu_ours"):
                s[k] = _med(rs, k)
            tops = [r["cpu_top"] for r in good if r.get("cpu_top")]
            if tops:
                name = statistics.mode(t[0] for t in tops)
                s["cpu_top"] = (name, statistics.median(t[1] for t in tops if t[0] == name))
            colds = [r["cold_pct"] for r in good if r.get("cold_pct")]
            s["cold_pct"] = (
                statistics.median(statistics.mean(c.values()) for c in colds) if colds else None
            )
            out[(load, b)] = s
    return out


def paired(
    rows: list[dict[str, Any]], ref: str, key: str, solo: bool = False
) -> dict[tuple[str, str], list[float]]:
    """Each backend's ``key`` against ``ref``'s of the same load, in percent (``+2.0``: 2%
    higher), one value a repeat of the backend.

    Side by side (the default) a repeat is paired with ``ref``'s of the same round: the
    pair shares the round's host and GPU conditions, which drift between rounds more than
    the servers differ. ``solo`` (``--solo``: one server at a time, its rounds back to
    back) has no shared round, and its servers get different numbers of rounds (a first
    start that compiles vLLM's kernels leaves the first server fewer): each repeat is
    compared with the median of all of ``ref``'s repeats of the load."""
    by = {(r["load"], r["repeat"], r["backend"]): r[key] for r in rows
          if r.get("ok") and r.get(key) is not None}  # fmt: skip
    ref_median = {}
    if solo:
        for load in {ld for ld, _, _ in by}:
            xs = [x for (ld, _, b), x in by.items() if ld == load and b == ref]
            if xs:
                ref_median[load] = statistics.median(xs)
    out: dict[tuple[str, str], list[float]] = {}
    for (load, rep_, b), x in sorted(by.items()):
        base = ref_median.get(load) if solo else by.get((load, rep_, ref))
        if b != ref and base:
            out.setdefault((load, b), []).append((x / base - 1) * 100)
    return out


def breakdown_markdown(
    rows: list[dict[str, Any]],
    summary: dict[tuple[str, str], dict[str, Any]],
    ref: str,
    solo: bool = False,
) -> str:
    """Where a step's time goes, per load and backend: ITL p50 and tok/s paired against
    ``ref`` round by round (median and range over the repeats), GPU busy, the first PLE
    layer's GPU stall and our host time per engine step (mmap servers' stats lines), and
    with ``--time-graphs`` the FULL graphs' span on the GPU and the device's time outside
    them."""
    itl, tok = paired(rows, ref, "itl_p50_ms", solo), paired(rows, ref, "tok_s", solo)
    how = (
        f"each repeat against the median of `{ref}`'s repeats (one server at a time: no "
        f"shared round; a second GPU-table server, `gpu-plugin-b` or `gpu-b`, measures "
        f"what two identical servers differ by)"
        if solo
        else f"each repeat's server against `{ref}` in the same round; the servers share "
        "the GPU: beside other servers Gemma's deferred FULL graphs ran 5-9% longer than "
        "alone (H200 hosts, vLLM 0.33.0) while the GPU table's did not, and Qwen4Exp's ran "
        "within 0.1 ms of the GPU table's (H100, vLLM 0.34.0; BENCHMARKS.md, servers sharing "
        "one GPU): for a lone server's cost, run with --solo"
    )
    lines = [
        f"Paired against `{ref}` ({how}; "
        "median [min, max] over the repeats). GPU busy: nvidia-smi's utilization.gpu over "
        "the load, @ its SM clock's median. GPU stall: the first PLE layer's consumer "
        "waiting for its rows, from the GPU's clock (steps stalled > 1 us, p50 / p99 / "
        "mean us). Host: our code per engine step, p50 us (total / p99; arm, wait, check, "
        "expect), then the engine's: its graph launch and its wait for a step's results "
        "(vLLM's get_output under async scheduling: its copy's cost alone where the host paces "
        "the engine, a GPU stall then off its critical path). "
        "Graphs (--time-graphs, any plugin server, the GPU table's too): a FULL replay's "
        "span on the GPU and the device's time "
        "between a graph's end and the next one's start, p50 us (two CUDA events a replay). "
        "CPU: cores the server's threads kept busy over the load (/proc: all of them, ours "
        "(`ple-*`), the busiest other thread).",
        "",
        f"| load | backend | runs | ITL p50 ms | ITL p50 vs {ref} | tok/s vs {ref} "
        "| GPU busy @ SM clock "
        "| GPU stall: stalled, p50 / p99 / mean us | host us: total p50 / p99; arm, wait, "
        "check, expect; graph launch; results wait p50 / p99 "
        "| graphs on the GPU: span p50 / outside p50 us; host launch p50; results wait "
        "p50 / p99 "
        "| CPU cores: all / ours; busiest other thread |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def spread(xs: list[float] | None) -> str:
        if not xs:
            return "-"
        return f"{statistics.median(xs):+.2f}% [{min(xs):+.1f}, {max(xs):+.1f}]"

    for (load, b), s in summary.items():
        st = s.get("stall") or {}
        # The first PLE layer's (the one every step waits for); a Gemma table split in
        # two (split_rows): both parts, layer 0's slice first.
        order = sorted(st, key=lambda n: (_layer_index(n), len(n)))
        shown = order if len(order) == 2 and order[1].endswith(".rest") else order[:1]
        stall = (
            "; ".join(
                f"{name}: {st[name]['stalled_pct']:.0f}%, {st[name]['p50_us']:.1f} / "
                f"{st[name]['p99_us']:.1f} / {st[name]['mean_us']:.1f}"
                for name in shown
            )
            or "-"
        )
        h = s.get("host_us")
        host = "-"
        if h:
            host = (
                f"{h['total_p50']:.0f} / {h['total_p99']:.0f}; {h['arm']:.0f}, {h['wait']:.0f}, "
                f"{h['check']:.0f}, {_f(_num(h.get('expect')), 0)}; "
                f"{_f(_num(h.get('launch')), 0)}; {_f(_num(h.get('results')), 0)} / "
                f"{_f(_num(h.get('results_p99')), 0)}"
            )
        g = s.get("graphs")
        graphs = "-"
        if g and g.get("span_p50_us") is not None:
            graphs = f"{g['span_p50_us']:,.1f} / {_f(g.get('outside_p50_us'), 1)}"
            if g.get("launch_host_p50_us") is not None:
                graphs += (
                    f"; {_f(g.get('launch_host_p50_us'), 0)}; "
                    f"{_f(g.get('results_p50_us'), 0)} / {_f(g.get('results_p99_us'), 0)}"
                )
        cpu = "-"
        if s.get("cpu_cores") is not None:
            top = s.get("cpu_top")
            cpu = f"{s['cpu_cores']:.2f} / {_f(s.get('cpu_ours'), 2)}"
            if top:
                cpu += f"; {top[0]} {top[1]:.2f}"
        lines.append(
            f"| {load} | {b} | {s['n']} | {_f(s['itl_p50_ms'], 2)} "
            f"| {'(ref)' if b == ref else spread(itl.get((load, b)))} "
            f"| {'(ref)' if b == ref else spread(tok.get((load, b)))} "
            f"| {_busy(s)} | {stall} | {host} | {graphs} | {cpu} |"
        )
    return "\n".join(lines)


def sizes_markdown(
    summary: dict[tuple[str, str], dict[str, Any]], ref: str, share: float = 0.05
) -> str:
    """The FULL graphs' span p50 by batch size, each backend against ``ref`` at the same
    size, for the loads whose replays came in several sizes (a span p50 over such a load
    mixes sizes in each server's own proportions). Sizes under ``share`` of ``ref``'s
    launches are left out. Empty when no server logged sizes."""
    rows = []
    for load in dict.fromkeys(ld for ld, _ in summary):
        base = ((summary.get((load, ref)) or {}).get("graphs") or {}).get("by_size") or {}
        total = sum(v[0] for v in base.values())
        if len(base) < 2 or not total:
            continue
        for size, (n, span) in sorted(base.items()):
            if n < share * total:
                continue
            cells = []
            for (ld, b), s in summary.items():
                other = ((s.get("graphs") or {}).get("by_size") or {}).get(size)
                if ld != load or b == ref or not other:
                    continue
                cells.append(f"{b} {other[1]:,.1f} ({other[1] - span:+.1f}; x{other[0]})")
            rows.append(f"| {load} | {size} | {span:,.1f} (x{n}) | {'; '.join(cells) or '-'} |")
    if not rows:
        return ""
    head = [
        f"FULL graphs' span p50 on the GPU by batch size (us; launches over the repeats), "
        f"each server against `{ref}` at the same size, sizes of at least {share:.0%} of "
        f"`{ref}`'s launches:",
        "",
        f"| load | batch size | {ref} | others (vs {ref}) |",
        "|---|---|---|---|",
    ]
    return "\n".join(head + rows)


def _median_of(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else None


def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)", name)
    return int(m.group(1)) if m else 1 << 30


def _num(x: float | None) -> float | None:
    """``x``, or ``None`` for a missing or NaN value (an older wheel's stats line)."""
    return None if x is None or x != x else x


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def verdict(
    rows: list[dict[str, Any]],
    summary: dict[tuple[str, str], dict[str, Any]],
    ref: str = "gpu",
    slow: str = "uva",
    solo: bool = False,
) -> str:
    """The targets, judged for ``mmap``: its ITL p50 within +1% of ``ref``'s (the GPU
    table: ``gpu``, or ``gpu-plugin`` when that is the run's reference), paired the way
    the breakdown pairs it (:func:`paired`, median over the repeats), at every load; its
    tok/s at least ``slow``'s, vLLM's own way to keep the table's bytes off the GPU
    (``disk``: vLLM 0.34.0's disk offload; ``uva``: Qwen4Exp's pinned tables; ``offload``:
    ``--cpu-offload-gb``); its mixed-load
    TTFT p50 at most ``slow``'s. Where ``slow`` is the run's reference itself (``--ref
    disk``: the residency runs), mmap is judged ahead of it or not: its ITL p50 below
    ``slow``'s and its tok/s above, each resolved by a second mmap server (``mmap-b``, or a
    replica such as ``mmap.2``) when the run has one: a difference no larger than the two
    mmap servers' distance is not resolved.

    A target whose other side the run did not measure is listed as not measured, never as
    missed. Where the run has ``ref``'s A/A partner (``<ref>-b``: ``gpu-b``,
    ``gpu-plugin-b``), its own paired ITL is given per load: what two identical servers
    differed by in this run, the resolution of the ITL verdict. A comparison the A/A pair
    cannot resolve is listed as not resolved, neither met nor missed: the ITL where the
    two identical servers differ by more than the 1% target, tok/s and TTFT where they
    differ by at least as much as mmap and ``slow`` do. A second mmap server
    (``mmap-b``) gives its paired ITL too, and with the graphs' clock the mmap server's
    wait for a step's results says whether the GPU's time was on the engine's critical
    path at that load (tens of us: the host paced it)."""
    if not summary:
        return "VERDICT (reported, not asserted): nothing was measured."
    notes: list[str] = []
    misses: list[str] = []
    unmeasured: list[str] = []
    unresolved: list[str] = []
    itl = paired(rows, ref, "itl_p50_ms", solo)
    tok = paired(rows, ref, "tok_s", solo)
    ttft = paired(rows, ref, "ttft_p50_ms", solo)

    def aa_of(pairs: dict[tuple[str, str], list[float]], load: str) -> float | None:
        """The A/A pair's median difference at ``load``, in percent (None: no pair)."""
        xs = pairs.get((load, f"{ref}-b"))
        return statistics.median(xs) if xs else None

    def get(load: str, b: str, k: str) -> float | None:
        s = summary.get((load, b))
        return None if s is None else s.get(k)

    # mmap against vLLM's own way off the GPU as the reference: "ahead", resolved by a
    # second mmap server (both servers beyond the two's distance, on the same side).
    ahead = ref == slow
    twins = sorted(
        {b for _, b in summary if b == "mmap-b" or (b != "mmap" and base_backend(b) == "mmap")}
    )

    def twin_doubt(pairs: dict[tuple[str, str], list[float]], load: str, d: float) -> str:
        """Why mmap's paired value ``d`` does not resolve: the second mmap server's lies
        on the other side of the reference, or either lies nearer to it than the two lie
        to each other; ``""`` when it resolves (or there is no second server)."""
        xs = pairs.get((load, twins[0])) if twins else None
        if not xs:
            return ""
        t = statistics.median(xs)
        apart = abs(t - d)
        if (t < 0) != (d < 0) or min(abs(t), abs(d)) <= apart:
            return f"two mmap servers {d:+.2f}% and {t:+.2f}%, {apart:.2f} points apart"
        return ""

    for load in dict.fromkeys(load for load, _ in summary):
        if (load, "mmap") not in summary:
            unmeasured.append(f"{load}: no mmap result")
            continue
        d = itl.get((load, "mmap"))
        if d:
            dm = statistics.median(d)
            aa = itl.get((load, f"{ref}-b"))
            second = itl.get((load, twins[0])) if twins else None
            waited = ((summary.get((load, "mmap")) or {}).get("graphs") or {}).get("results_p50_us")
            parts = [f"A/A {statistics.median(aa):+.2f}%"] if aa else []
            parts += [f"second mmap {statistics.median(second):+.2f}%"] if second else []
            parts += [f"engine's wait for results p50 {waited:.0f} us"] if waited else []
            aa_note = f" ({'; '.join(parts)})" if parts else ""
            notes.append(f"{load} ITL p50 {dm:+.2f}% vs {ref}{aa_note}")
            doubt = twin_doubt(itl, load, dm) if ahead else ""
            if doubt:
                unresolved.append(f"{load}: ITL vs {ref} ({doubt})")
            elif ahead:
                if dm >= 0:
                    misses.append(
                        f"{load}: ITL p50 {dm:+.2f}% vs {ref}{aa_note} (target: below it)"
                    )
            elif aa and abs(statistics.median(aa)) > 1:
                unresolved.append(f"{load}: ITL vs {ref} (A/A {statistics.median(aa):+.2f}%)")
            elif dm > 1:
                misses.append(f"{load}: ITL p50 {dm:+.2f}% vs {ref}{aa_note} (target <= +1%)")
        else:
            unmeasured.append(f"{load}: ITL vs {ref}")
        m, u = get(load, "mmap", "tok_s"), get(load, slow, "tok_s")
        if m is not None and u:
            diff, aa_tok = (m / u - 1) * 100, aa_of(tok, load)
            notes.append(f"{load} tok/s {diff:+.2f}% vs {slow}")
            doubt = twin_doubt(tok, load, diff) if ahead else ""
            if doubt:
                unresolved.append(f"{load}: tok/s vs {slow} ({doubt})")
            elif aa_tok is not None and abs(aa_tok) >= abs(diff):
                unresolved.append(f"{load}: tok/s vs {slow} (A/A {aa_tok:+.2f}%)")
            elif m < u:
                misses.append(f"{load}: tok/s {diff:+.2f}% vs {slow} (target >= 0)")
        else:
            unmeasured.append(f"{load}: tok/s vs {slow}")
    if ("mixed", "mmap") in summary:
        mt, ut = get("mixed", "mmap", "ttft_p50_ms"), get("mixed", slow, "ttft_p50_ms")
        if mt is not None and ut is not None:
            notes.append(f"mixed TTFT p50 {mt:.0f} vs {slow} {ut:.0f} ms")
            aa_ttft = aa_of(ttft, "mixed")
            if ut and aa_ttft is not None and abs(aa_ttft) >= abs((mt / ut - 1) * 100):
                unresolved.append(f"mixed: TTFT vs {slow} (A/A {aa_ttft:+.2f}%)")
            elif mt > ut:
                misses.append(f"mixed: TTFT p50 {mt:.0f} ms > {slow} {ut:.0f} ms")
        else:
            unmeasured.append(f"mixed: TTFT vs {slow}")
    head = "targets missed: " + "; ".join(misses) if misses else "no target missed"
    if unresolved:
        head += "; not resolved: " + ", ".join(unresolved)
    if unmeasured:
        head += "; not measured: " + ", ".join(unmeasured)
    return f"VERDICT (reported, not asserted): {head}. [{'; '.join(notes)}]"


def markdown(
    summary: dict[tuple[str, str], dict[str, Any]],
    servers: dict[str, dict[str, Any]],
    meta: dict[str, Any],
) -> str:
    lines = [
        f"Random weights, {meta.get('model', '')}; {meta.get('setup', '')}",
        "",
        "| load | backend | runs | output tok/s (range) | TPOT p50 / p99 ms | ITL p50 / p99 ms "
        "| TTFT p50 / p99 ms | GPU busy @ SM clock |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (load, b), s in summary.items():
        rng = s.get("tok_s_range")
        rs = f" ({_f(rng[0], 0)}-{_f(rng[1], 0)})" if rng else ""
        ttft_note = " (long)" if s.get("ttft_of") == "long prompts" else ""
        fail = f", {s['failed_requests']} failed" if s.get("failed_requests") else ""
        lines.append(
            f"| {load} | {b} | {s['n']}{fail} | {_f(s['tok_s'])}{rs} "
            f"| {_f(s['tpot_p50_ms'], 2)} / {_f(s['tpot_p99_ms'], 2)} "
            f"| {_f(s['itl_p50_ms'], 2)} / {_f(s['itl_p99_ms'], 2)} "
            f"| {_f(s['ttft_p50_ms'], 0)} / {_f(s['ttft_p99_ms'], 0)}{ttft_note} "
            f"| {_busy(s)} |"
        )
    delivery = [(k, s) for k, s in summary.items() if s.get("ple_steps") is not None]
    if delivery:
        lines += [
            "",
            "ple-memops stats of the mmap servers during each load (medians over the runs): "
            "steps, and each PLE layer's mean READY -> FILLED, the host gather from the GPU's "
            "publish being seen to the rows being ready",
            "",
            "| load | backend | steps (replays / eager / synchronous replays) | READY -> FILLED "
            "mean us, per layer: all fills | replays' | eager steps' | rows read cold |",
            "|---|---|---|---|---|---|---|",
        ]

        def per_layer(d: dict[str, float]) -> str:
            return ", ".join(f"{n} {us:.1f}" for n, us in d.items()) or "-"

        for (load, b), s in delivery:
            cold = "-" if s.get("cold_pct") is None else f"{s['cold_pct']:.1f}%"
            lines.append(
                f"| {load} | {b} | {_f(s['ple_steps'], 0)} ({_f(s['ple_replays'], 0)} / "
                f"{_f(s['ple_eager'], 0)} / {_f(s['ple_sync_replays'], 0)}) "
                f"| {per_layer(s['fill_us'])} | {per_layer(s['replay_fill_us'])} "
                f"| {per_layer(s['eager_fill_us'])} | {cold} |"
            )
    lines += [
        "",
        "| backend | ready after | weights (vLLM log) | GPU memory (nvidia-smi) | host RSS anon / "
        "file / shmem | table page cache | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, s in servers.items():
        rss = s.get("rss_gib") or {}
        notes = s.get("error") or ""
        facts = s.get("facts", {})
        if facts.get("skipped_files"):
            notes += f" table files skipped at load: {facts['skipped_files']}"
        if facts.get("mmap_fallback"):
            notes += f" FELL BACK: {facts['mmap_fallback']}"
        if facts.get("log_markers"):
            notes += f" log mentions {facts['log_markers']}"
        gpu = s.get("gpu_mib")
        lines.append(
            f"| {b} | {_f(s.get('ready_s'), 0)} s | {_f(facts.get('weights_gib'), 2)} GiB "
            f"| {'-' if gpu is None else f'{gpu / 1024:,.2f} GiB'} "
            f"| {_f(rss.get('anon'), 2)} / {_f(rss.get('file'), 2)} / "
            f"{_f(rss.get('shmem'), 2)} GiB "
            f"| {_f(s.get('page_cache_gib'), 2)} GiB | {notes.strip()} |"
        )
    w = {b: s.get("facts", {}).get("weights_gib") for b, s in servers.items()}
    if w.get("gpu") is not None:
        freed = [f"{b} {w['gpu'] - w[b]:.2f} GiB" for b in w if b != "gpu" and w[b] is not None]
        if freed:
            lines += ["", f"GPU memory freed against the GPU table (weights): {', '.join(freed)}"]
    disk = [(load, b, s["disk"]) for (load, b), s in summary.items() if s.get("disk")]
    if disk:
        lines += [
            "",
            "vLLM's disk offload, the engine thread a step before the forward (benchmarks/"
            "vllm_disk_timer.py): its staging call (the ids, the wait for the GPU, the reads "
            "and the copy) and the reads inside it, us:",
            "",
            "| load | backend | staging p50 / p99 | reads p50 / p99 |",
            "|---|---|---|---|",
            *(f"| {load} | {b} | {d['stage_p50_us']:,.0f} / {d['stage_p99_us']:,.0f} | "
              f"{d['reads_p50_us']:,.0f} / {d['reads_p99_us']:,.0f} |" for load, b, d in disk),
        ]  # fmt: skip
    before, after = meta.get("host_memory_before"), meta.get("host_memory_all_servers")
    if before and after:
        lines += [
            "",
            f"Host memory in use (MemTotal - MemAvailable): {before['used']:.2f} GiB before the "
            f"servers, {after['used']:.2f} GiB with all {len(servers)} healthy (+"
            f"{after['used'] - before['used']:.2f}); page cache {before['cached']:.2f} -> "
            f"{after['cached']:.2f} GiB, shared memory {before['shmem']:.2f} -> "
            f"{after['shmem']:.2f} GiB",
        ]
    return "\n".join(lines)


def report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    servers: dict[str, Server],
    meta: dict[str, Any],
    tables: list[Path],
) -> None:
    summary = summarize(rows, args.backends)
    left_after = [
        r["cache_after_evict_gib"] for r in rows if r.get("cache_after_evict_gib") is not None
    ]
    if left_after:
        meta = dict(meta, setup=meta.get("setup", "") + (
            f"; after each eviction {min(left_after):.2f}-{max(left_after):.2f} GiB of the "
            "tables stayed in the page cache (a live mmap server's mapped pages cannot be "
            "evicted from outside)"))  # fmt: skip
    per_server: dict[str, dict[str, Any]] = {}
    for b, s in servers.items():
        last = [r for r in rows if r["backend"] == b]
        res = server_resources(s, tables) if s.proc is not None and s.proc.poll() is None else {}
        per_server[b] = {
            "ready_s": s.ready_s, "error": s.error, "facts": s.facts, "profile": s.profile,
            "rss_gib": res.get("rss_gib") or (last[-1]["rss_gib"] if last else None),
            "gpu_mib": res.get("gpu_mib") if res else (last[-1].get("gpu_mib") if last else None),
            "page_cache_gib": page_cache(tables) if tables else None,
        }  # fmt: skip
    md = markdown(summary, per_server, meta)
    md += "\n\n" + breakdown_markdown(rows, summary, args.ref, bool(args.solo))
    if sizes := sizes_markdown(summary, args.ref):
        md += "\n\n" + sizes
    profiled = {b: s.profile for b, s in servers.items() if s.profile and s.profile["replays"]}
    if profiled:
        first = args.ref if args.ref in profiled else next(iter(profiled))
        named = {first: profiled[first]} | profiled
        n = args.profile_concurrency
        md += f"\n\n{n}-token decode steps profiled on each server (the FULL graphs' replays; "
        md += "benchmarks/trace_steps.py):\n\n" + trace_steps.markdown(named, top=8)
        base = servers[first].replays or []
        for b in profiled:
            if b != first and base and servers[b].replays:
                al = trace_steps.align(base, servers[b].replays or [], top=4)
                profiled[b]["align"] = al
                md += "\n\n" + trace_steps.align_markdown(first, b, al)
    # The stock way off the GPU mmap is judged against: vLLM 0.34.0's disk offload where it
    # ran, else the pinned tables (Qwen4Exp) or --cpu-offload-gb (a Gemma).
    slow = "uva" if family(args) == "qwen4exp" else "offload"
    slow = "disk" if "disk" in args.backends else slow
    v = verdict(rows, summary, args.ref, slow, bool(args.solo))
    print("\n" + md + "\n\n" + v + "\n", flush=True)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md + "\n\n" + v + "\n\n" + f"command: `{meta['command']}`\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"meta": meta, "servers": per_server, "runs": rows, "verdict": v,
                 "ref": args.ref,
                 "paired_itl_p50_pct": [{"load": k[0], "backend": k[1], "pct": x} for k, x in
                                        paired(rows, args.ref, "itl_p50_ms",
                                               bool(args.solo)).items()],
                 "summary": [{"load": k[0], "backend": k[1], **s} for k, s in summary.items()]},
                indent=1, default=str,
            )
        )  # fmt: skip


def cli_markdown(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"vLLM's own `vllm bench latency` (batch {args.latency_batch}, {args.input_len} in / "
        f"{args.output_len} out, {args.latency_iters} iterations after {args.latency_warmup} "
        f"warm-up) and "
        f"`vllm bench throughput` ({args.throughput_prompts} random prompts, "
        f"{args.input_len} in / {args.output_len} out), one engine a run, medians over runs",
        "",
        "| command | backend | runs | latency avg / p50 / p99 s | requests/s | total tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for kind in args.vllm_bench:
        for b in args.backends:
            rs = [x for x in rows if x["kind"] == kind and x["backend"] == b]
            good = [x for x in rs if x["rc"] == 0]

            def med(k: str, good: list[dict[str, Any]] = good) -> float | None:
                xs = [x[k] for x in good if x.get(k) is not None]
                return statistics.median(xs) if xs else None

            bad = f", {len(rs) - len(good)} failed" if len(rs) > len(good) else ""
            lat = (f"{_f(med('avg_s'), 3)} / {_f(med('p50_s'), 3)} / {_f(med('p99_s'), 3)}"
                   if kind == "latency" else "-")  # fmt: skip
            lines.append(
                f"| {kind} | {b} | {len(good)}{bad} | {lat} | "
                f"{_f(med('req_s'), 2) if kind == 'throughput' else '-'} | "
                f"{_f(med('tok_s'), 0) if kind == 'throughput' else '-'} |"
            )
    return "\n".join(lines)
