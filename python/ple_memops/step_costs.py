"""What a deferred step costs, measured where the cost arises: how long the GPU's consumer
waited for its rows (:class:`StallSummary`, from the GPU's own clock; see
:meth:`~ple_memops.DeferredRows.stall_samples`) and how long the host spent in the
integration's own code (:class:`HostTime`, per engine step, by hook; :class:`NoHostTime`
where nothing reads it). Both are immune
to the end-to-end noise of a shared host: a stall is a difference of two GPU timestamps,
a host time a sum of ``perf_counter_ns`` spans around our code alone. :class:`GraphClock`
times whole graph launches on the GPU the same way (two events a launch, no kernel): how
long each graph ran on the device and how long the device spent between graphs."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "ENGINE_KINDS",
    "HOST_KINDS",
    "GraphClock",
    "GraphTimes",
    "HostTime",
    "NoHostTime",
    "StallSummary",
    "percentile",
]

T = TypeVar("T")

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
before a step's output is handed out, and the runner's wrapping of that output; not
``time_graphs``' own wrapping of it) and ``stats`` (the stats line)."""

ENGINE_KINDS = ("launch", "results")
"""The engine's own host time that :class:`HostTime` counts beside ours, outside its
``total``: ``launch`` (the FULL graph's launch call, which the driver's work for the
graph's nodes makes longer or shorter) and ``results`` (the engine's thread handed a
step's results under async scheduling: vLLM's ``get_output``, which waits for the step
to finish on the GPU and copies its tokens out; near its copy's cost when the host paces
the engine, the GPU's remaining time for the step when the GPU does). Where ``results``
waits, a step's GPU time (a stall for rows among it) is on the engine's critical path;
where it does not, the GPU's work hides behind the host's and only host time counts."""

_ENGINE_LABELS = {"launch": "graph launch", "results": "results wait"}

_KINDS = HOST_KINDS + ENGINE_KINDS
_INDEX = {kind: i for i, kind in enumerate(_KINDS)}
_WAIT, _ARM, _LAUNCH = _INDEX["wait"], _INDEX["arm"], _INDEX["launch"]


class HostTime:
    """The host's time in the integration's own code, per engine step, by hook (see
    :data:`HOST_KINDS`). ``add`` from any thread; ``end_step`` closes a step's sample;
    ``summary`` drains the samples into percentiles. Keeps at most ``keep`` steps."""

    def __init__(self, keep: int = 20_000) -> None:
        self._lock = threading.Lock()
        # By position in _KINDS: a step's sample is a tuple of the list, no per-kind work.
        self._cur = [0] * len(_KINDS)
        self._steps: deque[tuple[int, ...]] = deque(maxlen=keep)

    def add(self, kind: str, ns: int) -> None:
        i = _INDEX[kind]
        with self._lock:
            self._cur[i] += ns

    def add_replay(self, wait: int, arm: int, launch: int) -> None:
        """``add`` of a replay's three kinds at once, in ns: ``wait``, ``arm`` and the
        engine's ``launch`` (one lock a replay, not three: its caller is cold)."""
        with self._lock:
            cur = self._cur
            cur[_WAIT] += wait
            cur[_ARM] += arm
            cur[_LAUNCH] += launch

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Count the time inside the block as ``kind``."""
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter_ns() - t0)

    def end_step(self, kind: str | None = None, ns: int = 0) -> None:
        """Close the step's sample (adding ``ns`` to ``kind`` first, in the same call)."""
        with self._lock:
            cur = self._cur
            if kind is not None:
                cur[_INDEX[kind]] += ns
            self._steps.append(tuple(cur))
            self._cur = [0] * len(_KINDS)

    def take(self) -> list[dict[str, int]]:
        """Every step's nanoseconds by hook since the last call, oldest first."""
        with self._lock:
            steps, self._steps = list(self._steps), deque(maxlen=self._steps.maxlen)
        return [dict(zip(_KINDS, s, strict=True)) for s in steps]

    def summary(self) -> str:
        """``host us per engine step over N: total p50 a p99 b, step ..., arm ..., ...;
        graph launch p50 c p99 d, results wait p50 e p99 f``, drained (the stats line's
        part). ``total`` is ours (:data:`HOST_KINDS`); the launch and the results' wait
        are the engine's (:data:`ENGINE_KINDS`), apart."""
        steps = self.take()
        if not steps:
            return "host us per engine step: no steps"

        def pct(name: str, ns: list[int]) -> str:
            us = sorted(x / 1e3 for x in ns)
            return f"{name} p50 {percentile(us, 50):.1f} p99 {percentile(us, 99):.1f}"

        ours = [pct("total", [sum(s[k] for k in HOST_KINDS) for s in steps])]
        ours += [pct(k, [s[k] for s in steps]) for k in HOST_KINDS]
        engine = [pct(_ENGINE_LABELS[k], [s[k] for s in steps]) for k in ENGINE_KINDS]
        return f"host us per engine step over {len(steps)}: {', '.join(ours)}; {', '.join(engine)}"


