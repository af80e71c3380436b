"""A benchmark-only vLLM general plugin: times vLLM 0.34.0's own Qwen4Exp disk offload in a
server whose environment has ``PLE_BENCH_TIME_DISK=1`` (``bench_vllm.py`` sets it for the
``disk`` backend). Each step vLLM runs ``stage_checkpoint_rows`` on the engine's thread
before the forward: the ids on the GPU, a stream synchronize (the wait for the step
before), then, per table, ``stage_rows``: the reads (``preadv`` of every distinct row) and
the copy to the GPU. The plugin times both, and every ``PLE_BENCH_TIME_DISK_EVERY``
seconds (default 10) prints one line to the server's log::

    ple-bench disk: steps 812, stage p50 412 p99 1933 us, reads p50 301 p99 1700 us

``stage`` is the engine thread's whole time in the call, ``reads`` the part in
``stage_rows``; the rest is the ids and the wait for the GPU. Nothing else of vLLM's
changes; a vLLM without the disk offload (0.33.0) is left as it is.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Timer", "line", "register"]

ENV = "PLE_BENCH_TIME_DISK"
PREFIX = "ple-bench disk:"


def _pct(xs: list[int], q: float) -> int:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def line(stage_ns: list[int], reads_ns: list[int]) -> str:
    """The log line of one interval's steps (durations in ns)."""
    us = [x // 1000 for x in stage_ns]
    rd = [x // 1000 for x in reads_ns] or [0]
    return (
        f"{PREFIX} steps {len(us)}, stage p50 {_pct(us, 0.5)} p99 {_pct(us, 0.99)} us, "
        f"reads p50 {_pct(rd, 0.5)} p99 {_pct(rd, 0.99)} us"
    )


class Timer:
    """Each step's time in the wrapped staging call and the reads inside it."""

    def __init__(self, every_s: float, out: Callable[[str], None]) -> None:
        self.every_s = every_s
        self.out = out
        self.stage: list[int] = []
        self.reads: list[int] = []
        self._in_step = 0
        self._lock = threading.Lock()
        self._last = time.monotonic()

    def wrap_stage(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            self._in_step = 0
            try:
                return fn(*args, **kwargs)
            finally:
                self._record(time.perf_counter_ns() - t0)

        return timed

    def wrap_reads(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self._in_step += time.perf_counter_ns() - t0

        return timed

    def _record(self, stage_ns: int) -> None:
        with self._lock:
            self.stage.append(stage_ns)
            self.reads.append(self._in_step)
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            self._last = now
            stage, reads, self.stage, self.reads = self.stage, self.reads, [], []
        self.out(line(stage, reads))


def _print(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def register() -> None:
    """vLLM's plugin entry point: the timer, where the environment asks for it and vLLM
    has the disk offload."""
    if os.environ.get(ENV) != "1":
        return
    try:
        from vllm.models.qwen4_exp.nvidia import model_state
        from vllm.models.qwen4_exp.nvidia.ngram_embedding import (
            Qwen4ExpPLEDiskOffloadEmbedding,
        )
    except ImportError:
        return  # no disk offload in this vLLM
    if getattr(model_state.stage_checkpoint_rows, "ple_bench_timed", False):
        return
    timer = Timer(float(os.environ.get(f"{ENV}_EVERY", "10")), _print)
    stage = timer.wrap_stage(model_state.stage_checkpoint_rows)
    stage.ple_bench_timed = True  # type: ignore[attr-defined]
    model_state.stage_checkpoint_rows = stage
    cls: Any = Qwen4ExpPLEDiskOffloadEmbedding
    cls.stage_rows = timer.wrap_reads(cls.stage_rows)
