"""bench_hooks.py end to end at a tiny size (no GPU, no vLLM): every step opens the
hooks' scope, arms and replays, and checks the output, so the table has a row per table
count and repeat with every column; a bad size is refused before anything runs. (The
path through vLLM's runner classes runs in ``test_vllm_real.py``, where vLLM is.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hooks.py"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
    )


def test_bench_hooks_times_every_hook_of_each_step() -> None:
    out = _run(
        "--steps", "60", "--repeats", "2", "--tables", "1,2", "--gap-us", "0",
        "--between", "sleep", "--native-split", "--hooks", "ours-stats",
    ).stdout  # fmt: skip
    header = next(line for line in out.splitlines() if line.startswith("| tables"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "tables", "repeat", "hooks", "all in", "total", "step", "arm", "wait", "check",
        "native wait", "native arm",
    ]  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1:4] for r in rows] == [
        [" 1 ", " 1 ", " ours-stats "], [" 2 ", " 1 ", " ours-stats "],
        [" 1 ", " 2 ", " ours-stats "], [" 2 ", " 2 ", " ours-stats "],
    ]  # fmt: skip
    kinds = [c.strip() for c in header.strip("|").split("|")][3:]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")][3:]
        p50 = {k: float(c.split(" / ")[0]) for k, c in zip(kinds, cells, strict=True)}
        # Each step was timed whole, armed and checked (microseconds each); the waits and
        # the native call's own phases may round to 0.0.
        assert all(p50[k] > 0 for k in ("all in", "total", "step", "arm", "check")), row
        assert all(v >= 0 for v in p50.values()), row


def test_the_flat_floor_runs_beside_ours_in_alternating_order() -> None:
    out = _run(
        "--steps", "60", "--repeats", "2", "--tables", "2", "--gap-us", "0",
        "--between", "sleep", "--hooks", "ours,flat,ours-stats",
    ).stdout  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[1:3] for c in cells] == [
        ["1", "ours"], ["1", "flat"], ["1", "ours-stats"],
        ["2", "ours-stats"], ["2", "flat"], ["2", "ours"],
    ]  # fmt: skip
    for c in cells:
        assert float(c[3].split(" / ")[0]) > 0  # all in: each step timed whole
        if c[2] == "ours-stats":  # counted by hook, as under a stats line
            assert all(float(x.split(" / ")[0]) >= 0 for x in c[4:]) and c[4] != "-"
        else:  # served as by default (no host time counted), and the floor
            assert c[4:] == ["-"] * len(c[4:])


def test_the_hooks_own_python_alone_beside_the_floor() -> None:
    out = _run("--python-only", "--repeats", "2", "--hooks", "ours,flat").stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[:2] for c in cells] == [["1", "ours"], ["1", "flat"], ["2", "flat"], ["2", "ours"]]
    assert all(0 < float(c[2]) < 1000 for c in cells)  # us a step
    got = _run("--python-only", "--hooks", "ours-stats", check=False)
    assert got.returncode == 2 and "--python-only times ours and/or flat" in got.stderr


def test_bench_hooks_refuses_a_bad_size() -> None:
    got = _run("--tokens", "0", check=False)
    assert got.returncode == 2 and "--tokens must be >= 1" in got.stderr
    got = _run("--hooks", "ours,fast", check=False)
    assert got.returncode == 2 and "--hooks takes ours, ours-stats and/or flat" in got.stderr
    got = _run("--hooks", "flat", "--native-split", check=False)
    assert got.returncode == 2 and "not with --hooks flat" in got.stderr