class NoHostTime:
    """:class:`HostTime`'s calls, counting nothing: the accountant of hooks whose host time
    nothing reads (no stats line). Chosen once, at the start: counting costs the engine's
    thread ~10 us a step once the engine's own work has evicted it from the caches (four
    tables, through vLLM's runner classes on a 2-vCPU VM: ``benchmarks/bench_hooks.py
    --hooks ours,ours-stats``)."""

    __slots__ = ()

    def add(self, kind: str, ns: int) -> None:
        return None

    def add_replay(self, wait: int, arm: int, launch: int) -> None:
        return None

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        yield

    def end_step(self, kind: str | None = None, ns: int = 0) -> None:
        return None

    def take(self) -> list[dict[str, int]]:
        return []

    def summary(self) -> str:
        return "host us per engine step: not counted"


@dataclass(frozen=True)
class GraphTimes:
    """Timed launches over an interval, in microseconds of the GPU's clock (see
    :class:`GraphClock`)."""

    launches: int
    span_p50_us: float
    span_p99_us: float
    period_p50_us: float | None
    """A launch's start to the next timed launch's start, over consecutive pairs (``None``
    with fewer than two)."""
    outside_p50_us: float | None
    """``period - span`` per pair: the device's time between a graph's end and the next
    graph's start (the engine's eager work there, or the device idle, waiting for the
    host's next launch)."""
    dropped: int = 0
    """Launches recorded but not read before the clock's window filled."""
    by_key: tuple[tuple[int, int, float], ...] = ()
    """``(key, launches, span p50 us)`` of each key the launches were timed with (a FULL
    graph's batch size), most launches first; empty when none was given. A p50 over a
    load whose batches vary mixes graph sizes; two servers compare at equal keys."""
    launch_host_us: tuple[float, float] | None = None
    """``(p50, p99)`` of the launch call itself on the host (the engine's thread in
    ``cudaGraphLaunch`` and what wraps it), over every launch timed in the interval."""
    results_us: tuple[float, float] | None = None
    """``(p50, p99)`` of the engine's wait for a step's results (:meth:`GraphClock.results`:
    vLLM's ``get_output`` under async scheduling), ``None`` where none was handed out."""

    def text(self) -> str:
        """``N graphs on the GPU: span us p50 a p99 b; period p50 c; outside the graph p50
        d``, then ``; host launch us p50 e p99 f``, ``; results wait us p50 g p99 h`` and
        ``; span p50 by size: k xn s, ...`` where measured (the line :class:`GraphClock`
        users log)."""
        out = (
            f"{self.launches} graphs on the GPU: span us p50 {self.span_p50_us:.1f} "
            f"p99 {self.span_p99_us:.1f}"
        )
        if self.period_p50_us is not None and self.outside_p50_us is not None:
            out += (
                f"; period p50 {self.period_p50_us:.1f}; outside the graph p50 "
                f"{self.outside_p50_us:.1f}"
            )
        out += f"; {self.dropped} dropped" if self.dropped else ""
        if self.launch_host_us is not None:
            p50, p99 = self.launch_host_us
            out += f"; host launch us p50 {p50:.1f} p99 {p99:.1f}"
        if self.results_us is not None:
            p50, p99 = self.results_us
            out += f"; results wait us p50 {p50:.1f} p99 {p99:.1f}"
        if self.by_key:
            sizes = ", ".join(f"{k} x{n} {p50:.1f}" for k, n, p50 in self.by_key)
            out += f"; span p50 by size: {sizes}"
        return out


