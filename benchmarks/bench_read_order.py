"""A step's cold reads in layer order against all at once, host side: when does each layer
get its rows, and how long does a step take whose consumers wait for them in order.

A model that publishes every PLE table's ids at the top of its forward (Qwen4Exp) has
every table's worker reach READY at once. With the tables cold, each worker then reads its
rows from storage. All at once, the storage device serves every table's reads together,
and the first table's rows (which the GPU needs first) arrive with the last table's. In
order (``Steps.build(read_in_order=True)``), each table reads after the one before it.

No GPU: ``Steps`` over host-mode rows, the ids published from the host back to back (as
the GPU's publishes come, microseconds apart), every table evicted (``drop_pages``) before
each step. The GPU's forward is stood in for by the main thread: it waits for table ``k``'s
fill (``GatherWorker.complete``), then sleeps ``--seg-us`` (the layers from table ``k``'s
consumer to the next table's), and after the last table the same again (the layers after
it). A step's time is from the first publish to the end of that. Per rows a table, the
servers run interleaved (``unordered``, ``ordered``, ``ordered-b``: the A/A), rotating
which goes first; the cells are medians over every step of each.

    python benchmarks/bench_read_order.py --tables 4 --table-gib 0.5 --rows 16 1024 \\
        --seg-us 825 2000 --steps 40 --repeats 4

``--seg-us`` pairs with ``--rows`` (one each, or one for all): a Qwen4Exp decode graph of
3.3 ms (batch 1) or 8 ms (batch 64) over four tables at decoder layers 0, 6, 12 and 18.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_cold import reads_together_us
from safetensors.numpy import save_file

import ple_memops as pm
from ple_memops.steps import Steps, StepTable

ROW_BYTES = 320  # a Qwen4Exp BF16 row
VARIANTS = ("unordered", "ordered", "ordered-b")


def write_tables(root: Path, tables: int, gib: float) -> tuple[Path, int]:
    """One safetensors file of ``tables`` tensors of ``gib`` GiB each (row ``r`` of table
    ``t`` holds ``(t * 7 + r) % 251``, so a wrong row is caught)."""
    rows = int(gib * 2**30) // ROW_BYTES
    path = root / "tables.safetensors"
    if not path.exists():
        col = np.arange(rows, dtype=np.int64)
        tensors = {}
        for t in range(tables):
            data = np.empty((rows, ROW_BYTES), dtype=np.uint8)
            data[:] = ((col + t * 7) % 251).astype(np.uint8)[:, None]
            tensors[f"t{t}"] = data.view(np.float16)
        save_file(tensors, str(path))
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    return path, rows


def make_steps(tables: list[pm.MmapTable], max_rows: int, ordered: bool) -> Steps:
    made = []
    for i, t in enumerate(tables):
        rows = pm.DeferredRows(max_rows, t.row_bytes, device="cpu", watchdog=None)
        made.append(StepTable(f"t{i}", t, rows, pm.GatherWorker(rows, t, depth=1)))
    return Steps(made, "deferred", None, None, 1, 30.0, read_in_order=ordered)


def one_step(
    steps: Steps, tables: list[pm.MmapTable], n: int, seg_s: float, rng: np.random.Generator
) -> tuple[float, list[float]]:
    """One cold step: returns its time and when each table's fill was seen done (s)."""
    for t in tables:
        t.drop_pages()
    ids = [rng.integers(0, tables[0].rows, n, dtype=np.int64) for _ in tables]
    steps.arm(n)
    t0 = time.perf_counter()
    for name, i in zip(steps.names, ids, strict=True):
        steps.publish_host(name, i)
    done = []
    for k, name in enumerate(steps.names):
        worker = steps.tables[name].worker
        assert worker is not None
        worker.complete(30.0)
        done.append(time.perf_counter() - t0)
        got = np.asarray(steps.staging(name, n))[:, 0]
        want = ((ids[k] % 251) + k * 7) % 251
        if not np.array_equal(got, want):
            raise SystemExit(f"table {name}: wrong rows")
        time.sleep(seg_s)
    return time.perf_counter() - t0, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--dir", default=None, help="where the table file goes (default: a temp dir)")
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--table-gib", type=float, default=0.5)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 1024])
    ap.add_argument("--seg-us", type=float, nargs="+", default=[825.0, 2000.0])
    ap.add_argument("--steps", type=int, default=40, help="steps of each server a repeat")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the table file")
    args = ap.parse_args()
    segs = args.seg_us if len(args.seg_us) == len(args.rows) else args.seg_us[:1] * len(args.rows)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ple-order-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        path, _ = write_tables(root, args.tables, args.table_gib)
        tables = [pm.MmapTable.open(path, f"t{i}") for i in range(args.tables)]
        print(f"{args.tables} tables of {args.table_gib} GiB, {ROW_BYTES} B rows; cold reads: "
              f"{tables[0].cold_reads}")  # fmt: skip
        rows_out: list[dict[str, Any]] = []
        for n, seg in zip(args.rows, segs, strict=True):
            fl = {k: reads_together_us(path, k) for k in sorted({n, n * args.tables})}
            made = {v: make_steps(tables, n, v != "unordered") for v in VARIANTS}
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            firsts: dict[str, list[float]] = {v: [] for v in VARIANTS}
            lasts: dict[str, list[float]] = {v: [] for v in VARIANTS}
            rng = np.random.default_rng(n)
            for r in range(args.repeats):
                order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
                for v in order:
                    for _ in range(args.steps):
                        t, done = one_step(made[v], tables, n, seg * 1e-6, rng)
                        times[v].append(t)
                        firsts[v].append(done[0])
                        lasts[v].append(done[-1])
            waits = {}
            for v, s in made.items():
                st = [w for _, w in s.stats().values() if w is not None]
                waits[v] = (
                    sum(w.ordered_waits for w in st),
                    sum(w.ordered_passed_over for w in st),
                )
                s.shutdown()
            med = {v: statistics.median(times[v]) * 1e3 for v in VARIANTS}
            rows_out.append(
                {
                    "rows": n,
                    "seg_us": seg,
                    "floor_us": fl,
                    "step_ms": med,
                    "first_ms": {v: statistics.median(firsts[v]) * 1e3 for v in VARIANTS},
                    "last_ms": {v: statistics.median(lasts[v]) * 1e3 for v in VARIANTS},
                    "waits": waits,
                    "steps": len(times["ordered"]),
                }
            )
        print()
        print("| rows a table | floor: 1 table's reads / all tables' (us) | server | "
              "step p50 (ms) | first table filled (ms) | last table filled (ms) | "
              "waits / passed over |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for row in rows_out:
            fl = list(row["floor_us"].values())
            for v in VARIANTS:
                w = row["waits"][v]
                print(
                    f"| {row['rows']} | {fl[0]:,.0f} / {fl[-1]:,.0f} | {v} | "
                    f"{row['step_ms'][v]:.2f} | {row['first_ms'][v]:.2f} | "
                    f"{row['last_ms'][v]:.2f} | {w[0]} / {w[1]} |"
                )
        print()
        for row in rows_out:
            s = row["step_ms"]
            print(
                f"rows {row['rows']} (segments of {row['seg_us']:.0f} us, {row['steps']} steps "
                f"each): ordered vs unordered {100 * (s['ordered'] / s['unordered'] - 1):+.1f}%, "
                f"ordered-b vs unordered {100 * (s['ordered-b'] / s['unordered'] - 1):+.1f}%; "
                f"A/A (ordered-b vs ordered) {100 * (s['ordered-b'] / s['ordered'] - 1):+.1f}%"
            )
        for t in tables:
            t.close()
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
