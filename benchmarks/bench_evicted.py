"""Gathers from a table whose pages the kernel dropped behind its back.

A table copies a row straight from its mapping once it has read the row's pages ("known
resident"). Memory pressure, or another process's eviction, can drop those pages later;
the copy then faults each one in from storage, one page at a time. This measures what a
gather costs then: the table is read whole (every page known), then held at a share of
its pages in the page cache by ``benchmarks/residency.py`` (from outside the process, as
the kernel's reclaim would), and random gathers run against it, beside a table opened
afresh under the same hold (nothing known: every row read through the cold path) and the
floor of the same gather with the file fully cached.

    python benchmarks/bench_evicted.py [--dir DIR] [--gib 1] [--shares 1.0,0.5,0.0]
        [--rows 16,256,1024] [--trials 40] [--json out.json]

prints, per share and gather size, the median and p90 gather time, rows a second, and
what the table's ``page_stats`` counted (rows read cold, copies that stopped as slow).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_cold import NAME, make_table
from residency import resident_bytes

import ple_memops as pm

HERE = Path(__file__).resolve().parent


def hold(path: Path, share: float) -> subprocess.Popen[bytes]:
    """``residency.py`` holding ``path`` at ``share`` until killed (ticks every 0.2 s)."""
    cmd = [sys.executable, str(HERE / "residency.py"), "--share", str(share), str(path),
           "--interval", "0.2", "--report-every", "3600"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def settle(path: Path, share: float, size: int, proc: subprocess.Popen[bytes]) -> float:
    """Wait until the file's resident share is within 2% of ``share`` (at most 20 s)."""
    end = time.monotonic() + 20
    got = resident_bytes(path) / size
    while time.monotonic() < end and got > share + 0.02:
        if proc.poll() is not None:
            raise SystemExit(
                f"the residency holder exited ({proc.returncode}): it may not page out "
                "this process's mapping here (needs CAP_SYS_NICE)"
            )
        time.sleep(0.2)
        got = resident_bytes(path) / size
    return got


def gathers(table: pm.MmapTable, n: int, trials: int, rng: np.random.Generator) -> dict[str, Any]:
    before = table.page_stats()
    us = []
    for _ in range(trials):
        ids = rng.integers(0, table.rows, n, dtype=np.int64)
        t0 = time.perf_counter()
        table.gather(ids)
        us.append((time.perf_counter() - t0) * 1e6)
    after = table.page_stats()
    med = float(np.median(us))
    return {
        "median_us": med,
        "p90_us": float(np.percentile(us, 90)),
        "rows_per_s": n / med * 1e6,
        "rows_cold": int(after["row_misses"] - before["row_misses"]),
        "slow_copies": int(after.get("slow_copies", 0) - before.get("slow_copies", 0)),
    }


def read_whole(table: pm.MmapTable) -> None:
    step = 1 << 16
    for lo in range(0, table.rows, step):
        table.gather(np.arange(lo, min(table.rows, lo + step), dtype=np.int64))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dir", type=Path, default=Path("/tmp/ple-evicted"), help="the table's folder")
    p.add_argument("--gib", type=float, default=1.0, help="the table's size")
    p.add_argument("--shares", default="1.0,0.5,0.0", help="resident shares held")
    p.add_argument("--rows", default="16,256,1024", help="rows a gather")
    p.add_argument("--trials", type=int, default=40, help="gathers per size and case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",") if s]
    sizes = [int(s) for s in args.rows.split(",") if s]
    path = make_table(args.dir, args.gib)
    size = path.stat().st_size
    rng = np.random.default_rng(args.seed)
    results: list[dict[str, Any]] = []
    print(f"ple_memops from {Path(pm.__file__).parent}; table {path} ({size / 2**30:.2f} GiB)")
    print("| held | rows | table | median us | p90 us | rows/s | rows read cold | slow copies |")
    print("|---|---|---|---|---|---|---|---|")
    for share in shares:
        known = pm.MmapTable.open(path, NAME)
        read_whole(known)  # every page known resident
        holder = hold(path, share)
        try:
            got = settle(path, share, size, holder)
            fresh = pm.MmapTable.open(path, NAME, adopt_resident=False)
            for n in sizes:
                for label, table in (("known, then dropped", known), ("opened afresh", fresh)):
                    r = gathers(table, n, args.trials, rng)
                    r |= {"share": share, "resident_at_start": got, "rows": n, "table": label}
                    results.append(r)
                    print(f"| {share:.0%} | {n} | {label} | {r['median_us']:,.0f} | "
                          f"{r['p90_us']:,.0f} | {r['rows_per_s']:,.0f} | {r['rows_cold']:,} | "
                          f"{r['slow_copies']:,} |")  # fmt: skip
            fresh.close()
        finally:
            holder.kill()
            holder.wait()
            known.close()
    if args.json:
        args.json.write_text(json.dumps({"table_bytes": size, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
