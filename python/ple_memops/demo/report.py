"""Tables (plain text and BENCHMARKS.md markdown), the targets' summary and the latency plot
of the runner's results."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .runner import DEFERRED_VARIANTS, RunResult, reference_name

__all__ = [
    "CPU_TIMINGS",
    "markdown",
    "memory_saved",
    "on_gpu",
    "plot",
    "summary",
    "text_table",
    "to_json",
]

_HEAD = (
    "batch",
    "style",
    "variant",
    "placement",
    "median us",
    "p99 us",
    "vs reference",
    "host gather us",
    "GPU waited (steps)",
    "GPU MiB",
    "pinned MiB",
    "tokens",
    "logits",
)


def _f(v: float | None, nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{nd}f}"


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.1f}"


def _ok(v: bool | None) -> str:
    return "-" if v is None else ("identical" if v else "DIFFER")


def _head(cuda: bool) -> tuple[str, ...]:
    """The columns, the reference's named for what it is here."""
    return tuple(f"vs {reference_name(cuda)}" if h == "vs reference" else h for h in _HEAD)


def on_gpu(results: Iterable[RunResult]) -> bool:
    """Whether ``results`` were measured on a GPU (their steps were captured graphs)."""
    return any(r.captured for r in results)


def _ref_median(results: list[RunResult], batch: int, style: str) -> float | None:
    """The GPU-table reference at (batch, style): the mean of its runs' medians (it runs
    before and after the other variants)."""
    meds = [
        x.median_us
        for x in results
        if x.variant == "gpu-table" and x.batch == batch and x.style == style
    ]
    return sum(meds) / len(meds) if meds else None


def rows(results: list[RunResult], cuda: bool | None = None) -> list[tuple[str, ...]]:
    """The table's rows; the reference is named for what it is on this machine (``cuda``,
    default: whether the runs were captured)."""
    cuda = on_gpu(results) if cuda is None else cuda
    out: list[tuple[str, ...]] = []
    for r in results:
        ref = _ref_median(results, r.batch, r.style)
        delta = None
        if ref is not None and r.variant != "gpu-table":
            delta = r.median_us - ref
        pct = "" if delta is None or ref is None else f" ({100 * delta / ref:+.2f}%)"
        logits = _ok(r.logits_identical)
        if r.first_mismatch is not None:
            logits += f" from step {r.first_mismatch}"
        if r.state_diff:
            logits += f" (started from a different {', '.join(r.state_diff)})"
        out.append(
            (
                str(r.batch),
                r.style,
                (reference_name(cuda) if r.variant == "gpu-table" else r.variant)
                + (f" [{r.mode}]" if r.mode and r.mode != "deferred" else ""),
                r.placement,
                _f(r.median_us),
                _f(r.p99_us),
                ("-" if delta is None else f"{delta:+.1f}") + pct,
                _f(r.host_gather_us),
                "-" if r.gpu_waited is None else str(r.gpu_waited),
                _mib(r.gpu_bytes),
                _mib(r.pinned_bytes),
                _ok(r.tokens_identical),
                logits,
            )
        )
    return out


def text_table(results: list[RunResult], cuda: bool | None = None) -> str:
    cuda = on_gpu(results) if cuda is None else cuda
    body, head = rows(results, cuda), _head(cuda)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(out)


def markdown(results: list[RunResult], cuda: bool | None = None) -> str:
    cuda = on_gpu(results) if cuda is None else cuda
    body, head = rows(results, cuda), _head(cuda)
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(out)


CPU_TIMINGS = (
    "note: CPU timings are not meaningful for the deferred protocol (it needs a CUDA GPU: "
    "captured graphs, rows filled after the launch); here they are noise, read the tokens "
    "and logits columns and the memory line"
)
"""Printed under the table of a run without a GPU."""


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,} B"


def _memory(
    results: list[RunResult], tables: Mapping[str, tuple[int, int]]
) -> tuple[int, int, int, str] | None:
    """``(largest batch, table bytes, staging bytes, shapes)`` of the tables
    (``name -> (rows, row_bytes)``): every row against one row per sequence at the
    largest batch run."""
    if not results or not tables:
        return None
    n = max(r.batch for r in results)
    table = sum(rows * width for rows, width in tables.values())
    staging = sum(n * width for _, width in tables.values())
    shapes = ", ".join(f"{rows:,} rows x {width:,} B" for rows, width in tables.values())
    return n, table, staging, shapes


