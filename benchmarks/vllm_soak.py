"""``bench_vllm.py --soak MINUTES``: one server under the mixed load for a long while, a
share of its streaming clients going away mid-stream (vLLM aborts their requests inside
running batches), and what must not move:

* no failed request (beyond the clients that left on purpose) and no error in the server's
  log (a watchdog release, an abort of the deferred rows, a traceback, an ERROR line);
* host RSS, the tables' page cache and the server's GPU memory flat: sampled every
  ``--soak-sample`` seconds, each one's range after the first sample within
  ``--soak-tolerance-mib``;
* a fixed greedy probe request gives the same text at the start and at the end.

``soak`` runs it against a healthy server, ``soak_verdict`` says what failed (nothing:
passed), ``soak_markdown`` prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import vllm_bench_model as vbm
from vllm_clock import left, log
from vllm_loads import Client, Out, Req, make_loads
from vllm_probes import gpu_memory_by_pid, host_rss, page_cache, proc_tree
from vllm_servers import Server, log_since, log_size

# What in a server's log is an error of ours or the engine's (vLLM's INFO/WARNING lines
# and our stats lines are not). A watchdog release aborts the deferred rows, so it shows
# as the abort line too.
LOG_ERRORS = re.compile(
    r"aborting deferred PLE rows|watchdog|Traceback \(most recent call last\)| ERROR "
)


@dataclass
class Sample:
    at_s: float
    rss_gib: dict[str, float]
    page_cache_gib: float
    gpu_mib: float | None


@dataclass
class SoakResult:
    minutes: float  # asked for
    planned_min: float = 0.0  # what the deadline left room for when it started
    disconnect_share: float = 0.0
    rounds: int = 0
    requests: int = 0
    disconnected: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    probe: tuple[str, str] = ("", "")
    probe_ok: tuple[bool, bool] = (False, False)
    elapsed_s: float = 0.0
    server_died: str = ""  # how the server's process ended, if it did
    cut_short: str = ""  # why the soak ended before its minutes (an interrupt)
    log_offset: int = 0
    finished: bool = False  # the log was read and the result is whole


def _sample(pid: int | None, tables: list[Path], t0: float) -> Sample:
    pids = proc_tree(pid) if pid is not None else [os.getpid()]
    by_pid = gpu_memory_by_pid()
    gpu = None
    if by_pid is not None:
        mine = [by_pid[p] for p in pids if p in by_pid]
        gpu = sum(mine) if mine else None
    return Sample(time.monotonic() - t0, host_rss(pids), page_cache(tables), gpu)


def probe_request(vocab: int, input_len: int) -> Req:
    """The fixed greedy request asked before and after the soak."""
    rng = random.Random("soak-probe")
    lo = len(vbm.SPECIALS)
    return Req([rng.randrange(lo, vocab) for _ in range(input_len)], 32)


# Seconds kept free before the deadline: the last round's requests and the final probe end
# by then, and the report is written before the device's time limit.
MARGIN_S = 45.0


async def soak(
    args: argparse.Namespace,
    server: Server,
    tables: list[Path],
    vocab: int,
    res: SoakResult | None = None,
    progress: Callable[[SoakResult], None] | None = None,
) -> SoakResult:
    """Run the mixed load round after round for ``args.soak`` minutes (or until the
    deadline) against ``server``, every ``1 / args.soak_disconnect``-th client of a round
    leaving after 2-8 streamed tokens; sample the host and the GPU meanwhile. ``res`` is
    filled in place as it goes (an interrupted soak leaves what it measured there);
    ``progress`` is called after every sample."""
    res = SoakResult(args.soak) if res is None else res
    pid = server.proc.pid if server.proc is not None else None
    res.log_offset = log_size(server.log_path)
    res.disconnect_share = args.soak_disconnect
    t0 = time.monotonic()
    res.planned_min = max(0.0, min(args.soak * 60, left() - MARGIN_S)) / 60
    end = t0 + res.planned_min * 60
    log(f"soak: {res.planned_min:.1f} of {args.soak:g} minutes fit before the deadline")
    probe = probe_request(vocab, args.input_len)

    def bound() -> float:  # a request ends before the deadline's margin
        return max(5.0, left() - MARGIN_S / 2)

    def sample() -> None:
        s = _sample(pid, tables, t0)
        res.samples.append(s)
        gpu = "-" if s.gpu_mib is None else f"{s.gpu_mib:,.0f}"
        log(f"soak {s.at_s / 60:.1f} min: RSS anon {s.rss_gib['anon']:.2f} GiB, page cache "
            f"{s.page_cache_gib:.2f} GiB, GPU {gpu} MiB; {res.rounds} rounds, "
            f"{res.requests} requests ({res.disconnected} left, {res.failed} failed)")  # fmt: skip
        if progress is not None:
            progress(res)

    async with Client(args.request_timeout, stdlib=True) as client:
        first = await client.request(server.port, probe, bound())
        res.probe, res.probe_ok = (_probe_text(first), ""), (first.ok, False)
        sample()
        next_sample = time.monotonic() + args.soak_sample
        share = args.soak_disconnect
        every = max(1, round(1 / share)) if share > 0 else 0
        while time.monotonic() < end:
            if died := _died(server):
                res.server_died = died
                break
            (load,) = [x for x in make_loads(args, vocab, 1000 + res.rounds) if x.name == "mixed"]
            rng = random.Random(f"soak-{res.rounds}")
            for k, r in enumerate(load.requests):
                if every and k % every == every - 1:
                    r.disconnect_after = rng.randint(2, 8)
            task = asyncio.ensure_future(_run(client, server.port, load.requests, bound()))
            while not task.done():
                await asyncio.sleep(0.2)
                if time.monotonic() >= next_sample:
                    sample()
                    next_sample += args.soak_sample
            outs = task.result()
            res.rounds += 1
            res.requests += len(outs)
            res.disconnected += sum(o.disconnected for o in outs)
            bad = [o for o in outs if not o.ok]
            res.failed += len(bad)
            res.errors += sorted({o.error[:200] for o in bad} - set(res.errors))[:3]
        if not res.server_died and (died := _died(server)):
            res.server_died = died
        sample()
        last = await client.request(server.port, probe, bound())
    res.probe, res.probe_ok = (res.probe[0], _probe_text(last)), (res.probe_ok[0], last.ok)
    finish(res, server, t0)
    return res


def finish(res: SoakResult, server: Server, t0: float | None = None) -> None:
    """Read the server's log since the soak began into ``res`` (idempotent)."""
    if res.finished:
        return
    text = log_since(server.log_path, res.log_offset)
    res.log_errors = [ln.strip()[:300] for ln in text.splitlines() if LOG_ERRORS.search(ln)]
    if t0 is not None:
        res.elapsed_s = time.monotonic() - t0
    elif res.samples:
        res.elapsed_s = res.samples[-1].at_s
    res.finished = True
    log(
        f"soak: {res.rounds} rounds, {res.requests} requests ({res.disconnected} left "
        f"mid-stream, {res.failed} failed) in {res.elapsed_s / 60:.1f} min"
    )


