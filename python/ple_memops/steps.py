"""The engine-neutral step driver: :class:`StepDriver` runs the steps of a
:class:`~ple_memops.plan.RowsPlan` for any engine.

An engine integration keeps only what is specific to its engine (finding the tables and
layers, where the PLE op sits, the engine's capture and replay calls) and drives every
step through one driver::

    driver = StepDriver(plan)                    # load time, outside any capture

    # capture (deferred mode): inside the engine's PLE op
    staged = driver.stage(name, ids, rows=n)     # graph-computed ids: publish + wait/copy
    staged = driver.stage_host_fed(name, rows=n) # host-fed steps: the wait/copy only
    ...; staged.join()                           # right before the consumer

    # replay
    driver.launch(n, graph.replay)               # arm (completing the oldest step first
                                                 # when `depth` are armed), then launch;
                                                 # any exception aborts the plan
    driver.arm(n); graph.replay()                # the same in two calls
    done = driver.advance(n); graph.replay()     # arm(n), timed: (completed, wait_ns, arm_ns)
    done = driver.stepper(n)                     # the same as one native call (the plan's
                                                 # stepper); on a failure: abort_on, raise
    driver.publish_host(name, ids)               # host-known ids, before the launch
    driver.publish_host_later(name, ids_of)      # ... or from the driver's publisher
                                                 # thread once ids_of() returns them
    driver.settle(limit)                         # after the launch: complete the oldest
                                                 # steps until at most `limit` are armed
    driver.drain()                               # complete every armed step

    # eager forwards with data, deferred mode: one more step, nothing waits on the host
    driver.arm(n)
    staged = driver.stage_eager(name, ids, rows=n)   # side stream per table; join() later

    # eager steps (warm-up, profiling, the synchronous fallback)
    rows = driver.gather_now(name, ids)          # drains first; may synchronise (eager)
    rows = driver.gather_many_now({name: host_ids, ...})  # every table at once, in parallel
    rows = driver.dummy_now(name, n)             # drains first; no data

    # failures, statistics, shutdown
    with driver.guard("engine step"): ...        # any exception aborts the plan
    driver.abort_on("engine step", exc)          # the same, for an exception caught
    driver.counters(name).since(base)            # StepCounters: armed, completed, fills,
                                                 # mean fill time, GPU waits
    driver.drain_for_shutdown()                  # bounded, never raises (aborts instead)
    driver.shutdown()                            # drain, then close the plan

Every completion waits at most :attr:`StepDriver.timeout` seconds; a failed completion
aborts the plan (the GPU is released for good, later calls raise
:class:`~ple_memops.PoisonedError`) and raises the first error. Like the plan, a driver
is driven from one thread; its publisher thread only calls the plan's thread-safe
``publish_host``.

Porting an engine's runner hooks (``vllm/hooks.py``'s ``PleRunnerHooks``) onto it:
``replay(desc, launch)`` is ``driver.launch(rows, launch)`` for a graph that waits for
rows; ``quiesce()`` and ``release_graphs()`` call ``driver.drain()``; the PLE op's eager
branch calls ``driver.gather_now`` / ``driver.dummy_now`` (which drain first) and its
capture branch ``driver.stage``; ``step()``'s abort-on-exception is ``driver.guard``;
``abort``, ``drain_for_shutdown`` and ``shutdown`` map one to one (``StepDriver(plan,
log=logger)`` logs aborts as the hooks do); ``armed_steps`` is the driver's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar

from .errors import ClosedError, StateError
from .settings import DEFAULTS

__all__ = ["PlanLike", "StagedLike", "StepCounters", "StepDriver"]


class StagedLike(Protocol):
    """A staged table's rows for one step (:class:`~ple_memops.StagedRows`)."""

    def join(self, stream: Any = None) -> Any: ...


