"""``scripts/gpu/disk_offload.sh`` with ``bench_vllm.py``'s wrapper and the storage floor
stubbed: which runs each part asks for, in which order, with which servers and loads."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUB_BENCH = """#!/usr/bin/env bash
# records each call: its tag, deadline, arguments, and whether the checkpoints are there
ckpt=$(echo "$BENCH_ARGS" | sed -n 's/.*--ckpt-root \\([^ ]*\\).*/\\1/p')
have=no; [ -e "$ckpt/marker" ] && have=yes
echo "bench $TAG $DEADLINE ckpt=$have :: $BENCH_ARGS" >> "$CALLS"
mkdir -p "$ckpt" && touch "$ckpt/marker"
"""


def _tree(tmp: Path) -> Path:
    (tmp / "scripts/gpu").mkdir(parents=True)
    (tmp / "benchmarks").mkdir()
    shutil.copy(ROOT / "scripts/gpu/disk_offload.sh", tmp / "scripts/gpu/disk_offload.sh")
    (tmp / "scripts/gpu/vllm_bench.sh").write_text(STUB_BENCH)
    (tmp / "benchmarks/bench_cold.py").write_text(  # it finds the wheel installed for the run
        "import os\nassert '/tmp/site' in os.environ['PYTHONPATH'].split(':')\n"
        "open(os.environ['CALLS'], 'a').write('floor\\n')\n"
    )
    return tmp


def _run(tmp: Path, part: str, **env: str) -> list[str]:
    calls = tmp / "calls.txt"
    full = dict(os.environ, PART=part, CALLS=str(calls), OUT=str(tmp / "out"),
                BENCH_CKPT_ROOT=str(tmp / "ckpt"), **env)  # fmt: skip
    r = subprocess.run(["bash", "scripts/gpu/disk_offload.sh"], cwd=tmp, env=full,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    # One space between words: the script's arguments wrap lines inside their quotes.
    return [" ".join(c.split()) for c in calls.read_text().splitlines()]


def test_beyond_ram_runs_the_floor_the_shares_then_the_servers_on_fresh_checkpoints(
    tmp_path: Path,
) -> None:
    calls = _run(_tree(tmp_path), "beyond-ram")
    assert calls[0] == "floor"
    shares = [c for c in calls if c.startswith("bench disk_res")]
    assert [c.split()[1] for c in shares] == ["disk_res10", "disk_res00", "disk_res05",
                                               "disk_res01"]  # fmt: skip
    assert "--backends gpu-plugin,disk,mmap" in shares[0]
    assert all("--backends disk,mmap --ref disk" in c for c in shares[1:])
    assert all("--concurrency 1,64" in c and "--repeats 1" in c for c in shares)
    assert all("--residency" in c and "--table-gib 24" in c for c in shares)
    servers = [c for c in calls if c.startswith("bench servers_")]
    assert [c.split()[1] for c in servers] == ["servers_mmap_1", "servers_mmap_4",
                                                "servers_uva_1", "servers_uva_4"]  # fmt: skip
    assert "--backends mmap,mmap.2,mmap.3,mmap.4 --ref mmap" in servers[1]
    assert all("--layers 8 --experts 16" in c for c in servers)
    # The residency checkpoints were removed before the servers' first run.
    assert "ckpt=no" in servers[0] and "ckpt=yes" in shares[-1]
    assert calls.index(servers[0]) > calls.index(shares[-1])


def test_the_residency_part_takes_its_floor_last_by_default_and_its_shares_as_given(
    tmp_path: Path,
) -> None:
    calls = _run(_tree(tmp_path), "residency", SHARES="0.5", CONC="64")
    assert calls[-1] == "floor" and len(calls) == 2
    assert "disk_res05" in calls[0] and "--concurrency 64" in calls[0]
    assert "--load-timeout 150" in calls[0]  # a cold load's slow backend finishes its requests
    calls = _run(_tree(tmp_path / "t"), "residency", SHARES="0.0", FLOOR="0", LOAD_TIMEOUT="240")
    assert "--load-timeout 240" in calls[0]
    assert _run(_tree(tmp_path / "b"), "residency", SHARES="0.0", FLOOR="0")[-1] != "floor"


def test_the_residency_part_leaves_the_gpu_table_out_when_asked(tmp_path: Path) -> None:
    calls = _run(_tree(tmp_path), "residency", SHARES="1.0 0.0", FLOOR="0", GPU_REF="0")
    assert [c.split()[1] for c in calls] == ["disk_res10", "disk_res00"]
    assert all("--backends disk,mmap --ref disk" in c for c in calls)
    # The first share's deadline has room for a fresh host's first start.
    assert [c.split()[2] for c in calls] == ["540", "330"]


def test_the_residency_part_holds_the_four_1_gib_tables_when_asked(tmp_path: Path) -> None:
    calls = _run(_tree(tmp_path), "residency", SHARES="0.5", FLOOR="0", TABLES="4x1")
    assert calls[0].split()[1] == "disk_res4x1_05"
    assert "--ple-layers 4 --table-gib 4" in calls[0] and "--table-gib 24" not in calls[0]
    r = subprocess.run(["bash", "scripts/gpu/disk_offload.sh"], cwd=tmp_path,
                       env=dict(os.environ, PART="residency", TABLES="8", OUT=str(tmp_path / "o")),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "unknown TABLES=8" in r.stdout + r.stderr


def test_an_unknown_part_is_refused(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    r = subprocess.run(["bash", "scripts/gpu/disk_offload.sh"], cwd=tree,
                       env=dict(os.environ, PART="nope", OUT=str(tmp_path / "o")),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "unknown PART=nope" in r.stdout + r.stderr


def test_the_residency_part_takes_its_servers_as_given(tmp_path: Path) -> None:
    """``RES_BACKENDS`` names the servers at every share (an A/A pair of mmap servers here),
    the GPU table added at 1.0 unless ``GPU_REF=0``, the first server the reference."""
    calls = _run(_tree(tmp_path), "residency", SHARES="1.0 0.1", FLOOR="0",
                 RES_BACKENDS="disk,mmap,mmap.2")  # fmt: skip
    assert "--backends gpu-plugin,disk,mmap,mmap.2 --ref gpu-plugin" in calls[0]
    assert "--backends disk,mmap,mmap.2 --ref disk" in calls[1]


def test_the_dp_part_runs_one_rank_then_several_per_backend(tmp_path: Path) -> None:
    """``PART=dp``: per backend a server of one rank, then one of ``DP`` data-parallel
    ranks, on the servers part's small model."""
    calls = _run(_tree(tmp_path), "dp", DP="2")
    assert [c.split()[1] for c in calls] == ["dp_mmap_1", "dp_mmap_2", "dp_uva_1", "dp_uva_2"]
    assert "--backends mmap --ref mmap --data-parallel-size 2" in calls[1]
    assert "--data-parallel-size 1" in calls[2] and "--layers 8 --experts 16" in calls[3]
