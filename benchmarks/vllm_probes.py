"""What ``bench_vllm.py`` reads of the host while the servers run: nvidia-smi's GPU
utilization, SM clock and power (``Utilization``) and memory (``gpu_memory_by_pid``,
``gpu_used_total``), a process tree (``proc_tree``), CPU use by thread (``cpu_use``,
``busy_thread_cpus``, over ``proc_cpu``'s samples), host RSS (``host_rss``), the host's
memory (``host_memory``), the table files' page cache (``resident_bytes``,
``page_cache``, ``evict``) and what the disks under them read (``disk_reads``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proc_cpu import CLK_TCK, OUR_THREADS
from residency import resident_bytes


class Utilization:
    """nvidia-smi's utilization.gpu, SM clock and power draw every 100 ms while a load runs
    (no samples without it). The clock tells a slow path from a slow host: lent H200s'
    graphs differ by ~6-12% from one host to the next, and a clock under the maximum (power
    or thermal slowdown) would slow every server of a run alike."""

    QUERY = "utilization.gpu,clocks.sm,power.draw"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.samples: list[tuple[float | None, float | None, float | None]] = []
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                 "-i", os.environ.get("BENCH_GPU_INDEX", "0"), "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            threading.Thread(target=self._read, daemon=True).start()

    @staticmethod
    def parse(line: str) -> tuple[float | None, float | None, float | None] | None:
        """One sample line (``70, 1980, 281.43``): busy %, SM MHz, watts, each ``None``
        where nvidia-smi has no value (``[N/A]``); ``None`` for a line that is not one."""
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            return None
        out: list[float | None] = []
        for f in fields:
            try:
                out.append(float(f))
            except ValueError:
                out.append(None)
        busy, mhz, watts = out
        return None if busy is None else (busy, mhz, watts)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            sample = self.parse(line)
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> dict[str, float | None]:
        """Stop sampling: ``gpu_busy_pct`` (the mean), ``sm_mhz_p50``, ``sm_mhz_min`` and
        ``power_w_p50`` over the samples but the first (it may predate the load), each
        ``None`` without samples."""
        if self.proc is not None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        return self.summary(self.samples)

    @staticmethod
    def summary(
        samples: list[tuple[float | None, float | None, float | None]],
    ) -> dict[str, float | None]:
        s = samples[1:] or samples
        busy = [x[0] for x in s if x[0] is not None]
        mhz = [x[1] for x in s if x[1] is not None]
        watts = [x[2] for x in s if x[2] is not None]
        return {
            "gpu_busy_pct": statistics.fmean(busy) if busy else None,
            "sm_mhz_p50": statistics.median(mhz) if mhz else None,
            "sm_mhz_min": min(mhz) if mhz else None,
            "power_w_p50": statistics.median(watts) if watts else None,
        }


def _proc_stats() -> Iterator[tuple[int, list[str]]]:
    """Every process's ``/proc/<pid>/stat`` fields after the name (state, ppid, pgrp, ...;
    the name may hold spaces and parentheses); processes gone meanwhile skipped."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        yield int(d), stat.rsplit(")", 1)[1].split()


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    return [pid for pid, f in _proc_stats() if f[0] != "Z" and int(f[2]) == pgid]


def proc_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, f in _proc_stats():
        children.setdefault(int(f[1]), []).append(pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_use(
    before: dict[tuple[int, int], tuple[str, int]],
    after: dict[tuple[int, int], tuple[str, int]],
    wall_s: float,
) -> dict[str, Any]:
    """Cores busy over ``wall_s`` between two :func:`thread_cpu` samples: the whole tree,
    our threads (named ``ple-*``), and the busiest thread by name."""
    if wall_s <= 0:
        return {}
    used: dict[str, float] = {}
    for key, (name, ticks) in after.items():
        d = ticks - before.get(key, (name, 0))[1]
        if d > 0:
            used[name] = used.get(name, 0.0) + d / CLK_TCK / wall_s
    if not used:
        return {"cpu_cores": 0.0, "cpu_ours": 0.0, "cpu_top": None}
    ours = sum(v for n, v in used.items() if n.startswith(OUR_THREADS))
    top = max((n for n in used if not n.startswith(OUR_THREADS)), key=used.get, default=None)
    return {
        "cpu_cores": sum(used.values()),
        "cpu_ours": ours,
        "cpu_top": None if top is None else (top, used[top]),
    }


def busy_thread_cpus(
    before: dict[tuple[int, int], tuple[str, int]],
    after: dict[tuple[int, int], tuple[str, int]],
    last_cpu: dict[tuple[int, int], int],
) -> dict[str, list[int]]:
    """Where the threads that ran during a load last ran, by name (the CPUs of all threads
    of one name, sorted): which CPUs, SMT siblings included, the engine's thread and ours
    shared."""
    out: dict[str, set[int]] = {}
    for key, (name, ticks) in after.items():
        if ticks - before.get(key, (name, 0))[1] > 0 and key in last_cpu:
            out.setdefault(name, set()).add(last_cpu[key])
    return {n: sorted(c) for n, c in sorted(out.items())}


def host_rss(pids: list[int]) -> dict[str, float]:
    """GiB of RssAnon / RssFile / RssShmem summed over the processes (shared pages count
    once per process that maps them)."""
    tot = {"anon": 0, "file": 0, "shmem": 0}
    for p in pids:
        try:
            text = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            for k, key in (("RssAnon:", "anon"), ("RssFile:", "file"), ("RssShmem:", "shmem")):
                if line.startswith(k):
                    tot[key] += int(line.split()[1]) * 1024
    return {k: v / 2**30 for k, v in tot.items()}


def gpu_memory_by_pid() -> dict[int, float] | None:
    """MiB per process from nvidia-smi (None without it; empty where it cannot see them)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=15, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    got = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        with contextlib.suppress(ValueError, IndexError):
            got[int(parts[0])] = float(parts[1])
    return got


def _gpu_query(field: str) -> str | None:
    """One field of the benchmarked GPU (``BENCH_GPU_INDEX``, default 0) from nvidia-smi,
    without units; ``None`` without nvidia-smi or an answer."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        text = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits",
             "-i", os.environ.get("BENCH_GPU_INDEX", "0")],
            capture_output=True, text=True, timeout=15, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return text.strip() or None


