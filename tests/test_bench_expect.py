"""bench_expect.py end to end at a tiny size (no GPU): its table, and its rows checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_expect.py"


def test_bench_expect_prints_both_variants() -> None:
    args = ["--tokens", "64", "--decodes", "4", "--rounds", "2", "--table-mib", "4"]
    args += ["--decode-calls", "20", "--call-gap-us", "50", "--contend", "20"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--lead-ms", "1", "--layers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    # 2 rounds of 64 prefill tokens x 16 ids expected early, 4 decode tokens x 16 late.
    assert "early 2048, late 128, wrong 0" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| host ids, 2 tables",
        "| publish -> rows ready, published",
        "| READY -> FILLED, published",
        "| publish -> rows ready, expected",
        "| READY -> FILLED, expected",
        "| host ids of a decode step, 2 tables",
        *(
            f"| {n} decode tokens{then}"
            for n in (1, 8, 64)
            for then in (
                "",
                ", 50 us asleep before each",
                ", 50 us asleep before each, another thread 20 us of every 320",
            )
        ),
    ], out
