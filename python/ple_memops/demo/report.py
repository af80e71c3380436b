"""Tables (plain text and BENCHMARKS.md markdown), the targets' summary and the latency plot
of the runner's results."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .runner import DEFERRED_VARIANTS, RunResult

__all__ = ["CPU_TIMINGS", "markdown", "memory_saved", "plot", "summary", "text_table", "to_json"]

_HEAD = (
    "batch",
    "style",
    "variant",
    "placement",
    "median us",
    "p99 us",
    "vs gpu-table",
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


def _ref_median(results: list[RunResult], batch: int, style: str) -> float | None:
    """The GPU-table reference at (batch, style): the mean of its runs' medians (it runs
    before and after the other variants)."""
    meds = [
        x.median_us
        for x in results
        if x.variant == "gpu-table" and x.batch == batch and x.style == style
    ]
    return sum(meds) / len(meds) if meds else None


def rows(results: list[RunResult]) -> list[tuple[str, ...]]:
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
                r.variant + (f" [{r.mode}]" if r.mode and r.mode != "deferred" else ""),
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


def text_table(results: list[RunResult]) -> str:
    body = rows(results)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(_HEAD)]
    line = "  ".join(h.ljust(w) for h, w in zip(_HEAD, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(out)


def markdown(results: list[RunResult]) -> str:
    body = rows(results)
    out = ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
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


def memory_saved(results: list[RunResult], tables: Mapping[str, tuple[int, int]]) -> str | None:
    """The GPU memory the deferred path saves, computed from the tables' shapes
    (``name -> (rows, row_bytes)``), so on every machine: the GPU table holds every row in
    GPU memory; the deferred path holds instead, per table, a staging buffer of one row
    per sequence on the GPU and a pinned slot of the same size, at the largest batch run."""
    if not results or not tables:
        return None
    n = max(r.batch for r in results)
    table = sum(rows * width for rows, width in tables.values())
    staging = sum(n * width for _, width in tables.values())
    shapes = ", ".join(f"{rows:,} rows x {width:,} B" for rows, width in tables.values())
    return (
        f"memory, computed from the table ({shapes}): the GPU table holds {_size(table)} "
        f"of GPU memory; the deferred path holds instead {_size(staging)} on the GPU "
        f"(staging, batch {n}) and {_size(staging)} pinned: saves {_size(table - staging)} "
        "of GPU memory"
    )


def summary(
    results: list[RunResult],
    table_bytes: int | None = None,
    tables: Mapping[str, tuple[int, int]] | None = None,
) -> list[str]:
    """The targets, as measured: per (batch, style) the best deferred variant against the
    GPU-table reference (within 1%); under async its overhead against the synchronous
    gather's (at most 1/5); whether every run matched the reference; GPU memory saved
    (measured where there is a GPU; computed from ``tables``, ``name -> (rows,
    row_bytes)``, on every machine)."""
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
        "bit-identical to the GPU-table reference"
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
    computed = memory_saved(results, tables or {})
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


def plot(results: list[RunResult], path: str | Path, title: str) -> str:
    """Per-step latency by variant, one panel per (batch, style). Returns what it did."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return "PNG skipped: matplotlib is not installed"
    keys = sorted({(r.batch, r.style) for r in results})
    if not keys:
        return "PNG skipped: no runs"
    batches = sorted({k[0] for k in keys})
    styles = sorted({k[1] for k in keys}, reverse=True)
    fig, axes = plt.subplots(
        len(batches), len(styles), figsize=(6 * len(styles), 3.2 * len(batches)), squeeze=False
    )
    for i, b in enumerate(batches):
        for j, s in enumerate(styles):
            ax = axes[i][j]
            for r in results:
                if r.batch == b and r.style == s and r.step_us:
                    late = r.placement not in ("-", "early")
                    label = r.variant + (f" ({r.placement})" if late else "")
                    ax.plot(range(1, len(r.step_us)), r.step_us[1:], lw=0.8, label=label)
            ax.set_title(f"batch {b}, {s} scheduling", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("us / step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"PNG written: {path}"