def _died(server: Server) -> str:
    if server.proc is None or server.proc.poll() is None:
        return ""
    return f"the server's process ended (exit {server.proc.returncode})"


async def _run(client: Client, port: int, reqs: list[Req], timeout: float) -> list[Out]:
    """Every request of a round at once (arrivals at their offsets), each bounded by
    ``timeout`` seconds from the round's start."""
    t_end = time.monotonic() + timeout

    async def one(r: Req) -> Out:
        if r.at > 0:
            await asyncio.sleep(r.at)
        return await client.request(port, r, max(1.0, t_end - time.monotonic()))

    return list(await asyncio.gather(*(one(r) for r in reqs)))


def _probe_text(o: Out) -> str:
    return o.text if o.ok else f"(failed: {o.error[:200]})"


def _ranges(samples: list[Sample]) -> dict[str, float | None]:
    """Each quantity's range in MiB over the samples after the first (the first is taken
    before the load's first round)."""
    later = samples[1:] or samples

    def span(xs: list[float | None]) -> float | None:
        got = [x for x in xs if x is not None]
        return max(got) - min(got) if got else None

    gib = 1024.0
    return {
        "rss_anon_mib": span([s.rss_gib["anon"] * gib for s in later]),
        "rss_shmem_mib": span([s.rss_gib["shmem"] * gib for s in later]),
        "page_cache_mib": span([s.page_cache_gib * gib for s in later]),
        "gpu_mib": span([s.gpu_mib for s in later]),
    }


