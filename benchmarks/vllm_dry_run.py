"""``bench_vllm.py --dry-run``: the CPU side of the benchmark checked without a GPU. The
checkpoint writer against transformers' ``save_pretrained`` and vLLM's CPU loader at a tiny
size, the tokenizer, the Gemma checkpoints (``check_gemma``), every backend's ``vllm
serve`` and ``vllm bench`` command lines through vLLM's own parsers
(``check_serve_args``), the stats-line parser on lines the runner hooks write
(``check_delivery_stats``), a stuck server given up (``check_stuck_server``), and the
measurement loop, the profile phase and the report against fake streaming servers
(``_Fake``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import vllm_bench_model as vbm
import vllm_clock
from vllm_clock import log
from vllm_probes import evict, page_cache
from vllm_report import delivery_stats, graph_stats, report, summarize, verdict
from vllm_servers import (
    MMAP_VARIANTS,
    STOCK_VARIANTS,
    Server,
    cli_argv,
    cpu_offload,
    describe,
    engine_env,
    ensure_gemma_checkpoint,
    family,
    free_port,
    known_backends,
    model_config,
    profile_dir,
    serve_argv,
    stop_servers,
    table_files,
    vllm_release,
    wait_healthy,
)

# A measurement phase of ``bench_vllm`` (``measure``, ``profile``): passed in, since
# ``bench_vllm`` imports this module.
Phase = Callable[..., Coroutine[Any, Any, Any]]


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
                    if i == 3 and outer.stream_fault == "cut":
                        return  # the connection closes: no usage, no [DONE]
                    if i == 3 and outer.stream_fault == "error":
                        err = {"error": {"message": "EngineCore died", "code": 500}}
                        self.wfile.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
                        return
                    chunk = {"choices": [{"text": f" w{i}", "index": 0}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

        self.fail = fail
        self.step_s = step_s
        self.trace_dir: Path | None = None
        self.stall_us = 0.0  # the traces' norm kernel this much later (a stall before it)
        # "cut": streams end after 3 tokens without [DONE]; "error": an error event there,
        # as vLLM reports a failure inside a stream.
        self.stream_fault = ""
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
            norm_at = 40.0 + step / 2 + self.stall_us
            for name, at, dur in (("cudaGraphLaunch", 0.0, 20.0), ("gemm", 30.0, step / 2),
                                  ("norm", norm_at, 10.0)):  # fmt: skip
                cat = "cuda_runtime" if name.startswith("cuda") else "kernel"
                ev.append({"ph": "X", "cat": cat, "name": name, "ts": t + at, "dur": dur,
                           "args": {"correlation": i}})  # fmt: skip
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        out = self.trace_dir / f"fake.{time.time_ns()}.pt.trace.json"
        out.write_text(json.dumps({"traceEvents": ev}))


def dry_run(args: argparse.Namespace, measure: Phase, profile: Phase) -> int:
    """The CPU side, here: checkpoint writer (tiny) against save_pretrained and vLLM's CPU
    loader, the tokenizer, the serve command lines, the loop and report on fake servers
    (``measure`` and ``profile``: bench_vllm's phases)."""
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
        if dtype == "bf16":  # the profiler's and graph timing's settings, once
            args.profile_steps, args.time_graphs = 8, True
            ok &= check_serve_args(args, ckpt)
            args.profile_steps, args.time_graphs = 0, False
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
    vllm_clock.DEADLINE = time.monotonic() + 20
    rows: list[dict[str, Any]] = []
    asyncio.run(measure(args, servers, tables, 512, rows))
    # The profile phase: every server profiled in turn (the failing one refuses).
    args.profile_steps = 4
    for b, f in fakes.items():
        f.trace_dir = profile_dir(args, b)
    vllm_clock.DEADLINE = time.monotonic() + 60
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
    print(verdict(fake_rows, summarize(fake_rows, args.backends), args.ref))
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
    if model.startswith("gemma3n") and importlib.util.find_spec("timm") is None:
        # transformers builds Gemma 3n's vision tower through timm (scripts/gpu/
        # gemma3n_wheels.sh brings it to the GPU host).
        log(f"timm is not installed here: the {model} checkpoint checks are skipped "
            "(pip install timm)")  # fmt: skip
        return True
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
    release = vllm_release()
    for b in known_backends(fam):
        if b == "disk" and release < (0, 34):
            continue  # vLLM 0.34.0's disk offload: no engram_config.disk_offload before it
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
            if ours.diag_early_join != (b == "mmap-early"):
                raise AssertionError(f"{b}: diag_early_join {ours.diag_early_join}")
            variant = MMAP_VARIANTS.get(b, {})
            timed = b in MMAP_VARIANTS and not variant.get("bare")
            if ours.time_stalls != bool(timed and variant.get("stalls", args.time_stalls)):
                raise AssertionError(f"{b}: time_stalls {ours.time_stalls}")
            logged = (b in MMAP_VARIANTS and bool(args.stats_every) and not variant.get("bare")
                      and variant.get("stats", True))  # fmt: skip
            # gpu-plugin logs its graph times at the stats interval with --time-graphs.
            stock_plugin = bool(STOCK_VARIANTS.get(b, {}).get("plugin"))
            if (ours.stats_every is not None) != (logged or (stock_plugin and args.time_graphs)):
                raise AssertionError(f"{b}: stats_every {ours.stats_every}")
            plugin = b in MMAP_VARIANTS or stock_plugin
            if ours.time_graphs != bool(plugin and args.time_graphs and not variant.get("bare")):
                raise AssertionError(f"{b}: time_graphs {ours.time_graphs}")
            if ours.predict_ready != (b == "mmap-predict"):
                raise AssertionError(f"{b}: predict_ready {ours.predict_ready}")
            if ours.split_rows != (b != "mmap-whole"):
                raise AssertionError(f"{b}: split_rows {ours.split_rows}")
            if ours.read_in_order != (b != "mmap-unordered"):
                raise AssertionError(f"{b}: read_in_order {ours.read_in_order}")
            if ours.first_layer_threads != variant.get("first_layer_threads"):
                raise AssertionError(f"{b}: first_layer_threads {ours.first_layer_threads}")
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
            elif offload != cpu_offload(b) or ea.cpu_offload_gb:
                raise AssertionError(f"{b}: engram {engram}, offload {ea.cpu_offload_gb} GB")
            if ea.async_scheduling != (not args.sync_scheduling):
                raise AssertionError(f"{b}: async scheduling {ea.async_scheduling}")
            if ea.tensor_parallel_size != args.tensor_parallel_size:
                raise AssertionError(f"{b}: tensor parallel size {ea.tensor_parallel_size}")
            if ea.data_parallel_size != args.data_parallel_size:
                raise AssertionError(f"{b}: data parallel size {ea.data_parallel_size}")
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
        "p99 0.5; graph launch p50 12.0 p99 20.1, results wait p50 9.0 p99 30.0; GPU stall per "
        "step: layers.0 400 steps, 40 stalled; us p50 0.0 p90 2.1 p99 61.0 max 90.2 mean 1.20; "
        "layers.6 400 steps, 0 stalled; us p50 0.0 p90 0.0 p99 0.0 max 0.5 mean 0.01"
    )
    three = delivery_stats("\n".join([gpu_like + costs] * 3))
    good &= three.get("host_us", {}).get("launch") == 12.0
    good &= three.get("host_us", {}).get("results_p99") == 30.0
    good &= three.get("host_us", {}).get("arm") == 20.3 and three.get("stall", {}).get(
        "layers.0", {}
    ) == {"steps": 800, "stalled_pct": 10.0, "p50_us": 0.0, "p99_us": 61.0, "max_us": 90.2,
          "mean_us": 1.2}  # fmt: skip
    log(f"stats lines: {'parsed' if good else 'NOT parsed'} ({real[0]!r} -> {got}; {two}; {three})")
    return good & check_graph_lines()


