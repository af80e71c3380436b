"""Where a process's threads spend their time, from ``py-spy record --format raw`` output
(collapsed stacks, one ``frame;frame;...;frame COUNT`` line per distinct stack, recorded
with ``--threads``, and ``--idle`` so that waits count too), and two recordings side by
side: the functions whose share of one thread's samples differs most.

    python benchmarks/stacks_diff.py STACKS [--against STACKS] [--thread NAME] [--top 25]

A function's share is inclusive (the samples with it anywhere on the stack, each sample
counted once) and taken of the thread's samples, so two recordings of different length
compare. ``--thread`` picks the thread whose stacks hold a frame containing NAME (default:
the engine core's busy loop); without a match, the thread with the most samples.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

__all__ = ["Stacks", "function", "load", "shares"]

_LINE = re.compile(r":\d+\)$")
DEFAULT_THREAD = "run_busy_loop"


def function(frame: str) -> str:
    """A frame without its line number: ``step (vllm/v1/engine/core.py)``."""
    return _LINE.sub(")", frame.strip())


class Stacks:
    """Samples by thread: ``threads[thread] = Counter({stack tuple: samples})``."""

    def __init__(self) -> None:
        self.threads: dict[str, Counter[tuple[str, ...]]] = {}

    def total(self, thread: str) -> int:
        return sum(self.threads[thread].values())

    def pick(self, name: str = DEFAULT_THREAD) -> str:
        """The thread whose stacks hold a frame containing ``name``, else the busiest."""
        if not self.threads:
            raise ValueError("no samples")
        for t, stacks in self.threads.items():
            if any(name in f for s in stacks for f in s):
                return t
        return max(self.threads, key=self.total)


def load(path: Path) -> Stacks:
    """Parse py-spy's raw output. A stack's first frames up to its ``thread (...)`` frame
    (the process, the thread) name the thread; the rest are its calls, outermost first."""
    out = Stacks()
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"{path}:{n}: not a collapsed stack line: {line[:120]!r}")
        frames = stack.split(";")
        cut = next((i for i, f in enumerate(frames) if f.startswith("thread ")), -1)
        thread = frames[cut] if cut >= 0 else "(all)"
        calls = tuple(function(f) for f in frames[cut + 1 :])
        out.threads.setdefault(thread, Counter())[calls] += int(count)
    return out


def shares(stacks: Counter[tuple[str, ...]]) -> dict[str, float]:
    """Each function's inclusive share of the samples (0-1)."""
    total = sum(stacks.values())
    if not total:
        return {}
    seen: Counter[str] = Counter()
    for calls, n in stacks.items():
        for f in set(calls):
            seen[f] += n
    return {f: n / total for f, n in seen.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stacks", type=Path)
    p.add_argument("--against", type=Path, help="a second recording (the reference)")
    p.add_argument("--thread", default=DEFAULT_THREAD)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    a = load(args.stacks)
    ta = a.pick(args.thread)
    for t in sorted(a.threads, key=a.total, reverse=True)[:8]:
        print(f"{args.stacks.name}: {t} {a.total(t)} samples{' (picked)' if t == ta else ''}")
    sa = shares(a.threads[ta])
    if args.against is None:
        for f, v in sorted(sa.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{100 * v:6.1f}%  {f[:150]}")
        return 0
    b = load(args.against)
    tb = b.pick(args.thread)
    sb = shares(b.threads[tb])
    print(f"{args.against.name}: picked {tb}, {b.total(tb)} samples")
    print(f"| function | {args.against.name} | {args.stacks.name} | difference |")
    print("|---|---|---|---|")
    names = sorted(set(sa) | set(sb), key=lambda f: -abs(sa.get(f, 0) - sb.get(f, 0)))
    for f in names[: args.top]:
        x, y = sb.get(f, 0.0), sa.get(f, 0.0)
        print(f"| `{f[:110]}` | {100 * x:.1f}% | {100 * y:.1f}% | {100 * (y - x):+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
