"""What ``bench_vllm.py`` serves and how its servers run: the backends (``BACKENDS``,
``STOCK_VARIANTS``, ``MMAP_VARIANTS``, ``FAMILY_STOCK``, ``known_backends``), the models
(``GEMMA_MODELS``, ``family``, ``model_config``, their checkpoints, ``table_files``,
``describe``), each engine's arguments and environment (``engine_argv``, ``serve_argv``,
``profiler_argv``, ``cli_argv``, ``engine_env``), and the ``vllm serve`` processes
(``Server``, ``start_server``, ``wait_healthy``, ``stop_servers``, what their logs say:
``log_facts``; what they hold: ``server_resources``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import vllm_bench_model as vbm
from vllm_clock import log
from vllm_probes import gpu_memory_by_pid, group_members, host_rss, proc_tree

# -- backends and models ----------------------------------------------------------------------


BACKENDS = ("gpu", "uva", "mmap")
# Servers of vLLM's own table paths beside the three: a second GPU-table server (A against
# A: what difference the protocol resolves), and the GPU table with ple-memops' plugin
# installed and switched off for the engine (does installing it cost anything?).
STOCK_VARIANTS: dict[str, dict[str, Any]] = {
    "gpu": {"offload": False},
    "gpu-b": {"offload": False},
    "uva": {"offload": True},
    "gpu-plugin": {"offload": False, "plugin": True},
    # A second gpu-plugin: the A/A pair of a --solo run with --time-graphs, so the two
    # identical servers' graphs on the GPU are compared too (gpu-b's are not timed).
    "gpu-plugin-b": {"offload": False, "plugin": True},
    # Gemma: vLLM's generic answer to a model that does not fit, --cpu-offload-gb, given
    # the table's bytes (it offloads decoder layers' weights, read over UVA every step;
    # vLLM offloads no embedding table).
    "offload": {"offload": False, "offload_gb": True},
    # Qwen4Exp on vLLM 0.34.0 and later: vLLM's own disk offload (engram_config's
    # disk_offload: each step waits for the GPU's ids, then reads the rows with preadv on
    # the engine's thread into staging buffers the graphs read).
    "disk": {"offload": False, "disk": True},
}
# What each model family serves: Qwen4Exp's table paths are vLLM's engram_config; a Gemma's
# table is on the GPU in vLLM, and --cpu-offload-gb frees as much GPU memory elsewhere.
FAMILY_STOCK = {
    "qwen4exp": ("gpu", "gpu-b", "uva", "disk", "gpu-plugin", "gpu-plugin-b"),
    "gemma4": ("gpu", "gpu-b", "offload", "gpu-plugin", "gpu-plugin-b"),
    "gemma3n": ("gpu", "gpu-b", "offload", "gpu-plugin", "gpu-plugin-b"),
}
# The Gemma models, each a text config's keys (``base``: None for the tests' tiny one, {}
# for transformers' own defaults; ``overrides`` on top). EOS is the bench tokenizer's (id
# 2; the requests ignore it).
# - gemma4-e2b, gemma4-e4b: the text models of the released google/gemma-4-E2B and E4B
#   checkpoints (their config.json's text_config): E2B 35 layers of hidden 1536, one KV
#   head, the last 20 layers sharing KV and their MLPs double wide, every fifth layer full
#   attention (heads of 512), a [262144, 35 x 256] BF16 per-layer table of 4.38 GiB; E4B
#   42 layers of hidden 2560, two KV heads, the last 18 sharing KV, every sixth full, a
#   [262144, 42 x 256] table of 5.25 GiB.
# - gemma4-default: transformers' Gemma4TextConfig defaults (its docstring says "similar to
#   google/gemma-4-e2b-it", but they are not E2B's widths): 30 layers of hidden 2304, four
#   KV heads, no KV sharing, every sixth full attention, a [262144, 30 x 256] table of
#   3.75 GiB.
# - gemma3n-e4b: Gemma3nTextConfig's defaults ("gemma3n_text-E4B style"): 35 layers of
#   hidden 2048, 15 KV-shared, a [262144, 35 x 256] table of 4.38 GiB; gemma3n-e2b:
#   E2B's (transformers' converter: 30 layers, intermediate 8192, 10 KV-shared), 3.75 GiB.
#   Gemma3nForConditionalGeneration, served text only (its towers are the tests' tiny ones
#   and vLLM does not build them).
_GEMMA4_RELEASED: dict[str, Any] = {
    "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
    "hidden_size_per_layer_input": 256, "num_attention_heads": 8, "head_dim": 256,
    "global_head_dim": 512, "sliding_window": 512, "attention_k_eq_v": False,
    "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "eos_token_id": vbm.EOS_ID,
}  # fmt: skip
_GEMMA4_E2B: dict[str, Any] = _GEMMA4_RELEASED | {
    "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144,
    "num_key_value_heads": 1, "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
}  # fmt: skip
_GEMMA4_E4B: dict[str, Any] = _GEMMA4_RELEASED | {
    "hidden_size": 2560, "num_hidden_layers": 42, "intermediate_size": 10240,
    "num_key_value_heads": 2, "num_kv_shared_layers": 18, "use_double_wide_mlp": False,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7,
}  # fmt: skip
GEMMA_MODELS: dict[str, dict[str, Any]] = {
    "gemma4-e2b": {"family": "gemma4", "base": {}, "overrides": _GEMMA4_E2B},
    "gemma4-e4b": {"family": "gemma4", "base": {}, "overrides": _GEMMA4_E4B},
    "gemma4-default": {"family": "gemma4", "base": {}, "overrides": {"eos_token_id": vbm.EOS_ID}},
    "gemma4-tiny": {
        "family": "gemma4",
        "base": None,
        "overrides": {"vocab_size": 512, "vocab_size_per_layer_input": 512, "eos_token_id": 2},
    },
    "gemma3n-e2b": {
        "family": "gemma3n",
        "base": {},
        "overrides": {
            "num_hidden_layers": 30,
            "intermediate_size": 8192,
            "num_kv_shared_layers": 10,
            "eos_token_id": vbm.EOS_ID,
        },
    },
    "gemma3n-e4b": {"family": "gemma3n", "base": {}, "overrides": {"eos_token_id": vbm.EOS_ID}},
    "gemma3n-tiny": {"family": "gemma3n", "base": None, "overrides": {"eos_token_id": 2}},
}
# More mmap servers on request (--backends): the device side of a deferred step forced to
# the polling kernel or to stream memory operations, and the synchronous fallback (the
# probe's failure forced: FULL graphs kept, each replay after an ids graph and a host
# gather), each measured in the real engine.
MMAP_VARIANTS: dict[str, dict[str, Any]] = {
    "mmap": {},
    "mmap-kernel": {"copy": "kernel"},
    "mmap-memop": {"copy": "memop"},
    # The single-block kernel at every size: one kernel node waits, copies and resets.
    "mmap-fused": {"copy": "kernel-fused"},
    # The gather workers hot (spinning, then yielding) for 50 ms instead of 2 ms: a worker
    # armed one step ahead no longer naps before the GPU publishes the step's ids.
    "mmap-spin": {"spin": 0.05},
    # The first PLE layer's table (the fill every step waits for: PLE at the start of decoder
    # layer 0) on 8 gather threads of its own instead of the pool all tables share.
    "mmap-lead": {"first_layer_threads": 8},
    # The gather workers never hot: they nap (20 us) from the start of every wait instead of
    # spinning, then yielding, for 2 ms; a worker armed one step ahead then burns almost no
    # CPU while the GPU runs the step before (does our threads' CPU use slow the engine's?).
    "mmap-quiet": {"spin": 1e-6},  # 1 us (0 means the default)
    # The gather workers hot only around the READY they predict from the last steps
    # (predict_ready), asleep through the step before instead of spinning, then napping.
    "mmap-predict": {"predict_ready": True},
    # A Gemma model run eagerly: whole rows joined at decoder layer 0's gate (the default
    # before split_rows was).
    "mmap-whole": {"split_rows": False},
    # A Gemma model run eagerly: decoder layer 0's slice of each row a table of its own,
    # joined at layer 0's gate, the rest of the row at layer 1's (split_rows), the rest on
    # the shared pool; with the GPU stall timing too, for the stall column.
    "mmap-split": {"split_rows": True, "first_layer_threads": 0},
    "mmap-split-stalls": {"split_rows": True, "first_layer_threads": 0, "stalls": True},
    # split_rows with the rest's table on 8 gather threads of its own kept awake: the
    # default (mmap), spelt out.
    "mmap-split-lead": {"split_rows": True, "first_layer_threads": 8},
    # Without the instruments (no stall timing, no stats lines): what measuring costs.
    "mmap-bare": {"bare": True},
    # The GPU stall timing on (two stamps a step; off in the other mmap servers unless
    # --time-stalls): the stall column's source, and what the instrument costs.
    "mmap-stalls": {"stalls": True},
    # The stats lines (host times) without the stall timing, even with --time-stalls.
    "mmap-nostall": {"stalls": False},
    # The stall timing without the stats lines; and a second server without either
    # (which of the two instruments, if either, a fast or slow server owes its speed to).
    "mmap-nostats": {"stats": False, "stalls": True},
    "mmap-bare-b": {"bare": True},
    # A second mmap server (A against A among the mmap rungs).
    "mmap-b": {},
    # Diagnostics: the protocol (publish, waits, copies) without the host's gather; the
    # rows are stale and the tokens wrong, only the timing counts.
    "mmap-nogather": {"diag_skip_gather": True},
    # Every table's reads from storage of a step at once, as before reads took the layers'
    # order (read_in_order off): what the order saves on a table that misses the page cache.
    "mmap-unordered": {"read_in_order": False},
    # A Gemma model's rows joined after the projection at the top of the forward, as before
    # the late join (which, in a model run eagerly, joins them at decoder layer 0's gate).
    "mmap-early": {"diag_early_join": True},
    "mmap-sync": {"env": {"PLE_MEMOPS_FORCE_SYNC": "1"}},
    # What the synchronous fallback did before it kept FULL graphs: graphs off.
    "mmap-sync-eager": {"env": {"PLE_MEMOPS_FORCE_SYNC": "1"}, "cudagraph_mode": "NONE"},
}
# The model name every server serves under (the client asks for it: vllm_loads).
SERVED = "ple-bench"


def family(args: argparse.Namespace) -> str:
    """``gemma4``, ``gemma3n`` or ``qwen4exp``: the model family ``--model`` names."""
    spec = GEMMA_MODELS.get(args.model)
    return "qwen4exp" if spec is None else str(spec["family"])


def cpu_offload(backend: str) -> bool:
    """Whether vLLM keeps the tables in pinned host memory (UVA; mmap servers never read
    them there) rather than on the GPU."""
    return bool(STOCK_VARIANTS.get(backend, {}).get("offload", True))


def vllm_version() -> str | None:
    """The installed vLLM's version (the servers start with this interpreter and its path),
    e.g. ``"0.34.0"``; ``None`` where vLLM is not installed (a dry run)."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def vllm_release() -> tuple[int, ...]:
    """The installed vLLM's (major, minor), e.g. ``(0, 34)``; ``()`` without vLLM."""
    return tuple(int(x) for x in (vllm_version() or "").split(".")[:2] if x.isdigit())


