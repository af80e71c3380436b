"""vLLM 0.33.0 serving a random-weight Qwen4Exp with its PLE tables three ways, side by side:
``gpu`` (the tables in GPU memory, ``engram_config.cpu_offload=False``),
``uva`` (vLLM's default: pinned host tables read by the GPU over UVA) and ``mmap``
(ple-memops: the tables read from the checkpoint's files through the page cache, FULL decode
graphs waiting for rows the host gathers after the launch); on vLLM 0.34.0 also ``disk``
(vLLM's own ``engram_config.disk_offload``: each step waits for the GPU's ids, then reads
the rows with ``preadv`` on the engine's thread).

The model has the real Qwen4Exp's per-layer widths (hidden 2048; with ``--attention-every
N``, dense full-attention layers of 16 heads of 256 with 2 KV heads, off by default;
GatedDeltaNet layers of 16 key / 32 value heads of 128; experts of 512 with a shared
expert, top-10 routing; 4 hyper-connection streams of rank 316, the real 320 less 4, which
vLLM 0.34.0 loads; 16 n-gram heads of 128-wide rows per PLE layer: ngram_size 3 x
heads_per_ngram 8, ple_embed_dim 2048),
``--layers`` deep with ``--experts`` experts, and PLE tables of
``--table-gib`` GiB in all over ``--ple-layers`` layers (BF16 or FP8 with a global scale,
``--dtype``). It is written once per configuration under ``--ckpt-root`` (random weights,
generated on the GPU, streamed into safetensors; ``benchmarks/vllm_bench_model.py``) with a
word-level tokenizer beside it, so ``vllm bench serve|latency|throughput --model DIR`` work
on it too.

The three ``vllm serve`` servers start together on one GPU (each with a fixed KV cache,
``--kv-cache-memory-bytes``, because vLLM's memory profiling counts the other servers'
allocations as its own), every one with ``VLLM_USE_BREAKABLE_CUDAGRAPH=0`` and
``cudagraph_mode=FULL_DECODE_ONLY`` (the mmap backend needs FULL graphs; vLLM would turn
breakable graphs on for the other two), async scheduling, no prefix caching (repeats must
not hit the cache), and ple-memops' plugin switched on (``PLE_MEMOPS_TABLE_BACKEND=mmap``)
only in the mmap server. Then, for each repeat, each load and each backend in a rotating
order (interleaved), one load runs against that server alone:

* ``c1``, ``c8``, ``c64``: decode-heavy, ``--input-len`` tokens in, ``--output-len`` out
  (greedy, ignore_eos), ``max(8, 6c)`` requests at concurrency c (closed loop, as
  ``vllm bench serve --max-concurrency c``);
* ``mixed``: ``--mixed-decoders`` short requests decoding from t=0 while
  ``--mixed-long`` prompts of 2-3k tokens arrive every ``--mixed-gap`` s (chunked prefill
  beside the decodes); its TTFT is the long prompts'.

Each request is timed by vLLM's own client (``vllm.benchmarks.lib.endpoint_request_func``,
what ``vllm bench serve`` uses: TTFT, ITL between streamed chunks, TPOT = (latency - TTFT)
/ (tokens - 1)), prompts as token ids (identical for every backend; they change with the
repeat). Reported per backend x load (median over repeats, the range of tok/s beside it):
output tok/s, TPOT p50/p99, ITL p50/p99, TTFT p50/p99; per server: GPU memory (nvidia-smi
per process where it sees our processes; vLLM's own "Model loading took" line always), host
RSS of its process tree (anon / file / shmem from /proc), and the page cache the table
files hold (``mincore``). "GPU busy" is nvidia-smi's ``utilization.gpu`` (the share of
time a kernel was running, sampled every 100 ms) averaged over the load: at c1 that is the
GPU's share of a decode step; beside it the SM clock's median over the same samples (a
lower one than the other servers' means a slowed GPU, not a slow path). ``--cold`` evicts
the table files (``POSIX_FADV_DONTNEED``) before every repeat; pages the mmap server has
mapped stay resident (the residency after eviction is reported), and only the mmap and
disk backends read the files at all.

The verdict line reports (never asserts) the targets: mmap within 1% of the GPU table's
throughput and ITL p50 at every concurrency and never below UVA's throughput; TTFT under
the mixed load no worse than UVA's.

What the real model has that this one cuts, to fit a 10-minute device call: the model is
``--layers`` (default 24) deep with ``--experts`` (default 64) experts instead of 40 x 512
(three servers' weights must fit one H200 together and the checkpoint must be written in
well under a minute); full-attention layers are dense (vLLM's ``Qwen3NextAttention``), not
QSA (its indexer needs kernels the offline bundle leaves out); one dtype per run
(``--dtype``); ``vllm bench latency|throughput`` are not run (the tokenizer makes them
possible); torch.compile is off by default (``--compile none``: three cold Inductor
compiles in parallel would take minutes; the decode step measured is a FULL CUDA graph
replay either way, and vLLM's stock Qwen4Exp default, breakable graphs, also runs without
it; ``--compile default`` turns it on). ``--deadline`` stops starting new measurements and
reports what was measured; every wait is bounded and a backend that fails is reported and
skipped (a server still starting ``--start-grace`` s after the first was healthy gets SIGABRT,
which dumps its Python stacks into its log, and is stopped before the loads).

Run on the H200 with ``scripts/gpu/vllm_bench.sh``; here, ``--dry-run`` checks the CPU
side: the checkpoint writer against transformers' ``save_pretrained`` and vLLM's CPU loader
at a tiny size, the tokenizer, the ``vllm serve`` command lines against vLLM's parser, and
the whole measurement loop and report against fake streaming servers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# The benchmark's modules beside this script (on sys.path when it is run as a script). The
# benchmark's parts live in modules of their own: vllm_clock (the deadline and the log),
# vllm_loads (the loads and the client), vllm_probes (what is read of the host),
# vllm_servers (backends, models, engine arguments, the servers), vllm_report (the stats
# lines, tables and verdict) and vllm_dry_run (--dry-run); this one is the command line,
# the measurement phases and main.
import trace_steps
import vllm_bench_model as vbm
import vllm_clock
import vllm_disk_timer
from proc_cpu import cpu_topology, thread_cpu, thread_last_cpu
from vllm_clock import left, log
from vllm_dry_run import dry_run

# The offline bundle leaves CuTe DSL out: the model then takes its unfused hyper-connection
# path in every vLLM process (a vLLM general plugin on PYTHONPATH; the engine tests'
# harness, tests/vllm_harness.py, writes it).
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from vllm_harness import write_test_plugin as write_plugin
from vllm_harness import write_vllm_plugin
from vllm_loads import Client, Load, Req, make_loads, metrics, run_load

# cpu_use and busy_thread_cpus are also tests/test_bench_vllm.py's (as bench_vllm.*).
from vllm_probes import (
    Utilization,
    busy_thread_cpus,
    cpu_use,
    disk_read_rate,
    disk_reads,
    evict,
    gpu_name,
    gpu_used_total,
    gpu_uuid,
    host_memory,
    page_cache,
    proc_tree,
)
from vllm_report import cli_markdown, delivery_stats, disk_stats, report
from vllm_servers import (
    GEMMA_MODELS,
    Server,
    base_backend,
    cli_argv,
    describe,
    engine_core_pid,
    engine_env,
    ensure_gemma_checkpoint,
    family,
    known_backends,
    log_facts,
    log_since,
    log_size,
    model_config,
    profile_dir,
    server_resources,
    start_server,
    stop_servers,
    table_files,
    vllm_release,
    vllm_version,
    wait_healthy,
)
from vllm_soak import SoakResult, soak, soak_markdown, soak_verdict
from vllm_soak import finish as soak_finish

from ple_memops.settings import COPIES

HERE = Path(__file__).resolve().parent


# -- the run ----------------------------------------------------------------------------------


async def measure(
    args: argparse.Namespace,
    servers: dict[str, Server],
    tables: list[Path],
    vocab: int,
    rows: list[dict[str, Any]],
    share_end: float | None = None,
) -> list[dict[str, Any]]:
    """Warm-up, then repeats x loads x backends (rotating order) until done or the deadline;
    each measurement is appended to ``rows`` as it ends (kept when interrupted).

    ``share_end`` (``--solo``: the monotonic time a server's share of the run ends) stops
    the loads only between repeats: a started repeat runs every load (within the
    deadline), so a server whose share is short still has each load measured once, to be
    paired with the other servers' (a reference whose first start compiled vLLM's
    kernels once had c1 and c8 only)."""
    took: dict[str, float] = {}
    live = [b for b in args.backends if b in servers and servers[b].healthy]
    async with Client(args.request_timeout) as client:
        log(f"client: {client.kind}")
        if live and args.warmup:
            # Every load once, untimed, on every server at once (prompts of its own; a
            # decode load's first wave, 16 tokens out): the first steps at a batch size or
            # prefill shape pay one-time costs (Triton's compiles, allocations) that no
            # measured load should carry.
            t = time.monotonic()
            for warm in make_loads(args, vocab, -1):
                if left() < 5:
                    log(f"deadline: {left():.0f} s left, warm-up stopped before {warm.name}")
                    break
                if warm.name != "mixed":
                    first = warm.requests[: warm.concurrency]
                    warm.requests = [Req(q.prompt, min(16, q.output_len)) for q in first]
                res = await asyncio.gather(
                    *(run_load(client, servers[b].port, warm,
                               min(args.load_timeout, max(left(), 1))) for b in live)
                )  # fmt: skip
                for b, (outs, _) in zip(live, res, strict=True):
                    bad = [o.error for o in outs if not o.ok]
                    if bad:
                        log(f"{b}: warm-up {warm.name} failed: {bad[0][:300]}")
            log(f"warm-up (every load once) done in {time.monotonic() - t:.0f} s")
        stop = False
        for r in range(args.repeats):
            if stop:
                break
            if r and share_end is not None and time.monotonic() >= share_end:
                log(f"this server's share is used: {r} repeats")
                break
            cache_before = None
            if args.cold and tables:
                evict(tables)
                cache_before = page_cache(tables)
                log(f"repeat {r + 1}: table files evicted, {cache_before:.2f} GiB still resident")
                if cache_before > 0.05 * sum(t.stat().st_size for t in tables) / 2**30:
                    # posix_fadvise cannot drop pages a process maps: a live mmap server's.
                    log("  not cold: the eviction cannot reach pages a live server maps")
            for li, load in enumerate(make_loads(args, vocab, r)):
                order = [live[(i + r + li) % len(live)] for i in range(len(live))] if live else []
                for b in order:
                    est = took.get(load.name, 0.0) * 1.2 + 2
                    if left() < est:
                        log(f"deadline: {left():.0f} s left, {load.name} needs ~{est:.0f} s: stop")
                        stop = True
                        break
                    srv = servers[b]
                    if srv.proc is not None and srv.proc.poll() is not None:
                        log(f"{b}: server died (exit {srv.proc.returncode}); skipped")
                        continue
                    util = Utilization()
                    timeout = max(5.0, min(args.load_timeout, left()))
                    log_at = log_size(srv.log_path)
                    tree = proc_tree(srv.proc.pid) if srv.proc is not None else []
                    cpu0 = thread_cpu(tree)
                    reads0 = disk_reads(tables) if tables else None
                    outs, wall = await run_load(client, srv.port, load, timeout)
                    reads1 = disk_reads(tables) if tables else None
                    cpu1 = thread_cpu(tree)
                    cpu = cpu_use(cpu0, cpu1, wall) if tree else {}
                    if tree:
                        cpu["thread_cpus"] = busy_thread_cpus(cpu0, cpu1, thread_last_cpu(tree))
                    gpu = util.stop()
                    busy, mhz = gpu["gpu_busy_pct"], gpu["sm_mhz_p50"]
                    since = log_since(srv.log_path, log_at)
                    m = metrics(outs, wall) | delivery_stats(since) | disk_stats(since)
                    m |= cpu | disk_read_rate(reads0, reads1, wall)
                    took[load.name] = max(took.get(load.name, 0.0), wall)
                    row = {"repeat": r + 1, "load": load.name, "backend": b, **gpu,
                           "page_cache_gib": page_cache(tables) if tables else None,
                           "cache_after_evict_gib": cache_before, **m,
                           **server_resources(srv, tables)}  # fmt: skip
                    rows.append(row)
                    if m["ok"]:
                        log(
                            f"r{r + 1} {load.name:6s} {b:4s}: {m['tok_s']:8.1f} tok/s  "
                            f"ITL p50 {m['itl_p50_ms']:.2f} ms  "
                            f"TTFT p50 {m['ttft_p50_ms']:.0f} ms  "
                            f"busy {'-' if busy is None else round(busy)}%  "
                            f"SM {'-' if mhz is None else round(mhz)} MHz  ({wall:.1f} s)"
                        )
                    if m["failed"]:
                        log(f"r{r + 1} {load.name} {b}: {m['failed']} failed: {m['errors'][:1]}")
                if stop:
                    break
    return rows


async def profile(args: argparse.Namespace, servers: dict[str, Server], vocab: int) -> None:
    """After the loads, each live server in turn: ``/start_profile``, ``--profile-concurrency``
    requests at once (1: one), each long enough for the profiler's 16 skipped and
    ``--profile-steps`` profiled iterations,
    ``/stop_profile``; its newest trace summarized (``trace_steps``: the FULL graphs'
    replays, span, busy, queued, period, the kernels) into ``servers[b].profile``."""

    def post(port: int, path: str) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=max(5.0, min(120.0, left()))) as r:
            r.read()

    steps = args.profile_steps + 16 + 8
    load = make_loads(args, vocab, 99)[0]
    n = args.profile_concurrency
    prompts = [load.requests[i % len(load.requests)].prompt for i in range(n)]
    one = Load("profile", n, [Req(p, steps) for p in prompts])
    async with Client(args.request_timeout) as client:
        for b in [b for b in args.backends if servers[b].healthy]:
            srv = servers[b]
            if left() < 30 or (srv.proc is not None and srv.proc.poll() is not None):
                log(f"{b}: not profiled ({left():.0f} s left)")
                continue
            try:
                await asyncio.to_thread(post, srv.port, "/start_profile")
                outs, wall = await run_load(client, srv.port, one, min(60.0, left()))
                await asyncio.to_thread(post, srv.port, "/stop_profile")
            except OSError as exc:
                log(f"{b}: profiling failed: {exc}")
                continue
            if not all(o.ok for o in outs):
                log(f"{b}: the profiled request failed: {outs[0].error[:200]}")
            # The trace is written when the profiler stops (after --profile-steps steps).
            until = time.monotonic() + min(30.0, max(left(), 1.0))
            traces: list[Path] = []
            while not traces and time.monotonic() < until:
                traces = sorted(profile_dir(args, b).glob("**/*.pt.trace.json*"),
                                key=lambda t: t.stat().st_mtime)  # fmt: skip
                if not traces:
                    await asyncio.sleep(0.5)
            if not traces:
                log(f"{b}: no trace under {profile_dir(args, b)} ({wall:.1f} s)")
                continue
            try:
                await asyncio.sleep(1.0)  # a trace still being written is read whole
                events = trace_steps.load_events(traces[-1])
                reps = trace_steps.replays(events)
                summary = trace_steps.summarize(reps)
            except (OSError, ValueError, EOFError) as exc:
                log(f"{b}: the trace {traces[-1]} could not be read: {exc!r}")
                continue
            summary["trace"] = str(traces[-1])
            srv.profile, srv.replays = summary, reps
            log(f"{b}: profiled {summary['replays']} replays ({traces[-1].name}): span "
                f"{summary.get('span_us')} us, busy {summary.get('busy_us')} us, period "
                f"{summary.get('period_us')} us")  # fmt: skip


async def sample_stacks(args: argparse.Namespace, servers: dict[str, Server], vocab: int) -> None:
    """After the loads, each live server in turn under each concurrency of ``--concurrency``
    (requests long enough to outlast the window): ``py-spy record`` of its engine core
    process for ``--py-spy`` seconds (every thread, idle ones included, without pausing the
    process), the collapsed stacks into ``py-spy-<backend>-c<N>.txt`` in ``--log-dir``
    (``stacks_diff.py`` compares two)."""
    # Outlasts the lead and the window at ~5 ms a token; awaited, never left running.
    steps = int((args.py_spy + 1.5) * 200) + 50
    loads = [
        Load(
            f"py-spy {ld.name}",
            ld.concurrency,
            [Req(r.prompt, steps) for r in ld.requests[: ld.concurrency]],  # one wave
        )
        for ld in make_loads(args, vocab, 98)
        if ld.name.startswith("c")
    ]
    async with Client(args.request_timeout) as client:
        for b in [b for b in args.backends if servers[b].healthy]:
            srv = servers[b]
            pid = None if srv.proc is None else engine_core_pid(srv.proc.pid)
            for load in loads:
                if pid is None or left() < args.py_spy + 20:
                    log(f"{b} {load.name}: not sampled ({left():.0f} s left, engine pid {pid})")
                    continue
                out = args.log_dir / f"py-spy-{b}-c{load.concurrency}.txt"
                task = asyncio.ensure_future(
                    run_load(client, srv.port, load, args.py_spy + 10 + 0.02 * steps)
                )
                await asyncio.sleep(1.5)  # past the prefills
                proc = await asyncio.create_subprocess_exec(
                    args.py_spy_bin, "record", "--pid", str(pid), "--duration",
                    f"{args.py_spy:g}", "--rate", "400", "--idle", "--threads",
                    "--nonblocking", "--format", "raw", "--output", str(out),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                )  # fmt: skip
                said, _ = await proc.communicate()
                outs, _wall = await task
                tail = said.decode(errors="replace").strip().splitlines()[-1:] or [""]
                failed = sum(not o.ok for o in outs)
                log(f"{b} {load.name}: py-spy exit {proc.returncode} -> {out.name} "
                    f"({failed} requests failed): {tail[0][:200]}")  # fmt: skip


# -- vLLM's own offline benchmarks -----------------------------------------------------------


def run_cli_benches(
    args: argparse.Namespace, ckpt: Path, plugin_dir: Path, rows: list[dict[str, Any]]
) -> None:
    """Each of ``--vllm-bench``'s commands for each backend (one engine a run, the order
    rotating between repeats), until done or the deadline; rows appended as they end."""
    took = 0.0
    for r in range(args.repeats):
        for kind in args.vllm_bench:
            order = [args.backends[(i + r) % len(args.backends)] for i in range(len(args.backends))]
            for b in order:
                if left() < took * 1.2 + 10:
                    log(f"deadline: {left():.0f} s left, a {kind} run needs ~{took:.0f} s: stop")
                    return
                out = args.log_dir / f"cli-{kind}-{b}-r{r + 1}.json"
                log_path = args.log_dir / f"cli-{kind}-{b}.log"
                cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main",
                       *cli_argv(args, kind, ckpt, b, out)]  # fmt: skip
                t = time.monotonic()
                with open(log_path, "a") as f:
                    f.write(" ".join(cmd) + "\n")
                    f.flush()
                    try:
                        done = subprocess.run(
                            cmd, stdout=f, stderr=subprocess.STDOUT, env=engine_env(b, plugin_dir),
                            timeout=max(10.0, left()), start_new_session=True,
                        )  # fmt: skip
                        rc: int | str = done.returncode
                    except subprocess.TimeoutExpired:
                        rc = "timeout"
                wall = time.monotonic() - t
                took = max(took, wall)
                row: dict[str, Any] = {"repeat": r + 1, "kind": kind, "backend": b, "rc": rc,
                                       "wall_s": wall}  # fmt: skip
                if rc == 0 and out.exists():
                    got = json.loads(out.read_text())
                    if kind == "latency":
                        row |= {"avg_s": got["avg_latency"],
                                "p50_s": got["percentiles"]["50"],
                                "p99_s": got["percentiles"]["99"]}  # fmt: skip
                    else:
                        req_s = got["requests_per_second"]
                        row |= {"req_s": req_s, "tok_s": got["tokens_per_second"],
                                "out_tok_s": req_s * args.output_len}  # fmt: skip
                    row |= delivery_stats(log_path.read_text(errors="replace"))
                rows.append(row)
                log(f"vllm bench {kind} {b} r{r + 1}: rc {rc} in {wall:.0f} s: "
                    + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                if k in ("avg_s", "p50_s", "p99_s", "req_s", "tok_s")))  # fmt: skip


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument(
        "--model",
        choices=["bench", "tiny", *GEMMA_MODELS],
        default="bench",
        help="bench: the Qwen4Exp benchmark model (--layers, --table-gib, ...); tiny: its "
        "tiny size; gemma4-e2b, gemma4-e4b: the released Gemma 4 E2B's and E4B's text "
        "models; gemma4-default: transformers' Gemma4TextConfig defaults; gemma3n-e2b, "
        "gemma3n-e4b: Gemma 3n at E2B's and E4B's text shapes, served text only; "
        "gemma4-tiny, gemma3n-tiny: the Gemma tests' tiny ones",
    )
    p.add_argument("--checkpoint", type=Path, help="serve this checkpoint instead of building one")
    p.add_argument("--ckpt-root", type=Path, default=Path("/tmp/ple-bench-ckpt"))
    p.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--ple-layers", type=int, default=4)
    p.add_argument("--table-gib", type=float, default=4.0)
    p.add_argument("--attention-every", type=int, default=0,
                   help="every N-th layer dense full attention (0, the default: all "
                        "GatedDeltaNet layers, what has run on the H200; dense attention "
                        "layers have not run there yet)")  # fmt: skip
    p.add_argument("--vocab", type=int, default=248_320)
    p.add_argument("--split-parts", type=int, default=16, help="shards per PLE table")
    p.add_argument("--build-only", action="store_true", help="write the checkpoint and exit")
    p.add_argument(
        "--backends",
        type=lambda s: s.split(","),
        default=None,
        help=f"of {', '.join(known_backends())} (default: gpu,uva,mmap; a Gemma: gpu,offload,mmap)",
    )
    p.add_argument(
        "--ref",
        help="the backend every other is compared with, repeat by repeat (paired), in "
        "the breakdown table (default: gpu if served, else the first backend)",
    )
    p.add_argument(
        "--time-stalls",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="every mmap server times each PLE layer's GPU stall for rows (two tiny "
        "kernels a layer a step) and reports it in its stats lines; off by default: in "
        "the engine the stamps cost ~0.4 ms a step at c1 (BENCHMARKS.md), so the stalls "
        "come from the mmap-stalls rung and the mmap server runs without them",
    )
    p.add_argument(
        "--time-graphs",
        action="store_true",
        help="the mmap servers and gpu-plugin (the plugin installed, its tables on the GPU) "
        "time every FULL replay on the GPU with two CUDA events (time_graphs): the breakdown "
        "table gets the graphs' span and the device's time between them",
    )
    p.add_argument("--concurrency", type=ints, default=[1, 8, 64])
    p.add_argument("--requests", type=int, help="requests per decode load (default max(8, 6c))")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--mixed-decoders", type=int, default=16)
    p.add_argument("--mixed-output-len", type=int, default=256)
    p.add_argument("--mixed-long", type=int, default=8, help="long prompts (0: no mixed load)")
    p.add_argument("--mixed-gap", type=float, default=0.4)
    p.add_argument("--long-min", type=int, default=2048)
    p.add_argument("--long-max", type=int, default=3072)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--cold",
        action="store_true",
        help="evict the table files before the servers start and before each "
        "repeat (pages a live mmap server maps stay: the log says how much)",
    )
    p.add_argument(
        "--residency",
        type=float,
        default=None,
        help="hold the table files' share in the page cache at this fraction (0 to 1) for "
        "the whole run, every backend alike (benchmarks/residency.py: the chunks outside a "
        "fixed random subset are dropped every 0.5 s, pages the servers map included); its "
        "lines go to residency.log in --log-dir",
    )
    p.add_argument("--deadline", type=float, default=480, help="seconds from start (all phases)")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--start-grace", type=float, default=90,
                   help="seconds a server may take after the first one is healthy")  # fmt: skip
    p.add_argument("--load-timeout", type=float, default=90)
    p.add_argument("--request-timeout", type=float, default=90)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs each engine spans (2 on a two-GPU host); every "
                        "server, or vllm bench command, uses all of them")  # fmt: skip
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine ranks each server runs, one a GPU (2 on a two-GPU host: "
                        "its host memory against the same server with one rank)")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--capture-sizes", type=ints, default=[1, 2, 4, 8, 16, 24, 32, 48, 64])
    p.add_argument("--kv-cache-gib", type=float, default=12.0)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.25,
        help="only vLLM's start-up check (free memory >= this share); the KV cache is fixed",
    )
    p.add_argument("--compile", choices=["none", "default"], default="none")
    p.add_argument("--copy", choices=list(COPIES), default="auto")
    p.add_argument(
        "--vllm-bench",
        type=lambda v: [x for x in v.split(",") if x],
        default=[],
        help="instead of the servers: vLLM's own `vllm bench` commands, of "
        "latency,throughput, one engine a run for each backend",
    )
    p.add_argument("--latency-batch", type=int, default=8)
    p.add_argument("--latency-iters", type=int, default=10)
    p.add_argument("--latency-warmup", type=int, default=3)
    p.add_argument("--throughput-prompts", type=int, default=512)
    p.add_argument(
        "--stats-every",
        type=float,
        default=0.5,
        help="mmap servers log ple-memops stats every N s (0: off); each load reports "
        "its fills, GPU stall and host time from the lines logged while it ran (the "
        "first dropped: it covers time before the load), so a load needs at least two "
        "(one of 2 s had none at 2 s)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after the loads, profile this many engine steps of one c1 request (see "
        "--profile-concurrency) on each "
        "server with vLLM's torch profiler (configured in every server alike) and report "
        "each server's FULL graph replays (span, busy, period, kernels; trace_steps.py); "
        "the traces stay under profile-<backend>/ in --log-dir",
    )
    p.add_argument(
        "--profile-concurrency",
        type=int,
        default=1,
        help="the profiled load's requests at once (--profile-steps): 64 profiles the FULL "
        "graphs of a 64-token decode step",
    )
    p.add_argument(
        "--py-spy",
        type=float,
        default=0,
        help="after the loads (and the profile), sample each server's engine core process "
        "with py-spy for this many seconds under each --concurrency (collapsed stacks in "
        "--log-dir; benchmarks/stacks_diff.py compares two)",
    )
    p.add_argument("--py-spy-bin", default="py-spy", help="the py-spy executable")
    p.add_argument(
        "--solo",
        action="store_true",
        help="each backend's server alone on the GPU, one after another (no interleaving: "
        "compare the graphs' GPU time, --time-graphs, rather than ITL)",
    )
    p.add_argument(
        "--sync-scheduling",
        action="store_true",
        help="every server without asynchronous scheduling (--no-async-scheduling): the "
        "host waits for each step, no input copies or launches overlap a running graph",
    )
    p.add_argument(
        "--soak",
        type=float,
        default=0,
        help="instead of the loads: one server (--backends, default mmap) under the mixed "
        "load for this many minutes, a share of its clients leaving mid-stream; passes "
        "with no error, memory flat and a probe's text unchanged (benchmarks/vllm_soak.py)",
    )
    p.add_argument(
        "--soak-disconnect",
        type=float,
        default=0.25,
        help="share of the soak's clients that leave after 2-8 streamed tokens",
    )
    p.add_argument(
        "--soak-sample", type=float, default=60, help="seconds between the soak's memory samples"
    )
    p.add_argument(
        "--soak-tolerance-mib",
        type=float,
        default=256,
        help="how far host RSS, the page cache or GPU memory may move during the soak",
    )
    p.add_argument("--log-dir", type=Path, default=Path(os.environ.get("OUT", "/tmp/ple-out")))
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--dry-run", action="store_true", help="CPU checks, fake servers (no GPU)")
    return p.parse_args(argv)


# Before one is measured here: a server's start on the H200 (Gemma 3n E2B 49-104 s, the
# Qwen4Exp bench model 149-215 s; the first on a fresh host compiles Triton's kernels), the
# seconds its stop may take, and the least time for loads that makes a start worth it.
SOLO_START_GUESS_S = 150.0
SOLO_STOP_GUESS_S = 15.0
SOLO_MIN_LOADS_S = 30.0


def _solo(
    args: argparse.Namespace,
    ckpt: Path,
    plugin_dir: Path,
    servers: dict[str, Server],
    tables: list[Path],
    vocab: int,
    rows: list[dict[str, Any]],
) -> None:
    """``--solo``: each backend's server alone on the GPU, one after another: started,
    measured (the repeats its share has time for, the first one whole: every load once,
    within the deadline), profiled and sampled as asked, its facts read, stopped
    (``servers`` keeps them for the report).

    The time is split by loads, not by wall time: once a server is healthy, its loads get
    an equal share of what is left after the starts and stops still to come (each
    estimated by the last one measured), so a slow first start (vLLM's Triton kernels
    compile on a fresh host) costs every backend a little rather than the first one its
    loads. A server is started only if its start and ``SOLO_MIN_LOADS_S`` of loads fit,
    and a started one gets at least ``SOLO_MIN_LOADS_S``.
    An interrupt leaves the running server to ``main``, which reports first."""
    start_s, stop_s = SOLO_START_GUESS_S, SOLO_STOP_GUESS_S
    for k, b in enumerate(args.backends):
        todo = len(args.backends) - k  # this backend and those after it
        if left() < start_s + SOLO_MIN_LOADS_S + stop_s:
            log(f"deadline: {left():.0f} s left, {b} not started (a start takes ~{start_s:.0f} s)")
            break
        used = gpu_used_total()
        log(f"{b}: starting alone (GPU memory in use before: {used} MiB)")
        t0 = time.monotonic()
        srv = servers[b] = start_server(args, ckpt, b, plugin_dir)
        wait_healthy([srv], min(args.start_timeout, max(left(), 1)), args.start_grace)
        if not srv.healthy:
            log(f"{b}: did not start ({srv.error})")
            stop_servers([srv])
            continue
        start_s = time.monotonic() - t0
        if k == 0:
            # The first start on a host also compiles vLLM's kernels (206 s on a fresh H100
            # host, the next starts 46-59 s): later ones are estimated at most the guess.
            start_s = min(start_s, SOLO_START_GUESS_S)
        srv.facts = log_facts(srv.log_path)
        still = todo * stop_s + (todo - 1) * start_s
        # A started server measures at least SOLO_MIN_LOADS_S (within the deadline), at the
        # cost of the servers after it (not started when the rest does not fit): a first
        # start that compiled vLLM's kernels (104 s on a fresh H200, the next ones 53-65 s)
        # made every later start look as slow, and left a started reference no loads.
        loads_s = max(0.0, left() - still) / todo
        loads_s = min(max(loads_s, SOLO_MIN_LOADS_S), max(0.0, left() - stop_s))
        log(f"{b}: {loads_s:.0f} s for its loads")
        whole = vllm_clock.DEADLINE
        one = argparse.Namespace(**{**vars(args), "backends": [b]})
        # The share ends between repeats (the first repeat runs whole); what the loads
        # left of it bounds the profile and the stacks.
        share_end = time.monotonic() + loads_s
        asyncio.run(measure(one, {b: srv}, tables, vocab, rows, share_end))
        vllm_clock.DEADLINE = min(whole, max(time.monotonic(), share_end))
        try:
            if args.profile_steps:
                asyncio.run(profile(one, {b: srv}, vocab))
            if args.py_spy:
                asyncio.run(sample_stacks(one, {b: srv}, vocab))
        finally:
            vllm_clock.DEADLINE = whole
        srv.facts = log_facts(srv.log_path)
        t1 = time.monotonic()
        stop_servers([srv])
        stop_s = max(5.0, time.monotonic() - t1 + 2)


def _soak(
    args: argparse.Namespace, server: Server, tables: list[Path], vocab: int, meta: dict[str, Any]
) -> int:
    """``--soak``: run it, print and write the result; 0 when it passed. The JSON is
    rewritten at every sample, and the result is written however the soak ends (a signal
    leaves what was measured, marked cut short)."""
    res = SoakResult(args.soak)

    def write(final: bool) -> None:
        if final:
            md = (
                meta["model"] + "\n\n" + soak_markdown(res, args.soak_tolerance_mib, server.backend)
            )
            print("\n" + md + "\n", flush=True)
            if args.markdown:
                args.markdown.write_text(md + f"\n\ncommand: `{meta['command']}`\n")
        if args.json:
            out = {"meta": meta, "soak": dataclasses.asdict(res), "final": final}
            args.json.write_text(json.dumps(out, indent=1, default=str))

    if not server.healthy:
        log(f"soak: {server.backend} did not start: {server.error}")
        res.server_died = f"the server did not start: {server.error}"
        write(True)
        return 1
    try:
        asyncio.run(soak(args, server, tables, vocab, res, progress=lambda _: write(False)))
    except KeyboardInterrupt as exc:
        res.cut_short = f"an interrupt ({exc})"
        log(f"soak interrupted: {exc}")
    finally:
        soak_finish(res, server)
        write(True)
    return 0 if not soak_verdict(res, args.soak_tolerance_mib) else 1


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fam = family(args)
    if args.soak:
        if args.backends is None:
            args.backends = ["mmap"]
        if len(args.backends) != 1 or args.mixed_long <= 0:
            raise SystemExit("--soak serves one backend under the mixed load (--mixed-long > 0)")
        others = [name for name, on in (("--solo", args.solo), ("--vllm-bench", args.vllm_bench),
                  ("--profile-steps", args.profile_steps), ("--py-spy", args.py_spy),
                  ("--cold", args.cold)) if on]  # fmt: skip
        if others:
            # --cold: the page cache of the tables would grow during the soak by design.
            raise SystemExit(f"--soak runs alone: drop {', '.join(others)}")
    if args.solo and args.vllm_bench:
        raise SystemExit("--solo measures the servers' loads; --vllm-bench runs no server")
    if args.backends is None:
        args.backends = ["gpu", "uva" if fam == "qwen4exp" else "offload", "mmap"]
    unknown = [b for b in args.backends if base_backend(b) not in known_backends(fam)]
    if unknown:
        raise SystemExit(f"unknown backends {unknown} for {fam}; known: {known_backends(fam)}")
    if any(base_backend(b) == "disk" for b in args.backends):
        if vllm_release() < (0, 34):
            raise SystemExit(f"backend disk is vLLM 0.34.0's disk_offload; vLLM {vllm_release()}")
    if args.ref is None:
        args.ref = "gpu" if "gpu" in args.backends else args.backends[0]
    elif args.ref not in args.backends:
        raise SystemExit(f"--ref {args.ref} is not among --backends {args.backends}")
    if set(args.vllm_bench) - {"latency", "throughput"}:
        raise SystemExit(f"--vllm-bench takes latency and/or throughput, got {args.vllm_bench}")
    if args.dry_run:
        return dry_run(args, measure, profile)
    vllm_clock.DEADLINE = vllm_clock.T0 + args.deadline
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args)
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` stops us: report, stop servers
    if args.checkpoint:
        ckpt = args.checkpoint
    elif args.build_only:
        log(f"checkpoint: {vbm.config_hash(cfg)} under {args.ckpt_root}")
        if family(args) != "qwen4exp":
            ckpt, built = ensure_gemma_checkpoint(args.ckpt_root, cfg, log=log)
        else:
            ckpt, built = vbm.ensure_checkpoint(args.ckpt_root, cfg, log=log)
        log(f"checkpoint {'written' if built else 'cached'}: {ckpt}")
        print(describe(cfg, ckpt))
        return 0
    else:
        ckpt = args.ckpt_root / f"{family(args)}-{vbm.config_hash(cfg)}"
        if not (ckpt / "tokenizer.json").exists():
            # In a process of its own: the writer's CUDA context and cached blocks must not
            # stay on the GPU the servers share.
            cmd = [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])]
            log(f"building the checkpoint: {' '.join(cmd)} --build-only")
            try:
                subprocess.run([*cmd, "--build-only"], check=True, timeout=max(left(), 1))
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                log(f"the checkpoint could not be built: {exc}")
                return 1
        log(f"checkpoint: {ckpt}")
    tables = table_files(args, ckpt)
    args.offload_gib = sum(t.stat().st_size for t in tables) / 2**30
    meta: dict[str, Any] = {
        "model": describe(cfg, ckpt),
        "setup": (
            f"{args.input_len} in / {args.output_len} out, mixed: {args.mixed_decoders} x "
            f"{args.input_len}/{args.mixed_output_len} + {args.mixed_long} x "
            f"{args.long_min}-{args.long_max}/{args.long_output_len} every {args.mixed_gap} s; "
            + _page_cache_setup(args)
            + f"; compile {args.compile}; "
            f"FULL_DECODE_ONLY {args.capture_sizes}; max_num_batched_tokens "
            f"{args.max_num_batched_tokens}; "
            + (
                f"one server at a time (--solo), up to {args.repeats} repeats each"
                if args.solo
                else f"median of up to {args.repeats} interleaved repeats"
            )
        ),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "checkpoint": str(ckpt),
        "config": cfg,
        "cpu_topology": cpu_topology(),
        "gpu": gpu_name(),
        "gpu_uuid": gpu_uuid(),
        "vllm": vllm_version(),
        "data_parallel_size": args.data_parallel_size,
    }
    log(meta["model"])
    plugin_dir = write_plugin(Path(tempfile.mkdtemp(prefix="ple-bench-plugin-")))
    # On only in the disk servers (PLE_BENCH_TIME_DISK).
    write_vllm_plugin(
        plugin_dir, "ple_bench_disk_timer", Path(vllm_disk_timer.__file__).read_text()
    )
    if args.vllm_bench:
        cli_rows: list[dict[str, Any]] = []
        try:
            run_cli_benches(args, ckpt, plugin_dir, cli_rows)
        except KeyboardInterrupt:
            log("interrupted: reporting what was measured")
        md = meta["model"] + "\n\n" + cli_markdown(args, cli_rows)
        print("\n" + md + "\n", flush=True)
        if args.markdown:
            args.markdown.write_text(md + f"\n\ncommand: `{meta['command']}`\n")
        if args.json:
            runs = {"meta": meta, "runs": cli_rows}
            args.json.write_text(json.dumps(runs, indent=1, default=str))
        return 0 if any(x["rc"] == 0 for x in cli_rows) else 1
    servers: dict[str, Server] = {}
    rows: list[dict[str, Any]] = []
    holder = _hold_residency(args, tables)
    meta["residency"] = args.residency
    meta["host_memory_before"] = host_memory()
    if args.cold and tables:
        # Before any server maps them: an mmap server then starts on a cold page cache
        # (vLLM's loader skips the table files; the gpu and uva servers read them while
        # they load, so a cold start of mmap is `--backends mmap --cold --no-warmup`).
        evict(tables)
        log(f"table files evicted before the servers start: {page_cache(tables):.2f} GiB resident")
    try:
        if args.solo:
            _solo(args, ckpt, plugin_dir, servers, tables, int(cfg["vocab_size"]), rows)
            return 0 if rows else 1
        for b in args.backends:
            servers[b] = start_server(args, ckpt, b, plugin_dir)
        log(f"started {', '.join(args.backends)}; waiting up to {args.start_timeout:.0f} s")
        wait_healthy(
            list(servers.values()), min(args.start_timeout, max(left(), 1)), args.start_grace
        )
        for s in servers.values():
            s.facts = log_facts(s.log_path)
        meta["gpu_used_mib_all_servers"] = gpu_used_total()
        meta["host_memory_all_servers"] = host_memory()
        if args.soak:
            return _soak(args, next(iter(servers.values())), tables, int(cfg["vocab_size"]), meta)
        asyncio.run(measure(args, servers, tables, int(cfg["vocab_size"]), rows))
        if args.profile_steps:
            asyncio.run(profile(args, servers, int(cfg["vocab_size"])))
        if args.py_spy:
            asyncio.run(sample_stacks(args, servers, int(cfg["vocab_size"])))
    except KeyboardInterrupt:
        log("interrupted: reporting what was measured")
    finally:
        for s in servers.values():
            s.facts = log_facts(s.log_path)
        try:
            if not args.soak:
                report(args, rows, servers, meta, tables)
        finally:
            stop_servers(list(servers.values()))
            if holder is not None:
                holder.terminate()
                holder.wait(timeout=10)
    return 0 if rows else 1


def _page_cache_setup(args: argparse.Namespace) -> str:
    if args.residency is not None:
        return f"table files held at {args.residency:.0%} resident"
    return f"{'cold' if args.cold else 'warm'} page cache"


def _hold_residency(args: argparse.Namespace, tables: list[Path]) -> subprocess.Popen[bytes] | None:
    """``--residency``: benchmarks/residency.py over the table files, for the whole run."""
    if args.residency is None:
        return None
    if not 0.0 <= args.residency <= 1.0 or not tables:
        raise SystemExit(f"--residency {args.residency}: a share from 0 to 1 of the table files")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).with_name("residency.py")), "--share",
           str(args.residency), "--interval", "0.5", "--report-every", "5",
           *map(str, tables)]  # fmt: skip
    path = args.log_dir / "residency.log"
    with open(path, "wb") as out:
        holder = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    # The servers start once the kept share is read in (a 24 GiB table's takes a minute),
    # so every backend starts at the share.
    deadline = time.monotonic() + 900
    while "read in" not in path.read_text() and holder.poll() is None:
        if time.monotonic() > deadline:
            holder.kill()
            raise SystemExit("--residency: the holder did not read the kept share in 900 s")
        time.sleep(0.5)
    time.sleep(1)  # its first tick
    if holder.poll() is not None:
        raise SystemExit(
            f"--residency: the holder stopped (exit {holder.returncode}): "
            + path.read_text()[-500:]
        )
    log(f"table files held at {args.residency:.0%} resident: {page_cache(tables):.2f} GiB now")
    return holder


if __name__ == "__main__":
    sys.exit(main())