class GraphClock:
    """How long each timed launch (a CUDA graph's replay) ran on the GPU, and what the GPU
    did between launches, from two timing events recorded on the launch's stream around
    it: no kernel, no fence, nothing captured (an event record is a command of the
    stream's queue, stamped when the queue reaches it).

    :meth:`around` runs one launch between its events, from the launching thread (with an
    integer ``key``, e.g. the graph's batch size, :meth:`summary` also gives each key's
    span);
    :meth:`take` reads the launches the GPU has finished, oldest first, and recycles their
    events (never blocks). At most ``window`` launches wait unread; beyond it the oldest
    are dropped and counted. ``event`` makes one timing event (default: torch's CUDA
    event; tests pass their own).

    On the host's side, :meth:`around` also times the launch call itself, and
    :meth:`results` times the engine's wait for a step's results: :meth:`summary` gives
    both (the last ``window`` of each), so an engine with its tables on the GPU and one
    with deferred rows compare there too, not only on the GPU."""

    def __init__(self, window: int = 4096, event: Callable[[], Any] | None = None) -> None:
        if window < 2:
            raise ValueError(f"window must be at least 2 launches, got {window}")
        self._window = int(window)
        self._event = event or _cuda_timing_event
        self._lock = threading.Lock()
        self._pending: deque[tuple[Any, Any, int | None]] = deque()
        self._spare: list[Any] = []
        self._dropped = 0
        self._last_start: Any = None
        """The start event of the last launch read (the next period's other end)."""
        self._last_span = 0.0
        self._launch_ns: deque[int] = deque(maxlen=self._window)
        self._results_ns: deque[int] = deque(maxlen=self._window)

    def _new(self) -> Any:
        return self._spare.pop() if self._spare else self._event()

    def around(self, launch: Callable[[], T], stream: Any = None, key: int | None = None) -> T:
        """``launch()``, with an event recorded on ``stream`` (default: the current
        stream) before and after it; ``key`` labels the launch in :meth:`summary`."""
        with self._lock:
            start, end = self._new(), self._new()
            if len(self._pending) >= self._window:
                self._pending.popleft()  # its events are abandoned, not recycled
                self._dropped += 1
                self._last_start = None
        start.record(stream)  # None: the current stream
        t0 = time.perf_counter_ns()
        out = launch()
        ns = time.perf_counter_ns() - t0
        end.record(stream)
        with self._lock:
            self._pending.append((start, end, key))
            self._launch_ns.append(ns)
        return out

    def results(self, get: Callable[[], T]) -> Callable[[], T]:
        """``get`` (a step's results, e.g. vLLM's ``get_output``), timed when called: the
        engine's wait for the step on the GPU, in :meth:`summary`'s ``results_us``."""

        def timed() -> T:
            t0 = time.perf_counter_ns()
            out = get()
            ns = time.perf_counter_ns() - t0
            with self._lock:
                self._results_ns.append(ns)
            return out

        return timed

    def take(self) -> list[tuple[float, float | None]]:
        """``(span_us, period_us)`` of every launch the GPU has finished since the last
        call, oldest first. ``period_us`` runs from the previous launch's start to this
        one's; ``None`` when the previous launch is unknown (the first, or after a drop)."""
        return [(span, period) for span, period, _, _ in self._take()]

    def _take(self) -> list[tuple[float, float | None, float | None, int | None]]:
        # (span, period, outside, key): outside = this period less the previous launch's
        # span.
        out: list[tuple[float, float | None, float | None, int | None]] = []
        with self._lock:
            while self._pending and self._pending[0][1].query():
                start, end, key = self._pending.popleft()
                span = float(start.elapsed_time(end)) * 1e3
                prev = self._last_start
                period = outside = None
                if prev is not None:
                    period = float(prev.elapsed_time(start)) * 1e3
                    outside = period - self._last_span
                    self._spare.append(prev)
                out.append((span, period, outside, key))
                self._spare.append(end)
                self._last_start, self._last_span = start, span
        return out

    def summary(self) -> GraphTimes | None:
        """The launches :meth:`take` would return, as percentiles (``None`` if none
        finished)."""
        got = self._take()
        if not got:
            return None  # the host's times wait for the launches they go with
        with self._lock:
            dropped, self._dropped = self._dropped, 0
            launch_ns, results_ns = list(self._launch_ns), list(self._results_ns)
            self._launch_ns.clear()
            self._results_ns.clear()
        spans = sorted(s for s, _, _, _ in got)
        periods = sorted(p for _, p, _, _ in got if p is not None)
        outside = sorted(o for _, _, o, _ in got if o is not None)
        keyed: dict[int, list[float]] = {}
        for span, _, _, key in got:
            if key is not None:
                keyed.setdefault(key, []).append(span)
        by_key = tuple(
            (k, len(v), percentile(sorted(v), 50))
            for k, v in sorted(keyed.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        )
        return GraphTimes(
            launches=len(spans),
            span_p50_us=percentile(spans, 50),
            span_p99_us=percentile(spans, 99),
            period_p50_us=percentile(periods, 50) if periods else None,
            outside_p50_us=percentile(outside, 50) if outside else None,
            dropped=dropped,
            by_key=by_key,
            launch_host_us=_p50_p99_us(launch_ns),
            results_us=_p50_p99_us(results_ns),
        )


def _p50_p99_us(ns: list[int]) -> tuple[float, float] | None:
    if not ns:
        return None
    us = sorted(x / 1e3 for x in ns)
    return percentile(us, 50), percentile(us, 99)


def _cuda_timing_event() -> Any:
    from ._common import optional_torch

    torch = optional_torch()
    if torch is None:
        raise RuntimeError("GraphClock needs torch with CUDA (or an event factory)")
    return torch.cuda.Event(enable_timing=True)
