"""GPU benchmark of device-produced ids (issue 4).

A graph computes ids with a kernel, publishes them, runs >= 100 us of other GPU work, then
consumes the rows the native worker gathered. Measured, side by side in one run:

(a) the GPU-side stall at the WAIT: GPU time of that graph minus the same graph whose rows
    object the host filled before launch (ids still computed and published, to a worker
    that is never armed); target 0 us median (the host wins the race);
(b) the worker's latency from seeing READY to its FILLED store, for 16 and 1024 rows of
    160 B; targets <= 10 us and <= 60 us median;
(c) for reference, the approach this replaces: a blocking device-to-host copy of the ids,
    a host gather, then the launch (vLLM PR #54129 with asynchronous scheduling).

    python benchmarks/bench_worker.py [--iters 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file

import ple_memops as pm

TABLE_ROWS, WIDTH = 1 << 20, 160


def make_table(tmp: Path) -> pm.MmapTable:
    data = np.random.default_rng(0).integers(0, 256, (TABLE_ROWS, WIDTH), dtype=np.uint8)
    path = tmp / "model.safetensors"
    save_file({"ple.weight": data.view(np.float16)}, str(path))
    table = pm.MmapTable.open(path, "ple.weight")
    table.prewarm()  # page-cache resident, as a served table would be
    return table


def sleep_cycles_for(us: float) -> int:
    """Calibrate torch.cuda._sleep to about ``us`` microseconds."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 100_000
    for _ in range(3):
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        e1.synchronize()
        took = e0.elapsed_time(e1) * 1e3
        cycles = int(cycles * us / max(took, 1.0))
    return cycles


class StepGraph:
    def __init__(self, worker: pm.GatherWorker, n: int, cycles: int) -> None:
        rows = worker.rows
        self.counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.lanes = torch.arange(n, dtype=torch.int64, device="cuda")
        self.ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        self.out = torch.zeros_like(rows.staging)

        def body() -> None:
            self.counter.add_(1)
            self.ids.copy_((self.counter * 7919 + self.lanes * 104729) % TABLE_ROWS)
            worker.publish(self.ids)
            torch.cuda._sleep(cycles)  # the layers before the first consumer
            rows.enqueue(rows=n)
            self.out.copy_(rows.staging)

        worker.begin(n)
        body()
        worker.complete(timeout=10.0)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body()


def bench(table: pm.MmapTable, n: int, iters: int, cycles: int) -> dict[str, list[float]]:
    live = pm.DeferredRows(n, WIDTH, device=0, watchdog=10.0, track_arrival=True)
    w_live = pm.GatherWorker(live, table)
    g_live = StepGraph(w_live, n, cycles)
    # Baseline: the same graph, but its rows are filled by the host before the launch and
    # its worker is never armed after capture (the publish lands in a mailbox nobody reads).
    # Two independent copies: their difference is the noise of this measurement.
    bases = [pm.DeferredRows(n, WIDTH, device=0, watchdog=10.0, track_arrival=True) for _ in "ab"]
    w_bases = [pm.GatherWorker(b, table) for b in bases]
    g_bases = [StepGraph(w, n, cycles) for w in w_bases]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host_rows = table.gather(np.arange(n))
    out: dict[str, list[float]] = {
        "worker": [],
        "prefilled": [],
        "prefilled #2": [],
        "ready_to_filled": [],
    }
    rng = np.random.default_rng(0)
    for i in range(iters + 20):
        for which in rng.permutation(3):
            if which == 0:
                w_live.begin(n)
                e0.record()
                g_live.graph.replay()
                e1.record()
                w_live.complete(timeout=10.0)
                e1.synchronize()
                if i >= 20:
                    out["worker"].append(e0.elapsed_time(e1) * 1e3)
                    out["ready_to_filled"].append(w_live.stats().ready_to_filled_ns_last / 1e3)
            else:
                base, g_base = bases[which - 1], g_bases[which - 1]
                base.begin(n)
                base.fill(host_rows)
                e0.record()
                g_base.graph.replay()
                e1.record()
                base.complete()
                e1.synchronize()
                if i >= 20:
                    out["prefilled" if which == 1 else "prefilled #2"].append(
                        e0.elapsed_time(e1) * 1e3
                    )
    out["gpu_waited_fraction"] = [live.stats().gpu_waited / max(1, live.stats().fills)]
    out["gpu_waited_fraction_prefilled"] = [
        bases[0].stats().gpu_waited / max(1, bases[0].stats().fills)
    ]
    for w in (w_live, *w_bases):
        w.close()
    return out


def blocking_d2h(table: pm.MmapTable, n: int, iters: int) -> list[float]:
    """Host wall time per step of the replaced approach: wait for the ids on the host
    (a blocking D2H copy), gather, copy to the GPU, launch."""
    ids = torch.randint(0, TABLE_ROWS, (n,), device="cuda")
    staging = torch.zeros((n, WIDTH), dtype=torch.uint8, device="cuda")
    pinned = torch.zeros((n, WIDTH), dtype=torch.uint8).pin_memory()
    times = []
    for i in range(iters + 20):
        torch.cuda._sleep(1000)
        t0 = time.perf_counter_ns()
        host_ids = ids.cpu().numpy()  # drains the queue
        table.gather_into(host_ids, pinned.numpy())
        staging.copy_(pinned, non_blocking=True)
        t1 = time.perf_counter_ns()
        if i >= 20:
            times.append((t1 - t0) / 1e3)
    torch.cuda.synchronize()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--work-us", type=float, default=150.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.cuda.init()
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    cycles = sleep_cycles_for(a.work_us)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        table = make_table(Path(tmp))
        for n in (16, 1024):
            results[str(n)] = bench(table, n, a.iters, cycles)
            results[f"{n}_blocking"] = blocking_d2h(table, n, a.iters)
        table.close()
    print(f"\n{a.iters} steps each; GPU work between publish and consumer ~{a.work_us:.0f} us")
    print(
        f"{'rows x 160 B':<14}{'graph us':>10}{'prefilled us':>14}{'#2 us':>8}{'stall med':>11}"
        f"{'A/A med':>9}{'ready->filled med':>19}{'p99':>8}{'GPU waited':>12}"
    )
    for n in ("16", "1024"):
        r = results[n]
        med_w, med_b = statistics.median(r["worker"]), statistics.median(r["prefilled"])
        med_b2 = statistics.median(r["prefilled #2"])
        rf = r["ready_to_filled"]
        print(
            f"{n:<14}{med_w:>10.2f}{med_b:>14.2f}{med_b2:>8.2f}{med_w - med_b:>11.2f}"
            f"{med_b2 - med_b:>9.2f}{statistics.median(rf):>19.2f}{np.percentile(rf, 99):>8.2f}"
            f"{r['gpu_waited_fraction'][0]:>11.1%}"
        )
    print("\nreplaced approach (blocking D2H of ids + host gather + H2D), host time per step:")
    for n in ("16", "1024"):
        v = results[f"{n}_blocking"]
        med, p99 = statistics.median(v), np.percentile(v, 99)
        print(f"  {n:>5} rows: median {med:.1f} us, p99 {p99:.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
