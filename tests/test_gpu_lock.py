"""scripts/gpu/gpu_lock.sh on this machine: two GPU scripts started together run one after
the other (vLLM's start-up memory profiling fails beside another engine), a script
started by one holding the lock goes on at once, and a waiter that runs out of time
exits 3 without running its body."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

LOCK_SH = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "gpu_lock.sh"

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="no flock here")


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(
        "set -uo pipefail\n"
        f'. "{LOCK_SH}" && gpu_lock {name}\n'
        f"echo start $(date +%s.%N) >> {tmp_path}/events\n"
        f"{body}\n"
        f"echo end $(date +%s.%N) >> {tmp_path}/events\n"
    )
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PLE_GPU_LOCK_HELD"}
    return env | {"PLE_GPU_LOCK": str(tmp_path / "gpu.lock")} | extra


def _events(tmp_path: Path) -> list[str]:
    return [line.split()[0] for line in (tmp_path / "events").read_text().splitlines()]


def test_two_scripts_run_one_after_the_other(tmp_path: Path) -> None:
    a = _script(tmp_path, "a.sh", "sleep 1")
    b = _script(tmp_path, "b.sh", "sleep 0.2")
    first = subprocess.Popen(["bash", str(a)], env=_env(tmp_path), stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    second = subprocess.run(
        ["bash", str(b)], env=_env(tmp_path), capture_output=True, text=True, timeout=30
    )
    assert first.wait(timeout=30) == 0 and second.returncode == 0
    assert _events(tmp_path) == ["start", "end", "start", "end"]
    assert "b.sh waits for the GPU" in second.stdout
    assert "b.sh has the GPU" in second.stdout


def test_a_script_started_under_the_lock_goes_on(tmp_path: Path) -> None:
    inner = _script(tmp_path, "inner.sh", "true")
    outer = _script(tmp_path, "outer.sh", f"bash {inner}")
    done = subprocess.run(
        ["bash", str(outer)], env=_env(tmp_path), capture_output=True, text=True, timeout=10
    )
    assert done.returncode == 0, done.stderr
    assert _events(tmp_path) == ["start", "start", "end", "end"]
    assert "waits" not in done.stdout


def test_a_waiter_out_of_time_exits_3_without_running(tmp_path: Path) -> None:
    holder = _script(tmp_path, "holder.sh", "sleep 3")
    waiter = _script(tmp_path, "waiter.sh", "true")
    first = subprocess.Popen(["bash", str(holder)], env=_env(tmp_path))
    time.sleep(0.3)
    late = subprocess.run(
        ["bash", str(waiter)],
        env=_env(tmp_path, PLE_GPU_LOCK_WAIT="1"),
        capture_output=True,
        text=True,
        timeout=10,
    )
    first.wait(timeout=30)
    assert late.returncode == 3
    assert "gave up waiting" in late.stderr
    assert _events(tmp_path) == ["start", "end"]
