"""``python -m ple_memops``: the demo, the benchmark and the device check.

- ``demo``: decode with a (tiny, random, built if missing) Gemma 3n through transformers,
  its PLE table served from the checkpoint, every variant this machine can run, checked
  against the stock model; a table, and a PNG (in the current directory) of the checks,
  the memory saved and per-step latency.
- ``bench``: the side-by-side benchmark (E2B shapes by default), BENCHMARKS.md tables.
- ``check``: probe the device and push deferred rows through a captured CUDA graph (or
  the synchronous fallback on a machine without one), printing what it did.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import DeferredRows, probe
from ._common import cuda_available


def _demo_gpu(device: int, steps: int, rows: int, row_bytes: int) -> int:
    import torch

    cap = probe(device)
    print(f"probe cuda:{device}: supported={cap.supported} ({cap.reason})")
    for c in cap.checks:
        print(f"  [{'ok' if c.passed else 'NO'}] {c.name}: {c.detail}")
    torch.cuda.set_device(device)
    dr = DeferredRows(rows, row_bytes, device=device)
    print(
        f"DeferredRows(max_rows={rows}, row_bytes={row_bytes}) mode={dr.mode}"
        + (f" (fallback: {dr.fallback_reason})" if dr.fallback_reason else "")
    )
    out = torch.zeros(rows * row_bytes, dtype=torch.int64, device=f"cuda:{device}")
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    # Warm-up and capture on a side stream, as torch.cuda.graph does.
    with torch.cuda.stream(stream):
        dr.begin(rows)
        dr.prepare_dummy()
        dr.enqueue()
        out.copy_(dr.staging.view(-1).to(torch.int64))
        dr.complete()
    stream.synchronize()
    dr.wait_consumed(5.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        how = dr.enqueue(rows=rows)
        out.copy_(dr.staging.view(-1).to(torch.int64) * 2)
    print(f"captured: enqueue -> {how}")
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _ in range(steps):
        host = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
        dr.begin(rows)
        if dr.deferred:
            graph.replay()  # launched first: the graph waits on the flag
            dr.fill(host)  # the host gathers after the launch
        else:
            dr.fill(host)  # fallback: fill before the launch
            graph.replay()
        dr.complete()
        got = out.cpu().numpy()
        want = host.reshape(-1).astype(np.int64) * 2
        if not np.array_equal(got, want):
            print("MISMATCH: the graph consumed different bytes than the host filled")
            return 1
        dr.wait_consumed(5.0)
    dt = time.perf_counter() - t0
    s = dr.stats()
    print(
        f"{steps} replays, bytes checked every replay: ok "
        f"({dt * 1e6 / steps:.1f} us/step incl. checks)"
    )
    print(
        f"stats: steps={s.steps} fills={s.fills} dummies={s.dummies} "
        f"fill host time (last)={s.fill_ns_last / 1e3:.2f} us"
    )
    dr.close()
    return 0


def _demo_host(steps: int, rows: int, row_bytes: int) -> int:
    cap = probe(0)
    print(f"no CUDA device usable here: {cap.reason}")
    dr = DeferredRows(rows, row_bytes, device="cpu")
    print(
        f"DeferredRows(max_rows={rows}, row_bytes={row_bytes}) mode={dr.mode} "
        f"(fallback: {dr.fallback_reason}); filling the host staging buffer synchronously"
    )
    rng = np.random.default_rng(0)
    for _ in range(steps):
        k = int(rng.integers(1, rows + 1))
        host = rng.integers(0, 256, size=(k, row_bytes), dtype=np.uint8)
        dr.begin(rows)
        dr.fill(host)
        dr.enqueue()
        dr.complete()
        staged = np.asarray(dr.staging)
        if not (np.array_equal(staged[:k], host) and not staged[k:].any()):
            print("MISMATCH in the host fallback")
            return 1
    print(f"{steps} steps, rows and zero padding checked every step: ok")
    dr.close()
    return 0


CHECK_DESCRIPTION = """\
Probe the CUDA device and print its evidence, then push deferred rows through a captured
CUDA graph, checking every step's bytes; without a usable GPU (or with --cpu) run the host
fallback's steps the same way."""


def _check(a: argparse.Namespace) -> int:
    if not a.cpu and cuda_available():
        return _demo_gpu(a.device, a.steps, a.rows, a.row_bytes)
    return _demo_host(a.steps, a.rows, a.row_bytes)


def main(argv: list[str] | None = None) -> int:
    from .demo import cli

    ap = argparse.ArgumentParser(
        prog="python -m ple_memops",
        description=cli.plain(__doc__ or ""),
        formatter_class=cli.HelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", metavar="{demo,bench,check}")
    demo = sub.add_parser(
        "demo",
        help="the main job: Gemma 3n decode, every variant, checked",
        description=cli.DEMO_DESCRIPTION,
        formatter_class=cli.HelpFormatter,
    )
    cli.add_demo_args(demo)
    bench = sub.add_parser(
        "bench",
        help="the side-by-side benchmark (BENCHMARKS.md form)",
        description=cli.BENCH_DESCRIPTION,
        formatter_class=cli.HelpFormatter,
    )
    cli.add_bench_args(bench)
    check = sub.add_parser(
        "check",
        help="probe the device and replay deferred rows in a graph",
        description=CHECK_DESCRIPTION,
        formatter_class=cli.HelpFormatter,
    )
    check.add_argument("--device", type=int, default=0, metavar="N", help="CUDA device ordinal")
    check.add_argument(
        "--steps", type=int, default=100, metavar="N", help="steps to replay, each checked"
    )
    check.add_argument(
        "--rows", type=int, default=16, metavar="N", help="rows a step delivers at most"
    )
    check.add_argument("--row-bytes", type=int, default=160, metavar="N", help="bytes of one row")
    check.add_argument("--cpu", action="store_true", help="use the host fallback even with a GPU")
    a = ap.parse_args(argv)
    if a.command == "demo":
        return cli.demo_main(a)
    if a.command == "bench":
        return cli.bench_main(a)
    if a.command == "check":
        return _check(a)
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
