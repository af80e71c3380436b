"""GPU benchmark of device-produced ids.

A graph computes ids with a kernel, publishes them, runs >= 100 us of other GPU work, then
consumes the rows the native worker gathered. Measured, side by side in one run:

(a) the GPU-side stall at the WAIT: GPU time of that graph minus the same graph without
    the publish whose rows the host filled before launch (so the difference includes the
    small publish kernel); target 0 us median (the host wins the race). A second worker
    with spin=0 (sleeps as soon as it waits) shows what a cold worker's wake-up costs;
(b) the worker's latency from seeing READY to its FILLED store, for 16 and 1024 rows of
    160 B; targets <= 10 us and <= 60 us median;
(c) for reference, the approach this replaces: a blocking device-to-host copy of the ids,
    a host gather, then the launch (vLLM PR #54129 with asynchronous scheduling).

    python benchmarks/bench_worker.py [--iters 1000] [--json out.json]
        [--table-rows 1048576 --width 160]   # 4194304 x 256: one of the vLLM bench's 1 GiB tables
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


def make_table(tmp: Path, table_rows: int, width: int) -> pm.MmapTable:
    words = np.random.default_rng(0).integers(0, 1 << 63, table_rows * width // 8, np.uint64)
    data = words.view(np.uint8).reshape(table_rows, width)
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
    """Bump a counter, compute ``n`` ids from it, publish them (unless ``worker`` is None:
    the prefilled baseline), run ``cycles`` of GPU work, consume the rows."""

    def __init__(
        self,
        rows: pm.DeferredRows,
        worker: pm.GatherWorker | None,
        n: int,
        cycles: int,
        table_rows: int,
    ) -> None:
        self.counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.lanes = torch.arange(n, dtype=torch.int64, device="cuda")
        self.ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        self.out = torch.zeros_like(rows.staging)

        def body() -> None:
            self.counter.add_(1)
            self.ids.copy_((self.counter * 7919 + self.lanes * 104729) % table_rows)
            if worker is not None:
                worker.publish(self.ids)
            torch.cuda._sleep(cycles)  # the layers before the first consumer
            rows.enqueue(rows=n)
            self.out.copy_(rows.staging)

        if worker is not None:
            worker.begin(n)
            body()
            worker.complete(timeout=10.0)
        else:
            rows.begin(n)
            rows.prepare_dummy()
            body()
            rows.complete()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body()


def bench(table: pm.MmapTable, n: int, iters: int, cycles: int) -> dict[str, list[float]]:
    # Two live workers: the default (hot for 2 ms after each step) and one that sleeps at
    # once (spin=0), which shows what a cold worker's late wake-up costs.
    lives = {
        name: pm.DeferredRows(n, table.row_bytes, device=0, watchdog=10.0, track_arrival=True)
        for name in ("worker", "worker spin=0")
    }
    workers = {
        "worker": pm.GatherWorker(lives["worker"], table),
        "worker spin=0": pm.GatherWorker(lives["worker spin=0"], table, spin=0.0),
    }
    graphs = {k: StepGraph(lives[k], w, n, cycles, table.rows) for k, w in workers.items()}
    # Baseline: the same graph without the publish, its rows filled by the host before
    # the launch. Two independent copies: their difference is the noise of this measurement.
    bases = {
        k: pm.DeferredRows(n, table.row_bytes, device=0, watchdog=10.0)
        for k in ("prefilled", "prefilled #2")
    }
    for k, b in bases.items():
        graphs[k] = StepGraph(b, None, n, cycles, table.rows)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host_rows = table.gather(np.arange(n))
    names = list(graphs)
    out: dict[str, list[float]] = {k: [] for k in names}
    for k in workers:
        out[f"{k} ready_to_filled"] = []
    rng = np.random.default_rng(0)
    for i in range(iters + 20):
        for which in rng.permutation(len(names)):
            k = names[which]
            if k in workers:
                workers[k].begin(n)
            else:
                bases[k].begin(n)
                bases[k].fill(host_rows)
            e0.record()
            graphs[k].graph.replay()
            e1.record()
            if k in workers:
                workers[k].complete(timeout=10.0)
            else:
                bases[k].complete()
            e1.synchronize()
            if i >= 20:
                out[k].append(e0.elapsed_time(e1) * 1e3)
                if k in workers:
                    rf = workers[k].stats().ready_to_filled_ns_last / 1e3
                    out[f"{k} ready_to_filled"].append(rf)
    for k, r in lives.items():
        out[f"{k} gpu_waited_fraction"] = [r.stats().gpu_waited / max(1, r.stats().fills)]
    for w in workers.values():
        w.close()
    return out


def blocking_d2h(table: pm.MmapTable, n: int, iters: int) -> list[float]:
    """Host wall time per step of the replaced approach: wait for the ids on the host
    (a blocking D2H copy), gather, copy to the GPU, launch."""
    ids = torch.randint(0, table.rows, (n,), device="cuda")
    staging = torch.zeros((n, table.row_bytes), dtype=torch.uint8, device="cuda")
    pinned = torch.zeros((n, table.row_bytes), dtype=torch.uint8).pin_memory()
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
    ap.add_argument("--table-rows", type=int, default=1 << 20)
    ap.add_argument("--width", type=int, default=160, help="row bytes (a multiple of 8)")
    a = ap.parse_args()
    if a.width % 8 or a.table_rows < 1024:
        ap.error("--width must be a multiple of 8 and --table-rows at least 1024")
    torch.cuda.init()
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    cycles = sleep_cycles_for(a.work_us)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        table = make_table(Path(tmp), a.table_rows, a.width)
        print(
            f"table: {a.table_rows} rows x {a.width} B ({a.table_rows * a.width / 2**20:.0f} MiB)"
        )
        for n in (16, 1024):
            results[str(n)] = bench(table, n, a.iters, cycles)
            results[f"{n}_blocking"] = blocking_d2h(table, n, a.iters)
        table.close()
    print(f"\n{a.iters} steps each; GPU work between publish and consumer ~{a.work_us:.0f} us")
    print(
        f"| rows x {a.width} B | worker | graph us | prefilled us | #2 us "
        "| **stall** (graph - prefilled) | A/A | READY seen -> FILLED med | p99 | GPU waited |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in ("16", "1024"):
        r = results[n]
        med_b = statistics.median(r["prefilled"])
        med_b2 = statistics.median(r["prefilled #2"])
        for k in ("worker", "worker spin=0"):
            med_w = statistics.median(r[k])
            rf = r[f"{k} ready_to_filled"]
            print(
                f"| {n} | {k} | {med_w:.2f} | {med_b:.2f} | {med_b2:.2f} | **{med_w - med_b:.2f}** "
                f"| {med_b2 - med_b:.2f} | {statistics.median(rf):.2f} | "
                f"{np.percentile(rf, 99):.2f} | {r[f'{k} gpu_waited_fraction'][0]:.1%} |"
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
