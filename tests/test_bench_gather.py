"""bench_gather.py end to end at a tiny size (no GPU): the rows it times are checked
against numpy's gather of the same file first, so wide rows (a Gemma token's, past the
part of a row the gather prefetches) and the pool's split are checked through the
public API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gather.py"


def test_bench_gather_checks_and_times_the_widths_and_sizes_asked() -> None:
    # 21,504 B x 64 rows (1.3 MiB) runs on the gather pool; 160 B x 16 inline.
    args = ["--rows", "512", "--reps", "3", "--threads", "2"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--row-bytes", "160,21504", "--sizes", "16,64"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    cells = [line.split("|")[0].split() for line in out.splitlines() if "|" in line]
    assert [c for c in cells if c and c[0].isdigit()] == [
        ["160", "16"],
        ["160", "64"],
        ["21504", "16"],
        ["21504", "64"],
    ], out
