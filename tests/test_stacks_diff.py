"""``benchmarks/stacks_diff.py``: py-spy's collapsed stacks (``--format raw --threads``),
by thread, with inclusive shares, and two recordings compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import stacks_diff

_PROC = 'process 7:"VLLM::EngineCore"'
_ENGINE = "thread (0x7f01)"


def _write(path: Path, sync: int, work: int) -> Path:
    loop = "run_busy_loop (vllm/v1/engine/core.py:900)"
    lines = [
        f"{_PROC};{_ENGINE};{loop};step (vllm/v1/engine/core.py:300);"
        f"synchronize (torch/cuda/streams.py:10) {sync}",
        f"{_PROC};{_ENGINE};{loop};step (vllm/v1/engine/core.py:301);"
        f"execute_model (vllm/runner.py:20) {work}",
        f"{_PROC};{_ENGINE};{loop};step (vllm/v1/engine/core.py:302) 10",
        f"{_PROC};thread (0x7f02);wait (threading.py:300) {5 * (sync + work)}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_threads_and_inclusive_shares(tmp_path: Path) -> None:
    s = stacks_diff.load(_write(tmp_path / "a.txt", sync=30, work=10))
    assert set(s.threads) == {_ENGINE, "thread (0x7f02)"}
    # The busy loop's thread is picked though another thread has more samples.
    assert s.pick() == _ENGINE and s.total(_ENGINE) == 50
    sh = stacks_diff.shares(s.threads[_ENGINE])
    # Line numbers are dropped: step's three lines are one function, counted once a sample.
    assert sh["step (vllm/v1/engine/core.py)"] == pytest.approx(1.0)
    assert sh["synchronize (torch/cuda/streams.py)"] == pytest.approx(0.6)
    assert sh["execute_model (vllm/runner.py)"] == pytest.approx(0.2)
    # Without the name, the thread with the most samples.
    assert s.pick("no such frame") == "thread (0x7f02)"


def test_against_ranks_the_differences(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path / "slow.txt", sync=10, work=30)
    b = _write(tmp_path / "fast.txt", sync=30, work=10)
    assert stacks_diff.main([str(a), "--against", str(b), "--top", "2"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| `")]
    # synchronize 60% -> 20% and execute_model 20% -> 60%: both move 40 points.
    assert len(rows) == 2 and all("40.0" in r for r in rows)
    assert {r.split("`")[1] for r in rows} == {
        "synchronize (torch/cuda/streams.py)",
        "execute_model (vllm/runner.py)",
    }


def test_a_line_that_is_not_a_stack_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("no count here\n")
    with pytest.raises(ValueError, match=r"bad\.txt:1"):
        stacks_diff.load(bad)