class _StampedEvent:
    """A timing event of a fake stream: stamped at the stream's clock, always finished."""

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.at = clock, 0.0

    def record(self, stream: object = None) -> None:
        self.at = self.clock[0]

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _StampedEvent) -> float:
        return (end.at - self.at) / 1e3


def check_graph_lines() -> bool:
    """``graph_stats`` reads the ``ple-memops graphs`` lines the plugin's graph manager
    writes (``GraphTimesLog``, over a fake stream: graphs of 100 then 300 us, 20 us
    apart, of batch sizes 1 and 2, a step's results waited for once a line), the first
    line of a load dropped."""
    from ple_memops.step_costs import GraphClock
    from ple_memops.vllm.runner import GraphTimesLog

    now = [0.0]
    timer = GraphTimesLog(3600.0, GraphClock(event=lambda: _StampedEvent(now)))
    lines = []
    for span in (100.0, 100.0, 300.0, 300.0):
        for _ in range(4):

            def graph(span: float = span) -> None:
                now[0] += span

            timer.around(graph, key=1 if span < 200 else 2)  # the graph's batch size
            now[0] += 20.0
        timer.clock.results(lambda: None)()  # the engine's wait for a step's results
        lines.append(timer.log())
    got = graph_stats("\n".join(f"INFO x {ln}" for ln in lines))
    g = got.get("graphs", {})
    # Lines 2-4: spans 100, 300, 300 (4 launches each); outside 20 us throughout.
    good = (
        g.get("launches") == 12
        and abs(g.get("span_p50_us", 0) - 700 / 3) < 1e-6
        and abs(g.get("outside_p50_us", 0) - 20.0) < 1e-6
        and g.get("by_size") == {1: [4, 100.0], 2: [8, 300.0]}
        and g.get("launch_host_p50_us") is not None
        and g.get("results_p99_us") is not None
    )
    log(f"graph lines: {'parsed' if good else 'NOT parsed'} ({lines[1]!r} -> {got})")
    return good
