"""Plot ``bench_vllm.py``'s results: ITL p50 per backend per load, each repeat a dot and
the median a bar; beside it each backend's ITL p50 paired against the reference server of
the same round (percent; a ``--solo`` run: against the median of the reference's
repeats); and what the mmap servers measured of a step's cost where it
arises: the first PLE layer's GPU stall (mean) and our host time (p50) per step, in us.
Reads one or more ``--json`` outputs of the bench (each its own panel row: two runs that
could not share the GPU) and writes one PNG.

    python3 benchmarks/plot_vllm.py out/bench_vllm_ladder_gpu.json \\
        out/bench_vllm_ladder_mmap.json -o benchmarks/vllm_step_costs.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from vllm_report import paired


def _runs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in doc["runs"] if r.get("ok") and r.get("itl_p50_ms") is not None]


def default_title(docs: list[tuple[str, dict[str, Any]]]) -> str:
    """The figure's title, naming the vLLM release and the GPU the runs recorded
    (``meta.vllm``, ``meta.gpu``; a run from before one was recorded names none, and runs
    that differ name each)."""
    releases = sorted({v for _, d in docs if (v := d.get("meta", {}).get("vllm"))})
    gpus = sorted({g for _, d in docs if (g := d.get("meta", {}).get("gpu"))})
    vllm = f"vLLM {' and '.join(releases)}" if releases else "vLLM"
    on = f" on {' and '.join(gpus)}" if gpus else ""
    return f"{vllm}{on}: ITL p50 per backend"


def plot(docs: list[tuple[str, dict[str, Any]]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(docs), 3, figsize=(17, 3.8 * len(docs)), squeeze=False)
    for row, (name, doc) in enumerate(docs):
        runs = _runs(doc)
        ref = doc.get("ref")
        backends = list(dict.fromkeys(r["backend"] for r in runs))
        loads = list(dict.fromkeys(r["load"] for r in runs))
        ax, axp, axc = axes[row]
        width = 0.8 / max(1, len(backends))
        for bi, b in enumerate(backends):
            for li, load in enumerate(loads):
                xs = [r["itl_p50_ms"] for r in runs if r["backend"] == b and r["load"] == load]
                if not xs:
                    continue
                x = li + (bi - (len(backends) - 1) / 2) * width
                ax.bar(x, statistics.median(xs), width * 0.9, color=f"C{bi}",
                       label=b if li == 0 else None, alpha=0.55)  # fmt: skip
                ax.plot([x] * len(xs), xs, "k.", ms=4)
        ax.set_xticks(range(len(loads)), loads)
        ax.set_ylabel("ITL p50 (ms)")
        ax.set_title(f"{name}\nITL p50, each repeat a dot, bar = median", fontsize=10)
        ax.legend(fontsize=8)
        lo = min(r["itl_p50_ms"] for r in runs)
        ax.set_ylim(lo * 0.9, None)
        # Paired: each repeat against the reference of the same round (--solo: against
        # the median of the reference's repeats).
        solo = " --solo" in str((doc.get("meta") or {}).get("command", ""))
        pairs = paired(runs, ref, "itl_p50_ms", solo) if ref else {}
        others = [b for b in backends if b != ref]
        for bi, b in enumerate(others):
            for li, load in enumerate(loads):
                pct = pairs.get((load, b))
                if not pct:
                    continue
                x = li + (bi - (len(others) - 1) / 2) * (0.8 / max(1, len(others)))
                axp.bar(x, statistics.median(pct), 0.7 / max(1, len(others)),
                        color=f"C{backends.index(b)}", alpha=0.55,
                        label=b if li == 0 else None)  # fmt: skip
                axp.plot([x] * len(pct), pct, "k.", ms=4)
        axp.axhline(0, color="k", lw=0.8)
        for y in (-1, 1):
            axp.axhline(y, color="gray", lw=0.6, ls="--")
        axp.set_xticks(range(len(loads)), loads)
        axp.set_ylabel(f"ITL p50 vs {ref} (%)")
        how = "its repeats' median" if solo else "round by round"
        axp.set_title(f"{name}\npaired against {ref}, {how} (dashed: +-1%)", fontsize=10)
        axp.legend(fontsize=8)
        _costs(axc, name, runs, backends)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def _results_wait(r: dict[str, Any]) -> float | None:
    got = (r.get("graphs") or {}).get("results_p50_us")
    return None if got is None else float(got)


def _costs(ax: Any, name: str, runs: list[dict[str, Any]], backends: list[str]) -> None:
    """Per backend (every load together): GPU stall mean of the first PLE layer, our
    host p50 per engine step and, with the graphs' clock, the engine's wait for a step's
    results (p50: near zero where the host paces the step, so a stall is off its critical
    path), each repeat a dot, the median a bar."""
    shown = [b for b in backends if any(r.get("stall") or r.get("host_us") or
                                        _results_wait(r) is not None
                                        for r in runs if r["backend"] == b)]  # fmt: skip
    labels = ("GPU stall, mean", "our host time, p50", "engine's wait for results, p50")
    width = 0.8 / len(labels)
    used: set[str] = set()
    for bi, b in enumerate(shown):
        stall, host, wait = [], [], []
        for r in runs:
            if r["backend"] != b:
                continue
            if r.get("stall"):
                first = min(r["stall"], key=lambda n: int(n.split("layers.")[1].split(".")[0]))
                stall.append(r["stall"][first]["mean_us"])
            if r.get("host_us"):
                host.append(r["host_us"]["total_p50"])
            if (w := _results_wait(r)) is not None:
                wait.append(w)
        for k, (xs, label) in enumerate(zip((stall, host, wait), labels, strict=True)):
            if not xs:
                continue
            x = bi + (k - (len(labels) - 1) / 2) * width
            ax.bar(x, statistics.median(xs), width * 0.9, color=f"C{k + 2}", alpha=0.6,
                   label=None if label in used else label)  # fmt: skip
            used.add(label)
            ax.plot([x] * len(xs), xs, "k.", ms=4)
    ax.set_xticks(range(len(shown)), shown, fontsize=8)
    ax.set_ylabel("us per step")
    ax.set_title(f"{name}\nmeasured where it arises (each repeat a dot)", fontsize=10)
    if shown:
        ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path, help="bench_vllm.py --json outputs")
    p.add_argument("-o", "--out", type=Path, default=Path("vllm_itl.png"))
    p.add_argument(
        "--title",
        help="the figure's title (default: the GPU each run recorded, or none named, e.g. "
        "'vLLM 0.33.0 on NVIDIA H100 80GB HBM3: ITL p50 per backend')",
    )
    args = p.parse_args(argv)
    docs = [
        (path.stem.removeprefix("bench_vllm_"), json.loads(path.read_text())) for path in args.json
    ]
    plot(docs, args.out, args.title or default_title(docs))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
