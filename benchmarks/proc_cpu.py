"""CPU time of a process's threads, from ``/proc`` (Linux): what the benchmarks read to
tell our threads' CPU use (the Rust core names them ``ple-*``) from everything else."""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
"""Clock ticks a second: the unit of :func:`thread_cpu`."""
OUR_THREADS = ("ple-",)
"""Our threads' name prefixes (Linux keeps 15 characters of a name)."""


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """CPU time (user + system, clock ticks) of every thread of the processes, by (pid,
    tid), with the thread's name."""
    out: dict[tuple[int, int], tuple[str, int]] = {}
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
            fields = rest.split()
            # fields[0] is the state (stat field 3): utime, stime are fields 14 and 15.
            out[(p, int(t))] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
    return out


def ours(sample: dict[tuple[int, int], tuple[str, int]]) -> int:
    """Clock ticks of our threads in a :func:`thread_cpu` sample."""
    return sum(ticks for name, ticks in sample.values() if name.startswith(OUR_THREADS))


def thread_last_cpu(pids: list[int]) -> dict[tuple[int, int], int]:
    """The CPU each thread of the processes last ran on (``/proc/.../stat`` field 39), by
    (pid, tid): a snapshot of where the scheduler keeps them."""
    out: dict[tuple[int, int], int] = {}
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                rest = Path(f"/proc/{p}/task/{t}/stat").read_text().rsplit(")", 1)[1]
            except (OSError, IndexError):
                continue
            # fields[0] is stat field 3 (the state): field 39 (processor) is fields[36].
            out[(p, int(t))] = int(rest.split()[36])
    return out


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
