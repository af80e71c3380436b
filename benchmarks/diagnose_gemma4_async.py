"""Why do a Gemma 4 mmap engine's tokens differ from the stock engine's under async
scheduling? A diagnostic for the real vLLM 0.33.0 engine on a GPU
(``DIAG=1 bash scripts/gpu/vllm_gemma4.sh`` runs it after the engine tests).

The plugin turns async scheduling off for Gemma 4 mmap engines: with two steps in flight,
4 of 5 engines with FULL decode graphs gave other tokens than the stock engine on the H200
(a different request each time, always after a prefill), while one step at a time, a
synchronous plan and (once) no graphs gave the stock tokens. This script turns it back on
and serves the Gemma 4 engine tests' workload (``benchmarks/vllm_harness.py``) with one
engine a variant, each asking one question:

* ``stock``: vLLM's own table in GPU memory (the reference; run twice: is stock itself
  deterministic under async scheduling?);
* ``mmap``: the plugin, with a shadow check inside every step: the rows the consumer reads
  compared, on the device, with a GPU copy of the checkpoint's table at the step's ids,
  counted apart for FULL replays and eager steps (captured into the graphs with the rest).
  No bad row while the tokens differ: the rows are right and the cause is elsewhere;
* ``mmap-serial-eager``: every eager step completes the pending steps before it is armed
  (no eager step in flight beside a replay);
* ``mmap-eager-model``: the model not compiled (``compilation_config.mode`` 0), FULL graphs
  kept: is it Inductor?
* ``stock-stall``: the stock engine with a GPU sleep (as long as a row fill, 200 us) where
  it looks its rows up: does a stall at the top of the forward alone change its tokens
  (a race in vLLM's async path, not in ple-memops)?

Prints one table (tokens equal to the first stock run's, the requests that differ, bad
rows by step kind); exit status 0 when it ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ["PLE_MEMOPS_TABLE_BACKEND"] = "mmap"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_harness as harness

VARIANTS = ("stock", "mmap", "stock", "mmap-serial-eager", "mmap-eager-model", "stock-stall")
STALL_CYCLES = 400_000  # about 200 us at the H200's clock

_LIB = torch.library.Library("ple_memops_diag", "DEF")  # type: ignore[no-untyped-call]
_LIB.define("stall(Tensor x) -> Tensor")  # type: ignore[no-untyped-call]


def _stall(x: torch.Tensor) -> torch.Tensor:
    torch.cuda._sleep(STALL_CYCLES)
    return x.clone()


_LIB.impl("stall", _stall, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
torch.library.register_fake("ple_memops_diag::stall", lambda x: torch.empty_like(x), lib=_LIB)


class Shadow:
    """The device-side check of every consumer's rows (see the module)."""

    def __init__(self) -> None:
        self.tables: dict[str, torch.Tensor] = {}
        self.counts: torch.Tensor | None = None  # [kind][checked rows, bad rows, bad steps]

    def install(self) -> None:
        from ple_memops.vllm.hooks import PleRunnerHooks

        shadow = self
        read_rows = PleRunnerHooks.read_rows

        def checked(hooks: Any, name: str, staged: Any) -> Any:
            out = read_rows(hooks, name, staged)
            table = shadow.tables.get(name)
            if table is None:
                layer = hooks.plan.layers[name]
                import numpy as np

                rows = layer.table.gather(np.arange(layer.table.rows, dtype=np.int64))
                table = shadow.tables[name] = torch.from_numpy(rows).to(out.device)
                shadow.counts = torch.zeros(2, 3, dtype=torch.int64, device=out.device)
            counts = shadow.counts
            assert counts is not None
            n = int(staged.shape[0])
            ids = hooks.ids_buffer(name)[:n]
            bad = (out != table[ids]).any(dim=1)
            kind = 1 if out.is_cuda and torch.cuda.is_current_stream_capturing() else 0
            if kind == 0 and getattr(hooks._scope, "dummy", False):
                return out  # profile, warm-up and dummy passes have no data
            counts[kind, 0] += n
            counts[kind, 1] += bad.sum()
            counts[kind, 2] += bad.any().to(torch.int64)
            return out

        PleRunnerHooks.read_rows = checked  # type: ignore[method-assign]

    def reset(self) -> None:
        if self.counts is not None:
            self.counts.zero_()
        self.tables.clear()

    def report(self) -> str:
        if self.counts is None:
            return "-"
        c = self.counts.tolist()
        eager, replay = c
        return (
            f"eager {eager[1]}/{eager[0]} rows bad ({eager[2]} steps); "
            f"replay {replay[1]}/{replay[0]} ({replay[2]} steps)"
        )


