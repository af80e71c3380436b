"""The real vLLM 0.33.0 engine at tensor parallel 2 on a host with two GPUs
(``python3 tests/vllm_tp2_check.py [--out DIR]``; ``scripts/gpu/vllm_tp2.sh`` runs it).

Each engine is ``vllm.LLM(tensor_parallel_size=2)`` with multiprocess workers, in a
subprocess of its own (the plugin's switch is process-wide), and serves the same greedy
workload: every captured decode size (1, 2, 4, 8; a batch of 3 padded to 4) and long
prompts prefilled in chunks beside decodes. Checked, token for token against the stock
engine (UVA tables) at TP 2:

* the mmap backend, BF16 and FP8 tables, async scheduling on and off: the same tokens,
  and on *both* ranks a deferring plan whose decode steps were armed replays;
* ranks that disagree: rank 1 forced onto the synchronous fallback
  (``PLE_MEMOPS_FORCE_SYNC=ranks=1``, read by every worker) while rank 0 could defer:
  both ranks end synchronous, the engine captures and serves, the same tokens, and rank
  0's log says why.

The bundle of ``scripts/vllm-h200`` leaves CuTe DSL out; the test plugin of
``vllm_serve_check.py`` makes the model take its unfused path in every worker. Every
engine is bounded by a timeout. Exit 0 when every check passed, 1 when one failed, 2
when this host has fewer than two GPUs (nothing was checked).

Not yet run on a two-GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.resolve().parent / "benchmarks"))  # vllm_checkpoints needs it

SIZES = [1, 2, 4, 8]
MAX_TOKENS = 16
TIMEOUT_S = 420  # one engine: start (two workers, captures), the workload, shutdown


def workload() -> list[list[list[int]]]:
    """Batches of prompts (token ids of the tiny model's 128-token vocabulary; 7 is EOS,
    ignore_eos keeps the lengths fixed)."""
    import random

    g = random.Random(11)

    def prompt(n: int) -> list[int]:
        return [g.randrange(8, 128) for _ in range(n)]

    return [
        [prompt(4)],
        [prompt(7), prompt(3), prompt(5)],  # padded up to the size-4 graph
        [prompt(2 + i) for i in range(8)],
        [prompt(2500), prompt(1200), prompt(5), prompt(9)],  # chunked prefills beside decodes
    ]


def rows_stats(worker: Any) -> dict[str, Any]:
    """On each worker (``collective_rpc``): what its rows hooks did."""
    hooks = getattr(worker.model_runner, "ple_rows", None)  # None: vLLM's own runner
    if hooks is None:
        return {"hooks": False}
    import torch.distributed as dist

    return {
        "hooks": True,
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "mode": hooks.steps.mode,
        "armed": hooks.armed_steps,
        "eager": hooks.eager_steps,
        "sync_replays": hooks.sync_replays,
        "graphs": len(hooks.wait_descs),
        "aborts": sum(int(r.aborts) for r, _ in hooks.steps.stats().values()),
    }


def child(spec: dict[str, Any]) -> int:
    """One engine: serve the workload, write tokens and every rank's stats as JSON."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {
        "gdn_prefill_backend": "triton",  # FlashInfer is not bundled
        "ple_memops": {"table_backend": spec["backend"]},
    }
    llm = LLM(
        model=spec["ckpt"],
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        gpu_memory_utilization=0.15,
        async_scheduling=spec["async_scheduling"],
        engram_config={"cpu_offload": True},
        additional_config=extra,
        compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": SIZES},
    )
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False, ignore_eos=True)
    tokens = []
    for batch in workload():
        done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in done])
    stats = llm.collective_rpc(rows_stats)
    Path(spec["out"]).write_text(json.dumps({"tokens": tokens, "stats": stats}))
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()  # the workers exit; bounded by run()'s timeout
    del llm
    cleanup_dist_env_and_memory()
    return 0


