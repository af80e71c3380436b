"""Gemma 3n decode with tensor parallelism over ``torch.distributed`` (NCCL), each rank
serving the PLE table from the one checkpoint through its own steps and worker (the
ranks share the page cache of the one file). Run with ``torchrun``::

    torchrun --nproc_per_node=2 -m ple_memops.demo.tp --model e2b --batch 8

Every rank first decodes with the whole model (TP 1) on its GPU, then shards it and
decodes again (TP 2). Sharding follows transformers' tensor-parallel plan for Gemma 3n
(attention heads split, ``o_proj`` row-parallel; MLP ``gate``/``up`` column-parallel,
``down`` row-parallel; an all-reduce after each row-parallel projection), except the MLPs
of the activation-sparse layers, which stay whole: their Gaussian top-k takes the mean and
standard deviation over the whole intermediate dimension, which a split would change.

Checks: TP 2 with deferred rows against TP 2 with the table in GPU memory (bit-identical
logits: the rows change nothing), and TP 2's tokens against TP 1's (a row-parallel sum
rounds differently from a whole matmul, so in bf16 a near-tie can flip a greedy token;
the report says where and by how much).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "shard_gemma3n"]


def _split(linear: Any, dim: int, rank: int, world: int) -> None:
    import torch

    w = linear.weight
    size = w.shape[dim]
    if size % world:
        raise ValueError(f"cannot split {size} features over {world} ranks")
    part = w.narrow(dim, rank * size // world, size // world).contiguous()
    linear.weight = torch.nn.Parameter(part, requires_grad=False)
    if dim == 0:
        linear.out_features = part.shape[0]
    else:
        linear.in_features = part.shape[1]


def _all_reduce_hook(module: Any, args: Any, output: Any) -> Any:
    import torch.distributed as dist

    dist.all_reduce(output)
    return output


def shard_gemma3n(model: Any, rank: int, world: int) -> dict[str, int]:
    """Shard a Gemma 3n model in place for tensor parallelism (see the module docs).
    Returns counts of what was split."""
    tm = model.model
    cfg = tm.config
    if cfg.num_attention_heads % world or cfg.num_key_value_heads % world:
        raise ValueError(
            f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads do not "
            f"split over {world} ranks"
        )
    counts = {"attention": 0, "mlp": 0, "mlp_whole": 0}
    for i, layer in enumerate(tm.layers):
        attn = layer.self_attn
        _split(attn.q_proj, 0, rank, world)
        if not attn.is_kv_shared_layer:
            _split(attn.k_proj, 0, rank, world)
            _split(attn.v_proj, 0, rank, world)
        _split(attn.o_proj, 1, rank, world)
        attn.o_proj.register_forward_hook(_all_reduce_hook)
        counts["attention"] += 1
        if cfg.activation_sparsity_pattern[i] > 0.0:
            counts["mlp_whole"] += 1
            continue
        mlp = layer.mlp
        _split(mlp.gate_proj, 0, rank, world)
        _split(mlp.up_proj, 0, rank, world)
        _split(mlp.down_proj, 1, rank, world)
        mlp.down_proj.register_forward_hook(_all_reduce_hook)
        counts["mlp"] += 1
    return counts


def _config(name: str, dtype: str, layers: int | None) -> Any:
    from .checkpoints import e2b_gemma3n_config, tiny_gemma3n_config

    if name == "e2b":
        cfg = e2b_gemma3n_config(**({"num_hidden_layers": layers} if layers else {}))
    elif name == "small":
        # Heads and KV heads that split over two ranks; a vocabulary small enough to build fast.
        n = layers or 10
        cfg = tiny_gemma3n_config(
            vocab_size=4096,
            vocab_size_per_layer_input=4096,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=n,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            hidden_size_per_layer_input=64,
            num_kv_shared_layers=n // 5,
            laurel_rank=16,
            activation_sparsity_pattern=[0.95] + [0.0] * (n - 1),
            # Both attention types among the layers that produce K/V, whatever n.
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(n)],
        )
    else:
        raise ValueError(f"--model must be e2b or small, got {name!r}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist
    import transformers

    from .checkpoints import build_checkpoint, default_cache_dir
    from .cli import load_gemma
    from .runner import Decoder, GemmaBench, RunResult

    ap = argparse.ArgumentParser(
        prog="python -m ple_memops.demo.tp",
        description="Gemma 3n decode with tensor parallelism 2 (run with torchrun "
        "--nproc_per_node=2), PLE rows deferred on every rank, checked against TP 2 with the "
        "table in GPU memory and against TP 1.",
    )
    ap.add_argument(
        "--model",
        default="e2b",
        help="e2b (E2B shapes, random weights) or small (fp32-friendly, fast to build); "
        "built once in the cache directory (default: e2b)",
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="layers of the built model (default: its own)"
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="weights' dtype (default: bfloat16)",
    )
    ap.add_argument("--batch", default="8", help="batch sizes, comma-separated (default: 8)")
    ap.add_argument("--steps", type=int, default=128, help="decode steps per run (default: 128)")
    ap.add_argument(
        "--styles",
        default="sync,async",
        help="scheduling styles, comma-separated; the CPU runs sync only (default: sync,async)",
    )
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="where built checkpoints live (default: $PLE_MEMOPS_CACHE, else the user cache)",
    )
    ap.add_argument(
        "--device", default=None, help="cuda (NCCL; default when there is a GPU) or cpu (gloo)"
    )
    ap.add_argument(
        "--require-identical-tokens",
        action="store_true",
        help="fail unless TP 2 decodes TP 1's tokens (use with float32)",
    )
    a = ap.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    cuda = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))

    def say(*x: object) -> None:
        print(f"[rank {rank}]", *x, flush=True)

    dtype = getattr(torch, a.dtype)
    root = Path(a.cache_dir) if a.cache_dir else default_cache_dir()
    tag = f"{a.model}{a.layers or ''}-{a.dtype}-tf{transformers.__version__}"
    ckpt = root / f"gemma3n-tp-{tag}"
    t0 = time.perf_counter()
    if rank == 0:
        build_checkpoint(ckpt, _config(a.model, a.dtype, a.layers), device=dev.type, dtype=dtype)
    dist.barrier()
    if rank == 0:
        say(f"checkpoint {ckpt} ready in {time.perf_counter() - t0:.1f} s")
    batches = [int(x) for x in a.batch.split(",")]
    styles = [s for s in a.styles.split(",") if s] if cuda else ["sync"]

    def run(bench: GemmaBench) -> list[RunResult]:
        out: list[RunResult] = []
        for b in batches:
            out += bench.run_batch(
                b,
                a.steps,
                variants=["gpu-table", "deferred-device"],
                styles=styles,
                placements=["late"],
            )
        return out

    def prefill_logits(bench: GemmaBench) -> dict[int, Any]:
        # The prompt's logits, eagerly: how far TP moves them (rounding) against how close
        # the top two are (what a greedy token flip needs).
        out = {}
        with bench.attention_scope():
            for b in batches:
                out[b] = Decoder(served.model, batch=b, steps=1, device=dev).prefill().float()
        return out

    served, stock = load_gemma(ckpt, dev, dtype=dtype)
    bench1 = GemmaBench(served, stock, device=dev, eager_check_steps=0)
    pre1 = prefill_logits(bench1)
    # The model's own sensitivity, for scale: the same TP 1 prefill with every token
    # embedding moved by about one unit in the last place of its dtype.
    emb = served.model.get_input_embeddings().weight
    saved = emb.detach().clone()
    with torch.no_grad():
        emb.mul_(1 + torch.finfo(emb.dtype).eps)
    pre_ulp = prefill_logits(bench1)
    with torch.no_grad():
        emb.copy_(saved)
    del saved
    tp1 = run(bench1)
    counts = shard_gemma3n(served.model, rank, world)
    if cuda:
        torch.cuda.empty_cache()
    if rank == 0:
        say(f"sharded over {world} ranks: {counts}")
    bench = GemmaBench(served, stock, device=dev, eager_check_steps=0)
    pre2 = prefill_logits(bench)
    tp2 = run(bench)
    ok = True
    if rank == 0:
        for b in batches:
            l1, l2 = pre1[b], pre2[b]
            top2 = l1.topk(2, dim=-1).values
            gap = (top2[:, 0] - top2[:, 1]).min().item()
            same = int((l1.argmax(-1) == l2.argmax(-1)).sum().item())
            moved = (l1 - pre_ulp[b]).abs().max().item()
            say(
                f"batch {b} prefill logits TP1 with token embeddings moved by 1 ulp: max |diff| "
                f"{moved:.3g}; argmax same in "
                f"{int((l1.argmax(-1) == pre_ulp[b].argmax(-1)).sum().item())} of {b} rows"
            )
            say(
                f"batch {b} prefill logits TP{world} vs TP1: max |diff| "
                f"{(l1 - l2).abs().max().item():.3g} (logits up to {l1.abs().max().item():.3g}); "
                f"smallest top-1/top-2 gap {gap:.3g}; argmax same in {same} of {b} rows"
            )
    for r1, r2 in zip(tp1, tp2, strict=True):
        same_tokens = bool(np.array_equal(r1.tokens, r2.tokens))
        line = (
            f"batch {r2.batch} {r2.style} {r2.variant:15s} TP{world} {r2.median_us:9.1f} us/step "
            f"(TP1 {r1.median_us:9.1f}); vs TP{world} gpu-table: "
            + (
                "-"
                if r2.logits_identical is None
                else ("logits bit-identical" if r2.logits_identical else "logits DIFFER")
            )
            + f"; tokens vs TP1: {'identical' if same_tokens else 'differ'}"
        )
        if not same_tokens:
            diff = np.argwhere(r1.tokens != r2.tokens)
            line += f" (first at step {int(diff[0][0])}, {len(diff)} of {r1.tokens.size})"
        bad = r2.logits_identical is False or r2.tokens_identical is False
        bad |= a.require_identical_tokens and not same_tokens
        if rank == 0 or bad:  # rank 0 reports; another rank only what fails there
            say(line)
        ok &= not bad
    # Every rank must have decoded the same tokens (the all-reduced state is replicated).
    mine = torch.from_numpy(np.concatenate([r.tokens.reshape(-1) for r in tp2])).to(dev)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    same_ranks = all(torch.equal(gathered[0], g) for g in gathered)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    ok = bool(flag.item())
    if rank == 0:
        say(f"every rank's checks passed: {ok}")
        say(f"tokens identical on all {world} ranks: {same_ranks}")
        mem = [r.gpu_bytes for r in tp2 if r.variant == "deferred-device"]
        ref = [r.gpu_bytes for r in tp2 if r.variant == "gpu-table"]
        if mem and ref and mem[0] is not None and ref[0] is not None:
            say(
                f"GPU memory per rank: gpu-table {ref[0] / 2**20:,.0f} MiB, deferred-device "
                f"{mem[0] / 2**20:,.0f} MiB (table {served.server.table_bytes / 2**20:,.0f} MiB)"
            )
    served.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok and same_ranks else 1


if __name__ == "__main__":
    code = main()
    # The result is decided and the process group destroyed: skip the interpreter's
    # teardown, where gloo's worker threads can still abort the process ("terminate called
    # without an active exception", seen once in ten CPU runs; pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
