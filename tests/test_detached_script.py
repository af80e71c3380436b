"""scripts/gpu/detached.sh on this machine: a command started detached outlives the
process group that started it (what a device call's end kills), runs in a copy of the
repository (the next call rewrites the working tree; carried dot-folders come along, the
bundle, .git and dist/ do not), and `collect` hands back its outputs, its log and its exit
status, or says it is still running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "detached.sh"


def _repo(tmp_path: Path) -> Path:
    """A repository root of two files: the script, and a marker the command reads."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "gpu" / "detached.sh")
    (repo / "marker.txt").write_text("as started\n")
    return repo


def _env(tmp_path: Path) -> dict[str, str]:
    return os.environ | {"PLE_DETACHED_ROOT": str(tmp_path / "root"), "OUT": str(tmp_path / "out")}


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/gpu/detached.sh", *args],
        cwd=tmp_path / "repo",
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_detached_command_outlives_its_callers_group_and_is_collected(
    tmp_path: Path,
) -> None:
    repo, out = _repo(tmp_path), tmp_path / "out"
    command = 'sleep 1; cat marker.txt > "$OUT/result.txt"; echo logged; exit 7'
    # As a device call runs it: in a process group of its own, killed when it returns.
    starter = subprocess.Popen(
        ["bash", "scripts/gpu/detached.sh", "start", "job", "bash", "-c", command],
        cwd=repo,
        env=_env(tmp_path),
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
    (repo / "marker.txt").write_text("rewritten by the next call\n")

    early = _run(tmp_path, "collect", "job", "0")
    assert early.returncode == 3, early.stdout + early.stderr
    done = _run(tmp_path, "collect", "job", "30")
    assert done.returncode == 7, done.stdout + done.stderr
    assert (out / "result.txt").read_text() == "as started\n"
    assert (out / "job.log").read_text() == "logged\n"
    assert "job ended, exit 7" in done.stdout
    assert _run(tmp_path, "status", "job").stdout.strip() == "job: ended, exit 7"


def test_refusals(tmp_path: Path) -> None:
    _repo(tmp_path)
    assert _run(tmp_path, "collect", "never").returncode == 2
    assert _run(tmp_path, "status", "never").returncode == 2
    assert _run(tmp_path, "start", "../x", "true").returncode == 2
    assert _run(tmp_path, "start", "nothing").returncode == 2
    assert _run(tmp_path, "frobnicate", "x").returncode == 2
    elsewhere = subprocess.run(
        ["bash", str(SCRIPT), "start", "x", "true"],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert elsewhere.returncode == 2 and "repository root" in elsewhere.stderr
    first = _run(tmp_path, "start", "busy", "sleep", "5")
    assert first.returncode == 0, first.stderr
    again = _run(tmp_path, "start", "busy", "true")
    assert again.returncode == 2 and "already running" in again.stderr
    assert _run(tmp_path, "status", "busy").returncode == 3
    assert _run(tmp_path, "collect", "busy", "20").returncode == 0


def test_the_copy_keeps_carried_dot_folders_and_leaves_the_bulk_out(tmp_path: Path) -> None:
    repo, out = _repo(tmp_path), tmp_path / "out"
    for folder in (".gemma3n-wheels", ".vllm-bundle", ".git", "dist"):
        (repo / folder).mkdir()
        (repo / folder / "f").write_text(folder)
    listing = 'ls -A > "$OUT/listing.txt"'
    assert _run(tmp_path, "start", "copy", "bash", "-c", listing).returncode == 0
    assert _run(tmp_path, "collect", "copy", "30").returncode == 0
    copied = set((out / "listing.txt").read_text().split())
    assert copied == {".gemma3n-wheels", "marker.txt", "scripts"}, copied
