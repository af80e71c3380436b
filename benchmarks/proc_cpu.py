"""CPU time of a process's threads, from ``/proc`` (Linux): what the benchmarks read to
tell our threads' CPU use (the Rust core names them ``ple-*``) from everything else."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
"""Clock ticks a second: the unit of :func:`thread_cpu`."""
OUR_THREADS = ("ple-",)
"""Our threads' name prefixes (Linux keeps 15 characters of a name)."""


def _thread_stats(pids: list[int]) -> Iterator[tuple[int, int, str, list[str]]]:
    """(pid, tid, name, fields) of every thread of the processes, where ``fields[0]`` is
    ``/proc/<pid>/task/<tid>/stat`` field 3 (the state); threads gone meanwhile skipped."""
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                stat = Path(f"/proc/{p}/task/{t}/stat").read_text()
            except OSError:
                continue
            head, rest = stat.rsplit(")", 1)
            yield p, int(t), head.split("(", 1)[1], rest.split()


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """CPU time (user + system, clock ticks) of every thread of the processes, by (pid,
    tid), with the thread's name."""
    # utime, stime are stat fields 14 and 15.
    return {(p, t): (name, int(f[11]) + int(f[12])) for p, t, name, f in _thread_stats(pids)}


def ours(sample: dict[tuple[int, int], tuple[str, int]]) -> int:
    """Clock ticks of our threads in a :func:`thread_cpu` sample."""
    return sum(ticks for name, ticks in sample.values() if name.startswith(OUR_THREADS))


def thread_last_cpu(pids: list[int]) -> dict[tuple[int, int], int]:
    """The CPU each thread of the processes last ran on (``/proc/.../stat`` field 39), by
    (pid, tid): a snapshot of where the scheduler keeps them."""
    return {(p, t): int(f[36]) for p, t, _, f in _thread_stats(pids)}


def cpu_topology() -> dict[str, object]:
    """The machine's NUMA nodes (each with its CPUs) and the SMT sibling groups of its
    CPUs, from ``/sys`` (empty where it does not say)."""
    nodes: dict[str, str] = {}
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            nodes[d.name] = (d / "cpulist").read_text().strip()
        except OSError:
            continue
    siblings: set[str] = set()
    for d in Path("/sys/devices/system/cpu").glob("cpu[0-9]*"):
        try:
            siblings.add((d / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            continue
    return {"nodes": nodes, "smt_siblings": sorted(siblings)}