class PlanLike(Protocol):
    """What :class:`StepDriver` and the engines' hooks use of a rows plan
    (:class:`~ple_memops.plan.RowsPlan`)."""

    @property
    def mode(self) -> str: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def layers(self) -> Mapping[str, Any]: ...
    @property
    def timeout(self) -> float: ...
    @property
    def poison_cause(self) -> str | None: ...
    def stage(self, name: str, ids: Any, *, rows: int) -> StagedLike: ...
    def stage_eager(self, name: str, ids: Any, *, rows: int) -> StagedLike: ...
    def begin(
        self, rows: int, *, eager: bool = False, expected: Mapping[str, Any] | None = None
    ) -> Any: ...
    def publish_host(self, name: str, ids: Any, timeout: float | None = None) -> None: ...
    def complete(self, timeout: float | None = None) -> None: ...
    def gather_now(
        self, name: str, ids: Any, rows: int | None = None, *, stream: Any = None
    ) -> Any: ...
    def gather_many_now(
        self, ids: Mapping[str, Any], rows: int | None = None, *, stream: Any = None
    ) -> dict[str, Any]: ...
    def dummy_now(self, name: str, rows: int, *, stream: Any = None) -> Any: ...
    def staging(self, name: str, n: int | None = None) -> Any: ...
    def stats(self) -> Mapping[str, Any]: ...
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...


T = TypeVar("T")


def _mean_us(total_ns: int, n: int) -> float | None:
    return total_ns / 1e3 / n if n else None


@dataclass(frozen=True)
class StepCounters:
    """What a driver counted (and its plan's objects), totals or differences."""

    armed: int = 0
    """Steps the driver armed."""
    completed: int = 0
    """Steps the driver completed."""
    fills: int = 0
    """Fills of the gather workers (deferred mode)."""
    fill_ns_total: int = 0
    """The workers' time from seeing a step's ids to its FILLED store, summed."""
    eager_fills: int = 0
    """Of ``fills``, those of eager forwards' steps (:meth:`StepDriver.arm` with
    ``eager=True``); the rest are replays."""
    eager_fill_ns_total: int = 0
    """Of ``fill_ns_total``, the eager forwards' fills."""
    gpu_waited: int = 0
    """Fills that found the GPU already waiting (plans built with ``track_arrival``)."""
    completes_waited: int = 0
    """Completions that found a worker's step not yet filled and waited for it."""
    complete_wait_ns_total: int = 0
    """How long those completions waited, summed."""
    expected_steps: int = 0
    """Steps armed with the ids the host expected (``arm(expected=...)``)."""
    expected_rows_early: int = 0
    """Their rows gathered before the step's ids were published."""
    expected_rows_wrong: int = 0
    """Their rows expected with another id than the published one (gathered again)."""

    def since(self, base: StepCounters) -> StepCounters:
        """What was counted after ``base`` (an earlier :meth:`StepDriver.counters`)."""
        return StepCounters(
            **{f.name: getattr(self, f.name) - getattr(base, f.name) for f in fields(self)}
        )

    @property
    def mean_fill_us(self) -> float | None:
        """Mean worker fill time in microseconds (``None`` without fills)."""
        return _mean_us(self.fill_ns_total, self.fills)

    @property
    def replay_fills(self) -> int:
        """Fills of replayed steps (``fills`` less the eager ones)."""
        return self.fills - self.eager_fills

    @property
    def mean_replay_fill_us(self) -> float | None:
        """Mean fill time of replayed steps in microseconds (``None`` without any)."""
        return _mean_us(self.fill_ns_total - self.eager_fill_ns_total, self.replay_fills)

    @property
    def mean_complete_wait_us(self) -> float | None:
        """Mean wait of the completions that waited, in microseconds (``None``: none did)."""
        return _mean_us(self.complete_wait_ns_total, self.completes_waited)

    @property
    def mean_eager_fill_us(self) -> float | None:
        """Mean fill time of eager forwards' steps in microseconds (``None`` without any)."""
        return _mean_us(self.eager_fill_ns_total, self.eager_fills)


class _Guard:
    """:meth:`StepDriver.guard`'s context (a class: entered on every step, it must cost
    less than a generator-based context manager)."""

    __slots__ = ("_driver", "_what")

    def __init__(self, driver: StepDriver, what: str | Callable[[], str]) -> None:
        self._driver, self._what = driver, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            what = self._what() if callable(self._what) else self._what
            self._driver.abort_on(what, exc)
        # None: the exception, if any, propagates.


