"""Compare Gemma 4 engines' greedy runs in the real vLLM 0.33.0 engine on a GPU, engine
against engine, with a device-side check of every row an mmap engine delivers.

Each run serves the Gemma 4 engine tests' workload (``tests/vllm_harness.py``) and
records its tokens and logprobs. ``--save FILE`` keeps them, so engines built in separate
processes (each compiling the model afresh) can be compared with ``--compare``: that is
the A/A measurement behind ``vllm_harness.NEAR_TIE`` (on the H200 two stock engines of
one configuration, compiled in two processes, gave logprobs up to 2e-3 apart and, on the
tiny model at init, other tokens). Variants, run in order in one process:

* ``stock``: vLLM's own table in GPU memory;
* ``mmap``: the plugin, with the shadow check: inside every step (captured into the
  graphs with the rest) the rows the consumer reads are compared, on the device, with a
  GPU copy of the checkpoint's table at the step's ids, counted apart for FULL replays
  and eager steps;
* a ``-sync`` suffix turns async scheduling off (``stock-sync``, ``mmap-sync``).

Prints one table: each run against the first (tokens, the requests that differ and whether
at a near tie of the first run's, logprobs where the tokens agree, bad rows by step kind).
``DIAG=1 bash scripts/gpu/vllm_gemma4.sh`` runs it after the engine tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ["PLE_MEMOPS_TABLE_BACKEND"] = "mmap"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import vllm_harness as harness

VARIANTS = ("stock", "mmap", "mmap-sync")


class Shadow:
    """The device-side check of every consumer's rows (see the module)."""

    def __init__(self) -> None:
        self.tables: dict[str, Any] = {}
        self.counts: Any = None  # [kind][checked rows, bad rows, bad steps]

    def install(self) -> None:
        import numpy as np
        import torch

        from ple_memops.vllm.hooks import PleRunnerHooks

        shadow = self
        read_rows = PleRunnerHooks.read_rows

        def checked(hooks: Any, name: str, staged: Any) -> Any:
            out = read_rows(hooks, name, staged)
            table = shadow.tables.get(name)
            if table is None:
                layer = hooks.steps.tables[name]
                rows = layer.table.gather(np.arange(layer.table.rows, dtype=np.int64))
                table = shadow.tables[name] = torch.from_numpy(rows).to(out.device)
                shadow.counts = torch.zeros(2, 3, dtype=torch.int64, device=out.device)
            kind = 1 if torch.cuda.is_current_stream_capturing() else 0
            if kind == 0 and getattr(hooks._scope, "dummy", False):
                return out  # profile, warm-up and dummy passes have no data
            n = int(staged.shape[0])
            bad = (out != table[hooks.ids_buffer(name)[:n]]).any(dim=1)
            counts = shadow.counts
            counts[kind, 0] += n
            counts[kind, 1] += bad.sum()
            counts[kind, 2] += bad.any().to(torch.int64)
            return out

        PleRunnerHooks.read_rows = checked  # type: ignore[method-assign]

    def reset(self) -> None:
        self.counts = None  # made under the engine's inference mode: not zeroed in place
        self.tables.clear()

    def report(self) -> str:
        if self.counts is None:
            return "-"
        eager, replay = self.counts.tolist()
        return (
            f"eager {eager[1]}/{eager[0]} rows bad ({eager[2]} steps); "
            f"replay {replay[1]}/{replay[0]} ({replay[2]} steps)"
        )


def _against(ref: dict[str, Any], got: dict[str, Any]) -> tuple[str, str]:
    """(the requests that differ, each ``b<batch>r<request>@<token>`` with ``~`` when the
    first run's choice there was a near tie; the logprobs where the tokens agree)."""
    differs, compared, differ, largest = [], 0, 0, 0.0
    for b, (tw, th, lw, lh, gw) in enumerate(
        zip(
            ref["tokens"], got["tokens"], ref["logprobs"], got["logprobs"], ref["gaps"], strict=True
        )
    ):
        for r, (w, h) in enumerate(zip(tw, th, strict=True)):
            first = next((i for i, (x, y) in enumerate(zip(w, h, strict=True)) if x != y), len(w))
            if first < len(w):
                differs.append(f"b{b}r{r}@{first}{'~' if gw[r][first] < harness.NEAR_TIE else ''}")
            for i in range(first):
                compared += 1
                d = abs(lw[r][i] - lh[r][i])
                differ += d > 0
                largest = max(largest, d)
    lp = f"{differ}/{compared} differ" + (f" (max {largest:.1e})" if differ else "")
    return " ".join(differs) or "-", lp


def _run(variant: str, ckpt: Path, workload: list[Any], shadow: Shadow) -> dict[str, Any]:
    backend = "default" if variant.startswith("stock") else "mmap"
    shadow.reset()
    llm = harness.gemma4_engine(ckpt, backend, async_scheduling=not variant.endswith("-sync"))
    try:
        run: dict[str, Any] = dataclasses.asdict(harness.generate_greedy(llm, workload))
        run["async"] = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    finally:
        harness.close(llm)
    run["shadow"] = shadow.report() if backend == "mmap" else "-"
    return run


def _table(runs: dict[str, dict[str, Any]]) -> None:
    names = list(runs)
    print(
        f"\n| run | async | against {names[0]}: requests that differ (~ at a near tie) | "
        "logprobs where the tokens agree | shadow check |\n|---|---|---|---|---|"
    )
    for name in names:
        differs, lp = _against(runs[names[0]], runs[name])
        print(f"| {name} | {runs[name].get('async')} | {differs} | {lp} | {runs[name]['shadow']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, run in order (default: {','.join(VARIANTS)})",
    )
    parser.add_argument("--save", metavar="FILE", help="write the runs to FILE (JSON)")
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="FILE",
        help="compare the runs saved in these files with the first one; build no engine",
    )
    args = parser.parse_args()
    runs: dict[str, dict[str, Any]] = {}
    if args.compare:
        for f in args.compare:
            for variant, run in json.loads(Path(f).read_text()).items():
                runs[f"{Path(f).stem}:{variant}"] = run
        _table(runs)
        return 0
    from ple_memops.vllm import plugin

    plugin.install()
    shadow = Shadow()
    shadow.install()
    ckpt = harness.write_gemma4_checkpoint(Path(tempfile.mkdtemp(prefix="ple-gemma4-cmp-")))
    workload = harness.gemma4_engine_workload()
    for variant in args.variants.split(","):
        start = time.monotonic()
        runs[variant] = _run(variant, ckpt, workload, shadow)
        print(f"{variant}: {time.monotonic() - start:.0f} s", flush=True)
        if args.save:  # after each run: a run cut short keeps what it has
            Path(args.save).write_text(json.dumps(runs))
    _table(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
