"""GPU benchmark of the core protocol, ple-memops against a pure-Python implementation of
the same protocol written with ``cuda.bindings.driver``, side by side in one run.

(a) host time of ``fill`` for 16 rows of 160 B, from the Python call to the flag store;
(b) GPU-side cost of WAIT + H2D + reset in a replayed graph (pre-signalled), as the
    difference of a graph with and without it around the same small kernel;
(c) per step size and device path (kernel / memop): the same, and a replay launched
    *before* the fill (the deferred use).

    python benchmarks/bench_deferred.py [--iters 2000] [--sizes 16,256,4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from cuda.bindings import driver as cu

import ple_memops as pm

ROWS, ROW_BYTES = 16, 160
WAIT_AND = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_AND)
WRITE_DEFAULT = int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)


def check(res: Any) -> Any:
    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class PyDeferredRows:
    """The same protocol in pure Python over cuda.bindings (the baseline)."""

    FILLED, EMPTY = 1, 0

    def __init__(self, max_rows: int, row_bytes: int, staging: torch.Tensor) -> None:
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        n = max_rows * row_bytes
        self.slot_ptr = int(check(cu.cuMemHostAlloc(n, flags)))
        self.flag_ptr = int(check(cu.cuMemHostAlloc(64, flags)))
        ctypes.memset(self.flag_ptr, 0, 64)
        self.flag_dptr = int(check(cu.cuMemHostGetDevicePointer(self.flag_ptr, 0)))
        self.slot = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(self.slot_ptr))
        self.slot = self.slot.reshape(max_rows, row_bytes)
        self.flag = ctypes.c_uint32.from_address(self.flag_ptr)
        self.staging = staging
        self.row_bytes = row_bytes
        self.extent = max_rows

    def enqueue(self, stream: int) -> None:
        s = cu.CUstream(stream)
        mask = (1 << 32) | 1
        check(cu.cuStreamWaitValue64(s, self.flag_dptr, mask, WAIT_AND))
        n = self.extent * self.row_bytes
        check(cu.cuMemcpyHtoDAsync(self.staging.data_ptr(), self.slot_ptr, n, s))
        check(cu.cuStreamWriteValue32(s, self.flag_dptr, 0, WRITE_DEFAULT))

    def fill(self, rows: np.ndarray) -> None:
        if self.flag.value != self.EMPTY:
            raise RuntimeError("slot busy")
        k = rows.shape[0]
        self.slot[:k] = rows
        self.slot[k : self.extent] = 0
        self.flag.value = self.FILLED

    def wait_consumed(self) -> None:
        while self.flag.value != self.EMPTY:
            pass


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def bench_fill(iters: int) -> dict[str, list[float]]:
    stream = torch.cuda.current_stream().cuda_stream
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8) for _ in range(64)]
    dr = pm.DeferredRows(ROWS, ROW_BYTES, device=0, watchdog=None)
    py = PyDeferredRows(
        ROWS, ROW_BYTES, torch.zeros((ROWS, ROW_BYTES), dtype=torch.uint8, device="cuda")
    )
    out: dict[str, list[float]] = {
        "ple_memops": [],
        "ple_memops (native part)": [],
        "cuda.bindings": [],
    }
    for i in range(iters + 200):
        rows = data[i % len(data)]
        dr.begin(ROWS)
        t0 = time.perf_counter_ns()
        dr.fill(rows)
        t1 = time.perf_counter_ns()
        dr.enqueue(stream)
        dr.complete()
        dr.wait_consumed(5.0)
        t2 = time.perf_counter_ns()
        py.fill(rows)
        t3 = time.perf_counter_ns()
        py.enqueue(stream)
        py.wait_consumed()
        if i >= 200:
            out["ple_memops"].append((t1 - t0) / 1e3)
            out["ple_memops (native part)"].append(dr.stats().fill_ns_last / 1e3)
            out["cuda.bindings"].append((t3 - t2) / 1e3)
    torch.cuda.synchronize()
    dr.close()
    return out


def capture(fn: Any) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _warm(dr: pm.DeferredRows, rows: int) -> None:
    dr.begin(rows)
    dr.prepare_dummy()
    dr.enqueue(rows=rows)
    dr.complete()
    torch.cuda.synchronize()
    dr.wait_consumed(5.0)


def bench_graph(iters: int, sizes: list[int]) -> dict[str, list[float]]:
    """GPU time of one replay, pre-signalled, for each version; every graph is built twice
    (its own objects and capture) and each iteration replays all of them in a fresh random
    order, so the two copies of a version show the noise. Also, per size and path, a
    replay launched *before* the fill (the deferred use)."""
    x = torch.zeros(1024, device="cuda")
    x.add_(1)
    entries: list[tuple[str, Any, int, torch.cuda.CUDAGraph]] = []
    keep: list[Any] = []
    for rep in (1, 2):
        entries.append((f"kernel only #{rep}", None, 0, capture(lambda: x.add_(1))))
        for rows in sizes:
            for path in ("kernel", "memop"):
                dr = pm.DeferredRows(rows, ROW_BYTES, device=0, watchdog=None, copy=path)
                _warm(dr, rows)
                g = capture(lambda dr=dr, rows=rows: (dr.enqueue(rows=rows), x.add_(1)))
                entries.append((f"ple_memops {path} {rows} rows #{rep}", dr, rows, g))
                keep.append(dr)
        staging = torch.zeros((ROWS, ROW_BYTES), dtype=torch.uint8, device="cuda")
        py = PyDeferredRows(ROWS, ROW_BYTES, staging)
        g = capture(lambda py=py: (py.enqueue(torch.cuda.current_stream().cuda_stream), x.add_(1)))
        entries.append((f"cuda.bindings memop {ROWS} rows #{rep}", py, ROWS, g))
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rng = np.random.default_rng(2)
    data = {r: rng.integers(0, 256, (r, ROW_BYTES), dtype=np.uint8) for r in {*sizes, ROWS}}
    out: dict[str, list[float]] = {name: [] for name, *_ in entries}
    late_keys = [e for e in entries if isinstance(e[1], pm.DeferredRows) and e[0].endswith("#1")]
    for name, *_ in late_keys:
        out[name.replace(" #1", ", fill after launch")] = []
    for i in range(iters + 50):
        for j in rng.permutation(len(entries)):
            name, obj, rows, g = entries[j]
            if isinstance(obj, pm.DeferredRows):
                obj.begin(rows)
                obj.fill(data[rows])
            elif obj is not None:
                obj.fill(data[rows])
            e0.record()
            g.replay()
            e1.record()
            if isinstance(obj, pm.DeferredRows):
                obj.complete()
            e1.synchronize()
            if i >= 50:
                out[name].append(e0.elapsed_time(e1) * 1e3)
        for j in rng.permutation(len(late_keys)):
            name, dr, rows, g = late_keys[j]
            dr.begin(rows)
            e0.record()
            g.replay()
            e1.record()
            dr.fill(data[rows])
            dr.complete()
            e1.synchronize()
            if i >= 50:
                out[name.replace(" #1", ", fill after launch")].append(e0.elapsed_time(e1) * 1e3)
    for dr in keep:
        dr.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default="16,256,4096", help="rows per step for the path sweep")
    a = ap.parse_args()
    torch.cuda.init()
    cap = pm.probe(0)
    print(
        f"device: {torch.cuda.get_device_name(0)}; probe supported={cap.supported}; "
        f"driver {cap.driver_version}; torch {torch.__version__}"
    )
    fill = bench_fill(a.iters)
    graph = bench_graph(a.iters, [int(v) for v in a.sizes.split(",")])
    print(
        f"\n(a) host time of fill(), {ROWS} rows x {ROW_BYTES} B, {a.iters} iterations"
        "  [target <= 3 us median]"
    )
    print(f"{'implementation':<28}{'median us':>10}{'p99 us':>10}{'min us':>10}")
    for k, v in fill.items():
        print(f"{k:<28}{statistics.median(v):>10.2f}{pct(v, 99):>10.2f}{min(v):>10.2f}")
    base = statistics.median(graph["kernel only #1"] + graph["kernel only #2"])
    print(
        f"\n(b) GPU time per graph replay (events), {a.iters} replays"
        "  [target: WAIT+H2D+reset <= 10 us]"
    )
    print(f"{'graph':<46}{'median us':>10}{'p99 us':>10}{'- kernel only':>15}")
    for k, v in graph.items():
        med = statistics.median(v)
        print(f"{k:<46}{med:>10.2f}{pct(v, 99):>10.2f}{med - base:>15.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"fill_us": fill, "graph_us": graph}, f)


if __name__ == "__main__":
    main()
