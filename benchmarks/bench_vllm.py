"""vLLM 0.33.0 serving a random-weight Qwen4Exp with its PLE tables three ways, side by side:
``gpu`` (the tables in GPU memory, ``engram_config.cpu_offload=False``),
``uva`` (vLLM's default: pinned host tables read by the GPU over UVA) and ``mmap``
(ple-memops: the tables read from the checkpoint's files through the page cache, FULL decode
graphs waiting for rows the host gathers after the launch).

The model has the real Qwen4Exp's per-layer widths (hidden 2048; with ``--attention-every
N``, dense full-attention layers of 16 heads of 256 with 2 KV heads, off by default;
GatedDeltaNet layers of 16 key / 32 value heads of 128; experts of 512 with a shared
expert, top-10 routing; 4 hyper-connection streams of rank 320; 16 n-gram heads of
128-wide rows per PLE layer: ngram_size 3 x heads_per_ngram 8, ple_embed_dim 2048),
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
files hold (``mincore``). "GPU busy" is nvidia-smi's ``utilization.gpu`` (the share of time
a kernel was running, sampled every 100 ms) averaged over the load: at c1 that is the GPU's
share of a decode step. ``--cold`` evicts the table files (``POSIX_FADV_DONTNEED``) before
every repeat; pages the mmap server has mapped stay resident (the residency after eviction
is reported), and only the mmap backend reads the files at all.

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
import contextlib
import ctypes
import json
import mmap
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The harness modules beside this script (on sys.path when it is run as a script).
import trace_steps
import vllm_bench_model as vbm
from proc_cpu import CLK_TCK, OUR_THREADS, cpu_topology, thread_cpu, thread_last_cpu

# The offline bundle leaves CuTe DSL out: the model then takes its unfused hyper-connection
# path in every vLLM process (a vLLM general plugin on PYTHONPATH).
from vllm_harness import write_test_plugin as write_plugin

HERE = Path(__file__).resolve().parent

BACKENDS = ("gpu", "uva", "mmap")
# Servers of vLLM's own table paths beside the three: a second GPU-table server (A against
# A: what difference the protocol resolves), and the GPU table with ple-memops' plugin
# installed and switched off for the engine (does installing it cost anything?).
STOCK_VARIANTS: dict[str, dict[str, Any]] = {
    "gpu": {"offload": False},
    "gpu-b": {"offload": False},
    "uva": {"offload": True},
    "gpu-plugin": {"offload": False, "plugin": True},
    # Gemma: vLLM's generic answer to a model that does not fit, --cpu-offload-gb, given
    # the table's bytes (it offloads decoder layers' weights, read over UVA every step;
    # vLLM offloads no embedding table).
    "offload": {"offload": False, "offload_gb": True},
}
# What each model family serves: Qwen4Exp's table paths are vLLM's engram_config; a Gemma's
# table is on the GPU in vLLM, and --cpu-offload-gb frees as much GPU memory elsewhere.
FAMILY_STOCK = {
    "qwen4exp": ("gpu", "gpu-b", "uva", "gpu-plugin"),
    "gemma4": ("gpu", "gpu-b", "offload", "gpu-plugin"),
    "gemma3n": ("gpu", "gpu-b", "offload", "gpu-plugin"),
}
# The Gemma models, each a text config's keys (``base``: None for the tests' tiny one, {}
# for transformers' own defaults; ``overrides`` on top). EOS is the bench tokenizer's (id
# 2; the requests ignore it).
# - gemma4-e2b: Gemma 4 at E2B's shapes as transformers' Gemma4TextConfig defaults describe
#   them (its docstring: "similar to google/gemma-4-e2b-it"): 30 layers of hidden 2304
#   (every sixth full attention), a [262144, 30 x 256] BF16 per-layer table of 3.75 GiB.
# - gemma3n-e4b: Gemma3nTextConfig's defaults ("gemma3n_text-E4B style"): 35 layers of
#   hidden 2048, 15 KV-shared, a [262144, 35 x 256] table of 4.38 GiB; gemma3n-e2b:
#   E2B's (transformers' converter: 30 layers, intermediate 8192, 10 KV-shared), 3.75 GiB.
#   Gemma3nForConditionalGeneration, served text only (its towers are the tests' tiny ones
#   and vLLM does not build them).
GEMMA_MODELS: dict[str, dict[str, Any]] = {
    "gemma4-e2b": {"family": "gemma4", "base": {}, "overrides": {"eos_token_id": vbm.EOS_ID}},
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
    "mmap-sync": {"env": {"PLE_MEMOPS_FORCE_SYNC": "1"}},
    # What the synchronous fallback did before it kept FULL graphs: graphs off.
    "mmap-sync-eager": {"env": {"PLE_MEMOPS_FORCE_SYNC": "1"}, "cudagraph_mode": "NONE"},
}
SERVED = "ple-bench"
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


# -- loads ------------------------------------------------------------------------------------


@dataclass
class Req:
    prompt: list[int]
    output_len: int
    at: float = 0.0  # arrival offset (s); requests at 0 wait for the concurrency limit
    kind: str = "short"


@dataclass
class Load:
    name: str
    concurrency: int
    requests: list[Req]


def make_loads(args: argparse.Namespace, vocab: int, repeat: int) -> list[Load]:
    """The loads of one repeat; prompts are random token ids (the specials excluded), the
    same for every backend, different per repeat (no prefix-cache hit across repeats)."""
    lo = len(vbm.SPECIALS)

    def ids(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(n)]

    loads = []
    for c in args.concurrency:
        rng = random.Random(f"c{c}-{repeat}")
        n = max(8, 6 * c) if args.requests is None else args.requests
        reqs = [Req(ids(rng, args.input_len), args.output_len) for _ in range(n)]
        loads.append(Load(f"c{c}", c, reqs))
    if args.mixed_long > 0:
        rng = random.Random(f"mixed-{repeat}")
        reqs = [
            Req(ids(rng, args.input_len), args.mixed_output_len) for _ in range(args.mixed_decoders)
        ]
        for k in range(args.mixed_long):
            n = rng.randint(args.long_min, args.long_max)
            reqs.append(Req(ids(rng, n), args.long_output_len, 0.25 + k * args.mixed_gap, "long"))
        loads.append(Load("mixed", args.mixed_decoders + args.mixed_long, reqs))
    return loads


# -- the client -------------------------------------------------------------------------------


@dataclass
class Out:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    start: float = 0.0
    error: str = ""
    kind: str = "short"
    prompt_len: int = 0


class Client:
    """vLLM's own completions client (aiohttp) where vLLM is importable, else a stdlib one
    with the same timing (first streamed chunk = TTFT, each later chunk one ITL)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.session: Any = None
        try:
            import aiohttp
            from vllm.benchmarks.lib import endpoint_request_func as erf

            self.kind = "vllm.benchmarks"
            self._erf: Any = erf
            self._aiohttp: Any = aiohttp
        except Exception as exc:  # the dry run outside vLLM's environment
            self.kind = f"stdlib ({type(exc).__name__}: {exc})"
            self._erf = None

    async def __aenter__(self) -> Client:
        if self._erf is not None:
            # Idle connections are dropped after 1 s, well before the server's keep-alive
            # (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) closes them: a load reusing one the
            # server has just closed fails with a disconnect (seen on the H200 when a c64
            # load followed a 5 s c1 load).
            self.session = self._aiohttp.ClientSession(
                connector=self._aiohttp.TCPConnector(
                    limit=0, force_close=False, keepalive_timeout=1.0
                ),
                timeout=self._aiohttp.ClientTimeout(total=self.timeout),
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def request(self, port: int, req: Req) -> Out:
        url = f"http://127.0.0.1:{port}/v1/completions"
        if self._erf is not None:
            inp = self._erf.RequestFuncInput(
                prompt=req.prompt,
                api_url=url,
                prompt_len=len(req.prompt),
                output_len=req.output_len,
                model=SERVED,
                model_name=SERVED,
                ignore_eos=True,
                extra_body={"temperature": 0.0},
            )
            try:
                o = await asyncio.wait_for(
                    self._erf.async_request_openai_completions(inp, self.session),
                    self.timeout,
                )
            except TimeoutError:
                return Out(error=f"timed out after {self.timeout:.0f} s", kind=req.kind)
            tokens = int(o.output_tokens or 0) or (len(o.itl) + 1 if o.success else 0)
            return Out(
                o.success, o.ttft, o.latency, list(o.itl), tokens, o.start_time,
                (o.error or "")[-500:], req.kind, len(req.prompt),
            )  # fmt: skip
        try:
            return await asyncio.wait_for(self._stdlib(port, req), self.timeout)
        except TimeoutError:
            return Out(error=f"timed out after {self.timeout:.0f} s", kind=req.kind)
        except Exception as exc:
            return Out(error=f"{type(exc).__name__}: {exc}", kind=req.kind)

    async def _stdlib(self, port: int, req: Req) -> Out:
        body = json.dumps(
            {
                "model": SERVED, "prompt": req.prompt, "max_tokens": req.output_len,
                "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True, "temperature": 0.0,
            }
        ).encode()  # fmt: skip
        out = Out(kind=req.kind, prompt_len=len(req.prompt))
        st = time.perf_counter()
        out.start = st
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            status = (await reader.readline()).decode()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip().lower()
            if " 200 " not in status:
                out.error = status.strip()
                return out
            chunked = headers.get("transfer-encoding") == "chunked"
            buf, last = b"", st
            while True:
                if chunked:
                    size = int((await reader.readline()).strip() or b"0", 16)
                    if size == 0:
                        break
                    data = await reader.readexactly(size + 2)
                    buf += data[:-2]
                else:
                    data = await reader.read(65536)
                    if not data:
                        break
                    buf += data
                while b"\n\n" in buf:
                    msg, buf = buf.split(b"\n\n", 1)
                    text = msg.decode().strip().removeprefix("data: ")
                    if not text or text.startswith(":") or text == "[DONE]":
                        continue
                    d = json.loads(text)
                    now = time.perf_counter()
                    if d.get("choices"):
                        if out.ttft == 0.0:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                    elif d.get("usage"):
                        out.tokens = int(d["usage"].get("completion_tokens") or 0)
            out.latency = last - st
            out.ok = out.ttft > 0
            return out
        finally:
            writer.close()


async def run_load(
    client: Client, port: int, load: Load, timeout: float
) -> tuple[list[Out], float]:
    sem = asyncio.Semaphore(load.concurrency)
    t0 = time.perf_counter()

    async def one(r: Req) -> Out:
        if r.at > 0:
            await asyncio.sleep(max(0.0, t0 + r.at - time.perf_counter()))
            return await client.request(port, r)
        async with sem:
            return await client.request(port, r)

    tasks = [asyncio.ensure_future(one(r)) for r in load.requests]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    outs = [
        t.result() if t in done and not t.cancelled() else Out(error="load timed out")
        for t in tasks
    ]
    return outs, time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    f = int(k)
    return s[f] + (s[min(f + 1, len(s) - 1)] - s[f]) * (k - f)


def metrics(outs: list[Out], wall: float) -> dict[str, Any]:
    ok = [o for o in outs if o.ok]
    if not ok:
        return {"ok": 0, "failed": len(outs), "errors": sorted({o.error[:300] for o in outs})[:3]}
    start = min(o.start for o in ok)
    end = max(o.start + o.latency for o in ok)
    dur = max(end - start, 1e-9)
    short = [o for o in ok if o.kind == "short"] or ok
    long_ = [o for o in ok if o.kind == "long"]
    tpot = [(o.latency - o.ttft) / (o.tokens - 1) for o in short if o.tokens > 1]
    itl = [x for o in short for x in o.itl]
    ttft = [o.ttft for o in (long_ or ok)]
    ms = 1000.0
    return {
        "ok": len(ok),
        "failed": len(outs) - len(ok),
        "errors": sorted({o.error[:300] for o in outs if not o.ok})[:3],
        "duration_s": dur,
        "wall_s": wall,
        "output_tokens": sum(o.tokens for o in ok),
        "tok_s": sum(o.tokens for o in ok) / dur,
        "tpot_p50_ms": (_pct(tpot, 50) or 0) * ms,
        "tpot_p99_ms": (_pct(tpot, 99) or 0) * ms,
        "itl_p50_ms": (_pct(itl, 50) or 0) * ms,
        "itl_p99_ms": (_pct(itl, 99) or 0) * ms,
        "ttft_p50_ms": (_pct(ttft, 50) or 0) * ms,
        "ttft_p99_ms": (_pct(ttft, 99) or 0) * ms,
        "ttft_of": "long prompts" if long_ else "all",
        "short_ttft_p50_ms": (_pct([o.ttft for o in short], 50) or 0) * ms,
    }


# -- host-side probes -------------------------------------------------------------------------


class Utilization:
    """nvidia-smi's utilization.gpu every 100 ms while a load runs (None without it)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.samples: list[int] = []
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 "-i", os.environ.get("BENCH_GPU_INDEX", "0"), "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.samples.append(int(line.strip()))

    def stop(self) -> float | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        s = self.samples[1:] or self.samples
        return statistics.fmean(s) if s else None


def _proc_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_use(
    before: dict[tuple[int, int], tuple[str, int]],
    after: dict[tuple[int, int], tuple[str, int]],
    wall_s: float,
) -> dict[str, Any]:
    """Cores busy over ``wall_s`` between two :func:`thread_cpu` samples: the whole tree,
    our threads (named ``ple-*``), and the busiest thread by name."""
    if wall_s <= 0:
        return {}
    used: dict[str, float] = {}
    for key, (name, ticks) in after.items():
        d = ticks - before.get(key, (name, 0))[1]
        if d > 0:
            used[name] = used.get(name, 0.0) + d / CLK_TCK / wall_s
    if not used:
        return {"cpu_cores": 0.0, "cpu_ours": 0.0, "cpu_top": None}
    ours = sum(v for n, v in used.items() if n.startswith(OUR_THREADS))
    top = max((n for n in used if not n.startswith(OUR_THREADS)), key=used.get, default=None)
    return {
        "cpu_cores": sum(used.values()),
        "cpu_ours": ours,
        "cpu_top": None if top is None else (top, used[top]),
    }


def busy_thread_cpus(
    before: dict[tuple[int, int], tuple[str, int]],
    after: dict[tuple[int, int], tuple[str, int]],
    last_cpu: dict[tuple[int, int], int],
) -> dict[str, list[int]]:
    """Where the threads that ran during a load last ran, by name (the CPUs of all threads
    of one name, sorted): which CPUs, SMT siblings included, the engine's thread and ours
    shared."""
    out: dict[str, set[int]] = {}
    for key, (name, ticks) in after.items():
        if ticks - before.get(key, (name, 0))[1] > 0 and key in last_cpu:
            out.setdefault(name, set()).add(last_cpu[key])
    return {n: sorted(c) for n, c in sorted(out.items())}


def host_rss(pids: list[int]) -> dict[str, float]:
    """GiB of RssAnon / RssFile / RssShmem summed over the processes (shared pages count
    once per process that maps them)."""
    tot = {"anon": 0, "file": 0, "shmem": 0}
    for p in pids:
        try:
            text = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            for k, key in (("RssAnon:", "anon"), ("RssFile:", "file"), ("RssShmem:", "shmem")):
                if line.startswith(k):
                    tot[key] += int(line.split()[1]) * 1024
    return {k: v / 2**30 for k, v in tot.items()}


def gpu_memory_by_pid() -> dict[int, float] | None:
    """MiB per process from nvidia-smi (None without it; empty where it cannot see them)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=15, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    got = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        with contextlib.suppress(ValueError, IndexError):
            got[int(parts[0])] = float(parts[1])
    return got


def gpu_used_total() -> float | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
             "-i", os.environ.get("BENCH_GPU_INDEX", "0")],
            capture_output=True, text=True, timeout=15, check=False,
        ).stdout  # fmt: skip
        return float(text.split()[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now (``mincore`` over a mapping nobody touches)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(b & 1 for b in bytes(vec)) * page
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def evict(paths: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (dirty ones are written first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def page_cache(paths: list[Path]) -> float:
    return sum(resident_bytes(p) for p in paths) / 2**30


# -- servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        for key in ("spin", "first_layer_threads", "diag_skip_gather", "predict_ready"):
            if key in variant:
                ours[key] = variant[key]
        if args.stats_every and not variant.get("bare") and variant.get("stats", True):
            ours["stats_every"] = args.stats_every
        if variant.get("stalls", args.time_stalls) and not variant.get("bare"):
            ours["time_stalls"] = True
        extra["ple_memops"] = ours
    elif STOCK_VARIANTS.get(backend, {}).get("plugin"):
        extra["ple_memops"] = {"table_backend": "default"}
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
        tables = ["--engram-config", json.dumps({"cpu_offload": _offload(backend)})]
    return [
        "--dtype", "bfloat16", "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30)),
        "--no-enable-prefix-caching", "--async-scheduling",
        "--compilation-config", json.dumps(graphs), *tables,
        "--additional-config", json.dumps(extra),
    ]  # fmt: skip


def family(args: argparse.Namespace) -> str:
    """``gemma4``, ``gemma3n`` or ``qwen4exp``: the model family ``--model`` names."""
    spec = GEMMA_MODELS.get(args.model)
    return "qwen4exp" if spec is None else str(spec["family"])


def _offload(backend: str) -> bool:
    """Whether vLLM keeps the tables in pinned host memory (UVA; mmap servers never read
    them there) rather than on the GPU."""
    return bool(STOCK_VARIANTS.get(backend, {}).get("offload", True))


def known_backends(fam: str | None = None) -> list[str]:
    """The backends of model family ``fam`` (every family's when None)."""
    stock = FAMILY_STOCK[fam] if fam else list(STOCK_VARIANTS)
    return list(dict.fromkeys([*(b for b in BACKENDS if b in stock or b == "mmap"),
                               *stock, *MMAP_VARIANTS]))  # fmt: skip


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


def engine_env(backend: str, plugin_dir: Path) -> dict[str, str]:
    """The environment of a vLLM process serving ``backend`` (server or ``vllm bench``)."""
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
    env["PYTHONPATH"] = f"{plugin_dir}:{env.get('PYTHONPATH', '')}".rstrip(":")
    return env


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
    for marker in ("TableIoError", "PlanPoisonedError", "watchdog", "Traceback"):
        if marker in text:
            facts.setdefault("log_markers", []).append(marker)
    if m := re.search(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)", text
    ):
        facts["init_engine_s"] = float(m.group(1))
    return facts


def stop_servers(servers: list[Server]) -> None:
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for s in servers:
        if s.proc is None:
            continue
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.proc.wait(timeout=10)


def server_resources(s: Server, tables: list[Path]) -> dict[str, Any]:
    pids = _proc_tree(s.proc.pid) if s.proc is not None else []
    res: dict[str, Any] = {"rss_gib": host_rss(pids)}
    by_pid = gpu_memory_by_pid()
    if by_pid is not None:
        mine = [by_pid[p] for p in pids if p in by_pid]
        res["gpu_mib"] = sum(mine) if mine else None
    return res


# -- the run ----------------------------------------------------------------------------------


def left() -> float:
    return DEADLINE - time.monotonic()


DEADLINE = float("inf")


async def measure(
    args: argparse.Namespace,
    servers: dict[str, Server],
    tables: list[Path],
    vocab: int,
    rows: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Warm-up, then repeats x loads x backends (rotating order) until done or the deadline;
    each measurement is appended to ``rows`` as it ends (kept when interrupted)."""
    took: dict[str, float] = {}
    live = [b for b in args.backends if servers[b].healthy]
    async with Client(args.request_timeout) as client:
        log(f"client: {client.kind}")
        if live and args.warmup:
            # Every load once, untimed, on every server at once (prompts of its own; a
            # decode load's first wave, 16 tokens out): the first steps at a batch size or
            # prefill shape pay one-time costs (Triton's compiles, allocations) that no
            # measured load should carry.
            t = time.monotonic()
            for warm in make_loads(args, vocab, -1):
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
                    log_at = _log_size(srv.log_path)
                    tree = _proc_tree(srv.proc.pid) if srv.proc is not None else []
                    cpu0 = thread_cpu(tree)
                    outs, wall = await run_load(client, srv.port, load, timeout)
                    cpu1 = thread_cpu(tree)
                    cpu = cpu_use(cpu0, cpu1, wall) if tree else {}
                    if tree:
                        cpu["thread_cpus"] = busy_thread_cpus(cpu0, cpu1, thread_last_cpu(tree))
                    busy = util.stop()
                    m = metrics(outs, wall) | delivery_stats(_log_since(srv.log_path, log_at))
                    m |= cpu
                    took[load.name] = max(took.get(load.name, 0.0), wall)
                    row = {"repeat": r + 1, "load": load.name, "backend": b, "gpu_busy_pct": busy,
                           "page_cache_gib": page_cache(tables) if tables else None,
                           "cache_after_evict_gib": cache_before, **m,
                           **server_resources(srv, tables)}  # fmt: skip
                    rows.append(row)
                    if m["ok"]:
                        log(
                            f"r{r + 1} {load.name:6s} {b:4s}: {m['tok_s']:8.1f} tok/s  "
                            f"ITL p50 {m['itl_p50_ms']:.2f} ms  "
                            f"TTFT p50 {m['ttft_p50_ms']:.0f} ms  "
                            f"busy {'-' if busy is None else round(busy)}%  ({wall:.1f} s)"
                        )
                    if m["failed"]:
                        log(f"r{r + 1} {load.name} {b}: {m['failed']} failed: {m['errors'][:1]}")
                if stop:
                    break
    return rows


async def profile(args: argparse.Namespace, servers: dict[str, Server], vocab: int) -> None:
    """After the loads, each live server in turn: ``/start_profile``, one c1 request long
    enough for the profiler's 16 skipped and ``--profile-steps`` profiled iterations,
    ``/stop_profile``; its newest trace summarized (``trace_steps``: the FULL graphs'
    replays, span, busy, queued, period, the kernels) into ``servers[b].profile``."""

    def post(port: int, path: str) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=max(5.0, min(120.0, left()))) as r:
            r.read()

    steps = args.profile_steps + 16 + 8
    load = make_loads(args, vocab, 99)[0]
    one = Load("profile", 1, [Req(load.requests[0].prompt, steps)])
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
                summary = trace_steps.summarize(trace_steps.replays(events))
            except (OSError, ValueError, EOFError) as exc:
                log(f"{b}: the trace {traces[-1]} could not be read: {exc!r}")
                continue
            summary["trace"] = str(traces[-1])
            srv.profile = summary
            log(f"{b}: profiled {summary['replays']} replays ({traces[-1].name}): span "
                f"{summary.get('span_us')} us, busy {summary.get('busy_us')} us, period "
                f"{summary.get('period_us')} us")  # fmt: skip


def engine_core_pid(root: int) -> int | None:
    """The engine core process of the server whose process is ``root`` (vLLM names it
    ``VLLM::EngineCore``), or ``None``."""
    for pid in _proc_tree(root):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
                return pid
    return None


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


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _log_since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


_STATS = re.compile(
    r"ple-memops stats, last ([\d.]+) s: (\d+) deferred steps \((\d+) replays, (\d+) eager\), "
    r"(\d+) synchronous replays; per layer, fills, mean READY -> FILLED[^:]*: (.*)$"
)
# "layers.0 120 fills, 160.7 us (110 replays 35.2 us, 10 eager 1375.0 us), 0.0% rows cold,
# 3 completes waited 41.0 us"; lines of older wheels lack the parenthesis and the completes.
_LAYER_STATS = re.compile(
    r"(\S+) (\d+) fills(?:, ([\d.]+) us)?"
    r"(?: \((\d+) replays(?: ([\d.]+) us)?, (\d+) eager(?: ([\d.]+) us)?\))?"
    r"(?:, ([\d.]+)% rows cold)?(?:, (\d+) completes waited ([\d.]+) us)?"
)


# "host us per engine step over 812: total p50 41.2 p99 95.0, step p50 6.1 p99 9.0, arm p50
# 20.3 p99 40.2, wait p50 0.4 p99 30.1, check p50 3.0 p99 5.2, stats p50 0.2 p99 0.5; graph
# launch p50 12.0 p99 20.1" (older wheels: no launch)
_HOST = re.compile(
    r"host us per engine step over (\d+): total p50 ([\d.]+) p99 ([\d.]+), "
    r"step p50 ([\d.]+) p99 [\d.]+, arm p50 ([\d.]+) p99 [\d.]+, "
    r"wait p50 ([\d.]+) p99 ([\d.]+), check p50 ([\d.]+) p99 [\d.]+, stats p50 ([\d.]+)"
    r"(?: p99 [\d.]+; graph launch p50 ([\d.]+))?"
)
# "GPU stall per step: layers.0 812 steps, 40 stalled; us p50 0.0 p90 2.1 p99 61.0 max 90.2
# mean 1.20; layers.6 ..."
_STALL = re.compile(
    r"(\S+) (\d+) steps, (\d+) stalled(?:, \d+ dropped)?; us p50 ([\d.]+) p90 [\d.]+ "
    r"p99 ([\d.]+) max ([\d.]+) mean ([\d.]+)"
)
HOST_FIELDS = (
    "total_p50", "total_p99", "step", "arm", "wait", "wait_p99", "check", "stats", "launch"
)  # fmt: skip


def cost_stats(lines: list[str]) -> dict[str, Any]:
    """What the stats lines say of a step's costs: our host time per engine step (p50s by
    hook, step-weighted over the lines) and each layer's GPU stall (steps, share stalled,
    step-weighted p50 / p99 / mean, the worst max)."""
    out: dict[str, Any] = {}
    host = [(int(m.group(1)), [float(x or "nan") for x in m.groups()[1:]]) for ln in lines
            if (m := _HOST.search(ln))]  # fmt: skip
    n = sum(k for k, _ in host)
    if n:
        out["host_us"] = {f: sum(k * v[i] for k, v in host) / n for i, f in enumerate(HOST_FIELDS)}
    stall: dict[str, list[tuple[int, int, float, float, float, float]]] = {}
    for ln in lines:
        _, sep, tail = ln.partition("GPU stall per step: ")
        if not sep:
            continue
        for name, steps, stalled, p50, p99, top, mean in _STALL.findall(tail):
            stall.setdefault(name, []).append(
                (int(steps), int(stalled), float(p50), float(p99), float(top), float(mean))
            )
    if stall:
        out["stall"] = {}
        for name, v in stall.items():
            k = sum(x[0] for x in v) or 1
            out["stall"][name] = {
                "steps": sum(x[0] for x in v),
                "stalled_pct": 100 * sum(x[1] for x in v) / k,
                "p50_us": sum(x[0] * x[2] for x in v) / k,
                "p99_us": sum(x[0] * x[3] for x in v) / k,
                "max_us": max(x[4] for x in v),
                "mean_us": sum(x[0] * x[5] for x in v) / k,
            }
    return out


def delivery_stats(text: str) -> dict[str, Any]:
    """What an mmap server's ``ple-memops stats`` lines (``--stats-every``) say about one
    load: deferred steps, replays, eager steps, synchronous replays, and each layer's
    fill-weighted mean READY -> FILLED (the host gather of a step's rows), over all fills
    and over replays' and eager steps' apart. The first line after a load starts covers
    the end of the server's previous load, so it is dropped."""
    raw = [ln for ln in text.splitlines() if _STATS.search(ln)][1:]
    lines = [m for ln in raw if (m := _STATS.search(ln))]
    if not lines:
        return {}
    out: dict[str, Any] = {
        "ple_steps": sum(int(m.group(2)) for m in lines),
        "ple_replays": sum(int(m.group(3)) for m in lines),
        "ple_eager": sum(int(m.group(4)) for m in lines),
        "ple_sync_replays": sum(int(m.group(5)) for m in lines),
    }
    fills: dict[str, list[tuple[int, float]]] = {}
    replay: dict[str, list[tuple[int, float]]] = {}
    eager: dict[str, list[tuple[int, float]]] = {}
    cold: dict[str, list[tuple[int, float]]] = {}
    late: dict[str, list[tuple[int, float]]] = {}
    for m in lines:
        for name, n, us, nr, rus, ne, eus, pct, nl, lus in _LAYER_STATS.findall(m.group(6)):
            if nl:
                late.setdefault(name, []).append((int(nl), float(lus)))
            for d, count, x in (
                (fills, n, us),
                (replay, nr, rus),
                (eager, ne, eus),
                (cold, n, pct),
            ):
                if x:
                    d.setdefault(name, []).append((int(count), float(x)))

    def weighted(d: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
        return {k: sum(n * x for n, x in v) / max(1, sum(n for n, _ in v)) for k, v in d.items()}

    out["fill_us"], out["cold_pct"] = weighted(fills), weighted(cold)
    # Host completions that found their step unfilled: how many, and their mean wait.
    out["late_completes"] = {k: sum(n for n, _ in v) for k, v in late.items()}
    out["late_complete_us"] = weighted(late)
    if replay or eager:
        out["replay_fill_us"], out["eager_fill_us"] = weighted(replay), weighted(eager)
    return out | cost_stats(raw)


# -- the report -------------------------------------------------------------------------------


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None and r.get("ok")]
    return statistics.median(xs) if xs else None


def summarize(
    rows: list[dict[str, Any]], backends: list[str]
) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    loads = list(dict.fromkeys(r["load"] for r in rows))
    for load in loads:
        for b in backends:
            rs = [r for r in rows if r["load"] == load and r["backend"] == b]
            if not rs:
                continue
            good = [r for r in rs if r.get("ok")]
            s: dict[str, Any] = {"n": len(good), "failed_runs": len(rs) - len(good)}
            for k in ("tok_s", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms",
                      "ttft_p50_ms", "ttft_p99_ms", "gpu_busy_pct"):  # fmt: skip
                s[k] = _med(rs, k)
            toks = [r["tok_s"] for r in good]
            s["tok_s_range"] = (min(toks), max(toks)) if toks else None
            s["ttft_of"] = rs[0].get("ttft_of", "all")
            s["failed_requests"] = sum(r.get("failed", 0) for r in rs)
            for k in ("ple_steps", "ple_replays", "ple_eager", "ple_sync_replays"):
                s[k] = _med(rs, k)
            for key in ("fill_us", "replay_fill_us", "eager_fill_us"):
                layers = list(dict.fromkeys(n for r in good for n in r.get(key, {})))
                s[key] = {
                    n: statistics.median(r[key][n] for r in good if n in r.get(key, {}))
                    for n in layers
                }
            hosts = [r["host_us"] for r in good if r.get("host_us")]
            if hosts:
                s["host_us"] = {f: statistics.median(h[f] for h in hosts) for f in HOST_FIELDS}
            stalls = [r["stall"] for r in good if r.get("stall")]
            if stalls:
                names = list(dict.fromkeys(n for st in stalls for n in st))
                s["stall"] = {
                    n: {
                        k: statistics.median(st[n][k] for st in stalls if n in st)
                        for k in ("steps", "stalled_pct", "p50_us", "p99_us", "max_us", "mean_us")
                    }
                    for n in names
                }
            for k in ("cpu_cores", "cpu_ours"):
                s[k] = _med(rs, k)
            tops = [r["cpu_top"] for r in good if r.get("cpu_top")]
            if tops:
                name = statistics.mode(t[0] for t in tops)
                s["cpu_top"] = (name, statistics.median(t[1] for t in tops if t[0] == name))
            colds = [r["cold_pct"] for r in good if r.get("cold_pct")]
            s["cold_pct"] = (
                statistics.median(statistics.mean(c.values()) for c in colds) if colds else None
            )
            out[(load, b)] = s
    return out


def paired(rows: list[dict[str, Any]], ref: str, key: str) -> dict[tuple[str, str], list[float]]:
    """Each backend's ``key`` against ``ref``'s of the same load and repeat, in percent
    (``+2.0``: 2% higher): a pair shares the round's host and GPU conditions, which drift
    between rounds more than the servers differ."""
    by = {(r["load"], r["repeat"], r["backend"]): r[key] for r in rows
          if r.get("ok") and r.get(key) is not None}  # fmt: skip
    out: dict[tuple[str, str], list[float]] = {}
    for (load, rep_, b), x in by.items():
        base = by.get((load, rep_, ref))
        if b != ref and base:
            out.setdefault((load, b), []).append((x / base - 1) * 100)
    return out


def breakdown_markdown(
    rows: list[dict[str, Any]], summary: dict[tuple[str, str], dict[str, Any]], ref: str
) -> str:
    """Where a step's time goes, per load and backend: ITL p50 and tok/s paired against
    ``ref`` round by round (median and range over the repeats), GPU busy, the first PLE
    layer's GPU stall and our host time per engine step (mmap servers' stats lines)."""
    itl, tok = paired(rows, ref, "itl_p50_ms"), paired(rows, ref, "tok_s")
    lines = [
        f"Paired against `{ref}` (each repeat's server against `{ref}` in the same round; "
        "median [min, max] over the repeats). GPU stall: the first PLE layer's consumer "
        "waiting for its rows, from the GPU's clock (steps stalled > 1 us, p50 / p99 / "
        "mean us). Host: our code per engine step, p50 us (total / arm / wait / check). "
        "CPU: cores the server's threads kept busy over the load (/proc: all of them, ours "
        "(`ple-*`), the busiest other thread).",
        "",
        f"| load | backend | runs | ITL p50 ms | ITL p50 vs {ref} | tok/s vs {ref} | GPU busy "
        "| GPU stall: stalled, p50 / p99 / mean us | host us: total p50 / p99; arm, wait, "
        "check; graph launch | CPU cores: all / ours; busiest other thread |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def spread(xs: list[float] | None) -> str:
        if not xs:
            return "-"
        return f"{statistics.median(xs):+.2f}% [{min(xs):+.1f}, {max(xs):+.1f}]"

    for (load, b), s in summary.items():
        st = s.get("stall") or {}
        first = min(st, key=_layer_index) if st else None
        stall = "-"
        if first is not None:
            x = st[first]
            stall = (
                f"{first}: {x['stalled_pct']:.0f}%, {x['p50_us']:.1f} / {x['p99_us']:.1f} / "
                f"{x['mean_us']:.1f}"
            )
        h = s.get("host_us")
        host = "-"
        if h:
            host = (
                f"{h['total_p50']:.0f} / {h['total_p99']:.0f}; {h['arm']:.0f}, {h['wait']:.0f}, "
                f"{h['check']:.0f}; {_f(_num(h.get('launch')), 0)}"
            )
        cpu = "-"
        if s.get("cpu_cores") is not None:
            top = s.get("cpu_top")
            cpu = f"{s['cpu_cores']:.2f} / {_f(s.get('cpu_ours'), 2)}"
            if top:
                cpu += f"; {top[0]} {top[1]:.2f}"
        lines.append(
            f"| {load} | {b} | {s['n']} | {_f(s['itl_p50_ms'], 2)} "
            f"| {'(ref)' if b == ref else spread(itl.get((load, b)))} "
            f"| {'(ref)' if b == ref else spread(tok.get((load, b)))} "
            f"| {_f(s['gpu_busy_pct'], 0)}% | {stall} | {host} | {cpu} |"
        )
    return "\n".join(lines)


def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)", name)
    return int(m.group(1)) if m else 1 << 30


def _num(x: float | None) -> float | None:
    """``x``, or ``None`` for a missing or NaN value (an older wheel's stats line)."""
    return None if x is None or x != x else x


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def verdict(summary: dict[tuple[str, str], dict[str, Any]], slow: str = "uva") -> str:
    """The targets against the GPU table and against ``slow``, vLLM's own way to keep the
    table's bytes off the GPU (``uva``: Qwen4Exp's pinned tables; ``offload``:
    ``--cpu-offload-gb``)."""
    notes, misses = [], []

    def get(load: str, b: str, k: str) -> float | None:
        s = summary.get((load, b))
        return None if s is None else s.get(k)

    loads = list(dict.fromkeys(load for load, _ in summary))
    for load in loads:
        m, g, u = (get(load, b, "tok_s") for b in ("mmap", "gpu", slow))
        for b, x in (("mmap", m), ("gpu", g), (slow, u)):
            if x is None:
                misses.append(f"{load}: no {b} result")
        if m is None:
            continue
        if g:
            d = (m / g - 1) * 100
            notes.append(f"{load} tok/s {d:+.2f}% vs gpu")
            if d < -1:
                misses.append(f"{load}: throughput {d:+.2f}% vs gpu (target >= -1%)")
            mi, gi = get(load, "mmap", "itl_p50_ms"), get(load, "gpu", "itl_p50_ms")
            if mi and gi and load != "mixed":
                di = (mi / gi - 1) * 100
                notes.append(f"ITL {di:+.2f}%")
                if di > 1:
                    misses.append(f"{load}: ITL p50 {di:+.2f}% vs gpu (target <= +1%)")
        if u and m < u:
            misses.append(f"{load}: throughput below {slow} ({(m / u - 1) * 100:+.2f}%)")
    mt, ut = get("mixed", "mmap", "ttft_p50_ms"), get("mixed", slow, "ttft_p50_ms")
    if mt is not None and ut is not None:
        notes.append(f"mixed TTFT p50 {mt:.0f} vs {slow} {ut:.0f} ms")
        if mt > ut:
            misses.append(f"mixed: TTFT p50 {mt:.0f} ms > {slow} {ut:.0f} ms")
    if not summary:
        return "VERDICT (reported, not asserted): nothing was measured."
    head = "all targets met" if not misses else "targets missed: " + "; ".join(misses)
    return f"VERDICT (reported, not asserted): {head}. [{'; '.join(notes)}]"


def markdown(
    summary: dict[tuple[str, str], dict[str, Any]],
    servers: dict[str, dict[str, Any]],
    meta: dict[str, Any],
) -> str:
    lines = [
        f"Random weights, {meta.get('model', '')}; {meta.get('setup', '')}",
        "",
        "| load | backend | runs | output tok/s (range) | TPOT p50 / p99 ms | ITL p50 / p99 ms "
        "| TTFT p50 / p99 ms | GPU busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (load, b), s in summary.items():
        rng = s.get("tok_s_range")
        rs = f" ({_f(rng[0], 0)}-{_f(rng[1], 0)})" if rng else ""
        ttft_note = " (long)" if s.get("ttft_of") == "long prompts" else ""
        fail = f", {s['failed_requests']} failed" if s.get("failed_requests") else ""
        lines.append(
            f"| {load} | {b} | {s['n']}{fail} | {_f(s['tok_s'])}{rs} "
            f"| {_f(s['tpot_p50_ms'], 2)} / {_f(s['tpot_p99_ms'], 2)} "
            f"| {_f(s['itl_p50_ms'], 2)} / {_f(s['itl_p99_ms'], 2)} "
            f"| {_f(s['ttft_p50_ms'], 0)} / {_f(s['ttft_p99_ms'], 0)}{ttft_note} "
            f"| {_f(s['gpu_busy_pct'], 0)}% |"
        )
    delivery = [(k, s) for k, s in summary.items() if s.get("ple_steps") is not None]
    if delivery:
        lines += [
            "",
            "ple-memops stats of the mmap servers during each load (medians over the runs): "
            "steps, and each PLE layer's mean READY -> FILLED, the host gather from the GPU's "
            "publish being seen to the rows being ready",
            "",
            "| load | backend | steps (replays / eager / synchronous replays) | READY -> FILLED "
            "mean us, per layer: all fills | replays' | eager steps' | rows read cold |",
            "|---|---|---|---|---|---|---|",
        ]

        def per_layer(d: dict[str, float]) -> str:
            return ", ".join(f"{n} {us:.1f}" for n, us in d.items()) or "-"

        for (load, b), s in delivery:
            cold = "-" if s.get("cold_pct") is None else f"{s['cold_pct']:.1f}%"
            lines.append(
                f"| {load} | {b} | {_f(s['ple_steps'], 0)} ({_f(s['ple_replays'], 0)} / "
                f"{_f(s['ple_eager'], 0)} / {_f(s['ple_sync_replays'], 0)}) "
                f"| {per_layer(s['fill_us'])} | {per_layer(s['replay_fill_us'])} "
                f"| {per_layer(s['eager_fill_us'])} | {cold} |"
            )
    lines += [
        "",
        "| backend | ready after | weights (vLLM log) | GPU memory (nvidia-smi) | host RSS anon / "
        "file / shmem | table page cache | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, s in servers.items():
        rss = s.get("rss_gib") or {}
        notes = s.get("error") or ""
        facts = s.get("facts", {})
        if facts.get("skipped_files"):
            notes += f" table files skipped at load: {facts['skipped_files']}"
        if facts.get("mmap_fallback"):
            notes += f" FELL BACK: {facts['mmap_fallback']}"
        if facts.get("log_markers"):
            notes += f" log mentions {facts['log_markers']}"
        gpu = s.get("gpu_mib")
        lines.append(
            f"| {b} | {_f(s.get('ready_s'), 0)} s | {_f(facts.get('weights_gib'), 2)} GiB "
            f"| {'-' if gpu is None else f'{gpu / 1024:,.2f} GiB'} "
            f"| {_f(rss.get('anon'), 2)} / {_f(rss.get('file'), 2)} / "
            f"{_f(rss.get('shmem'), 2)} GiB "
            f"| {_f(s.get('page_cache_gib'), 2)} GiB | {notes.strip()} |"
        )
    w = {b: s.get("facts", {}).get("weights_gib") for b, s in servers.items()}
    if w.get("gpu") is not None:
        freed = [f"{b} {w['gpu'] - w[b]:.2f} GiB" for b in w if b != "gpu" and w[b] is not None]
        if freed:
            lines += ["", f"GPU memory freed against the GPU table (weights): {', '.join(freed)}"]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument(
        "--model",
        choices=["bench", "tiny", *GEMMA_MODELS],
        default="bench",
        help="bench: the Qwen4Exp benchmark model (--layers, --table-gib, ...); tiny: its "
        "tiny size; gemma4-e2b: Gemma 4 at E2B's shapes (transformers' Gemma4TextConfig "
        "defaults); gemma3n-e2b, gemma3n-e4b: Gemma 3n at E2B's and E4B's text shapes, "
        "served text only; gemma4-tiny, gemma3n-tiny: the Gemma tests' tiny ones",
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
    p.add_argument("--copy", choices=["auto", "kernel", "memop"], default="auto")
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
        help="after the loads, profile this many engine steps of one c1 request on each "
        "server with vLLM's torch profiler (configured in every server alike) and report "
        "each server's FULL graph replays (span, busy, period, kernels; trace_steps.py); "
        "the traces stay under profile-<backend>/ in --log-dir",
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
    p.add_argument("--log-dir", type=Path, default=Path(os.environ.get("OUT", "/tmp/ple-out")))
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--dry-run", action="store_true", help="CPU checks, fake servers (no GPU)")
    return p.parse_args(argv)


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


def report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    servers: dict[str, Server],
    meta: dict[str, Any],
    tables: list[Path],
) -> None:
    summary = summarize(rows, args.backends)
    left_after = [
        r["cache_after_evict_gib"] for r in rows if r.get("cache_after_evict_gib") is not None
    ]
    if left_after:
        meta = dict(meta, setup=meta.get("setup", "") + (
            f"; after each eviction {min(left_after):.2f}-{max(left_after):.2f} GiB of the "
            "tables stayed in the page cache (a live mmap server's mapped pages cannot be "
            "evicted from outside)"))  # fmt: skip
    per_server: dict[str, dict[str, Any]] = {}
    for b, s in servers.items():
        last = [r for r in rows if r["backend"] == b]
        res = server_resources(s, tables) if s.proc is not None and s.proc.poll() is None else {}
        per_server[b] = {
            "ready_s": s.ready_s, "error": s.error, "facts": s.facts, "profile": s.profile,
            "rss_gib": res.get("rss_gib") or (last[-1]["rss_gib"] if last else None),
            "gpu_mib": res.get("gpu_mib") if res else (last[-1].get("gpu_mib") if last else None),
            "page_cache_gib": page_cache(tables) if tables else None,
        }  # fmt: skip
    md = markdown(summary, per_server, meta)
    md += "\n\n" + breakdown_markdown(rows, summary, args.ref)
    profiled = {b: s.profile for b, s in servers.items() if s.profile and s.profile["replays"]}
    if profiled:
        first = args.ref if args.ref in profiled else next(iter(profiled))
        named = {first: profiled[first]} | profiled
        md += "\n\nOne c1 request profiled on each server (the FULL graphs' replays; "
        md += "benchmarks/trace_steps.py):\n\n" + trace_steps.markdown(named, top=8)
    v = verdict(summary, "uva" if family(args) == "qwen4exp" else "offload")
    print("\n" + md + "\n\n" + v + "\n", flush=True)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md + "\n\n" + v + "\n\n" + f"command: `{meta['command']}`\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"meta": meta, "servers": per_server, "runs": rows, "verdict": v,
                 "ref": args.ref,
                 "paired_itl_p50_pct": [{"load": k[0], "backend": k[1], "pct": x} for k, x in
                                        paired(rows, args.ref, "itl_p50_ms").items()],
                 "summary": [{"load": k[0], "backend": k[1], **s} for k, s in summary.items()]},
                indent=1, default=str,
            )
        )  # fmt: skip


# -- vLLM's own offline benchmarks -----------------------------------------------------------


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


def cli_markdown(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"vLLM's own `vllm bench latency` (batch {args.latency_batch}, {args.input_len} in / "
        f"{args.output_len} out, {args.latency_iters} iterations after {args.latency_warmup} "
        f"warm-up) and "
        f"`vllm bench throughput` ({args.throughput_prompts} random prompts, "
        f"{args.input_len} in / {args.output_len} out), one engine a run, medians over runs",
        "",
        "| command | backend | runs | latency avg / p50 / p99 s | requests/s | total tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for kind in args.vllm_bench:
        for b in args.backends:
            rs = [x for x in rows if x["kind"] == kind and x["backend"] == b]
            good = [x for x in rs if x["rc"] == 0]

            def med(k: str, good: list[dict[str, Any]] = good) -> float | None:
                xs = [x[k] for x in good if x.get(k) is not None]
                return statistics.median(xs) if xs else None

            bad = f", {len(rs) - len(good)} failed" if len(rs) > len(good) else ""
            lat = (f"{_f(med('avg_s'), 3)} / {_f(med('p50_s'), 3)} / {_f(med('p99_s'), 3)}"
                   if kind == "latency" else "-")  # fmt: skip
            lines.append(
                f"| {kind} | {b} | {len(good)}{bad} | {lat} | "
                f"{_f(med('req_s'), 2) if kind == 'throughput' else '-'} | "
                f"{_f(med('tok_s'), 0) if kind == 'throughput' else '-'} |"
            )
    return "\n".join(lines)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    global DEADLINE
    args = parse_args(argv)
    fam = family(args)
    if args.backends is None:
        args.backends = ["gpu", "uva" if fam == "qwen4exp" else "offload", "mmap"]
    unknown = [b for b in args.backends if b not in known_backends(fam)]
    if unknown:
        raise SystemExit(f"unknown backends {unknown} for {fam}; known: {known_backends(fam)}")
    if args.ref is None:
        args.ref = "gpu" if "gpu" in args.backends else args.backends[0]
    elif args.ref not in args.backends:
        raise SystemExit(f"--ref {args.ref} is not among --backends {args.backends}")
    if set(args.vllm_bench) - {"latency", "throughput"}:
        raise SystemExit(f"--vllm-bench takes latency and/or throughput, got {args.vllm_bench}")
    if args.dry_run:
        return dry_run(args)
    DEADLINE = T0 + args.deadline
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
            f"{'cold' if args.cold else 'warm'} page cache; compile {args.compile}; "
            f"FULL_DECODE_ONLY {args.capture_sizes}; max_num_batched_tokens "
            f"{args.max_num_batched_tokens}; median of up to {args.repeats} interleaved repeats"
        ),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "checkpoint": str(ckpt),
        "config": cfg,
        "cpu_topology": cpu_topology(),
    }
    log(meta["model"])
    plugin_dir = write_plugin(Path(tempfile.mkdtemp(prefix="ple-bench-plugin-")))
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
    if args.cold and tables:
        # Before any server maps them: an mmap server then starts on a cold page cache
        # (vLLM's loader skips the table files; the gpu and uva servers read them while
        # they load, so a cold start of mmap is `--backends mmap --cold --no-warmup`).
        evict(tables)
        log(f"table files evicted before the servers start: {page_cache(tables):.2f} GiB resident")
    try:
        for b in args.backends:
            servers[b] = start_server(args, ckpt, b, plugin_dir)
        log(f"started {', '.join(args.backends)}; waiting up to {args.start_timeout:.0f} s")
        wait_healthy(
            list(servers.values()), min(args.start_timeout, max(left(), 1)), args.start_grace
        )
        for s in servers.values():
            s.facts = log_facts(s.log_path)
        meta["gpu_used_mib_all_servers"] = gpu_used_total()
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
            report(args, rows, servers, meta, tables)
        finally:
            stop_servers(list(servers.values()))
    return 0 if rows else 1


# -- the dry run ------------------------------------------------------------------------------


class _Fake(threading.Thread):
    """A streaming completions server: ``step_s`` per token; ``fail`` answers 500."""

    def __init__(self, step_s: float, fail: bool = False) -> None:
        super().__init__(daemon=True)
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path in ("/start_profile", "/stop_profile") and not outer.fail:
                    if self.path == "/stop_profile" and outer.trace_dir is not None:
                        outer.write_trace()
                    self.send_response(200)
                    self.end_headers()
                    return
                body = json.loads(raw)
                if outer.fail:
                    self.send_response(500)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                time.sleep(len(body["prompt"]) * 2e-6)  # "prefill"
                for i in range(body["max_tokens"]):
                    time.sleep(outer.step_s)
                    chunk = {"choices": [{"text": f" w{i}", "index": 0}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

        self.fail = fail
        self.step_s = step_s
        self.trace_dir: Path | None = None
        ThreadingHTTPServer.request_queue_size = 256  # no SYN retries at concurrency 64
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])

    def run(self) -> None:
        self.httpd.serve_forever()

    def write_trace(self, replays: int = 6) -> None:
        """A profiler trace as CUPTI lays one out: per step a graph launch and its kernels
        (each carrying the launch's correlation id), ``step_s`` apart."""
        assert self.trace_dir is not None
        ev: list[dict[str, Any]] = []
        step = self.step_s * 1e6
        for i in range(replays):
            t = i * step
            for name, at, dur in (("cudaGraphLaunch", 0.0, 20.0), ("gemm", 30.0, step / 2),
                                  ("norm", 40.0 + step / 2, 10.0)):  # fmt: skip
                cat = "cuda_runtime" if name.startswith("cuda") else "kernel"
                ev.append({"ph": "X", "cat": cat, "name": name, "ts": t + at, "dur": dur,
                           "args": {"correlation": i}})  # fmt: skip
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        out = self.trace_dir / f"fake.{time.time_ns()}.pt.trace.json"
        out.write_text(json.dumps({"traceEvents": ev}))


def dry_run(args: argparse.Namespace) -> int:
    """The CPU side, here: checkpoint writer (tiny) against save_pretrained and vLLM's CPU
    loader, the tokenizer, the serve command lines, the loop and report on fake servers."""
    global DEADLINE
    work = Path(tempfile.mkdtemp(prefix="ple-bench-dry-"))
    args.log_dir = work
    ok = True
    for dtype in ("bf16", "fp8"):
        for every in (0, 4):
            cfg = vbm.bench_config(
                layers=8, experts=4, topk=2, ple_layers=2, table_gib=0.002, dtype=dtype,
                attention_every=every, vocab=512, split_parts=4, tiny=True,
            )  # fmt: skip
            problems = vbm.verify_against_save_pretrained(cfg, work / f"verify-{dtype}-{every}")
            log(f"writer vs save_pretrained ({dtype}, attention every {every}): "
                f"{'identical' if not problems else problems[:5]}")  # fmt: skip
            ok &= not problems
    args.model = "tiny"
    args.attention_every = 4
    for dtype in ("bf16", "fp8"):
        args.dtype = dtype
        cfg = model_config(args)
        ckpt, _ = vbm.ensure_checkpoint(work / "ckpt", cfg, log=lambda _: None)
        log(f"tiny {dtype} checkpoint: {describe(cfg, ckpt)}")
        log(f"tokenizer: {vbm.check_tokenizer(ckpt)}")
        try:
            import vllm  # noqa: F401
        except ImportError:
            log("vLLM is not importable here: its loader and parser checks are skipped")
            continue
        # mmap first: vLLM remembers the model class it resolved for a checkpoint, so a
        # stock load before would make the mmap one build vLLM's pinned table (CUDA).
        for mm in (True, False):
            try:
                log(f"vLLM's CPU loader (mmap={mm}): {vbm.check_vllm_loads(ckpt, mmap=mm)}")
            except Exception as exc:
                import traceback

                ok = False
                log(f"vLLM's CPU loader (mmap={mm}) FAILED: {type(exc).__name__}: {exc}")
                traceback.print_exc()
        ok &= check_serve_args(args, ckpt)
        if dtype == "bf16":  # the profiler's settings as vLLM parses them, once
            args.profile_steps = 8
            ok &= check_serve_args(args, ckpt)
            args.profile_steps = 0
        ok &= check_delivery_stats(ckpt)
    ok &= check_gemma(args, work)
    ok &= check_stuck_server(work)
    # The loop and the report against fake servers (one failing), a short deadline.
    fakes = {
        "gpu": _Fake(0.0010),
        "uva": _Fake(0.0012),
        "mmap": _Fake(0.0010),
        "bad": _Fake(0, True),
    }
    for f in fakes.values():
        f.start()
    args.backends = list(fakes)
    args.concurrency, args.repeats, args.output_len = [1, 8], 3, 24
    args.mixed_decoders, args.mixed_long, args.mixed_output_len, args.mixed_gap = 4, 2, 24, 0.05
    args.long_min, args.long_max, args.warmup = 300, 400, True
    servers = {
        b: Server(b, f.port, work / f"{b}.log", healthy=True, ready_s=0.0) for b, f in fakes.items()
    }
    tables = vbm.table_files(ckpt)
    DEADLINE = time.monotonic() + 20
    rows: list[dict[str, Any]] = []
    asyncio.run(measure(args, servers, tables, 512, rows))
    # The profile phase: every server profiled in turn (the failing one refuses).
    args.profile_steps = 4
    for b, f in fakes.items():
        f.trace_dir = profile_dir(args, b)
    DEADLINE = time.monotonic() + 60
    asyncio.run(profile(args, servers, 512))
    got = {b: (s.profile or {}).get("replays") for b, s in servers.items()}
    if got != {"gpu": 6, "uva": 6, "mmap": 6, "bad": None}:
        ok = False
        log(f"profile phase FAILED: {got}")
    args.profile_steps = 0
    args.markdown, args.json = work / "bench.md", work / "bench.json"
    meta = {"model": describe(cfg, ckpt), "setup": "DRY RUN against fake servers",
            "command": "bench_vllm.py --dry-run"}  # fmt: skip
    report(args, rows, servers, meta, tables)
    fake_rows = [dict(r, backend={"gpu": "uva", "uva": "gpu"}.get(r["backend"], r["backend"]))
                 for r in rows]  # fmt: skip
    log("the verdict with gpu and uva swapped (a report that misses targets):")
    print(verdict(summarize(fake_rows, args.backends)))
    evict(tables)
    log(f"page cache of the tiny tables after eviction: {page_cache(tables) * 2**30:.0f} bytes")
    for t in tables:
        t.read_bytes()
    log(f"after reading them: {page_cache(tables) * 2**30:.0f} bytes "
        f"(files {sum(t.stat().st_size for t in tables)} bytes)")  # fmt: skip
    log(f"dry run {'PASSED' if ok and rows else 'FAILED'}; files under {work}")
    return 0 if ok and rows else 1


_HEALTHY_AFTER_1S = """
import http.server, sys, time
time.sleep(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
_STUCK = "import time\ndef waiting_forever():\n    time.sleep(3600)\nwaiting_forever()\n"


def check_gemma(args: argparse.Namespace, work: Path) -> bool:
    """Both Gemma families at a tiny size."""
    return all([check_gemma_model(args, work, m) for m in ("gemma4-tiny", "gemma3n-tiny")])


def check_gemma_model(args: argparse.Namespace, work: Path, model: str) -> bool:
    """A tiny Gemma: the checkpoint (transformers' save_pretrained, the table in its own
    file), its tokenizer, and every Gemma backend's serve arguments through vLLM's parser
    (``offload``: --cpu-offload-gb of the table file's size)."""
    g = argparse.Namespace(**vars(args))
    g.model = model
    cfg = model_config(g)
    ckpt, built = ensure_gemma_checkpoint(work / "ckpt", cfg, log=lambda _: None)
    again, rebuilt = ensure_gemma_checkpoint(work / "ckpt", cfg, log=lambda _: None)
    tables = table_files(g, ckpt)
    g.offload_gib = sum(t.stat().st_size for t in tables) / 2**30
    from safetensors import safe_open

    with safe_open(str(tables[0]), "pt") as st:
        names = list(st.keys())
        shape = list(st.get_slice(names[0]).get_shape())
    good = built and not rebuilt and again == ckpt and shape == cfg["table"] and len(names) == 1
    log(f"tiny Gemma checkpoint: {describe(cfg, ckpt)}; table {names} {shape}; "
        f"{'written once, then reused' if good else 'NOT as expected'}")  # fmt: skip
    log(f"Gemma tokenizer: {vbm.check_tokenizer(ckpt)}")
    try:
        import vllm  # noqa: F401
    except ImportError:
        log("vLLM is not importable here: the Gemma serve-argument checks are skipped")
        return good
    return check_serve_args(g, ckpt) and good


def check_stuck_server(work: Path) -> bool:
    """wait_healthy on real processes: one healthy after 1 s, one stuck for ever; the stuck
    one must be given up ``grace`` s after the first was healthy, its Python stack must be
    in its log (SIGABRT + faulthandler) and it must be gone."""
    servers = []
    for name, code in (("up", _HEALTHY_AFTER_1S), ("stuck", _STUCK)):
        port = free_port()
        srv = Server(name, port, work / f"stuck-check-{name}.log")
        with open(srv.log_path, "w") as f:
            srv.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(port)], stdout=f, stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONFAULTHANDLER="1"), start_new_session=True,
            )  # fmt: skip
        servers.append(srv)
    t = time.monotonic()
    try:
        wait_healthy(servers, 60, grace=3)
    finally:
        stop_servers(servers)
    took = time.monotonic() - t
    up, stuck = servers
    stack = stuck.log_path.read_text(errors="replace")
    good = (
        up.healthy and not stuck.healthy and "after the first server" in stuck.error
        and took < 20 and "waiting_forever" in stack and stuck.proc is not None
        and stuck.proc.poll() is not None
    )  # fmt: skip
    log(
        f"a stuck server: {'given up, stack dumped, stopped' if good else 'NOT handled'} "
        f"after {took:.0f} s ({stuck.error})"
    )
    return good


