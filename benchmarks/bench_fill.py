"""The host side of a fill at an engine's geometry, without a GPU or an engine.

In the vLLM benchmark on the H200 (BENCHMARKS.md, "vLLM at a real width"), a decode
replay's fill of 1,024 rows of 256 B took ~215 us (0.2 us a row) from page-cached,
adopted tables, where ``bench_worker.py`` on the same kind of host had gathered 1,024 rows
of 160 B in ~40 us from one 320 MiB table. This separates what differs between the two:
table size (4 x 1 GiB against 320 MiB: TLB reach and page-table walks), the engine's
layout (16 safetensors shards a table), the four PLE layers' workers gathering at once,
and the pool (a 1,024-row gather of 256 B rows is exactly the 256 KiB pool threshold)
against inline copies.

Each table is written by the ``safetensors`` package as the engine's checkpoint is (a file a
table, ``--shards`` tensors), then read once so its pages are cached, and opened by
``MmapTable.open(pattern=...)`` (adopting the cached pages, as the engine does). For every
fill size and copy mode, each round times ``--gathers`` gathers of fresh random rows (a
decode step's rows are random in a table this size): first from one table alone, then
from every table at once, one Python thread a table (``gather_into`` releases the GIL, so
the native copies run in parallel, as the layers' workers do). The ``lead`` mode opens the
first table on ``--lead-threads`` gather threads of its own (the vLLM setting
``first_layer_threads``) and the others on the shared pool, all gathering at once, and
reports the first table apart. Cells are the median over
rounds of each round's median, in ns a row, with the p99 of the gathers.

    python benchmarks/bench_fill.py --tables 4 --table-gib 1 --shards 16 --rows 16,128,1024,32768
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import ple_memops as pm

NEVER = 1 << 62  # parallel_min_bytes that keeps every gather inline
THRESHOLD = 256 << 10  # the core's default parallel_min_bytes (PARALLEL_MIN_BYTES)


def write_tables(root: Path, tables: int, gib: float, shards: int, row_bytes: int) -> list[Path]:
    rows = int(gib * 2**30) // row_bytes // shards * shards
    per = rows // shards
    paths = []
    for t in range(tables):
        path = root / f"ple-layer-{t}.safetensors"
        if not path.exists():
            shard = np.empty((per, row_bytes // 2), dtype=np.float16)
            tensors = {}
            for s in range(shards):
                # Distinct content a shard (a row's bytes say where it came from).
                shard.view(np.uint16)[:] = (t * shards + s) % 65_000 + 1
                tensors[f"t{t}.shard_{s}.weight"] = shard.copy()
            save_file(tensors, str(path))
            del tensors
        with open(path, "rb") as f:  # into the page cache, as a warm server finds it
            while f.read(64 << 20):
                pass
        paths.append(path)
    return paths


def open_tables(paths: list[Path], pmb: int, lead_threads: int | None) -> list[pm.MmapTable]:
    """The tables, the first on ``lead_threads`` threads of its own (``None``: all on the
    shared pool)."""
    return [
        pm.MmapTable.open(
            path,
            pattern=f"t{t}.shard_{{}}.weight",
            parallel_min_bytes=pmb,
            gather_threads=lead_threads if t == 0 else None,
        )
        for t, path in enumerate(paths)
    ]


def timed_gathers(
    table: pm.MmapTable, n_rows: int, gathers: int, seed: int, idle_s: float = 0.0
) -> list[float]:
    """ns a row of each of ``gathers`` gathers of ``n_rows`` random rows, ``idle_s`` of
    sleep between two (untimed: the gap between an engine's steps)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, table.rows, (gathers, n_rows), dtype=np.int64)
    dst = np.empty((n_rows, table.row_bytes), dtype=np.uint8)
    out = []
    for k in range(gathers):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter_ns()
        table.gather_into(ids[k], dst)
        out.append((time.perf_counter_ns() - t0) / n_rows)
    return out


def run_cell(
    tabs: list[pm.MmapTable],
    n_rows: int,
    gathers: int,
    concurrent: bool,
    seed: int,
    idle_s: float = 0.0,
) -> list[list[float]]:
    chosen = tabs if concurrent else tabs[:1]
    results: list[list[float]] = [[] for _ in chosen]

    def work(i: int) -> None:
        results[i] = timed_gathers(chosen[i], n_rows, gathers, seed + 7919 * i, idle_s)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(chosen))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tables", type=int, default=4, help="PLE layers' tables (default 4)")
    p.add_argument("--table-gib", type=float, default=1.0, help="size of each table")
    p.add_argument("--shards", type=int, default=16, help="tensors a table (the engine's 16)")
    p.add_argument("--row-bytes", type=int, default=256, help="256: BF16 rows of 128")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 128, 1024, 32768],
                   help="rows a fill: c1, c8, c64 decode steps and a 2048-token chunk")  # fmt: skip
    p.add_argument("--gathers", type=int, default=400, help="gathers a cell a round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-us", type=float, default=0.0,
                   help="sleep between two gathers of a table, untimed (an engine's step "
                        "is milliseconds: its gather threads are idle in between, and wake "
                        "for the next fill); 0: back to back")  # fmt: skip
    p.add_argument("--dir", type=Path, default=None, help="keep the tables here (reused)")
    p.add_argument("--lead-threads", type=int, default=8,
                   help="the 'lead' mode: the first table on this many threads of its own "
                        "(the vLLM setting first_layer_threads), the others on the shared "
                        "pool, all at once; 0: no lead mode")  # fmt: skip
    args = p.parse_args(argv)
    if args.row_bytes % 2 or args.tables < 1 or args.shards < 1:
        p.error("--row-bytes must be even, --tables and --shards positive")
    root = args.dir or Path(tempfile.mkdtemp(prefix="ple-bench-fill-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        paths = write_tables(root, args.tables, args.table_gib, args.shards, args.row_bytes)
        print(
            f"{args.tables} tables x {args.table_gib:g} GiB ({args.shards} shards each, "
            f"{args.row_bytes} B rows) under {root}, cached, in {time.monotonic() - t0:.0f} s; "
            f"{os.cpu_count()} CPUs; {args.rounds} rounds x {args.gathers} gathers a cell, "
            f"{args.idle_us:g} us idle between two",
            flush=True,
        )
        modes = {"pool": THRESHOLD, "inline": NEVER}
        if args.lead_threads and args.tables > 1:
            modes["lead"] = THRESHOLD
        cells: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
        for rnd in range(args.rounds):
            for mode, pmb in modes.items():
                lead = args.lead_threads if mode == "lead" else None
                tabs = open_tables(paths, pmb, lead)
                try:
                    adopted = tabs[0].page_stats().get("pages_adopted")
                    for n in args.rows:
                        if mode != "pool" and n * args.row_bytes < THRESHOLD:
                            continue  # the pool run copied these inline already
                        gathers = max(20, args.gathers * 1024 // max(n, 1024))
                        for concurrent in (False, True) if mode != "lead" else (True,):
                            per = run_cell(
                                tabs, n, gathers, concurrent, rnd * 1000 + n, args.idle_us / 1e6
                            )
                            groups = {mode: per}
                            if mode == "lead":  # the first table apart from the others
                                groups = {"lead: first (own threads)": per[:1],
                                          "lead: others (shared pool)": per[1:]}  # fmt: skip
                            for name, group in groups.items():
                                flat = [x for r in group for x in r]
                                key = (n, name, len(per))
                                cells.setdefault(key, []).append(
                                    (statistics.median(flat), float(np.percentile(flat, 99)))
                                )
                finally:
                    for t in tabs:
                        t.close()
            print(f"round {rnd + 1} done ({time.monotonic() - t0:.0f} s; pages adopted "
                  f"a table: {adopted})", flush=True)  # fmt: skip
        print()
        print(
            "| rows a fill | copy | tables at once | ns a row, median | us a fill | p99 ns a row |"
        )
        print("|---|---|---|---|---|---|")
        for (n, mode, at_once), v in cells.items():
            med = statistics.median(x for x, _ in v)
            p99 = statistics.median(x for _, x in v)
            copy = mode if n * args.row_bytes >= THRESHOLD else "inline (under the pool threshold)"
            print(f"| {n} | {copy} | {at_once} | {med:.1f} | {med * n / 1e3:.1f} | {p99:.1f} |")
        return 0
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
