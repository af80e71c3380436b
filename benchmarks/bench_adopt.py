"""A table opened on a warm host: its pages are in the page cache (another process, or an
earlier run, read them), but the new table has read none of them itself. Without
adoption every first row of a page goes through a cold read (io_uring, ``MADV_WILLNEED``,
...) although the page is cached; with it (``adopt_resident=True``, the default since
this benchmark) those rows are copied straight from the mapping.

This is what a vLLM engine's first minutes of serving looked like on the H200 (a fresh
engine over a warm checkpoint: 180-350 us a 1024-row gather of 128-256 B rows, in the
engine's ``ple-memops stats``). Fresh tables, the two variants alternating round by
round, the same random ids for both; a table of ``--table-gib`` GiB written by the
safetensors package and read once before each open (cached, not mapped).

    python benchmarks/bench_adopt.py --table-gib 1 --rounds 3 --gathers 600
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import ple_memops as pm


def write_table(path: Path, gib: float, row_bytes: int) -> int:
    rows = int(gib * 2**30) // row_bytes
    chunk = np.random.default_rng(0).integers(0, 1 << 16, (rows, row_bytes // 2), dtype=np.uint16)
    save_file({"t.weight": chunk.view(np.float16)}, str(path))
    return rows


def cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def run(path: Path, adopt: bool, n: int, gathers: int, seed: int) -> dict[str, float]:
    cache(path)
    t0 = time.perf_counter()
    table = pm.MmapTable.open(path, "t.weight", adopt_resident=adopt)
    open_ms = (time.perf_counter() - t0) * 1e3
    rng = np.random.default_rng(seed)
    out = np.empty((n, table.row_bytes), dtype=np.uint8)
    us = []
    for _ in range(gathers):
        ids = rng.integers(0, table.rows, n)
        a = time.perf_counter_ns()
        table.gather_into(ids, out)
        us.append((time.perf_counter_ns() - a) / 1e3)
    st = table.page_stats()
    table.close()
    gc.collect()
    x = np.array(us)
    return {
        "open_ms": open_ms,
        "first100": float(np.median(x[:100])),
        "all": float(np.median(x)),
        "p99": float(np.percentile(x, 99)),
        "misses": st["row_misses"] / max(1, st["row_misses"] + st["row_hits"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table-gib", type=float, default=1.0)
    p.add_argument("--row-bytes", type=lambda s: [int(x) for x in s.split(",")], default=[256])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128, 1024])
    p.add_argument("--gathers", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(
        "| row B | rows a gather | adopt | open ms | first 100 gathers med us | all med us "
        "| p99 us | rows read cold |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        for rb in args.row_bytes:
            path = Path(d) / f"t{rb}.safetensors"
            write_table(path, args.table_gib, rb)
            for n in args.rows:
                res: dict[bool, list[dict[str, float]]] = {False: [], True: []}
                for r in range(args.rounds):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    for adopt in order:
                        res[adopt].append(run(path, adopt, n, args.gathers, seed=r))
                for adopt in (False, True):
                    rs = res[adopt]

                    def med(k: str, rs: list[dict[str, float]] = rs) -> float:
                        return float(np.median([x[k] for x in rs]))

                    print(
                        f"| {rb} | {n} | {'yes' if adopt else 'no'} | {med('open_ms'):.1f} "
                        f"| {med('first100'):.1f} | {med('all'):.1f} | {med('p99'):.1f} "
                        f"| {med('misses') * 100:.1f}% |",
                        flush=True,
                    )
            path.unlink()


if __name__ == "__main__":
    main()
