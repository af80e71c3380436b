"""What a deferred step costs, measured where the cost arises: how long the GPU's consumer
waited for its rows (:class:`StallSummary`, from the GPU's own clock; see
:meth:`~ple_memops.DeferredRows.stall_samples`) and how long the host spent in the
integration's own code (:class:`HostTime`, per engine step, by hook). Both are immune
to the end-to-end noise of a shared host: a stall is a difference of two GPU timestamps,
a host time a sum of ``perf_counter_ns`` spans around our code alone."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["ENGINE_KINDS", "HOST_KINDS", "HostTime", "StallSummary", "percentile"]

STALLED_NS = 1_000
"""A step counts as stalled when its consumer waited more than this (1 us: below it the
two stamps' own launch jitter)."""


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0-100) of ascending ``sorted_values``."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


@dataclass(frozen=True)
class StallSummary:
    """One layer's consumer stalls over an interval, in microseconds."""

    steps: int
    stalled: int
    """Steps whose consumer waited more than 1 us."""
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float
    mean_us: float
    dropped: int = 0
    """Steps timed but overwritten before they were read."""

    @classmethod
    def of(cls, stalls_ns: Sequence[int], dropped: int = 0) -> StallSummary:
        if not stalls_ns:
            raise ValueError("a stall summary needs at least one step")
        us = sorted(ns / 1e3 for ns in stalls_ns)
        return cls(
            steps=len(us),
            stalled=sum(1 for ns in stalls_ns if ns > STALLED_NS),
            p50_us=percentile(us, 50),
            p90_us=percentile(us, 90),
            p99_us=percentile(us, 99),
            max_us=us[-1],
            mean_us=sum(us) / len(us),
            dropped=int(dropped),
        )

    def text(self) -> str:
        """``N steps, S stalled; us p50 a p90 b p99 c max d mean e`` (the stats line)."""
        drop = f", {self.dropped} dropped" if self.dropped else ""
        return (
            f"{self.steps} steps, {self.stalled} stalled{drop}; us p50 {self.p50_us:.1f} "
            f"p90 {self.p90_us:.1f} p99 {self.p99_us:.1f} max {self.max_us:.1f} "
            f"mean {self.mean_us:.2f}"
        )


HOST_KINDS = ("step", "arm", "wait", "check", "stats")
"""The hooks an engine step runs through, as :class:`HostTime` counts them: ``step`` (the
step's scope: opening, eager forwards' end, not the engine's work inside), ``arm`` (arming
every table and the launch's bookkeeping, not the launch), ``wait`` (completing the
oldest step when ``depth`` are armed: a wait for a fill), ``check`` (the failure check
before a step's output is handed out), ``stats`` (the stats line)."""

ENGINE_KINDS = ("launch",)
"""The engine's own host time that :class:`HostTime` counts beside ours, outside its
``total``: ``launch`` (the FULL graph's launch call, which the driver's work for the
graph's nodes makes longer or shorter)."""

_KINDS = HOST_KINDS + ENGINE_KINDS


class HostTime:
    """The host's time in the integration's own code, per engine step, by hook (see
    :data:`HOST_KINDS`). ``add`` from any thread; ``end_step`` closes a step's sample;
    ``summary`` drains the samples into percentiles. Keeps at most ``keep`` steps."""

    def __init__(self, keep: int = 20_000) -> None:
        self._lock = threading.Lock()
        self._cur = dict.fromkeys(_KINDS, 0)
        self._steps: deque[tuple[int, ...]] = deque(maxlen=keep)

    def add(self, kind: str, ns: int) -> None:
        with self._lock:
            self._cur[kind] += ns

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Count the time inside the block as ``kind``."""
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter_ns() - t0)

    def end_step(self) -> None:
        with self._lock:
            self._steps.append(tuple(self._cur[k] for k in _KINDS))
            self._cur = dict.fromkeys(_KINDS, 0)

    def take(self) -> list[dict[str, int]]:
        """Every step's nanoseconds by hook since the last call, oldest first."""
        with self._lock:
            steps, self._steps = list(self._steps), deque(maxlen=self._steps.maxlen)
        return [dict(zip(_KINDS, s, strict=True)) for s in steps]

    def summary(self) -> str:
        """``host us per engine step over N: total p50 a p99 b, step ..., arm ..., ...;
        graph launch p50 c p99 d``, drained (the stats line's part). ``total`` is ours
        (:data:`HOST_KINDS`); the launch is the engine's, apart."""
        steps = self.take()
        if not steps:
            return "host us per engine step: no steps"

        def pct(name: str, ns: list[int]) -> str:
            us = sorted(x / 1e3 for x in ns)
            return f"{name} p50 {percentile(us, 50):.1f} p99 {percentile(us, 99):.1f}"

        ours = [pct("total", [sum(s[k] for k in HOST_KINDS) for s in steps])]
        ours += [pct(k, [s[k] for s in steps]) for k in HOST_KINDS]
        launch = pct("graph launch", [s["launch"] for s in steps])
        return f"host us per engine step over {len(steps)}: {', '.join(ours)}; {launch}"