class StepDriver:
    """Runs the steps of one rows plan (see the module docs).

    Args:
        plan: a :class:`~ple_memops.plan.RowsPlan` (or any :class:`PlanLike`).
        depth: steps armed at once (default :data:`~ple_memops.settings.DEFAULTS`'s;
            the plan's workers must allow as many).
        timeout: seconds each completion waits for a step's fill (default: the plan's
            ``timeout``; :attr:`stepper` binds the value it has when the driver is made).
        log: a logger that reports every abort (an engine's own words), or ``None``.
    """

    def __init__(
        self,
        plan: PlanLike,
        *,
        depth: int | None = None,
        timeout: float | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        # Checked by the settings' own rules (the one place they are written).
        depth = DEFAULTS.depth if depth is None else depth
        DEFAULTS.replace(depth=depth, **({} if timeout is None else {"timeout": timeout}))
        self.plan = plan
        self.depth = depth
        self._timeout = None if timeout is None else float(timeout)
        self._log = log
        self._closed = False
        self._aborted = False
        # Steps armed and completed here, besides the stepper's (its own counts).
        self._armed = 0
        self._completed = 0
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._publishes: dict[int, concurrent.futures.Future[None]] = {}
        # The plan's one-call step (RowsPlan.advance), if it has one.
        self._advance: Callable[..., tuple[int, int, int]] | None = getattr(plan, "advance", None)
        # ... and the same as one native callable, depth and timeout bound
        # (RowsPlan.stepper: deferred plans).
        make = getattr(plan, "stepper", None)
        self.stepper: Callable[..., tuple[int, int, int]] | None = (
            make(depth, self.timeout) if make is not None and plan.mode == "deferred" else None
        )
        """The driver's step as one native call, for a serving loop that makes it every
        step: ``stepper(rows, eager=False)`` arms as :meth:`advance` does (completing the
        oldest steps while :attr:`depth` are armed) and returns the same ``(steps
        completed, ns completing, ns arming)``, counted in :attr:`armed_steps` and
        :attr:`completed_steps`; ``None`` for a plan without one (synchronous plans). It
        does not abort the plan on a failure: catch the exception and call
        :meth:`abort_on`. It does not wait for :meth:`publish_host_later`'s publishes
        (a caller that uses those arms through :meth:`advance`). The plan closes it at
        :meth:`shutdown` (later calls raise :class:`~ple_memops.ClosedError`)."""

    # -- state ----------------------------------------------------------------------------

    @property
    def armed_steps(self) -> int:
        """Steps armed (through :attr:`stepper` too)."""
        step: Any = self.stepper
        return self._armed + (step.armed if step is not None else 0)

    @property
    def completed_steps(self) -> int:
        """Steps completed (through :attr:`stepper` too)."""
        step: Any = self.stepper
        return self._completed + (step.completed if step is not None else 0)

    @property
    def timeout(self) -> float:
        """Seconds each completion waits for a step's fill."""
        if self._timeout is not None:
            return self._timeout
        return float(self.plan.timeout)

    @property
    def mode(self) -> str:
        """The plan's mode: ``"deferred"``, ``"sync"`` or ``"host"``."""
        return str(self.plan.mode)

    @property
    def deferred(self) -> bool:
        return self.mode == "deferred"

    @property
    def in_flight(self) -> int:
        """Steps armed and not yet completed."""
        return int(self.plan.in_flight)

    @property
    def closed(self) -> bool:
        return self._closed

    def staging(self, name: str, n: int) -> Any:
        """The stable ``uint8 [n, row_bytes]`` view the consumers of ``name`` read."""
        return self.plan.staging(name, n)

    # -- captured steps ---------------------------------------------------------------------

    def stage(self, name: str, ids: Any, *, rows: int) -> Any:
        """Under capture (or an eager pass of the captured path): publish ``ids`` (a
        graph-static CUDA tensor) and fork the consumer's wait and copy onto a side
        stream. Returns the :class:`~ple_memops.StagedRows` to join before the consumer."""
        return self.plan.stage(name, ids, rows=rows)

    def stage_eager(self, name: str, ids: Any, *, rows: int) -> Any:
        """An eager forward's rows in deferred mode, after :meth:`arm`: the publish and
        the wait/copy on a side stream of the table's (``RowsPlan.stage_eager``), so the
        host's gathers of every table run in parallel with the GPU work before the
        consumer. Returns what to join before the consumer."""
        return self.plan.stage_eager(name, ids, rows=rows)

    def stage_host_fed(self, name: str, *, rows: int) -> Any:
        """The consumer's wait and copy only, for steps whose ids the host publishes
        (:meth:`publish_host`): the graph publishes nothing of its own."""
        return self.plan.layers[name].rows.stage(rows=rows)

    # -- replayed steps ---------------------------------------------------------------------

    def arm(
        self, rows: int, *, eager: bool = False, expected: Mapping[str, Any] | None = None
    ) -> None:
        """Arm every table for a step of ``rows`` rows, completing the oldest steps first
        while :attr:`depth` are armed (so under asynchronous scheduling the host waits for
        a fill only when it is ``depth`` steps ahead). ``eager``: the step of an eager
        forward, not a replay (its fills are counted apart). ``expected``: per table, the
        ids the host expects the step to publish (``RowsPlan.begin``). A failure aborts
        the plan."""
        self._check_open()
        one_call = self.stepper is not None or self._advance is not None
        if not expected and one_call and not self._publishes:
            self.advance(rows, eager=eager)
        else:
            self._arm_call_by_call(rows, eager, expected)

    def _arm_call_by_call(self, rows: int, eager: bool, expected: Mapping[str, Any] | None) -> None:
        """:meth:`arm` through the plan's ``complete`` and ``begin`` (expected ids, a
        pending host publish, a plan without ``advance``)."""
        with self.guard(lambda: f"arming a step of {rows} rows"):
            armed = self.in_flight
            while armed >= self.depth:
                self._complete_one(armed)
                armed -= 1
            if expected:
                self.plan.begin(int(rows), eager=eager, expected=expected)
            else:
                self.plan.begin(int(rows), eager=eager)
            self._armed += 1

    def advance(self, rows: int, *, eager: bool = False) -> tuple[int, int, int]:
        """:meth:`arm` (without expected ids), timed in two parts: returns ``(steps
        completed, ns completing them, ns arming)``. A deferred
        :class:`~ple_memops.plan.RowsPlan` does both in one native call for every table
        (:attr:`stepper`), which times them itself (unless a publish of
        :meth:`publish_host_later` is pending); any other plan through :meth:`settle` and
        :meth:`arm`, timed around them. A failure aborts the plan. (A plain tuple: a
        serving loop calls this every step, and building a named tuple cold costs
        microseconds; a caller that wants its own Python in the arming times the call
        itself, as the vLLM hooks do.)"""
        if self._closed:
            raise ClosedError("the step driver is shut down")
        step = self.stepper
        if step is not None and not self._publishes:
            # A serving loop's every step: no guard object, no closure; the stepper counts
            # the step.
            try:
                return step(rows, eager)
            except BaseException as exc:
                self.abort_on(f"arming a step of {rows} rows", exc)
                raise
        fast = self._advance
        if fast is None or self._publishes:
            t0 = time.perf_counter_ns()
            before = self.completed_steps
            self.settle(self.depth - 1)
            t1 = time.perf_counter_ns()
            self._arm_call_by_call(rows, eager, None)  # nothing left to complete
            return (self.completed_steps - before, t1 - t0, time.perf_counter_ns() - t1)
        try:
            done = fast(rows, self.depth, eager=eager, timeout=self._timeout)
        except BaseException as exc:
            self.abort_on(f"arming a step of {rows} rows", exc)  # the plan aborted itself
            raise
        self._completed += done[0]
        self._armed += 1
        return done

    def launch(self, rows: int, launch: Callable[[], T], *, what: str = "") -> T:
        """:meth:`arm`, then ``launch()`` (the engine's replay); any exception between
        the two, or in the launch, aborts the plan (``what`` names the launch in the
        abort's reason)."""
        self.arm(rows)
        with self.guard(what or "the launch of an armed step"):
            return launch()

    def publish_host(self, name: str, ids: Any) -> None:
        """Host-known ids of the oldest armed step that has none yet, for ``name``'s
        worker (``RowsPlan.publish_host``): call after :meth:`arm`, before the launch or
        from another thread, never as a fill on the launching thread after it."""
        self.plan.publish_host(name, ids, timeout=self.timeout)

    def publish_host_later(self, name: str, ids_of: Callable[[], Any]) -> None:
        """Publish the ids of the step armed last from the driver's publisher thread,
        once ``ids_of()`` returns them (it may block, e.g. until the previous step's
        tokens reach the host). Completing that step first waits (bounded) for the
        publish; :meth:`stop_publisher` ends the thread."""
        self._check_open()
        if self.armed_steps == 0 or self.in_flight == 0:
            raise StateError("publish_host_later() needs an armed step: arm() first")
        if self._publisher is None:
            self._publisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ple-ids")
        step = self.armed_steps - 1
        self._publishes[step] = self._publisher.submit(lambda: self.publish_host(name, ids_of()))

    def complete_oldest(self) -> None:
        """Complete the oldest armed step (waiting at most :attr:`timeout`); a failure
        aborts the plan and is raised."""
        self._check_open()
        self._complete_one()

    def settle(self, limit: int = 0) -> None:
        """Complete the oldest steps until at most ``limit`` are armed (after a launch:
        ``0`` under synchronous scheduling, ``depth - 1`` under asynchronous)."""
        self._check_open()
        # One count, then one completion a step: each completes the oldest step of every
        # table or raises (asking the plan again each time costs a serving loop's step).
        armed = self.in_flight
        while armed > limit:
            self._complete_one(armed)
            armed -= 1

    def drain(self) -> None:
        """Complete every armed step (before eager work, captures, dropping graphs); a
        failure aborts the plan and is raised."""
        self.settle(0)

    # -- eager steps ------------------------------------------------------------------------

    def gather_now(
        self, name: str, ids: Any, rows: int | None = None, *, stream: Any = None
    ) -> Any:
        """An eager step with data: :meth:`drain`, then ``RowsPlan.gather_now`` (ids to
        the host, which may synchronise with the device: the eager path allows it).
        Returns ``staging[:n]``."""
        self.drain()
        return self.plan.gather_now(name, ids, rows, stream=stream)

    def gather_many_now(
        self, ids: Any, rows: int | None = None, *, stream: Any = None
    ) -> dict[str, Any]:
        """Several tables' eager rows from ids already on the host: :meth:`drain`, then
        ``RowsPlan.gather_many_now`` (the gathers in parallel, no device synchronisation).
        Returns ``{name: staging[:n]}``."""
        self.drain()
        return dict(self.plan.gather_many_now(ids, rows, stream=stream))

    def dummy_now(self, name: str, rows: int, *, stream: Any = None) -> Any:
        """An eager step without data (profile, warm-up, dummy runs): :meth:`drain`, then
        ``RowsPlan.dummy_now``. Returns ``staging[:rows]``."""
        self.drain()
        return self.plan.dummy_now(name, rows, stream=stream)

    # -- failures and lifecycle ---------------------------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise now if any table's rows failed (a fill that failed, an abort): the armed
        steps are completed so the worker's typed error comes out (or
        :class:`~ple_memops.PoisonedError`). An engine calls it before it hands out a
        step's results, once the GPU finished the step: a step whose rows failed read
        zeros, and its output must not reach anyone."""
        cause = self.plan.poison_cause
        if cause is None:
            return
        self.drain()  # raises the first failure (the plan is aborted)
        from .errors import PoisonedError

        raise PoisonedError(cause)

    def guard(self, what: str | Callable[[], str]) -> _Guard:
        """A context in which any exception (``KeyboardInterrupt`` included) aborts the
        plan, so no GPU wait outlives a failed step, and is re-raised. ``what`` names the
        work in the abort's reason; a callable is called only then (a serving loop's
        guards cost no formatting)."""
        return _Guard(self, what)

    def abort(self, reason: str) -> None:
        """Release every GPU wait for good (idempotent); later calls raise
        :class:`~ple_memops.PoisonedError`. The log has the first abort as an error, the
        later ones (the same failure reaching each scope around it) at debug level."""
        if self._log is not None:
            level = logging.DEBUG if self._aborted else logging.ERROR
            self._log.log(level, "ple-memops: aborting deferred PLE rows: %s", reason)
        self._aborted = True
        self.plan.abort(reason)

    def abort_on(self, what: str, exc: BaseException) -> None:
        """:meth:`abort` for an exception in ``what`` (the reason names both); nothing once
        the driver is shut down. What :meth:`guard` does, for a caller on a serving loop's
        every step that catches the exception itself rather than build a guard."""
        if not self._closed:
            self.abort(f"exception in {what}: {exc!r}")

    def stop_publisher(self) -> None:
        """End the publisher thread of :meth:`publish_host_later` (if any) without waiting:
        a publish still under way ends within its bounded wait."""
        pool, self._publisher = self._publisher, None
        self._publishes.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def drain_for_shutdown(self) -> None:
        """Complete the armed steps, bounded; a failure is logged and aborts the plan
        instead of raising, so no captured wait can hold the device. Idempotent; the plan
        stays open until :meth:`shutdown`."""
        if self._closed:
            return
        try:
            self.drain()
        except BaseException as exc:
            if self._log is not None:
                self._log.error("ple-memops: pending PLE rows failed at shutdown: %r", exc)
            self.plan.abort(f"shutdown: {exc!r}")
        finally:
            self.stop_publisher()

    def shutdown(self) -> None:
        """:meth:`drain_for_shutdown`, then close the plan (idempotent). A caller that
        synchronises the device drains first, synchronises, then calls this, so nothing
        the GPU may still read is freed."""
        if self._closed:
            return
        self.drain_for_shutdown()
        self._closed = True
        self.plan.close()

    # -- statistics -------------------------------------------------------------------------

    def counters(self, name: str | None = None) -> StepCounters:
        """The driver's step counts and the fill counters of table ``name`` (default:
        every table summed). Subtract an earlier value with :meth:`StepCounters.since`."""
        fills = fill_ns = waited = eager = eager_ns = late = late_ns = 0
        expected = early = wrong = 0
        for table, (rows, worker) in self.plan.stats().items():
            if name is not None and table != name:
                continue
            waited += rows.gpu_waited
            if worker is not None:
                fills += worker.fills
                fill_ns += worker.ready_to_filled_ns_total
                eager += worker.eager_fills
                eager_ns += worker.eager_fill_ns_total
                late += worker.completes_waited
                late_ns += worker.complete_wait_ns_total
                expected += worker.expected_steps
                early += worker.expected_rows_early
                wrong += worker.expected_rows_wrong
        return StepCounters(
            armed=self.armed_steps,
            completed=self.completed_steps,
            fills=fills,
            fill_ns_total=fill_ns,
            gpu_waited=waited,
            eager_fills=eager,
            eager_fill_ns_total=eager_ns,
            completes_waited=late,
            complete_wait_ns_total=late_ns,
            expected_steps=expected,
            expected_rows_early=early,
            expected_rows_wrong=wrong,
        )

    # -- helpers ----------------------------------------------------------------------------

    def _complete_one(self, armed: int | None = None) -> None:
        """Complete the oldest armed step (``armed``: the steps armed now, if known)."""
        oldest = self.armed_steps - (self.in_flight if armed is None else armed)
        if self._publishes:
            self._published(oldest)
        self.plan.complete(timeout=self.timeout)  # aborts the plan itself on a failure
        self._completed += 1

    def _published(self, step: int) -> None:
        """Wait (bounded: the worker's own waits are) for the publisher thread's publish
        of ``step``, if it has one; its error is the step's."""
        fut = self._publishes.pop(step, None)
        if fut is None:
            return
        bound = 2 * self.timeout + 5.0
        try:
            fut.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            self.abort(f"step {step}: the publisher thread did not return")
            raise StateError(
                f"step {step}: the publisher thread did not publish within {bound:.0f} s "
                "(the GPU was released)"
            ) from None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the step driver is shut down")

    def __repr__(self) -> str:
        return (
            f"StepDriver(mode={self.mode!r}, depth={self.depth}, in_flight={self.in_flight}, "
            f"armed={self.armed_steps}, closed={self._closed})"
        )