def base_backend(name: str) -> str:
    """The backend a replica serves: ``mmap.2`` is a second ``mmap`` server (``NAME.K``,
    K >= 2: one more identical server, e.g. for the host memory of several servers of one
    checkpoint); any other name is itself."""
    base, dot, k = name.rpartition(".")
    return base if dot and k.isdigit() and int(k) >= 2 else name


def known_backends(fam: str | None = None) -> list[str]:
    """The backends of model family ``fam`` (every family's when None)."""
    stock = FAMILY_STOCK[fam] if fam else list(STOCK_VARIANTS)
    return list(dict.fromkeys([*(b for b in BACKENDS if b in stock or b == "mmap"),
                               *stock, *MMAP_VARIANTS]))  # fmt: skip


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    if family(args) != "qwen4exp":
        return gemma_config(args.model)
    if args.model == "tiny":
        return vbm.bench_config(
            layers=8, experts=4, topk=2, ple_layers=2, table_gib=0.002, dtype=args.dtype,
            attention_every=args.attention_every, vocab=512, split_parts=4, tiny=True,
        )  # fmt: skip
    return vbm.bench_config(
        layers=args.layers, experts=args.experts, topk=args.topk, ple_layers=args.ple_layers,
        table_gib=args.table_gib, dtype=args.dtype, attention_every=args.attention_every,
        vocab=args.vocab, split_parts=args.split_parts,
        max_positions=max(8192, args.max_model_len),
    )  # fmt: skip


