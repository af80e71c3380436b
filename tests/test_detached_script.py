"""scripts/gpu/detached.sh on this machine: a command started detached outlives the
process group that started it (what a device call's end kills), and `collect` hands back
its outputs, its log and its exit status, or says it is still running."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "detached.sh"


def _run(root: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PLE_DETACHED_ROOT": str(root), "OUT": str(out)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_detached_command_outlives_its_callers_group_and_is_collected(
    tmp_path: Path,
) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    env = os.environ | {"PLE_DETACHED_ROOT": str(root), "OUT": str(out)}
    command = 'sleep 1; echo "rows ok" > "$OUT/result.txt"; echo logged; exit 7'
    # As a device call runs it: in a process group of its own, killed when it returns.
    starter = subprocess.Popen(
        ["bash", str(SCRIPT), "start", "job", "bash", "-c", command],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    said, _ = starter.communicate(timeout=30)
    assert starter.returncode == 0 and "job started" in said, said
    with pytest.raises(ProcessLookupError):  # the group is gone, or this kills it
        os.killpg(starter.pid, signal.SIGKILL)
        time.sleep(0.2)
        os.killpg(starter.pid, signal.SIGKILL)

    early = _run(root, out, "collect", "job", "0")
    assert early.returncode == 3, early.stdout + early.stderr
    done = _run(root, out, "collect", "job", "30")
    assert done.returncode == 7, done.stdout + done.stderr
    assert (out / "result.txt").read_text() == "rows ok\n"
    assert (out / "job.log").read_text() == "logged\n"
    assert "job ended, exit 7" in done.stdout
    assert _run(root, out, "status", "job").stdout.strip() == "job: ended, exit 7"


def test_refusals(tmp_path: Path) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    assert _run(root, out, "collect", "never").returncode == 2
    assert _run(root, out, "status", "never").returncode == 2
    assert _run(root, out, "start", "../x", "true").returncode == 2
    assert _run(root, out, "start", "nothing").returncode == 2
    assert _run(root, out, "frobnicate", "x").returncode == 2
    first = _run(root, out, "start", "busy", "sleep", "5")
    assert first.returncode == 0, first.stderr
    again = _run(root, out, "start", "busy", "true")
    assert again.returncode == 2 and "already running" in again.stderr
    assert _run(root, out, "status", "busy").returncode == 3
    assert _run(root, out, "collect", "busy", "20").returncode == 0