def check_serve_args(args: argparse.Namespace, ckpt: Path) -> bool:
    """Every backend's ``vllm serve`` arguments through vLLM's own parser and EngineArgs
    (our settings through ple-memops' own checks), and the ``vllm bench latency`` and
    ``throughput`` command lines through those commands' parsers."""
    from vllm.benchmarks import latency, throughput
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ple_memops.vllm.settings import Settings

    ok = True
    fam = family(args)
    for b in known_backends(fam):
        parser = FlexibleArgumentParser()
        sub = parser.add_subparsers(dest="cmd")
        ServeSubcommand().subparser_init(sub)
        try:
            ns = parser.parse_args(serve_argv(args, ckpt, b, 8000))
            ns.model = ns.model_tag
            ea = AsyncEngineArgs.from_cli_args(ns)
            ours = Settings.for_engine(ea.additional_config, engine_env(b, Path("/nonexistent")))
            if ours.mmap != (b in MMAP_VARIANTS):
                raise AssertionError(f"{b}: table backend {ours.table_backend}")
            if ours.diag_skip_gather != (b == "mmap-nogather"):
                raise AssertionError(f"{b}: diag_skip_gather {ours.diag_skip_gather}")
            variant = MMAP_VARIANTS.get(b, {})
            timed = b in MMAP_VARIANTS and not variant.get("bare")
            if ours.time_stalls != bool(timed and variant.get("stalls", args.time_stalls)):
                raise AssertionError(f"{b}: time_stalls {ours.time_stalls}")
            logged = (b in MMAP_VARIANTS and bool(args.stats_every) and not variant.get("bare")
                      and variant.get("stats", True))  # fmt: skip
            if (ours.stats_every is not None) != logged:
                raise AssertionError(f"{b}: stats_every {ours.stats_every}")
            if ours.predict_ready != (b == "mmap-predict"):
                raise AssertionError(f"{b}: predict_ready {ours.predict_ready}")
            engram = ea.engram_config
            offload = (
                engram.get("cpu_offload")
                if isinstance(engram, dict)
                else getattr(engram, "cpu_offload", None)
            )
            if fam != "qwen4exp":
                want_gb = float(f"{args.offload_gib:.6g}") if b == "offload" else 0
                if engram or abs(ea.cpu_offload_gb - want_gb) > 1e-9:
                    raise AssertionError(f"{b}: engram {engram}, offload {ea.cpu_offload_gb} GB")
                text_only = ea.enable_prompt_embeds and ea.limit_mm_per_prompt == {
                    "image": 0, "audio": 0}  # fmt: skip
                if text_only != (fam == "gemma3n"):
                    raise AssertionError(f"{b}: prompt embeds {ea.enable_prompt_embeds}, "
                                         f"limits {ea.limit_mm_per_prompt}")  # fmt: skip
            elif offload != _offload(b) or ea.cpu_offload_gb:
                raise AssertionError(f"{b}: engram {engram}, offload {ea.cpu_offload_gb} GB")
            if ea.tensor_parallel_size != args.tensor_parallel_size:
                raise AssertionError(f"{b}: tensor parallel size {ea.tensor_parallel_size}")
            prof = ea.profiler_config
            want = str(profile_dir(args, b)) if args.profile_steps else ""
            if prof.torch_profiler_dir != want or (prof.profiler == "torch") != bool(want):
                raise AssertionError(f"{b}: profiler {prof}")
            log(f"serve args ({fam} {b}): parsed; engram {ea.engram_config}, offload "
                f"{ea.cpu_offload_gb} GiB, ple-memops {ours}, "
                f"cudagraph_mode {ea.compilation_config.cudagraph_mode}, kv "
                f"{ea.kv_cache_memory_bytes}, prefix caching {ea.enable_prefix_caching}, "
                f"async {ea.async_scheduling}")  # fmt: skip
            for kind, module in (("latency", latency), ("throughput", throughput)):
                cli = FlexibleArgumentParser()
                module.add_cli_args(cli)
                cns = cli.parse_args(cli_argv(args, kind, ckpt, b, Path("/tmp/x.json"))[2:])
                cea = EngineArgs.from_cli_args(cns)
                if cea.additional_config != ea.additional_config or cea.model != str(ckpt):
                    raise AssertionError(f"vllm bench {kind} ({b}): engine args differ")
            log(f"vllm bench latency|throughput args ({b}): parsed, the servers' engine")
        except (SystemExit, Exception) as exc:
            ok = False
            log(f"serve or vllm bench args ({b}) REFUSED: {exc!r}")
    return ok