def gemma_config(model: str) -> dict[str, Any]:
    """The Gemma text model ``model`` names (:data:`GEMMA_MODELS`), as the keys its
    checkpoint is written from and named by."""
    from transformers import Gemma3nTextConfig, Gemma4TextConfig
    from vllm_harness import GEMMA3N_CONFIG, GEMMA4_CONFIG

    spec = GEMMA_MODELS[model]
    fam = spec["family"]
    tiny = GEMMA4_CONFIG if fam == "gemma4" else GEMMA3N_CONFIG
    keys = (tiny if spec["base"] is None else spec["base"]) | spec["overrides"]
    text = (Gemma4TextConfig if fam == "gemma4" else Gemma3nTextConfig)(**keys)
    return {
        "family": fam, "model": model, "keys": keys, "writer": 1,
        "vocab_size": text.vocab_size, "num_hidden_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "table": [text.vocab_size_per_layer_input,
                  text.num_hidden_layers * text.hidden_size_per_layer_input],
        "full_layers": sum(t == "full_attention" for t in text.layer_types),
        "max_position_embeddings": text.max_position_embeddings,
    }  # fmt: skip


def gemma_table_files(ckpt: Path) -> list[Path]:
    return [ckpt / "model-ple.safetensors"]


def ensure_gemma_checkpoint(root: Path, cfg: dict[str, Any], log: Any = print) -> tuple[Path, bool]:
    """The Gemma checkpoint of ``cfg`` under ``root`` (written by transformers' own
    ``save_pretrained`` from random weights initialised on the GPU when there is one, the
    per-layer table moved into a file of its own), with a word-level tokenizer;
    ``(path, written now)``."""
    import torch
    from vllm_harness import write_gemma3n_checkpoint, write_gemma4_checkpoint

    out = root / f"{cfg['family']}-{vbm.config_hash(cfg)}"
    if (out / "tokenizer.json").exists():
        return out, False
    work = root / f".writing-{out.name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"writing {cfg['model']} ({device} init) under {work}")
    if cfg["family"] == "gemma4":
        ckpt = write_gemma4_checkpoint(work, base=cfg["keys"], device=device)
    else:
        ckpt = write_gemma3n_checkpoint(work, text=cfg["keys"], device=device)
    shutil.rmtree(work / f"hf-{ckpt.name}")  # save_pretrained's own copy, before the split
    vbm.write_tokenizer(ckpt, int(cfg["vocab_size"]), int(cfg["max_position_embeddings"]))
    shutil.rmtree(out, ignore_errors=True)
    ckpt.rename(out)
    shutil.rmtree(work)
    return out, True


