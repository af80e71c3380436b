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
