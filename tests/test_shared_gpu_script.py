"""``scripts/gpu/shared_gpu.sh`` with ``bench_vllm.py``'s wrapper, ``nvidia-smi`` and MPS's
control stubbed: which runs it asks for, with which model, servers and loads, and that it
starts MPS's daemon only where the image has one and stops it after."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUB_BENCH = """#!/usr/bin/env bash
echo "bench $TAG $DEADLINE mps=${CUDA_MPS_PIPE_DIRECTORY:-none} :: $BENCH_ARGS" >> "$CALLS"
"""
STUB_SMI = "#!/usr/bin/env bash\necho 'Timeslice Default'\n"
STUB_MPS = """#!/usr/bin/env bash
if [ "$#" -gt 0 ]; then echo "mps $*" >> "$CALLS"; else echo "mps stdin $(cat)" >> "$CALLS"; fi
"""


def _tree(tmp: Path, mps: bool) -> Path:
    (tmp / "scripts/gpu").mkdir(parents=True)
    shutil.copy(ROOT / "scripts/gpu/shared_gpu.sh", tmp / "scripts/gpu/shared_gpu.sh")
    (tmp / "scripts/gpu/vllm_bench.sh").write_text(STUB_BENCH)
    bin_ = tmp / "bin"
    bin_.mkdir()
    stubs = {"nvidia-smi": STUB_SMI, **({"nvidia-cuda-mps-control": STUB_MPS} if mps else {})}
    for name, text in stubs.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    # The few tools the script and the stubs use, and nothing else: a GPU image's own
    # nvidia-cuda-mps-control (in /usr/bin there) must not start a real daemon.
    for tool in ("bash", "mkdir", "head", "cat"):
        real = shutil.which(tool)
        assert real is not None
        (bin_ / tool).symlink_to(real)
    return tmp


def _run(tmp: Path, **env: str) -> tuple[int, list[str], str]:
    calls = tmp / "calls.txt"
    calls.touch()
    full = dict(os.environ, PATH=str(tmp / "bin"), CALLS=str(calls), OUT=str(tmp / "out"), **env)
    r = subprocess.run(["bash", "scripts/gpu/shared_gpu.sh"], cwd=tmp, env=full,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    return r.returncode, [" ".join(c.split()) for c in calls.read_text().splitlines()], r.stdout


def test_qwen4exp_runs_with_separate_contexts_then_under_mps(tmp_path: Path) -> None:
    rc, calls, out = _run(_tree(tmp_path, mps=True), CONC="8,64", REPEATS="2")
    assert rc == 0
    bench = [c for c in calls if c.startswith("bench")]
    assert [c.split()[1] for c in bench] == ["shared", "shared_mps"]
    assert "mps=none" in bench[0] and "mps=/tmp/ple-mps/pipe" in bench[1]
    for c in bench:
        assert "--table-gib 4" in c and "--concurrency 8,64" in c and "--repeats 2" in c
        assert "--backends gpu-plugin,mmap-kernel,mmap-memop" in c and "--time-graphs" in c
    # the daemon started before the MPS run and told to quit after it
    assert calls.index("mps -d") < calls.index(bench[1]) < calls.index("mps stdin quit")
    assert (tmp_path / "out/shared_timeslice.txt").read_text().startswith("Timeslice")
    assert "Timeslice Default" in out


def test_a_gemma_model_runs_its_own_servers_and_tags(tmp_path: Path) -> None:
    rc, calls, _ = _run(_tree(tmp_path, mps=False), MODEL="gemma3n-e2b")
    assert rc == 0 and len(calls) == 1  # no MPS control on this image: one run
    tag, c = calls[0].split()[1], calls[0]
    assert tag == "shared_gemma3n-e2b"
    assert "--model gemma3n-e2b --kv-cache-gib 4 --output-len 64" in c
    assert "--backends gpu-plugin,mmap,mmap-split,mmap-nogather" in c
    assert "--concurrency 1,8,64" in c and "--repeats 3" in c  # the defaults
    rc, calls, _ = _run(_tree(tmp_path / "s", mps=False), MODEL="gemma4-e4b",
                        SERVERS="gpu-plugin,mmap")  # fmt: skip
    assert rc == 0 and "--backends gpu-plugin,mmap" in calls[0]
    assert "shared_gemma4-e4b" in calls[0]


def test_an_unknown_model_is_refused_before_any_run(tmp_path: Path) -> None:
    rc, calls, out = _run(_tree(tmp_path, mps=True), MODEL="llama")
    assert rc == 2 and calls == [] and "unknown MODEL=llama" in out
