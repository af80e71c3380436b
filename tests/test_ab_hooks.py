"""ab_hooks.py: the pairing and its sign test on known numbers, and a tiny run end to end
(the installed package against itself, alternated)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ab_hooks

SCRIPT = Path(ab_hooks.__file__)

TABLE = """host us per engine step, p50 / p99 over 60 steps

| tables | repeat | all in | total | step |
|---|---|---|---|---|
| 1 | 1 | 31.4 / 77.0 | 20.8 / 50.1 | 5.8 / 9.9 |
| 4 | 1 | 35.6 / 80.2 | 22.7 / 51.0 | 5.2 / 9.0 |
"""


def test_the_table_is_read_by_column() -> None:
    assert ab_hooks.parse_table(TABLE, "all in") == {1: 31.4, 4: 35.6}
    assert ab_hooks.parse_table(TABLE, "step") == {1: 5.8, 4: 5.2}
    with pytest.raises(ValueError, match="no column 'arm'"):
        ab_hooks.parse_table(TABLE, "arm")
    with pytest.raises(ValueError, match="no table"):
        ab_hooks.parse_table("nothing", "all in")


def test_the_sign_test_resolves_only_pairs_that_move_one_way() -> None:
    faster = ab_hooks.Paired(
        (34.0, 35.9, 33.7, 34.5, 32.0, 32.7), (30.8, 31.8, 31.8, 31.4, 30.4, 31.4)
    )
    assert faster.sign_p == pytest.approx(2 / 64)
    assert "resolved (sign test p = 0.0312)" in faster.summary()
    assert "B - A median -2.5 us [-4.1, -1.3] over 6 pairs" in faster.summary()
    assert "A 32.0-35.9 (its spread 3.9)" in faster.summary()
    mixed = ab_hooks.Paired((33.0, 32.3, 33.5), (32.2, 30.3, 33.7))
    assert mixed.sign_p == 1.0 and mixed.summary().endswith("not resolved")
    tie = ab_hooks.Paired((30.0, 31.0), (30.0, 30.0))
    assert tie.sign_p == 1.0
    # One pair of 12 the other way: 2 (1 + 12) / 2^12; of 8: 2 (1 + 8) / 2^8.
    a = (34.0,) * 12
    most = ab_hooks.Paired(a, (32.0,) * 11 + (34.5,))
    assert most.sign_p == pytest.approx(26 / 4096)
    assert "resolved (sign test p = 0.00635)" in most.summary()
    assert ab_hooks.Paired(a[:8], (32.0,) * 7 + (34.5,)).sign_p == pytest.approx(18 / 256)
    # A tie counts against the verdict.
    assert ab_hooks.Paired(a[:6], (32.0,) * 5 + (34.0,)).sign_p == pytest.approx(14 / 64)
    # Too few pairs cannot resolve anything, however one-sided.
    assert ab_hooks.Paired((30.0, 31.0), (20.0, 21.0)).summary().endswith("not resolved")


def test_a_tiny_run_alternates_and_pairs(tmp_path: Path) -> None:
    empty = str(tmp_path)  # nothing there: the installed package, on both sides
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--a", empty, "--b", empty, "--rounds", "2", "--",
         "--steps", "30", "--tables", "1", "--gap-us", "0", "--between", "sleep"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = [line.split("|")[1:4] for line in out.splitlines() if line[:3] in ("| 1", "| 2")]
    assert [[c.strip() for c in r] for r in rows] == [["1", "AB", "1"], ["2", "BA", "1"]]
    assert "1 table(s): B - A median" in out and "over 2 pairs" in out
