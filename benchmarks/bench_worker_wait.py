"""What a gather worker's wait for READY costs the host, by its ``spin`` setting.

In an engine under asynchronous scheduling the worker is armed one step ahead: it waits a
whole step (3.5-7.6 ms at decode) for the GPU to publish the step's ids. While it waits it
either stays hot (spinning, then yielding: the first ``spin`` seconds, 2 ms by default) or
naps 20 us at a time. Hot, it sees READY at once but keeps a CPU busy, on the host whose
engine thread paces a decode step; napping, it costs a wake-up per nap and sees READY up
to a nap late. This measures both sides on the machine it runs on, with the worker's own
thread and the host publish path an engine's GPU publish takes (the same mailbox, the same
READY word):

* ``CPU ms a step``: the CPU time the process's ``ple-*`` threads (the worker, the gather
  pool) used, per step, read from ``/proc`` (user + system, clock ticks);
* ``READY -> FILLED``: the worker's own stat, from the READY it saw to the rows written
  (the gather, 1 row of ``--row-bytes``);
* ``publish -> complete``: from the host publish to ``complete()`` returning, on the
  publishing thread: how late the worker saw READY, plus the gather.

Each step: ``begin()``, sleep ``--step-us`` (the GPU running the step before), publish
``--rows`` ids, ``complete()``. One worker at a time (a hot worker would spin through
another's steps), the settings' order rotated round by round, so drift of the host falls on
all alike.

Run: ``python benchmarks/bench_worker_wait.py`` (any Linux machine; no GPU needed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from proc_cpu import CLK_TCK, ours, thread_cpu
from safetensors.numpy import save_file

import ple_memops as pm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="steps a setting, over all rounds")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (settings alternate within)")
    ap.add_argument("--step-us", type=int, default=5000, help="the wait before each publish")
    ap.add_argument("--rows", type=int, default=1, help="ids a step (a decode step's tokens)")
    ap.add_argument(
        "--row-bytes", type=int, default=15360, help="bytes a row, a multiple of 4 (Gemma E2B)"
    )
    ap.add_argument(
        "--spins",
        default="default,0.000001,0.05,predict",
        help="settings to compare: spin seconds, 'default' (the core's, 2 ms) or 'predict' "
        "(the default spin placed where READY is expected: predict_ready)",
    )
    args = ap.parse_args()
    names = args.spins.split(",")
    spins = [None if s in ("default", "predict") else float(s) for s in names]
    table_rows = 4096
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        data = np.random.default_rng(0).integers(
            0, 256, (table_rows, args.row_bytes), dtype=np.uint8
        )
        save_file({"t": data.view(np.float32)}, str(path))  # rows of --row-bytes bytes
        table = pm.MmapTable.open(path, "t")
        per = args.steps // args.rounds
        lat: dict[int, list[float]] = {i: [] for i in range(len(spins))}
        ticks: dict[int, int] = dict.fromkeys(range(len(spins)), 0)
        fills: dict[int, list[float]] = {i: [] for i in range(len(spins))}
        rng = np.random.default_rng(1)
        sleep = args.step_us / 1e6
        try:
            for r in range(args.rounds):
                # One worker at a time (a hot worker would spin through another's steps),
                # the settings' order rotated round by round.
                for k in range(len(spins)):
                    i = (k + r) % len(spins)
                    rows = pm.DeferredRows(max(args.rows, 1), args.row_bytes, device="cpu")
                    predict = names[i] == "predict"
                    with pm.GatherWorker(rows, table, spin=spins[i], predict_ready=predict) as w:
                        for step in range(per + 5):  # 5 warm-up steps, untimed
                            ids = rng.integers(0, table_rows, args.rows)
                            c0 = ours(thread_cpu([os.getpid()]))
                            w.begin(args.rows)
                            time.sleep(sleep)
                            t0 = time.perf_counter_ns()
                            w.publish_from_host(ids)
                            w.complete()
                            t1 = time.perf_counter_ns()
                            if step >= 5:
                                lat[i].append((t1 - t0) / 1e3)
                                ticks[i] += ours(thread_cpu([os.getpid()])) - c0
                        s = w.stats()
                        fills[i].append(s.ready_to_filled_ns_total / max(s.fills, 1) / 1e3)
        finally:
            table.close()
        print(
            f"{per * args.rounds} steps a setting in {args.rounds} rounds, {args.step_us} us "
            f"before each publish, {args.rows} x {args.row_bytes} B rows; "
            f"{os.cpu_count()} CPUs\n"
        )
        print(
            "| spin | CPU ms a step (share of a CPU) | READY -> FILLED mean us "
            "| publish -> complete p50 / p99 us |"
        )
        print("|---|---|---|---|")
        for i, spin in enumerate(spins):
            n = len(lat[i])
            cpu_ms = ticks[i] / CLK_TCK * 1e3 / n
            share = cpu_ms / (args.step_us / 1e3 + statistics.mean(lat[i]) / 1e3)
            xs = sorted(lat[i])
            name = "default (2 ms)" if spin is None else f"{spin * 1e3:g} ms"
            if names[i] == "predict":
                name = "predict_ready (2 ms)"
            print(
                f"| {name} | {cpu_ms:.2f} ({share:.0%}) | {statistics.mean(fills[i]):.1f} "
                f"| {xs[n // 2]:.1f} / {xs[min(n - 1, n * 99 // 100)]:.1f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