def table_files(args: argparse.Namespace, ckpt: Path) -> list[Path]:
    return vbm.table_files(ckpt) if family(args) == "qwen4exp" else gemma_table_files(ckpt)


def describe(cfg: dict[str, Any], ckpt: Path) -> str:
    if cfg.get("family") in ("gemma4", "gemma3n"):
        tgib = sum(p.stat().st_size for p in gemma_table_files(ckpt)) / 2**30
        allgib = sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) / 2**30
        rows, width = cfg["table"]
        name = "Gemma 4" if cfg["family"] == "gemma4" else "Gemma 3n"
        return (
            f"{name} ({cfg['model']}): {cfg['num_hidden_layers']} layers "
            f"({cfg['full_layers']} full attention), hidden {cfg['hidden_size']}, vocabulary "
            f"{cfg['vocab_size']}; per-layer table [{rows}, {width}] BF16, {tgib:.2f} GiB "
            f"(checkpoint {allgib:.2f} GiB)"
        )
    tables = vbm.table_files(ckpt)
    tgib = sum(p.stat().st_size for p in tables) / 2**30
    allgib = sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) / 2**30
    full = sum(t == vbm.FULL for t in cfg["layer_types"])
    return (
        f"{cfg['num_hidden_layers']} layers ({full} full attention), {cfg['num_experts']} "
        f"experts top-{cfg['num_experts_per_tok']}, hidden {cfg['hidden_size']}, PLE on layers "
        f"{cfg['ple_layer_ids']} (1-based), {cfg['_dtype']} tables {tgib:.2f} GiB "
        f"(checkpoint {allgib:.2f} GiB)"
    )


