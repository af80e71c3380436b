"""One device's PLE tables driven as one: :class:`Steps`, the object every engine
integration runs its steps through.

A :class:`Steps` is built once at load time, outside any graph capture: one
:class:`~ple_memops.DeferredRows` per table (a stable staging buffer that captured
kernels read) and, where the device runs the deferred protocol, one
:class:`~ple_memops.GatherWorker` each. Every table gets the same mode: a graph never mixes
a deferred consumer with one that needs its rows before the launch. When the tables cannot
defer (no capability, ``deferred=False``, a worker that cannot start), :attr:`Steps.reason`
says why (and the ``ple_memops`` logger, once).

The step policy is native (``_native.Steps``): arming a step on every table (completing
the oldest while ``depth`` are armed), settling and draining, all-or-none failure (any
failure aborts every table, so no captured consumer waits for rows that will not come,
and no step's rows are silently wrong), bounded waits, shutdown and the counts. This
module is its thin face: building the tables, the stream-side calls (staging under
capture and in eager forwards), the synchronous path, statistics::

    steps = Steps.build({"layer2": t2, "layer7": t7}, max_rows=n_max, device=0)

    # capture (deferred mode): ids computed by the graph itself
    staged = steps.stage("layer2", ids, rows=n)     # publish + wait/copy on a side stream
    ...                                             # layers before the consumer
    staged.join()                                   # the consumer's edge
    rows = steps.staging("layer2", n)               # uint8 [n, row_bytes]

    # replay
    steps.arm(n); graph.replay()       # one native call: arm every table, completing the
                                       # oldest step first while `depth` are armed
    steps.publish_host(name, ids)      # host-known ids, before the launch
    steps.settle(limit); steps.drain() # complete the oldest steps

    # eager forwards: deferred too, or synchronous
    steps.arm(n, eager=True)
    staged = steps.stage_eager(name, ids, rows=n)   # a side stream per table; join later
    rows = steps.gather_now(name, ids)              # drains first; may synchronise
    rows = steps.dummy_now(name, n)                 # drains first; no data

    steps.raise_if_failed()            # before an engine hands out a step's results
    steps.shutdown()                   # drain (bounded, never raises), close
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from . import _native
from ._common import host_ids, optional_torch, parse_device
from ._deferred import (
    DeferredRows,
    StagedRows,
    StallSamples,
    native_rows,
    own_stream,
    probe,
    stamp_arrival,
)
from ._worker import GatherWorker, WorkerStats, native_worker
from .errors import (
    ClosedError,
    InvalidArgumentError,
    PleMemopsError,
    PoisonedError,
    RowShapeError,
    StateError,
)
from .settings import DEFAULTS
from .table import MmapTable

__all__ = ["EagerStaged", "StepCounters", "StepTable", "Steps"]

log = logging.getLogger("ple_memops")

Heads = tuple[Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class StepTable:
    """One table of a :class:`Steps` and the objects that serve it."""

    name: str
    table: MmapTable
    rows: DeferredRows
    worker: GatherWorker | None
    """``None`` unless the tables run in ``deferred`` mode."""


def _mean_us(total_ns: int, n: int) -> float | None:
    return total_ns / 1e3 / n if n else None


@dataclass(frozen=True)
class StepCounters:
    """What a :class:`Steps` counted (and its tables' workers), totals or differences."""

    armed: int = 0
    """Steps armed (every table at once), eager forwards' included."""
    completed: int = 0
    """Steps completed."""
    eager: int = 0
    """Of ``armed``, eager forwards' steps (``arm(n, eager=True)``)."""
    fills: int = 0
    """Fills of the gather workers (deferred mode)."""
    fill_ns_total: int = 0
    """The workers' time from seeing a step's ids to its FILLED store, summed."""
    eager_fills: int = 0
    """Of ``fills``, those of eager forwards' steps; the rest are replays."""
    eager_fill_ns_total: int = 0
    """Of ``fill_ns_total``, the eager forwards' fills."""
    gpu_waited: int = 0
    """Fills that found the GPU already waiting (tables built with ``track_arrival``)."""
    completes_waited: int = 0
    """Completions that found a worker's step not yet filled and waited for it."""
    complete_wait_ns_total: int = 0
    """How long those completions waited, summed."""

    def since(self, base: StepCounters) -> StepCounters:
        """What was counted after ``base`` (an earlier :meth:`Steps.counters`)."""
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


class EagerStaged:
    """One table's rows of an eager step, staged on a side stream by
    :meth:`Steps.stage_eager`; :meth:`join` before the consumer."""

    def __init__(self, side: Any, ids: Any, staged: StagedRows, rows: DeferredRows) -> None:
        self._side, self._ids, self._staged, self._rows = side, ids, staged, rows

    @property
    def stream(self) -> Any:
        """The stream the rows were staged on: the table's own (created by the native core,
        never one of torch's pooled streams, which other code in the process shares)."""
        return self._side

    def join(self, stream: Any = None) -> Any:
        """Make ``stream`` (default: the current stream) wait for the side stream's copy;
        returns ``staging[:rows]``. After it, freeing the ids is ordered after their read."""
        torch = optional_torch()
        cur = torch.cuda.current_stream(self._side.device) if stream is None else stream
        stamp_arrival(self._rows, cur)
        cur.wait_stream(self._side)
        self._ids = None
        return self._staged.join(cur)


class _Guard:
    """:meth:`Steps.guard`'s context (a class: cheaper to enter than a generator's)."""

    __slots__ = ("_steps", "_what")

    def __init__(self, steps: Steps, what: str | Callable[[], str]) -> None:
        self._steps, self._what = steps, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            what = self._what() if callable(self._what) else self._what
            self._steps.abort_on(what, exc)


class Steps:
    """See the module docs. Build with :meth:`build`. Driven from one thread (an engine's
    step loop); the objects inside are thread-safe.

    :attr:`arm` is the native call itself (no Python frame between the engine and the
    step's bookkeeping: a cold call between two engine steps pays for every line it
    touches): ``arm(rows, eager=False)`` returns ``(steps completed, ns completing, ns
    arming)``. A row count out of ``1..=max_rows`` raises
    :class:`~ple_memops.RowShapeError` and changes nothing; any other failure aborts every
    table, then raises. Synchronous tables have nothing to arm
    (:class:`~ple_memops.StateError`).
    """

    arm: Callable[..., tuple[int, int, int]]

    def __init__(
        self,
        tables: Sequence[StepTable],
        mode: str,
        reason: str | None,
        device: int | None,
        depth: int,
        timeout: float,
        *,
        read_in_order: bool = False,
    ) -> None:
        self._tables = {t.name: t for t in tables}
        self._index = {t.name: i for i, t in enumerate(tables)}
        workers = tuple(native_worker(t.worker) for t in tables if t.worker is not None)
        self._native = _native.Steps(
            tuple(native_rows(t.rows) for t in tables),
            workers,
            depth,
            timeout,
            read_in_order and bool(workers),
        )
        self.arm = self._native
        self._mode = mode
        self._reason = reason
        self._device = device
        self._aborted = False
        self._closed = False
        self._gather_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._publishes: dict[int, concurrent.futures.Future[None]] = {}

    # -- construction -----------------------------------------------------------------

    @classmethod
    def build(
        cls,
        tables: Mapping[str, MmapTable] | Sequence[tuple[str, MmapTable]],
        *,
        max_rows: int,
        device: object = None,
        depth: int = DEFAULTS.depth,
        timeout: float = DEFAULTS.timeout,
        id_dtype: str = "int64",
        heads: Heads | Mapping[str, Heads] | None = None,
        deferred: bool = True,
        watchdog: float | None = DEFAULTS.watchdog,
        copy: str = DEFAULTS.copy,
        publish: str = DEFAULTS.publish,
        spin: float | None = DEFAULTS.spin,
        predict_ready: bool = False,
        track_arrival: bool = False,
        time_stalls: bool = False,
        skip_gather: bool = False,
        read_in_order: bool = False,
        log_fallback: bool = True,
    ) -> Steps:
        """One staging buffer of ``max_rows`` rows per table on ``device`` (``"cpu"``,
        ``"cuda:N"``, an ordinal, or ``None`` for CUDA if available), and a worker per
        table where the device defers. ``deferred=False`` forces the synchronous path.
        ``depth``: steps armed at once; ``timeout``: seconds a completion waits for a
        step's fill (both checked by :data:`~ple_memops.settings.DEFAULTS`' rules).
        ``heads``: the per-head map of :class:`~ple_memops.GatherWorker`, one for all
        tables or one per table name. ``track_arrival`` counts fills the GPU had to wait
        for; ``time_stalls`` times each step's consumer stall on the GPU
        (:meth:`stall_samples`); ``skip_gather`` (diagnostics only: wrong rows) fills
        without reading the tables, and ``predict_ready`` places each worker's hot window
        where READY is expected, see :class:`~ple_memops.GatherWorker`. ``read_in_order``
        (deferred tables): each step's reads from storage are taken table by table in the
        order of ``tables``, which must be the order the GPU consumes their rows, for a
        model that publishes every table's ids before it consumes any (see
        :attr:`reads_in_order`). Raises only for
        bad arguments; a device that cannot defer gives ``sync`` tables with
        :attr:`reason`, logged once unless ``log_fallback=False`` (for a caller that says
        it in its own words)."""
        items = list(tables.items()) if isinstance(tables, Mapping) else list(tables)
        if not items:
            raise InvalidArgumentError("Steps need at least one table")
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"table names must be unique, got {names}")
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows <= 0:
            raise InvalidArgumentError(f"max_rows must be a positive int, got {max_rows!r}")
        DEFAULTS.replace(timeout=timeout, depth=depth)  # checked by the settings' rules
        torch = optional_torch()
        if torch is None:
            raise InvalidArgumentError("Steps need torch (their staging buffers are tensors)")
        ordinal = parse_device(device)
        reason: str | None = None
        force_sync = not deferred
        if ordinal is not None and deferred:
            cap = probe(ordinal)
            if not cap.supported:
                force_sync, reason = True, cap.reason
        elif ordinal is not None:
            reason = "deferral turned off (deferred=False)"
        else:
            reason = "no CUDA device: rows are gathered on the host"
        made = _make_tables(
            torch, items, max_rows, ordinal, watchdog, force_sync, copy, track_arrival, time_stalls
        )
        mode = made[0].rows.mode
        if mode == "deferred":
            try:
                made = [
                    StepTable(
                        t.name,
                        t.table,
                        t.rows,
                        GatherWorker(
                            t.rows,
                            t.table,
                            id_dtype=id_dtype,
                            heads=_heads_for(heads, t.name),
                            publish=publish,
                            depth=depth,
                            spin=spin,
                            predict_ready=predict_ready,
                            skip_gather=skip_gather,
                        ),
                    )
                    for t in made
                ]
            except InvalidArgumentError:
                _close_tables(made)
                raise
            except PleMemopsError as exc:
                # All or none: a worker that cannot start makes every table synchronous.
                _close_tables(made)
                reason = f"a gather worker could not start ({exc})"
                made = _make_tables(
                    torch, items, max_rows, ordinal, watchdog, True, copy, track_arrival, False
                )
                mode = made[0].rows.mode
        if reason is not None and log_fallback:
            log.warning(
                "ple_memops: PLE rows of %d table(s) use the %s path: %s", len(made), mode, reason
            )
        try:
            return cls(
                made,
                mode,
                reason if mode != "deferred" else None,
                ordinal,
                depth,
                timeout,
                read_in_order=read_in_order,
            )
        except BaseException:
            _close_tables(made)
            raise

    # -- state ------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"deferred"``, ``"sync"`` or ``"host"``: the same for every table."""
        return self._mode

    @property
    def deferred(self) -> bool:
        return self._mode == "deferred"

    @property
    def reason(self) -> str | None:
        """Why the tables do not defer (``None`` when they do)."""
        return self._reason

    @property
    def device(self) -> int | None:
        return self._device

    @property
    def tables(self) -> dict[str, StepTable]:
        return dict(self._tables)

    @property
    def names(self) -> list[str]:
        return list(self._tables)

    @property
    def reads_in_order(self) -> bool:
        """Whether each step's reads from storage are taken table by table, in the order
        the tables were given: a table that misses the page cache waits (bounded) for the
        earlier tables' reads of the same step, so the first table's rows, which the GPU
        needs first, are not read behind the later tables'. Only cold reads wait, and only
        for an earlier table reading at most 128 rows (a larger batch reads beside the
        others: together they keep more reads in flight); a table whose READY comes more
        than 0.5 ms late is passed over, so the order never waits on the GPU. Deferred
        tables only; ``False`` for synchronous ones."""
        return bool(self._native.reads_in_order)

    @property
    def depth(self) -> int:
        return int(self._native.depth)

    @property
    def timeout(self) -> float:
        """Seconds a completion waits for a step's fill."""
        return float(self._native.timeout)

    @property
    def max_rows(self) -> int:
        return int(self._native.max_rows)

    @property
    def in_flight(self) -> int:
        """Steps armed and not yet completed."""
        return int(self._native.in_flight)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def step_counts(self) -> tuple[int, int, int]:
        """``(armed, eager, completed)`` steps, from the native step alone (no table's
        statistics read; :meth:`counters` adds the workers')."""
        native = self._native
        return int(native.armed), int(native.eager), int(native.completed)

    def staging(self, name: str, n: int | None = None) -> Any:
        """The stable ``uint8 [n, row_bytes]`` view that consumers of ``name`` read."""
        rows = self._table(name).rows
        return rows.staging if n is None else rows.staging[:n]

    # -- captured steps ---------------------------------------------------------------

    def stage(
        self, name: str, ids: Any, *, rows: int | None = None, count: Any = None
    ) -> StagedRows:
        """Under capture (or an eager pass of the captured path): publish ``ids`` (a
        graph-static CUDA tensor) and fork the consumer's wait and copy onto a side
        stream; join the returned :class:`~ple_memops.StagedRows` before the consumer.
        Deferred mode only."""
        return self._worker(name, "stage()").stage(ids, rows, count)

    def stage_host_fed(self, name: str, *, rows: int) -> StagedRows:
        """The consumer's wait and copy only, for steps whose ids the host publishes
        (:meth:`publish_host`): the graph publishes nothing of its own."""
        return self._table(name).rows.stage(rows=rows)

    # -- replayed steps ---------------------------------------------------------------

    def publish_host(self, name: str, ids: Any) -> None:
        """Host-known ids of table ``name``'s oldest armed step that has none yet: call
        after :meth:`arm`, before the launch (the gather overlaps it) or from any thread
        after it, never as a fill on the launching thread after it. A failure aborts every
        table, except :class:`~ple_memops.NoArmedStepError` (nothing was written)."""
        self._worker(name, "publish_host()")
        # Host ids only: reading a CUDA tensor here would synchronise with the device.
        host = host_ids(
            ids, allow_device_sync=False, dtype=np.int64, flatten=True, error=RowShapeError
        )
        self._native.publish_host(self._index[name], np.ascontiguousarray(host))

    def publish_host_later(self, name: str, ids_of: Callable[[], Any]) -> None:
        """Publish the ids of the step armed last from a publisher thread, once
        ``ids_of()`` returns them (it may block, e.g. until the previous step's tokens
        reach the host). Settling that step first waits (bounded) for the publish, and
        raises its error; an arming that completes it at depth waits for its fill (bounded
        by :attr:`timeout`). :meth:`stop_publisher` ends the thread."""
        self._check_open()
        armed = int(self._native.armed)
        if armed == 0 or self.in_flight == 0:
            raise StateError("publish_host_later() needs an armed step: arm() first")
        if self._publisher is None:
            self._publisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ple-ids")
        self._publishes[armed - 1] = self._publisher.submit(
            lambda: self.publish_host(name, ids_of())
        )

    def settle(self, limit: int = 0) -> int:
        """Complete the oldest steps until at most ``limit`` are armed (after a launch:
        ``0`` under synchronous scheduling, ``depth - 1`` under asynchronous). Returns the
        steps completed; a failure aborts every table and is raised."""
        self._check_open()
        if self._publishes:
            done = int(self._native.completed)
            for step in [k for k in self._publishes if k < done]:
                # Completed by an arming at depth, which waited for the fill (the publisher
                # thread ran meanwhile: the native wait releases the GIL).
                del self._publishes[step]
            for step in range(done, done + max(0, self.in_flight - limit)):
                self._published(step)
        return int(self._native.settle(limit))

    def drain(self) -> int:
        """Complete every armed step (before eager work, captures, dropping graphs)."""
        return self.settle(0)

    # -- eager steps ------------------------------------------------------------------

    def stage_eager(self, name: str, ids: Any, *, rows: int | None = None) -> EagerStaged:
        """An eager forward's rows in deferred mode, after ``arm(n, eager=True)``: the
        publish of ``ids`` and the consumer's wait/copy on a side stream of the table's,
        made to wait for the current stream, so the GPU work queued before the consumer's
        :meth:`EagerStaged.join` overlaps the host's gather (every table on its own
        worker, in parallel). ``ids`` is held until the join."""
        worker = self._worker(name, "stage_eager()")
        torch = optional_torch()
        if torch is None or not isinstance(ids, torch.Tensor) or ids.device.type != "cuda":
            raise InvalidArgumentError("stage_eager() needs the ids as a CUDA tensor")
        if torch.cuda.is_current_stream_capturing():
            raise StateError("stage_eager() is for eager forwards; under capture use stage()")
        table = self._tables[name]
        # The rows' own stream, not a pooled one: vLLM computes on a pooled stream, and a
        # pooled side stream that turned out to be it would hold the forward at the wait.
        side = own_stream(table.rows)
        if side.device != ids.device:
            raise InvalidArgumentError(
                f"stage_eager(): the ids are on {ids.device}, table {name!r} on {side.device}"
            )
        side.wait_stream(torch.cuda.current_stream(ids.device))  # the ids are computed
        with torch.cuda.stream(side):
            staged = worker.stage(ids, rows, consumer_joins=True)
        return EagerStaged(side, ids, staged, table.rows)

    def gather_now(
        self, name: str, ids: Any, rows: int | None = None, *, stream: Any = None
    ) -> Any:
        """The synchronous path (eager steps, the ``sync`` fallback): :meth:`drain`, copy
        ``ids`` to the host (a CUDA tensor's copy synchronises with the device: the eager
        path allows that), gather straight into the pinned slot, copy to the staging
        buffer on ``stream``; returns ``staging[:n]`` (``n = rows`` or ``len(ids)``; rows
        past ``len(ids)`` are zero). The same bytes as a deferred step."""
        self.drain()
        table = self._table(name)
        host, n = self._checked_ids(table, ids, rows, allow_device_sync=True)
        return self._fill_host(table, host, n, stream, "gather_now")

    def gather_many_now(
        self, ids: Mapping[str, Any], rows: int | None = None, *, stream: Any = None
    ) -> dict[str, Any]:
        """:meth:`gather_now` for several tables at once, from ids already on the host
        (never a device synchronisation: a CUDA tensor is refused): every table's gather
        on a thread of its own (the native gather releases the GIL), each copy to staging
        issued on ``stream`` (default: the caller's current stream). All or none: every id
        is checked before anything is written, and any failure aborts every table before
        the first error is raised. Returns ``{name: staging[:n]}``."""
        self.drain()
        work = []
        for name, table_ids in ids.items():
            table = self._table(name)
            host, n = self._checked_ids(table, table_ids, rows, allow_device_sync=False)
            work.append((table, host, n))
        if stream is None and self._device is not None:
            torch = optional_torch()
            # Resolved here: a gather thread's current stream is not the caller's.
            stream = torch.cuda.current_stream(self._device)
        out: dict[str, Any] = {}
        first: BaseException | None = None
        if len(work) == 1:  # no thread for one table
            table, host, n = work[0]
            try:
                out[table.name] = self._fill_host(table, host, n, stream)
            except BaseException as exc:
                first = exc
        else:
            if self._gather_pool is None:
                self._gather_pool = concurrent.futures.ThreadPoolExecutor(
                    min(8, len(self._tables)), thread_name_prefix="ple-gather"
                )
            futures = [
                (t.name, self._gather_pool.submit(self._fill_host, t, host, n, stream))
                for t, host, n in work
            ]
            for name, fut in futures:
                try:
                    out[name] = fut.result()
                except BaseException as exc:
                    first = first or exc
        if first is not None:
            self.abort(f"gather_many_now() failed: {first!r}")
            raise first
        return out

    def dummy_now(self, name: str, rows: int, *, stream: Any = None) -> Any:
        """An eager step without data (warm-up, profiling, capture passes): :meth:`drain`,
        then the consumer reads whatever the staging buffer holds. Returns
        ``staging[:rows]``."""
        self.drain()
        table = self._table(name)
        return self._eager_step(
            table, rows, "dummy_now", lambda r: r.prepare_dummy(stream=stream), stream
        )

    # -- failures and lifecycle -------------------------------------------------------

    @property
    def poison_cause(self) -> str | None:
        """Why a table's rows were poisoned (a failed fill, an abort, the watchdog), or
        ``None`` while every table is usable (or once closed). One native read."""
        got = None if self._closed else self._native.poison_cause
        if got is None:
            return None
        index, cause = got
        return f"{self.names[index]}: {cause}"

    def raise_if_failed(self) -> None:
        """Raise now if any table's rows failed (a fill that failed, an abort): the armed
        steps are completed so the worker's typed error comes out (or
        :class:`~ple_memops.PoisonedError`). An engine calls it before it hands out a
        step's results, once the GPU finished the step: a step whose rows failed read
        zeros, and its output must not reach anyone."""
        cause = self.poison_cause
        if cause is None:
            return
        self.drain()  # raises the first failure
        raise PoisonedError(cause)

    def guard(self, what: str | Callable[[], str]) -> _Guard:
        """A context in which any exception (``KeyboardInterrupt`` included) aborts every
        table, so no GPU wait outlives a failed step, and is re-raised (for the engine's
        own work between arming and launching: its launch). ``what`` names the work in the
        abort's reason; a callable is called only then."""
        return _Guard(self, what)

    def abort(self, reason: str) -> None:
        """Release every GPU wait for good and poison every table (idempotent); later calls
        raise :class:`~ple_memops.PoisonedError`. The log has the first abort as an error,
        later ones at debug level."""
        level = logging.DEBUG if self._aborted else logging.ERROR
        log.log(level, "ple-memops: aborting deferred PLE rows: %s", reason)
        self._aborted = True
        if not self._closed:
            self._native.abort(reason)

    def abort_on(self, what: str, exc: BaseException) -> None:
        """:meth:`abort` for an exception in ``what`` (the reason names both)."""
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
        """Complete the armed steps, bounded; a failure is logged and aborts every table
        instead of raising, so no captured wait can hold the device. Idempotent; the
        tables stay open until :meth:`shutdown`."""
        if self._closed:
            return
        try:
            self.drain()
        except BaseException as exc:
            log.error("ple-memops: pending PLE rows failed at shutdown: %r", exc)
            self._native.abort(f"shutdown: {exc!r}")
        finally:
            self.stop_publisher()

    def shutdown(self) -> None:
        """:meth:`drain_for_shutdown`, then stop the workers and close every table
        (idempotent). A caller that synchronises the device drains first, synchronises,
        then calls this, so nothing the GPU may still read is freed."""
        if self._closed:
            return
        self.drain_for_shutdown()
        self._closed = True
        failed = self._native.shutdown()  # nothing left to drain: closes
        if failed is not None:  # pragma: no cover - drained just above
            log.error("ple-memops: pending PLE rows failed at shutdown: %s", failed)
        pool, self._gather_pool = self._gather_pool, None
        if pool is not None:
            pool.shutdown(wait=True)  # a gather in progress ends (its reads are bounded)
        _close_tables(list(self._tables.values()))

    close = shutdown

    # -- statistics -------------------------------------------------------------------

    def counters(self, name: str | None = None) -> StepCounters:
        """The step counts and the fill counters of table ``name`` (default: every table
        summed). Subtract an earlier value with :meth:`StepCounters.since`."""
        sums = dict.fromkeys(
            ("fills", "fill_ns", "waited", "eager", "eager_ns", "late", "late_ns"), 0
        )
        for table, (rows, worker) in self.stats().items():
            if name is not None and table != name:
                continue
            sums["waited"] += rows.gpu_waited
            if worker is not None:
                sums["fills"] += worker.fills
                sums["fill_ns"] += worker.ready_to_filled_ns_total
                sums["eager"] += worker.eager_fills
                sums["eager_ns"] += worker.eager_fill_ns_total
                sums["late"] += worker.completes_waited
                sums["late_ns"] += worker.complete_wait_ns_total
        armed, eager, completed = self.step_counts
        return StepCounters(
            armed=armed,
            completed=completed,
            eager=eager,
            fills=sums["fills"],
            fill_ns_total=sums["fill_ns"],
            gpu_waited=sums["waited"],
            eager_fills=sums["eager"],
            eager_fill_ns_total=sums["eager_ns"],
            completes_waited=sums["late"],
            complete_wait_ns_total=sums["late_ns"],
        )

    def stall_samples(self) -> dict[str, StallSamples]:
        """Per table: the consumer stalls of every step timed since the last call (tables
        built with ``time_stalls``; empty otherwise), from the GPU's clock."""
        return {n: t.rows.stall_samples() for n, t in self._tables.items()}

    def stats(self) -> dict[str, tuple[Any, WorkerStats | None]]:
        """Per table: the rows' :class:`~ple_memops.Stats` and the worker's, if any."""
        return {
            n: (t.rows.stats(), None if t.worker is None else t.worker.stats())
            for n, t in self._tables.items()
        }

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __iter__(self) -> Iterator[StepTable]:
        return iter(self._tables.values())

    def __repr__(self) -> str:
        return (
            f"Steps({len(self._tables)} tables, mode={self._mode!r}, device={self._device}, "
            f"depth={self.depth}, in_flight={0 if self._closed else self.in_flight}, "
            f"reason={self._reason!r})"
        )

    # -- helpers ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the steps are shut down")

    def _table(self, name: str) -> StepTable:
        self._check_open()
        try:
            return self._tables[name]
        except KeyError:
            raise InvalidArgumentError(
                f"no table {name!r} here (tables: {list(self._tables)})"
            ) from None

    def _worker(self, name: str, what: str) -> GatherWorker:
        worker = self._table(name).worker
        if worker is None:
            raise StateError(
                f"{what} needs the deferred path; these tables are {self._mode!r} "
                f"({self._reason}): gather_now() instead"
            )
        return worker

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

    def _checked_ids(
        self, table: StepTable, ids: Any, rows: int | None, *, allow_device_sync: bool
    ) -> tuple[Any, int]:
        """``ids`` on the host and the step's extent; a bad id raises before any step
        begins."""
        host = host_ids(ids, allow_device_sync=allow_device_sync, dtype=np.int64, flatten=True)
        n = len(host) if rows is None else int(rows)
        if len(host) > n:
            raise InvalidArgumentError(
                f"{len(host)} ids for a step of {n} rows (table {table.name!r})"
            )
        table.table.check_ids(host)
        return host, n

    def _fill_host(
        self, table: StepTable, host: Any, n: int, stream: Any, what: str = "gather_many_now"
    ) -> Any:
        return self._eager_step(
            table, n, what, lambda r: r.fill_from(table.table, host, stream=stream), stream
        )

    @staticmethod
    def _eager_step(
        table: StepTable, n: int, what: str, publish: Callable[[DeferredRows], None], stream: Any
    ) -> Any:
        """One eager step of ``table``'s rows: begin, ``publish`` (fill or dummy), the
        consumer inline on ``stream``, complete; any failure aborts the rows."""
        r = table.rows
        r.begin(n)
        try:
            publish(r)
            r.enqueue(stream=stream, rows=n)
            r.complete()
        except BaseException as exc:
            r.abort(f"{what}({table.name!r}) failed: {exc!r}")
            raise
        return r.staging[:n]