def memory_saved(
    results: list[RunResult],
    tables: Mapping[str, tuple[int, int]],
    cuda: bool | None = None,
) -> str | None:
    """The GPU memory the deferred path saves, computed from the tables' shapes
    (``name -> (rows, row_bytes)``), so on every machine: the GPU table holds every row in
    GPU memory; the deferred path holds instead, per table, a staging buffer of one row
    per sequence on the GPU and a pinned slot of the same size, at the largest batch run.
    Without a GPU (``cuda`` false; default: whether the runs were captured) it says so,
    and what the in-memory table and the served path hold here, in host memory."""
    got = _memory(results, tables)
    if got is None:
        return None
    n, table, staging, shapes = got
    cuda = on_gpu(results) if cuda is None else cuda
    if cuda:
        return (
            f"memory, computed from the table ({shapes}): the GPU table holds {_size(table)} "
            f"of GPU memory; the deferred path holds instead {_size(staging)} on the GPU "
            f"(staging, batch {n}) and {_size(staging)} pinned: saves "
            f"{_size(table - staging)} of GPU memory"
        )
    return (
        f"memory, computed from the table ({shapes}): on a GPU the table would hold "
        f"{_size(table)} of GPU memory, the deferred path instead {_size(staging)} on the "
        f"GPU (staging, batch {n}) and {_size(staging)} pinned: it would save "
        f"{_size(table - staging)} of GPU memory; here the in-memory table holds "
        f"{_size(table)} of host memory, the served path {_size(2 * staging)} (staging and "
        "slot)"
    )


def summary(
    results: list[RunResult],
    table_bytes: int | None = None,
    tables: Mapping[str, tuple[int, int]] | None = None,
    cuda: bool | None = None,
) -> list[str]:
    """The targets, as measured: per (batch, style) the best deferred variant against the
    GPU-table reference (within 1%); under async its overhead against the synchronous
    gather's (at most 1/5); whether every run matched the reference; GPU memory saved
    (measured where there is a GPU; computed from ``tables``, ``name -> (rows,
    row_bytes)``, on every machine). ``cuda``: whether the runs had a GPU (default:
    whether they were captured); without one the reference is the in-memory table."""
    cuda = on_gpu(results) if cuda is None else cuda
    lines: list[str] = []
    keys = sorted({(r.batch, r.style) for r in results}, key=lambda k: (k[0], k[1]))
    for b, s in keys:
        group = [r for r in results if r.batch == b and r.style == s]
        ref = _ref_median(results, b, s)
        refs = [r.median_us for r in group if r.variant == "gpu-table"]
        deferred = [r for r in group if r.variant in DEFERRED_VARIANTS and r.mode == "deferred"]
        if ref is None or not deferred:
            continue
        best = min(deferred, key=lambda r: r.median_us)
        over = best.median_us - ref
        pct = 100 * over / ref
        line = (
            f"batch {b} {s}: best deferred = {best.variant} ({best.placement}) "
            f"{best.median_us:.1f} us vs gpu-table {ref:.1f} us "
            f"(runs: {', '.join(f'{m:.1f}' for m in refs)}): {pct:+.2f}% "
            f"({'within' if pct <= 1.0 else 'NOT within'} 1%)"
        )
        sg = next((r for r in group if r.variant == "sync-gather"), None)
        if sg is not None:
            sg_over = sg.median_us - ref
            ratio = over / sg_over if sg_over > 0 else float("nan")
            line += f"; sync-gather overhead {sg_over:+.1f} us"
            if s == "async":
                ok = not math.isnan(ratio) and ratio <= 0.2
                line += f", ratio {ratio:.2f} ({'at most' if ok else 'NOT at most'} 1/5)"
        lines.append(line)
    checked = [r for r in results if r.logits_identical is not None]
    bad = [r for r in checked if not (r.logits_identical and r.tokens_identical)]
    moved = [r for r in checked if r.state_diff]
    if moved:
        lines.append(
            "the state after the prefill differed from the recording's in "
            + "; ".join(
                f"{r.variant}/{r.batch}/{r.style}: {', '.join(r.state_diff or [])}" for r in moved
            )
        )
    elif any(r.state_diff is not None for r in checked):
        lines.append(
            "every run started from the recording's state (KV cache, counters, token, "
            "prefill logits, constants, weights: identical checksums)"
        )
    lines.append(
        f"{len(checked) - len(bad)}/{len(checked)} runs: tokens identical and logits "
        f"bit-identical to the {'GPU-table' if cuda else 'in-memory table'} reference"
        + (
            ""
            if not bad
            else "; DIFFER: " + ", ".join(f"{r.variant}/{r.batch}/{r.style}" for r in bad)
        )
    )
    ref_mem = [r.gpu_bytes for r in results if r.variant == "gpu-table" and r.gpu_bytes]
    dd_mem = [
        r.gpu_bytes for r in results if r.variant == "deferred-device" and r.gpu_bytes is not None
    ]
    if ref_mem and dd_mem:
        saved = max(ref_mem) - min(dd_mem)
        line = (
            f"GPU memory: gpu-table {_mib(max(ref_mem))} MiB, deferred-device "
            f"{_mib(min(dd_mem))} MiB: saved {_mib(saved)} MiB"
        )
        if table_bytes:
            line += f" (the table is {_mib(table_bytes)} MiB)"
        lines.append(line)
    computed = memory_saved(results, tables or {}, cuda)
    if computed is not None:
        lines.append(computed)
    return lines