# -- engine arguments -------------------------------------------------------------------------


def serve_argv(args: argparse.Namespace, ckpt: Path, backend: str, port: int) -> list[str]:
    return [
        "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED, "--disable-uvicorn-access-log",
        *engine_argv(args, backend), *profiler_argv(args, backend),
    ]  # fmt: skip


def profile_dir(args: argparse.Namespace, backend: str) -> Path:
    return (args.log_dir / f"profile-{backend}").resolve()


def profiler_argv(args: argparse.Namespace, backend: str) -> list[str]:
    """With ``--profile-steps``: vLLM's torch profiler configured in every server alike
    (idle until ``/start_profile``; no Python stacks, no front end, the GPU's activity
    and the host's runtime calls), traces under ``profile-<backend>/``."""
    if not args.profile_steps:
        return []
    cfg = {
        "profiler": "torch", "torch_profiler_dir": str(profile_dir(args, backend)),
        "torch_profiler_with_stack": False, "ignore_frontend": True,
        "torch_profiler_dump_cuda_time_total": False, "delay_iterations": 16,
        "max_iterations": args.profile_steps,
    }  # fmt: skip
    return ["--profiler-config", json.dumps(cfg)]


def engine_argv(args: argparse.Namespace, backend: str) -> list[str]:
    """The engine's arguments for ``backend``: the same for ``vllm serve`` and for
    ``vllm bench latency|throughput``."""
    backend = base_backend(backend)
    variant = MMAP_VARIANTS.get(backend, {})
    graphs: dict[str, Any] = {
        "cudagraph_mode": variant.get("cudagraph_mode", "FULL_DECODE_ONLY"),
        "cudagraph_capture_sizes": args.capture_sizes,
    }
    if args.compile == "none":
        graphs["mode"] = "NONE"
    fam = family(args)
    gemma = fam != "qwen4exp"
    # FlashInfer is not bundled (Qwen4Exp's GatedDeltaNet prefill then takes Triton).
    extra: dict[str, Any] = {} if gemma else {"gdn_prefill_backend": "triton"}
    if backend in MMAP_VARIANTS:
        ours = {"table_backend": "mmap", "copy": variant.get("copy", args.copy)}
        for key in (
            "spin",
            "first_layer_threads",
            "diag_skip_gather",
            "predict_ready",
            "diag_early_join",
            "split_rows",
            "read_in_order",
        ):
            if key in variant:
                ours[key] = variant[key]
        if args.stats_every and not variant.get("bare") and variant.get("stats", True):
            ours["stats_every"] = args.stats_every
        if variant.get("stalls", args.time_stalls) and not variant.get("bare"):
            ours["time_stalls"] = True
        if args.time_graphs and not variant.get("bare"):
            ours["time_graphs"] = True
        extra["ple_memops"] = ours
    elif STOCK_VARIANTS.get(backend, {}).get("plugin"):
        extra["ple_memops"] = {"table_backend": "default"}
        if args.time_graphs:
            # Its graphs timed like the mmap servers', logged at their stats interval.
            extra["ple_memops"] |= {"time_graphs": True, "stats_every": args.stats_every or 10.0}
    tables: list[str] = []
    if fam == "gemma4":
        # Gemma 4's full-attention layers have heads of 512: vLLM picks FlashAttention 4
        # (CuTe DSL, not in the offline bundle) for such models when it can; its Triton
        # backend is the one it validates for mixed head sizes.
        tables += ["--attention-config", json.dumps({"backend": "TRITON_ATTN"})]
    if fam == "gemma3n":
        # Text only: no tower is built. vLLM 0.33.0's GPU runner gives this class no
        # embeddings in text-only mode unless prompt embeddings are on (it then embeds
        # the ids first, as in multimodal mode); the same for every server.
        tables += ["--limit-mm-per-prompt", json.dumps({"image": 0, "audio": 0}),
                   "--enable-prompt-embeds"]  # fmt: skip
    if gemma:
        if STOCK_VARIANTS.get(backend, {}).get("offload_gb"):
            tables += ["--cpu-offload-gb", f"{args.offload_gib:.6g}"]
    else:
        engram: dict[str, bool] = {"cpu_offload": cpu_offload(backend)}
        if STOCK_VARIANTS.get(backend, {}).get("disk"):
            engram["disk_offload"] = True
        tables = ["--engram-config", json.dumps(engram)]
    return [
        "--dtype", "bfloat16", "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--data-parallel-size", str(args.data_parallel_size),
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30)),
        "--no-enable-prefix-caching",
        "--no-async-scheduling" if args.sync_scheduling else "--async-scheduling",
        "--compilation-config", json.dumps(graphs), *tables,
        "--additional-config", json.dumps(extra),
    ]  # fmt: skip