def check_delivery_stats(ckpt: Path) -> bool:
    """``delivery_stats`` reads the lines the runner hooks write (their own format, from
    hooks on the tiny checkpoint's tables, a host plan), and adds up fills per layer."""
    from ple_memops.vllm.hooks import build_hooks
    from ple_memops.vllm.tables import checkpoint_tensor_names, find_layer_table, open_layer_table

    names = checkpoint_tensor_names(ckpt)
    layers = sorted({int(m.group(1)) for n in names
                     if (m := re.search(r"layers\.(\d+)\.ple\.ple_embedding", n))})  # fmt: skip
    tables = {
        f"model.layers.{i}.ple.ple_embedding.ngram_embedding": open_layer_table(
            ckpt, find_layer_table(names, i)
        )
        for i in layers
    }
    hooks = build_hooks(tables, rows_per_token=16, max_rows=64, device="cpu", stats_every=1.0)
    try:
        real = [hooks.log_stats(force=True) for _ in range(3)]
    finally:
        hooks.shutdown()
        for t in tables.values():
            t.close()
    gpu_like = (
        "ple-memops stats, last 2.0 s: 400 deferred steps (390 replays, 10 eager), 0 "
        "synchronous replays; per layer, fills, mean READY -> FILLED (of replays', of eager "
        "steps'), rows read cold and completes that waited: layers.0 400 fills, 30.0 us (390 "
        "replays 10.0 us, 10 eager 810.0 us), 10.0% rows cold; layers.6 400 fills, 20.0 us "
        "(400 replays 20.0 us, 0 eager), 0.0% rows cold, 4 completes waited 40.0 us"
    )
    got = delivery_stats("\n".join(["INFO x " + str(x) for x in real]))
    # The first line is dropped: 60, 30, 60 us over 400 fills each.
    two = delivery_stats("\n".join([gpu_like, gpu_like.replace("30.0 us (", "60.0 us (")] * 2))
    good = (
        got.get("ple_steps") == 0 and got.get("fill_us") == {} and got.get("cold_pct") == {}
        and two == {"ple_steps": 1200, "ple_replays": 1170, "ple_eager": 30,
                    "ple_sync_replays": 0, "fill_us": {"layers.0": 50.0, "layers.6": 20.0},
                    "cold_pct": {"layers.0": 10.0, "layers.6": 0.0},
                    "replay_fill_us": {"layers.0": 10.0, "layers.6": 20.0},
                    "eager_fill_us": {"layers.0": 810.0},
                    "late_completes": {"layers.6": 12}, "late_complete_us": {"layers.6": 40.0}}
    )  # fmt: skip
    costs = (
        "; host us per engine step over 400: total p50 41.2 p99 95.0, step p50 6.1 p99 9.0, "
        "arm p50 20.3 p99 40.2, wait p50 0.4 p99 30.1, check p50 3.0 p99 5.2, stats p50 0.2 "
        "p99 0.5; graph launch p50 12.0 p99 20.1; GPU stall per step: layers.0 400 steps, 40 "
        "stalled; us p50 0.0 p90 2.1 p99 61.0 max 90.2 mean 1.20; layers.6 400 steps, 0 "
        "stalled; us p50 0.0 p90 0.0 p99 0.0 max 0.5 mean 0.01"
    )
    three = delivery_stats("\n".join([gpu_like + costs] * 3))
    good &= three.get("host_us", {}).get("launch") == 12.0
    good &= three.get("host_us", {}).get("arm") == 20.3 and three.get("stall", {}).get(
        "layers.0", {}
    ) == {"steps": 800, "stalled_pct": 10.0, "p50_us": 0.0, "p99_us": 61.0, "max_us": 90.2,
          "mean_us": 1.2}  # fmt: skip
    log(f"stats lines: {'parsed' if good else 'NOT parsed'} ({real[0]!r} -> {got}; {two}; {three})")
    return good


if __name__ == "__main__":
    sys.exit(main())
