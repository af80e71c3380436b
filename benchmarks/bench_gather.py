"""Row gather from a page-cache-resident table: ple_memops.MmapTable against numpy fancy
indexing on an np.memmap of the same file (the vLLM PR #54129 approach) and against a
thread-pool numpy gather.

    python benchmarks/bench_gather.py [--reps 3000] [--rows 1048576]
    python benchmarks/bench_gather.py --row-bytes 15360,21504 --sizes 64,2048 --rows 65536
        # Gemma's rows: 3n E2B's 30 x 256 BF16, Gemma 4 E4B's 42 x 256

Each cell is the median and p99 of `--reps` timed calls (time.perf_counter_ns around
the call, from Python), rotating among 16 random id sets; the destination array is
preallocated for every method that can take one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from ple_memops import MmapTable

SIZES = (16, 256, 4096)
ROW_BYTES = (160, 320)


def _timed(fn: Callable[[int], object], reps: int) -> tuple[float, float]:
    for i in range(min(200, reps)):  # warm-up
        fn(i)
    ns = np.empty(reps, np.int64)
    clock = time.perf_counter_ns
    for i in range(reps):
        t0 = clock()
        fn(i)
        ns[i] = clock() - t0
    return float(np.median(ns)) / 1e3, float(np.percentile(ns, 99)) / 1e3


def _data_offset(path: Path) -> int:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return 8 + n  # the only tensor starts the data section


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--row-bytes",
        type=_ints,
        default=ROW_BYTES,
        help="row widths, comma-separated (160: FP8 rows, the rest BF16; default 160,320)",
    )
    ap.add_argument(
        "--sizes", type=_ints, default=SIZES, help="rows a gather (default 16,256,4096)"
    )
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    pool = ThreadPoolExecutor(args.threads)

    print(
        f"rows={args.rows} reps={args.reps} cpus={os.cpu_count()} "
        f"(times in microseconds, median / p99, measured from Python)"
    )
    header = (
        f"{'row_B':>6} {'n':>6} | {'MmapTable.gather_into':>22} | {'np.memmap fancy idx':>22} | "
        f"{'threadpool np (' + str(args.threads) + ')':>22} | {'speedup vs memmap':>17}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for row_bytes in args.row_bytes:
            path = Path(tmp) / f"table{row_bytes}.safetensors"
            # FP8 rows of 160 B (Qwen4Exp), BF16 rows of 320 B: random bytes, viewed.
            data = torch.from_numpy(rng.integers(0, 256, (args.rows, row_bytes), dtype=np.uint8))
            dtype = torch.float8_e4m3fn if row_bytes == 160 else torch.bfloat16
            save_file({"w": data.view(dtype)}, str(path))
            del data
            table = MmapTable.open(path, "w")
            table.prewarm()  # touch it once: page-cache resident
            mm: np.memmap[Any, np.dtype[np.uint8]] = np.memmap(
                path, np.uint8, "r", _data_offset(path), (args.rows, row_bytes)
            )
            for n in args.sizes:
                sets = [rng.integers(0, args.rows, n, dtype=np.int64) for _ in range(16)]
                out = np.empty((n, row_bytes), np.uint8)
                # Correctness first: the three methods agree.
                table.gather_into(sets[0], out)
                assert np.array_equal(out, mm[sets[0]])
                chunks = max(1, min(args.threads, n // 64))

                def native(i: int, out: Any = out, sets: Any = sets, t: MmapTable = table) -> None:
                    t.gather_into(sets[i % 16], out)

                def memmap(i: int, sets: Any = sets, mm: Any = mm) -> None:
                    mm[sets[i % 16]]

                def threaded(
                    i: int, out: Any = out, sets: Any = sets, mm: Any = mm, chunks: int = chunks
                ) -> None:
                    ids = sets[i % 16]
                    bounds = np.linspace(0, len(ids), chunks + 1, dtype=np.int64)

                    def part(k: int) -> None:
                        lo, hi = bounds[k], bounds[k + 1]
                        np.take(mm, ids[lo:hi], axis=0, out=out[lo:hi])

                    list(pool.map(part, range(chunks)))

                a = _timed(native, args.reps)
                b = _timed(memmap, args.reps)
                c = _timed(threaded, args.reps)
                print(
                    f"{row_bytes:>6} {n:>6} | {a[0]:>10.2f} / {a[1]:>9.2f} | "
                    f"{b[0]:>10.2f} / {b[1]:>9.2f} | {c[0]:>10.2f} / {c[1]:>9.2f} | "
                    f"{b[0] / a[0]:>16.1f}x"
                )
            del mm
            table.close()
    pool.shutdown()


if __name__ == "__main__":
    main()