def _keep_async() -> None:
    """Undo the plugin's async-scheduling switch-off (this diagnostic's whole point)."""
    from ple_memops.vllm import gemma4

    verify = gemma4.verify_and_update_config

    def keep(vllm_config: Any) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        verify(vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    gemma4.verify_and_update_config = keep  # type: ignore[assignment]


def _serial_eager(on: bool) -> None:
    from ple_memops.vllm.hooks import PleRunnerHooks

    original = getattr(PleRunnerHooks, "_diag_stage_eager", PleRunnerHooks._stage_eager)
    PleRunnerHooks._diag_stage_eager = original  # type: ignore[attr-defined]

    def serial(hooks: Any, scope: Any, *args: Any) -> None:
        if scope.rows is None:
            hooks.driver.drain()
        original(hooks, scope, *args)

    PleRunnerHooks._stage_eager = serial if on else original  # type: ignore[method-assign]


def _stock_stall(on: bool) -> None:
    from vllm.model_executor.models.gemma4 import Gemma4SelfDecoderLayers

    original = getattr(
        Gemma4SelfDecoderLayers, "_diag_get", Gemma4SelfDecoderLayers.get_per_layer_inputs
    )
    Gemma4SelfDecoderLayers._diag_get = original

    def stalled(self: Any, input_ids: torch.Tensor) -> Any:
        return original(self, torch.ops.ple_memops_diag.stall(input_ids))

    Gemma4SelfDecoderLayers.get_per_layer_inputs = stalled if on else original


def _differs(ref: list[Any], got: list[Any]) -> list[str]:
    return [
        f"b{b}r{r}@{next(i for i, (x, y) in enumerate(zip(w, h, strict=True)) if x != y)}"
        for b, (want, have) in enumerate(zip(ref, got, strict=True))
        for r, (w, h) in enumerate(zip(want, have, strict=True))
        if w != h
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, run in order (default: {','.join(VARIANTS)})",
    )
    args = parser.parse_args()
    from ple_memops.vllm import plugin

    plugin.install()
    _keep_async()
    shadow = Shadow()
    shadow.install()
    root = Path(tempfile.mkdtemp(prefix="ple-gemma4-diag-"))
    ckpt = harness.write_gemma4_checkpoint(root)
    workload = harness.gemma4_engine_workload()
    reference = None
    rows = []
    for variant in args.variants.split(","):
        backend = "default" if variant.startswith("stock") else "mmap"
        kw: dict[str, Any] = {"async_scheduling": True}
        if variant == "mmap-eager-model":
            kw["compilation_config"] = {
                "mode": 0,
                "cudagraph_mode": "FULL_DECODE_ONLY",
                "cudagraph_capture_sizes": harness.GEMMA4_GRAPH_SIZES,
            }
        _serial_eager(variant == "mmap-serial-eager")
        _stock_stall(variant == "stock-stall")
        shadow.reset()
        start = time.monotonic()
        llm = harness.gemma4_engine(ckpt, backend, **kw)
        try:
            got = harness.generate(llm, workload)
            asynced = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        finally:
            harness.close(llm)
        if reference is None:
            reference = got
        differs = _differs(reference, got)
        rows.append(
            f"| {variant} | {asynced} | {'yes' if not differs else 'no'} | "
            f"{' '.join(differs) or '-'} | {shadow.report() if backend == 'mmap' else '-'} | "
            f"{time.monotonic() - start:.0f} s |"
        )
        print(rows[-1], flush=True)
    print(
        "\n| variant | async | tokens = first stock run | differing requests@token | "
        "shadow check | wall |\n|---|---|---|---|---|---|"
    )
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
