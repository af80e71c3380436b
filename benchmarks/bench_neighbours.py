"""Does a deferred step slow down when other processes share the machine, and through
which resource? ``bench_step.py`` (the GPU table's rows already on the GPU, ``static``,
against the worker's deferred rows, ``worker-staged``) run under each of these
neighbours in turn, started before it and stopped after it:

* ``none``: nothing else runs (run first and last: the two bound the drift of the host);
* ``idle-contexts``: ``--procs`` processes that each create a CUDA context on the same GPU,
  allocate 1 GiB and sleep (what an idle vLLM server leaves on the GPU);
* ``gpu-ticks``: the same processes launching a ~50 us kernel (100k cycles) every 2 ms
  (a neighbour with a little GPU work: the GPU time-slices between contexts with work);
* ``cpu-spin``: ``--spinners`` processes spinning on the CPU (a host short of cores: the
  gather threads are scheduled late).

Prints one table: each neighbour's step period for both variants, the deferred step's
excess over ``static`` and the share of steps in which the GPU had to wait for the
worker. Needs a CUDA GPU and ple-memops installed (``benchmarks/bench_step.py`` is run
as a script)::

    python3 benchmarks/bench_neighbours.py --batches 8,64 --consumer 0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

_IDLE = (
    "import time, torch\n"
    "x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "time.sleep(3600)\n"
)
_TICKS = (
    "import time, torch\n"
    "x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    torch.cuda._sleep(100_000); torch.cuda.synchronize(); time.sleep(0.002)\n"
)
_SPIN = "print('ready', flush=True)\nwhile True:\n    pass\n"

NEIGHBOURS = ("none", "idle-contexts", "gpu-ticks", "cpu-spin")


def _start(kind: str, procs: int, spinners: int) -> list[subprocess.Popen[str]]:
    code, count = {
        "none": ("", 0),
        "idle-contexts": (_IDLE, procs),
        "gpu-ticks": (_TICKS, procs),
        "cpu-spin": (_SPIN, spinners),
    }[kind]
    started = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    for p in started:  # each says so once its context (if any) exists
        line = p.stdout.readline() if p.stdout is not None else ""
        if line.strip() != "ready":
            _stop(started)
            raise RuntimeError(f"a {kind} neighbour did not start (exit {p.poll()})")
    return started


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _run_step_bench(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(HERE / "bench_step.py"),
        "--batches",
        args.batches,
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--consumer",
        str(args.consumer),
        "--variants",
        "static,worker-staged",
        "--track",
        "--json",
        str(out),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def summarise(kind: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per batch: the median step period of each variant, the excess and the
    share of steps the GPU waited for the worker."""
    rows = []
    for batch, per in doc.items():
        static = statistics.median(r["period_us"] for r in per["static"])
        staged = statistics.median(r["period_us"] for r in per["worker-staged"])
        steps = sum(r["steps"] for r in per["worker-staged"])
        waited = sum(r["waited"] for r in per["worker-staged"])
        rows.append(
            {
                "neighbours": kind,
                "batch": int(batch),
                "static_us": static,
                "staged_us": staged,
                "excess_us": staged - static,
                "waited": waited,
                "steps": steps,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| neighbours | batch | static us | deferred us | deferred - static us "
        "| steps the GPU waited |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['neighbours']} | {r['batch']} | {r['static_us']:.1f} | "
            f"{r['staged_us']:.1f} | {r['excess_us']:+.1f} | {r['waited']}/{r['steps']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="8,64", help="bench_step.py's --batches")
    ap.add_argument("--steps", type=int, default=200, help="bench_step.py's --steps")
    ap.add_argument("--rounds", type=int, default=3, help="bench_step.py's --rounds")
    ap.add_argument(
        "--consumer",
        type=int,
        default=0,
        help="the layer that reads the rows (0: no GPU work ahead)",
    )
    ap.add_argument(
        "--neighbours",
        default="none,idle-contexts,gpu-ticks,cpu-spin,none",
        help=f"comma-separated, run in this order; any of {', '.join(NEIGHBOURS)}",
    )
    ap.add_argument("--procs", type=int, default=3, help="processes with a CUDA context")
    ap.add_argument(
        "--spinners",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 4),
        help="processes spinning on the CPU (default: all cores but four)",
    )
    ap.add_argument("--json", type=Path, help="write every row here")
    a = ap.parse_args()
    kinds = a.neighbours.split(",")
    unknown = sorted(set(kinds) - set(NEIGHBOURS))
    if unknown:
        ap.error(f"unknown neighbours {unknown}; known: {', '.join(NEIGHBOURS)}")
    if a.procs < 1 or a.spinners < 1:
        ap.error("--procs and --spinners must be >= 1")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, kind in enumerate(kinds):
            procs = _start(kind, a.procs, a.spinners)
            try:
                t0 = time.monotonic()
                doc = _run_step_bench(a, Path(tmp) / f"{i}.json")
            finally:
                _stop(procs)
            mine = summarise(kind, doc)
            rows.extend(mine)
            print(f"{kind}: {time.monotonic() - t0:.0f} s", flush=True)
            for r in mine:  # as it goes: a run cut short keeps what it measured
                print(table([r]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