def gpu_name() -> str | None:
    """The benchmarked GPU's name (``None`` without nvidia-smi), for the results' JSON: a
    run's numbers hold for the card that made them."""
    return _gpu_query("name")


def gpu_uuid() -> str | None:
    """The benchmarked GPU's UUID (``None`` without nvidia-smi): which card, and so which
    host, made a run, where runs of one table are compared across lent machines (their
    disks and CPUs differ while the card's name does not)."""
    return _gpu_query("uuid")


def gpu_used_total() -> float | None:
    """MiB of the benchmarked GPU's memory in use (``None`` without nvidia-smi)."""
    text = _gpu_query("memory.used")
    try:
        return None if text is None else float(text.split()[0])
    except (ValueError, IndexError):
        return None


def host_memory() -> dict[str, float]:
    """GiB of the host's memory in use (``MemTotal - MemAvailable``: pinned and anonymous
    memory of every process, what the kernel cannot reclaim), its page cache (``Cached``)
    and shared memory (``Shmem``), from ``/proc/meminfo``."""
    kib: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            kib[key] = int(rest.split()[0])
    gib = 2**20
    return {"used": (kib["MemTotal"] - kib["MemAvailable"]) / gib,
            "cached": kib["Cached"] / gib, "shmem": kib["Shmem"] / gib}  # fmt: skip


def evict(paths: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (dirty ones are written first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def page_cache(paths: list[Path]) -> float:
    return sum(resident_bytes(p) for p in paths) / 2**30


def _disks_of(path: Path) -> list[str]:
    """The whole block devices (names in ``/sys/block``) that may hold ``path``: the one
    its file system is on where ``/sys/dev/block`` knows it (a partition's parent disk),
    else every disk but loop, ram and zram ones (an overlay or a bind mount's device is
    not a block device)."""
    st = path.stat()
    node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if node.exists():
        real = node.resolve()
        name = real.parent.name if (real / "partition").exists() else real.name
        if (Path("/sys/block") / name).exists():
            return [name]
    return sorted(d.name for d in Path("/sys/block").iterdir()
                  if not d.name.startswith(("loop", "ram", "zram")))  # fmt: skip


def disk_reads(paths: list[Path]) -> dict[str, Any] | None:
    """Reads completed and bytes read so far by the disks under ``paths`` (``/proc/diskstats``,
    whole disks only, so a partition is not counted twice): ``{"disks", "ios", "bytes"}``;
    None where the host has no ``/proc/diskstats``. Two readings around a load give the
    storage's read rate during it (``disk_read_rate``)."""
    names = sorted({d for p in paths for d in _disks_of(p)})
    try:
        lines = Path("/proc/diskstats").read_text().splitlines()
    except OSError:
        return None
    ios = sectors = 0
    for line in lines:
        f = line.split()
        if len(f) >= 6 and f[2] in names:
            ios += int(f[3])
            sectors += int(f[5])  # 512-byte units whatever the device's sector size
    return {"disks": names, "ios": ios, "bytes": sectors * 512}


def disk_read_rate(
    before: dict[str, Any] | None, after: dict[str, Any] | None, seconds: float
) -> dict[str, Any]:
    """The storage's reads between two ``disk_reads``: MiB and reads a second, the mean
    read's KiB, the disks counted."""
    if not before or not after or seconds <= 0:
        return {}
    n = after["ios"] - before["ios"]
    b = after["bytes"] - before["bytes"]
    return {"disk_read_mib_s": b / 2**20 / seconds, "disk_read_iops": n / seconds,
            "disk_read_kib": b / 1024 / n if n else 0.0, "disk_read_mib": b / 2**20,
            "disks": after["disks"]}  # fmt: skip
