"""bench_read_order.py end to end at a tiny size (no GPU): every step's rows are checked
against the table's contents (a wrong row ends the run), each server gets its steps, and
only the ordered servers' later tables wait."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_read_order.py"


def test_bench_read_order_times_each_server_with_checked_rows(tmp_path: Path) -> None:
    args = ["--tables", "3", "--table-gib", "0.01", "--rows", "8", "300", "--seg-us", "100"]
    args += ["--steps", "3", "--repeats", "1", "--dir", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    ]
    assert [(r[0], r[2]) for r in rows] == [
        (n, v) for n in ("8", "300") for v in ("unordered", "ordered", "ordered-b")
    ], out
    waits = {(r[0], r[2]): int(r[6].split("/")[0]) for r in rows}
    # Unordered never waits; ordered tables after the first may (their earlier tables
    # read 8 rows), at most once a step (2 later tables x 3 steps).
    assert waits[("8", "unordered")] == waits[("300", "unordered")] == 0, out
    assert 0 <= waits[("8", "ordered")] <= 6, out
    assert "ordered vs unordered" in out and "A/A" in out, out
