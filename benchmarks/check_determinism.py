"""Is the stock Gemma 3n decode step bit-reproducible on this GPU? Bit-identical logits
against a reference only mean something if the reference itself repeats exactly.

Loads an E2B-shaped random-weight checkpoint (built once, as ``python -m ple_memops
bench --model e2b`` does) with the stock table on the GPU, then decodes ``--steps`` greedy
steps ``--reps`` times from the same prompt, eagerly and by replaying one captured step,
and reports for each repetition the first step whose logits differ from repetition 0's
(and by how much). Environment: ``DET=1`` turns on ``torch.use_deterministic_algorithms``
(set ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` with it).

    python benchmarks/check_determinism.py [--layers 6] [--batch 1] [--steps 48] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from ple_memops.demo.checkpoints import (
    build_checkpoint,
    default_cache_dir,
    e2b_gemma3n_config,
)
from ple_memops.demo.cli import relayer
from ple_memops.demo.runner import Decoder


def run(dec: Decoder, steps: int, graph: Any, logits: Any) -> torch.Tensor:
    first = dec.prefill()
    rec = []
    for _ in range(steps):
        if graph is None:
            rec.append(dec.step().float().cpu())
        else:
            graph.replay()
            rec.append(logits.float().cpu())
    return torch.cat([first.float().cpu().unsqueeze(0), torch.stack(rec)], 0)


def compare(name: str, reps: list[torch.Tensor]) -> None:
    base = reps[0]
    for i, r in enumerate(reps[1:], 1):
        diff = (r != base).flatten(1).any(1)
        if not bool(diff.any()):
            print(f"  {name} rep {i}: identical to rep 0 over {len(base)} steps (incl. prefill)")
            continue
        k = int(diff.nonzero()[0])
        mx = float((r[k] - base[k]).abs().max())
        print(
            f"  {name} rep {i}: first differs at step {k} ({'prefill' if k == 0 else 'decode'}),"
            f" max |diff| {mx:.3g}; {int(diff.sum())}/{len(base)} steps differ"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=6, help="0: the full 30")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: eager only (a dry run)")
    a = ap.parse_args()
    import transformers

    if os.environ.get("DET"):
        torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = e2b_gemma3n_config()
    if a.layers:
        cfg = relayer(cfg, a.layers, tiny=False)
    ckpt = default_cache_dir() / f"gemma3n-e2b-shaped{a.layers or ''}-tf{transformers.__version__}"
    t0 = time.perf_counter()
    build_checkpoint(ckpt, cfg, device=a.device)
    model = transformers.Gemma3nForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    model.to(a.device)
    print(
        f"{ckpt.name}: {cfg.num_hidden_layers} layers, batch {a.batch}, ready in "
        f"{time.perf_counter() - t0:.1f} s; DET={os.environ.get('DET', '')} "
        f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '')}"
    )
    dec = Decoder(model, batch=a.batch, steps=a.steps, device=a.device)
    eager = [run(dec, a.steps, None, None) for _ in range(a.reps)]
    compare("eager", eager)
    if a.device == "cpu":
        return
    graph, logits = dec.capture()
    replays = [run(dec, a.steps, graph, logits) for _ in range(a.reps)]
    compare("graph", replays)
    diff = (replays[0] != eager[0]).flatten(1).any(1)
    where = int(diff.nonzero()[0]) if bool(diff.any()) else None
    print(f"  graph rep 0 vs eager rep 0: first differs at step {where}")


if __name__ == "__main__":
    main()