def cli_argv(args: argparse.Namespace, kind: str, ckpt: Path, backend: str, out: Path) -> list[str]:
    """``vllm bench latency|throughput`` on the bench checkpoint, the engine set up as the
    servers are."""
    common = ["--model", str(ckpt), *engine_argv(args, backend), "--output-json", str(out)]
    if kind == "latency":
        return [
            "bench", "latency", *common, "--batch-size", str(args.latency_batch),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--num-iters-warmup", str(args.latency_warmup),
            "--num-iters", str(args.latency_iters),
        ]  # fmt: skip
    return [
        "bench", "throughput", *common, "--dataset-name", "random",
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--num-prompts", str(args.throughput_prompts),
    ]  # fmt: skip


def engine_env(backend: str, plugin_dir: Path) -> dict[str, str]:
    """The environment of a vLLM process serving ``backend`` (server or ``vllm bench``)."""
    backend = base_backend(backend)
    env = dict(os.environ)
    env.pop("PLE_MEMOPS_TABLE_BACKEND", None)
    # PYTHONFAULTHANDLER: a server that never gets healthy is sent SIGABRT, and every
    # Python thread of its processes prints its stack into the log (wait_healthy).
    env |= {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}  # fmt: skip
    if backend in MMAP_VARIANTS or STOCK_VARIANTS.get(backend, {}).get("plugin"):
        # Only the environment installs the plugin's classes; additional_config then
        # chooses per engine (gpu-plugin's says "default").
        env["PLE_MEMOPS_TABLE_BACKEND"] = "mmap"
    if backend in MMAP_VARIANTS:
        env |= MMAP_VARIANTS[backend].get("env", {})
    env.pop("PLE_BENCH_TIME_DISK", None)
    if STOCK_VARIANTS.get(backend, {}).get("disk"):
        env["PLE_BENCH_TIME_DISK"] = "1"  # benchmarks/vllm_disk_timer.py: its staging timed
    env["PYTHONPATH"] = f"{plugin_dir}:{env.get('PYTHONPATH', '')}".rstrip(":")
    return env


# -- servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    backend: str
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    healthy: bool = False
    error: str = ""
    ready_s: float | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] | None = None
    # The profiled FULL graph replays (trace_steps.Replay), for aligning against the ref's.
    replays: list[Any] | None = None