def soak_verdict(res: SoakResult, tolerance_mib: float) -> list[str]:
    """What failed (an empty list: the soak passed)."""
    problems = []
    if res.server_died:
        problems.append(res.server_died)
    if res.cut_short:
        problems.append(f"cut short by {res.cut_short}")
    if res.rounds == 0:
        problems.append("no round of the load ran")
    if res.failed:
        problems.append(f"{res.failed} requests failed: {res.errors[:3]}")
    if res.log_errors:
        n = len(res.log_errors)
        problems.append(f"{n} error lines in the server's log: {res.log_errors[:3]}")
    if res.disconnected == 0 and res.rounds and res.disconnect_share > 0:
        problems.append("no client left mid-stream (the abort path was not exercised)")
    for name, r in _ranges(res.samples).items():
        if r is not None and r > tolerance_mib:
            problems.append(f"{name} moved {r:.0f} MiB (tolerance {tolerance_mib:.0f})")
    if not all(res.probe_ok):
        problems.append(f"the probe failed: {res.probe[0]!r} / {res.probe[1]!r}")
    elif res.probe[0] != res.probe[1]:
        problems.append(f"the probe's text changed: {res.probe[0]!r} -> {res.probe[1]!r}")
    if len(res.samples) < 3:
        problems.append(f"only {len(res.samples)} samples (a soak shorter than its sampling)")
    return problems


def soak_markdown(res: SoakResult, tolerance_mib: float, backend: str) -> str:
    if not all(res.probe_ok):
        probe = "FAILED"
    else:
        probe = "the same" if res.probe[0] == res.probe[1] else "CHANGED"
    lines = [
        f"Soak of `{backend}`: {res.elapsed_s / 60:.1f} min ({res.minutes:g} asked, "
        f"{res.planned_min:.1f} before the deadline), {res.rounds} rounds of the mixed load, "
        f"{res.requests} requests ({res.disconnected} clients left mid-stream, {res.failed} "
        f"failed); {len(res.log_errors)} error lines in the server's log; the probe's text "
        f"{probe} at the end",
        "",
        "| at min | RSS anon / file / shmem GiB | table page cache GiB | GPU MiB |",
        "|---|---|---|---|",
    ]
    for s in res.samples:
        r = s.rss_gib
        gpu = "-" if s.gpu_mib is None else f"{s.gpu_mib:,.0f}"
        lines.append(
            f"| {s.at_s / 60:.1f} | {r['anon']:.2f} / {r['file']:.2f} / {r['shmem']:.2f} | "
            f"{s.page_cache_gib:.2f} | {gpu} |"
        )
    ranges = ", ".join(
        f"{k} {'-' if v is None else f'{v:.0f}'}" for k, v in _ranges(res.samples).items()
    )
    problems = soak_verdict(res, tolerance_mib)
    unsampled = all(s.gpu_mib is None for s in res.samples)
    lines += [
        "",
        f"Ranges after the first sample (MiB): {ranges}; tolerance {tolerance_mib:.0f} MiB "
        "(RSS file, the mapped table pages, is shown, not checked"
        + ("; GPU memory could not be read per process, not checked)." if unsampled else ")."),
        "",
        "SOAK: " + ("passed" if not problems else "FAILED: " + "; ".join(problems)),
    ]
    return "\n".join(lines)