def run(name: str, spec: dict[str, Any], work: Path, env: dict[str, str]) -> dict[str, Any]:
    """``spec`` in a subprocess (its log under ``work``); its JSON, or ``{"error": ...}``."""
    spec = dict(spec, out=str(work / f"{name}.json"))
    log = work / f"{name}.log"
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    text = log.read_text(errors="replace")
    if rc != 0 or not Path(spec["out"]).exists():
        return {"error": f"exit {rc} (-1: timed out after {TIMEOUT_S} s)", "log": text[-4000:]}
    got: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    got["log"] = text
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help="keep logs and results here")
    args = p.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    import torch

    if torch.cuda.device_count() < 2:
        print(f"SKIP: {torch.cuda.device_count()} CUDA device(s); TP 2 needs two")
        return 2
    import vllm_checkpoints as ckpts
    from vllm_serve_check import write_test_plugin

    work = args.out or Path(tempfile.mkdtemp(prefix="ple-tp2-"))
    work.mkdir(parents=True, exist_ok=True)
    plugins = write_test_plugin(work / "plugins")
    env = dict(os.environ, PLE_MEMOPS_TABLE_BACKEND="mmap", VLLM_USE_FLASHINFER_SAMPLER="0")
    env["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"  # stock in the mmap engines' FULL graphs
    env["PYTHONPATH"] = f"{plugins}:{env.get('PYTHONPATH', '')}"
    env.pop("PLE_MEMOPS_FORCE_SYNC", None)
    failures: list[str] = []
    for kind in ("bf16", "fp8"):
        ckpt = ckpts.write_checkpoint(work / kind, fp8=kind == "fp8", max_position_embeddings=8192)
        base = {"ckpt": str(ckpt), "async_scheduling": True}
        stock = run(f"{kind}-stock", dict(base, backend="default"), work, env)
        if "error" in stock:
            failures.append(f"{kind} stock: {stock['error']}")
            print(stock["log"])
            continue
        cases = [
            (f"{kind}-mmap-async", dict(base, backend="mmap"), env, "deferred"),
            (f"{kind}-mmap-sync-sched", dict(base, backend="mmap", async_scheduling=False), env,
             "deferred"),
        ]  # fmt: skip
        if kind == "bf16":  # the one-rank fault
            forced = dict(env, PLE_MEMOPS_FORCE_SYNC="ranks=1")
            cases.append((f"{kind}-mmap-rank1-forced", dict(base, backend="mmap"), forced, "sync"))
        for name, spec, case_env, mode in cases:
            got = run(name, spec, work, case_env)
            if "error" in got:
                failures.append(f"{name}: {got['error']}")
                print(got["log"])
                continue
            problems = []
            if got["tokens"] != stock["tokens"]:
                diff = sum(
                    a != b
                    for x, y in zip(got["tokens"], stock["tokens"], strict=True)
                    for u, v in zip(x, y, strict=True)
                    for a, b in zip(u, v, strict=True)
                )
                problems.append(f"{diff} tokens differ from stock's")
            ranks = got["stats"]
            if len(ranks) != 2 or not all(r.get("hooks") for r in ranks):
                problems.append(f"not both ranks serve mmap tables: {ranks}")
            elif {r["mode"] for r in ranks} != {mode}:
                problems.append(f"ranks' modes {[r['mode'] for r in ranks]}, expected {mode}")
            elif any(r["aborts"] for r in ranks) or any(r["graphs"] != len(SIZES) for r in ranks):
                problems.append(f"aborts or missing graphs: {ranks}")
            elif mode == "deferred" and any(r["armed"] < MAX_TOKENS for r in ranks):
                problems.append(f"decode steps were not armed replays: {ranks}")
            elif mode == "sync" and any(r["sync_replays"] < MAX_TOKENS for r in ranks):
                problems.append(f"the synchronous plan did not keep its graphs: {ranks}")
            if mode == "sync" and "another rank of this engine cannot defer" not in got["log"]:
                problems.append("no log line says why the ranks fell back")
            status = "PASS" if not problems else "FAIL: " + "; ".join(problems)
            print(f"{name}: {status}; ranks {ranks}")
            failures += [f"{name}: {x}" for x in problems]
    print(f"logs and results under {work}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("PASS: every TP 2 engine gave the stock engine's tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
