"""A deferred server's FULL graphs in the first stats interval of each load against the
rest of the load, from the servers' logs of a ``bench_vllm.py --time-graphs`` run.

Side by side with other servers (Gemma 4 on an H200, docs/lab/vllm-gemma4.md, run 7), a
deferred server's graphs ran at the GPU table's span for the first ~0.5 s of every load and
~400 us (8%) longer after it (Qwen4Exp's on an H100 did not: BENCHMARKS.md, servers sharing
one GPU); this reads that out of the ``ple-memops graphs`` lines (one every ``--stats-every`` s
while the server runs steps). A line that covers more than ``--idle-s`` seconds spans the
idle time before a load, so the line after it is the load's first window. Per server and
batch size: the first windows' span p50 (the median over loads) against the later
windows' (the median over lines), each window with at least ``--min-launches`` replays of
that size.

    python benchmarks/graph_windows.py bench_logs_<tag>.tgz        # or server-*.log files
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tarfile
from pathlib import Path

from vllm_report import sizes_of

_LINE = re.compile(r"ple-memops graphs, last ([\d.]+) s: \d+ graphs on the GPU")


def windows(text: str, idle_s: float = 1.5, min_launches: int = 10) -> dict[int, list[list[float]]]:
    """Size -> [first windows' spans, later windows' spans] of one server's log."""
    out: dict[int, list[list[float]]] = {}
    first = True  # a server's first line follows its start, idle
    for line in text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        if float(m.group(1)) > idle_s:
            first = True  # this line covers the idle time; the next opens a load
            continue
        for size, (n, span) in sizes_of(line).items():
            if n >= min_launches:
                out.setdefault(size, [[], []])[0 if first else 1].append(span)
        first = False
    return out


def markdown(logs: dict[str, str], idle_s: float = 1.5, min_launches: int = 10) -> str:
    lines = [
        "| server | batch size | first window of a load: loads, span p50 us | later "
        "windows: lines, span p50 us | later - first |",
        "|---|---|---|---|---|",
    ]
    for name, text in logs.items():
        for size, (first, later) in sorted(windows(text, idle_s, min_launches).items()):
            f = statistics.median(first) if first else None
            r = statistics.median(later) if later else None
            diff = f"{r - f:+,.0f}" if f is not None and r is not None else "-"
            lines.append(
                f"| {name} | {size} | {len(first)}, {'-' if f is None else f'{f:,.0f}'} "
                f"| {len(later)}, {'-' if r is None else f'{r:,.0f}'} | {diff} |"
            )
    return "\n".join(lines)


def read_logs(paths: list[Path]) -> dict[str, str]:
    """Server name (``server-<name>.log``) -> log text, from log files or the bench's
    ``bench_logs_<tag>.tgz`` archives."""
    logs: dict[str, str] = {}

    def server(name: str) -> str:
        return name.removeprefix("server-").removesuffix(".log")

    for path in paths:
        if path.name.endswith((".tgz", ".tar.gz")):
            with tarfile.open(path) as tar:
                for member in tar.getmembers():
                    name = Path(member.name).name
                    f = tar.extractfile(member)
                    if f is not None and name.startswith("server-") and name.endswith(".log"):
                        logs[server(name)] = f.read().decode(errors="replace")
        else:
            logs[server(path.name)] = path.read_text(errors="replace")
    return logs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", type=Path, nargs="+", help="server-*.log files or bench_logs_*.tgz")
    p.add_argument("--idle-s", type=float, default=1.5, help="a line longer than this is idle")
    p.add_argument("--min-launches", type=int, default=10, help="replays a window needs")
    args = p.parse_args(argv)
    logs = read_logs(args.logs)
    if not logs:
        print("no server logs found", file=sys.stderr)
        return 1
    print(markdown(logs, args.idle_s, args.min_launches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