def start_server(args: argparse.Namespace, ckpt: Path, backend: str, plugin_dir: Path) -> Server:
    port = free_port()
    srv = Server(backend, port, args.log_dir / f"server-{backend}.log")
    env = engine_env(backend, plugin_dir)
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        *serve_argv(args, ckpt, backend, port),
    ]
    with open(srv.log_path, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        srv.proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return srv


def wait_healthy(servers: list[Server], limit: float, grace: float = float("inf")) -> None:
    """Poll every server's /health until healthy, dead, or ``limit`` seconds have passed,
    and at most ``grace`` seconds after the first one got healthy. A server still starting
    then is stuck: it gets SIGABRT (faulthandler prints its Python stacks into its log,
    whose tail is logged) and is stopped, so it cannot share the GPU with the loads."""
    start = time.monotonic()
    first: float | None = None
    pending = [s for s in servers if s.proc is not None]
    while pending and time.monotonic() - start < limit:
        if first is not None and time.monotonic() - first > grace:
            break
        for s in list(pending):
            assert s.proc is not None
            if s.proc.poll() is not None:
                s.error = f"exited with {s.proc.returncode} before it was healthy"
                pending.remove(s)
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/health", timeout=3) as r:
                    if r.status == 200:
                        s.healthy, s.ready_s = True, time.monotonic() - start
                        first = first if first is not None else time.monotonic()
                        pending.remove(s)
                        log(f"{s.backend}: healthy after {s.ready_s:.0f} s (port {s.port})")
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
        time.sleep(1)
    for s in pending:
        waited = time.monotonic() - start
        s.error = f"not healthy after {waited:.0f} s" + (
            f" ({grace:.0f} s after the first server)" if first is not None else ""
        )
        abort_stuck(s)
    for s in servers:
        if not s.healthy:
            log(f"{s.backend}: FAILED to start: {s.error}; log tail:\n{tail(s.log_path, 60)}")


def abort_stuck(s: Server) -> None:
    """SIGABRT to a stuck server's process group (its API server and engine core dump their
    Python stacks), then stop it."""
    if s.proc is None or s.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(s.proc.pid, signal.SIGABRT)
    time.sleep(5)
    stop_servers([s])


def tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# vLLM's first line once a server is told to stop (0.33.0 and 0.34.0).
STOPPING = re.compile(r"\[shutdown\].*(trigger received signal|shutdown triggered)")


def log_facts(path: Path) -> dict[str, Any]:
    """What the server's log says about memory and the PLE tables."""
    text = path.read_text(errors="replace") if path.exists() else ""
    facts: dict[str, Any] = {}
    if m := re.search(r"Model loading took ([\d.]+) GiB", text):
        facts["weights_gib"] = float(m.group(1))
    if m := re.search(r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB", text):
        facts["graphs_s"], facts["graphs_gib"] = int(m.group(1)), float(m.group(2))
    if m := re.search(r"Skipped (\d+)/(\d+) safetensors shard", text):
        facts["skipped_files"] = f"{m.group(1)}/{m.group(2)}"
    if "deferred PLE rows are unavailable" in text:
        line = next(ln for ln in text.splitlines() if "deferred PLE rows are unavailable" in ln)
        facts["mmap_fallback"] = line.strip()[-400:]
    # The markers count while the server runs: once it is told to stop (the benchmark's
    # SIGTERM), vLLM's own teardown logs an EngineDeadError traceback on every clean stop.
    running = text[: m.start()] if (m := STOPPING.search(text)) else text
    for marker in ("TableIoError", "PlanPoisonedError", "watchdog", "Traceback"):
        if marker in running:
            facts.setdefault("log_markers", []).append(marker)
    if m := re.search(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)", text
    ):
        facts["init_engine_s"] = float(m.group(1))
    return facts


def stop_servers(servers: list[Server], grace: float = 30.0) -> None:
    """Stop each server's whole process group (the API server, vLLM's engine core and
    whatever they started): SIGTERM, up to ``grace`` seconds for every process of the group
    to end, then SIGKILL. On return no process of theirs holds the GPU (a solo run's next
    server starts on a GPU of its own)."""
    # Only groups with a live process: a stopped server's group id may be reused.
    live = []
    for s in servers:
        if s.proc is not None and group_members(s.proc.pid):
            live.append(s)
        elif s.proc is not None:
            s.proc.poll()  # reaps a leader that already ended
    for s in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(s.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
    deadline = time.monotonic() + grace
    for s in live:
        proc = s.proc
        assert proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if not _group_ends(proc.pid, deadline):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if not _group_ends(proc.pid, time.monotonic() + 10):
                log(f"{s.backend}: processes of its group outlived SIGKILL")


def _group_ends(pgid: int, deadline: float) -> bool:
    """Wait until no live process of group ``pgid`` is left (``True``) or ``deadline``
    passes. Zombies do not count: they hold no memory, and one whose parent never reaps it
    would otherwise keep the group alive for good."""
    while True:
        if not group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def server_resources(s: Server, tables: list[Path]) -> dict[str, Any]:
    pids = proc_tree(s.proc.pid) if s.proc is not None else []
    res: dict[str, Any] = {"rss_gib": host_rss(pids)}
    by_pid = gpu_memory_by_pid()
    if by_pid is not None:
        mine = [by_pid[p] for p in pids if p in by_pid]
        res["gpu_mib"] = sum(mine) if mine else None
    return res


def engine_core_pid(root: int) -> int | None:
    """The engine core process of the server whose process is ``root`` (vLLM names it
    ``VLLM::EngineCore``), or ``None``."""
    for pid in proc_tree(root):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
                return pid
    return None


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
