"""Two builds of the package against each other on ``bench_hooks.py``, alternated and paired.

Our host time a step moves by a few microseconds between runs of the same code on a
shared VM (BENCHMARKS.md, "Through vLLM's runner classes": one code's rounds 1.5-4 us
apart within a run, its level ~5 us apart between runs), so a change of that size is
only resolved by alternating the two builds in one run and pairing each round's two
measurements. This runs ``bench_hooks.py --repeats 1`` once a build a round, ``--rounds``
rounds, in the order A B, B A, A B, ... (so a drift in the machine falls on both sides),
each build from its own directory on ``PYTHONPATH`` (an unpacked wheel, e.g. ``pip install
--no-deps --target DIR dist/*.whl``; an empty directory means the installed package), and
prints, per table count: each round's ``--column`` p50 for A and B and their difference,
then B - A's median and range over the pairs, A's own spread over its rounds (the A
against A of this run) and a two-sided sign test over the pairs (ties counted against
it): a difference is called resolved only at p <= 0.05, which takes every pair moving the
same way with 6 rounds (p = 1/32), all but one with 9-11, all but two with 12.

    python3 benchmarks/ab_hooks.py --a DIR_A --b DIR_B [--rounds 6] [--column "all in"] \
        [--python PY] [-- bench_hooks.py's own arguments, e.g. --steps 2000 --tables 1]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench_hooks.py"


def parse_table(out: str, column: str) -> dict[int, float]:
    """``bench_hooks.py``'s table as ``{tables: p50 of column}`` (one repeat)."""
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    header = next((line for line in lines if line.startswith("| tables")), None)
    if header is None:
        raise ValueError(f"no table in bench_hooks.py's output:\n{out}")
    kinds = [c.strip() for c in header.strip("|").split("|")]
    if column not in kinds:
        raise ValueError(f"no column {column!r} in {kinds}")
    at = kinds.index(column)
    hooks_at = kinds.index("hooks") if "hooks" in kinds else None
    got = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0].isdigit() and (hooks_at is None or cells[hooks_at] == "ours"):
            got[int(cells[0])] = float(cells[at].split(" / ")[0])
    return got


@dataclass(frozen=True)
class Paired:
    """One table count's rounds: A's and B's value a round, in round order."""

    a: tuple[float, ...]
    b: tuple[float, ...]

    @property
    def diffs(self) -> list[float]:
        return [b - a for a, b in zip(self.a, self.b, strict=True)]

    @property
    def sign_p(self) -> float:
        """The two-sided sign test's p-value for "B moves one way": with ``k`` of the
        ``n`` pairs not moving the way most do (ties count among them, against the
        verdict), ``2 P(Binomial(n, 1/2) <= k)``, at most 1 (2 / 2^n when every pair
        moves the same way)."""
        d = self.diffs
        n = len(d)
        k = n - max(sum(x < 0 for x in d), sum(x > 0 for x in d))
        return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)

    def summary(self) -> str:
        d = self.diffs
        verdict = (
            f"resolved (sign test p = {self.sign_p:.3g})" if self.sign_p <= 0.05 else "not resolved"
        )
        return (
            f"B - A median {statistics.median(d):+.1f} us [{min(d):+.1f}, {max(d):+.1f}] over "
            f"{len(d)} pairs; A {min(self.a):.1f}-{max(self.a):.1f} (its spread "
            f"{max(self.a) - min(self.a):.1f}), B {min(self.b):.1f}-{max(self.b):.1f}: {verdict}"
        )


def run_once(python: str, site: str, bench_args: list[str], column: str) -> dict[int, float]:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [python, str(BENCH), "--repeats", "1", *bench_args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_table(out, column)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="directory holding build A's ple_memops")
    p.add_argument("--b", required=True, help="directory holding build B's ple_memops")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--column", default="all in", help="bench_hooks.py's column compared")
    p.add_argument("--python", default=sys.executable, help="the interpreter for both")
    p.add_argument("bench_args", nargs="*", help="after --: bench_hooks.py's arguments")
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2")
    for d in (args.a, args.b):
        if d and not Path(d).is_dir():
            p.error(f"{d} is not a directory")
    values: dict[str, list[dict[int, float]]] = {"A": [], "B": []}
    print(f"| round | order | tables | A | B | B - A |  ({args.column}, p50 us)")
    print("|---|---|---|---|---|---|")
    for r in range(args.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        got = {}
        for side in order:
            site = args.a if side == "A" else args.b
            got[side] = run_once(args.python, site, args.bench_args, args.column)
            values[side].append(got[side])
        for n in sorted(got["A"]):
            a, b = got["A"][n], got["B"][n]
            print(f"| {r + 1} | {''.join(order)} | {n} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    print()
    for n in sorted(values["A"][0]):
        paired = Paired(tuple(v[n] for v in values["A"]), tuple(v[n] for v in values["B"]))
        print(f"{n} table(s): {paired.summary()}")


if __name__ == "__main__":
    main()