def to_json(results: Iterable[RunResult], path: str | Path, extra: dict[str, Any]) -> None:
    data = []
    for r in results:
        d = asdict(r)
        d.pop("tokens", None)
        d["median_us"], d["p99_us"] = r.median_us, r.p99_us
        data.append(d)
    Path(path).write_text(json.dumps({"runs": data, **extra}, indent=1))


def _run_label(r: RunResult, cuda: bool) -> str:
    name = reference_name(cuda) if r.variant == "gpu-table" else r.variant
    if r.placement == "again":
        return f"{name} (again)"
    return name + (f" ({r.placement})" if r.placement not in ("-", "early") else "")


def _identity_panel(ax: Any, results: list[RunResult], cuda: bool) -> None:
    """Runs (rows) by (batch, style) (columns): green where every step's tokens and
    logits were bit-identical to the reference, red where they were not, from which step."""
    checked = [r for r in results if r.logits_identical is not None]
    labels = list(dict.fromkeys(_run_label(r, cuda) for r in checked))
    cols = sorted({(r.batch, r.style) for r in checked}, key=lambda k: (k[0], k[1] != "sync"))
    ax.set_xlim(0, max(len(cols), 1))
    ax.set_ylim(len(labels), 0)
    for r in checked:
        x, y = cols.index((r.batch, r.style)), labels.index(_run_label(r, cuda))
        ok = bool(r.logits_identical and r.tokens_identical)
        if ok:
            text = "identical"
        elif r.first_mismatch is not None:
            text = f"DIFFER\nat step {r.first_mismatch}"
        else:
            text = "DIFFER\n(tokens)"
        ax.add_patch(_rect((x + 0.04, y + 0.08), 0.92, 0.84, "#2e9e4f" if ok else "#d62728"))
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_xticks([i + 0.5 for i in range(len(cols))])
    ax.set_xticklabels([f"batch {b}\n{s}" for b, s in cols], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(labels))])
    ax.set_yticklabels(labels, fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    good = sum(1 for r in checked if r.logits_identical and r.tokens_identical)
    steps = "/".join(map(str, sorted({r.steps for r in checked})))
    ax.set_title(
        f"rows: {good}/{len(checked)} runs bit-identical to the {reference_name(cuda)} "
        f"reference\n(tokens and logits, every one of {steps} steps)",
        fontsize=9,
    )


def _rect(xy: tuple[float, float], w: float, h: float, color: str) -> Any:
    from matplotlib.patches import Rectangle  # type: ignore[import-not-found,unused-ignore]

    return Rectangle(xy, w, h, color=color)


def _memory_panel(
    ax: Any, results: list[RunResult], tables: Mapping[str, tuple[int, int]], cuda: bool
) -> None:
    """What the table costs held whole (the reference) against what the served path
    holds instead, computed from the tables' shapes; on a GPU also what was measured."""
    got = _memory(results, tables)
    if got is None:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no table shapes: memory not drawn", ha="center", va="center")
        return
    n, table, staging, shapes = got
    where = "GPU" if cuda else "host"
    bars = [
        (f"{reference_name(cuda)} (reference):\nevery row in {where} memory", table, "#7f7f7f"),
        (
            f"served: staging, one row a sequence\n(batch {n}, {'GPU' if cuda else 'host'})",
            staging,
            "#2e9e4f",
        ),
        (f"served: {'pinned ' if cuda else ''}host slot\n(batch {n})", staging, "#2e9e4f"),
    ]
    unit, scale = next(
        ((u, k) for u, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if table >= k),
        ("B", 1),
    )
    ys = list(range(len(bars)))
    ax.barh(ys, [b[1] / scale for b in bars], color=[b[2] for b in bars], height=0.6)
    for y, (_, v, _c) in zip(ys, bars, strict=True):
        ax.text(v / scale, y, f"  {_size(v)}", va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, table / scale * 1.35)
    ax.set_xlabel(f"{unit} (the table: {shapes})", fontsize=8)
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    saved = _size(table - staging)
    if cuda:
        head = (
            f"memory: the table would cost {_size(table)} of GPU memory;\n"
            f"served, {_size(staging)} of it (and {_size(staging)} pinned): it saves {saved}"
        )
        ref_mem = [r.gpu_bytes for r in results if r.variant == "gpu-table" and r.gpu_bytes]
        dd = [r.gpu_bytes for r in results if r.variant == "deferred-device" and r.gpu_bytes]
        if ref_mem and dd:
            head += f"\n(measured here: {_size(max(ref_mem) - min(dd))} less GPU memory allocated)"
    else:
        head = (
            f"memory: the table costs {_size(table)} held whole;\nserved, "
            f"{_size(2 * staging)} (on a GPU it would save {saved} of GPU memory)"
        )
    ax.set_title(head, fontsize=9)


def plot(
    results: list[RunResult],
    path: str | Path,
    title: str,
    tables: Mapping[str, tuple[int, int]] | None = None,
    cuda: bool | None = None,
) -> str:
    """What a run showed, in one PNG: which runs were bit-identical to the reference
    (tokens and logits, per batch and style), the memory the table costs held whole
    against what the served path holds (from ``tables``, ``name -> (rows, row_bytes)``),
    and per-step latency by variant, one panel per (batch, style). ``cuda``: whether the
    runs had a GPU (default: whether they were captured); without one the reference is
    the in-memory table and the timings are marked as noise. Returns what it did."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return "PNG skipped: matplotlib is not installed"
    keys = sorted({(r.batch, r.style) for r in results})
    if not keys:
        return "PNG skipped: no runs"
    cuda = on_gpu(results) if cuda is None else cuda
    batches = sorted({k[0] for k in keys})
    styles = sorted({k[1] for k in keys}, reverse=True)
    labels = {_run_label(r, cuda) for r in results if r.logits_identical is not None}
    top = max(3.2, 0.42 * len(labels) + 1.2)
    fig = plt.figure(figsize=(13, top + 3.0 * len(batches)))
    grid = fig.add_gridspec(
        1 + len(batches), 2, height_ratios=[top] + [3.0] * len(batches), width_ratios=[1, 1]
    )
    _identity_panel(fig.add_subplot(grid[0, 0]), results, cuda)
    _memory_panel(fig.add_subplot(grid[0, 1]), results, tables or {}, cuda)
    meds = [r.median_us for r in results if r.step_us]
    ms = bool(meds) and max(meds) >= 10_000
    unit, scale = ("ms", 1e-3) if ms else ("us", 1.0)
    for i, b in enumerate(batches):
        for j, s in enumerate(styles):
            ax = fig.add_subplot(grid[1 + i, j] if len(styles) > 1 else grid[1 + i, :])
            for r in results:
                if r.batch == b and r.style == s and r.step_us:
                    ax.plot(
                        range(1, len(r.step_us)),
                        [v * scale for v in r.step_us[1:]],
                        lw=0.8,
                        label=_run_label(r, cuda),
                    )
            head = f"batch {b}, {s} scheduling: time a step"
            if not cuda:
                head += " (CPU: eager steps, no graphs, no deferral; the times are noise)"
            ax.set_title(head, fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel(f"{unit} / step")
            ax.ticklabel_format(axis="y", style="plain", useOffset=False)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"PNG written: {path}"