def _heads_for(heads: Heads | Mapping[str, Heads] | None, name: str) -> Heads | None:
    if heads is None:
        return None
    if isinstance(heads, Mapping):
        return heads.get(name)
    return heads


def _make_tables(
    torch: Any,
    items: list[tuple[str, MmapTable]],
    max_rows: int,
    ordinal: int | None,
    watchdog: float | None,
    force_sync: bool,
    copy: str,
    track_arrival: bool,
    time_stalls: bool,
) -> list[StepTable]:
    made: list[StepTable] = []
    dev = "cpu" if ordinal is None else f"cuda:{ordinal}"
    try:
        for name, table in items:
            staging = torch.zeros((max_rows, table.row_bytes), dtype=torch.uint8, device=dev)
            rows = DeferredRows(
                max_rows,
                table.row_bytes,
                staging=staging,
                watchdog=watchdog,
                force_sync=force_sync,
                copy=copy,
                track_arrival=track_arrival,
                time_stalls=time_stalls,
            )
            made.append(StepTable(name, table, rows, None))
    except BaseException:
        _close_tables(made)
        raise
    modes = {t.rows.mode for t in made}
    if len(modes) > 1:  # pragma: no cover - the probe is cached per device
        _close_tables(made)
        raise StateError(f"tables ended up in mixed modes {sorted(modes)}")
    return made


def _close_tables(tables: Sequence[StepTable]) -> None:
    for t in tables:
        if t.worker is not None:
            t.worker.close()
        t.rows.close()
