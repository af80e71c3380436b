"""All-or-none deferred rows for several PLE tables on one device: :class:`RowsPlan`.

An engine integration builds one plan at load time, outside any graph capture: one
:class:`~ple_memops.DeferredRows` per table (a stable staging buffer that captured kernels
read) and, where the device runs the deferred protocol, one
:class:`~ple_memops.GatherWorker` each. Every table gets the same mode: a graph never mixes
a deferred consumer with one that needs its rows before the launch. When the plan cannot
defer (no capability, ``deferred=False``, a worker that cannot start), it says why once
on the ``ple_memops`` logger and :attr:`RowsPlan.reason`.

A plan holds a device's tables; a :class:`~ple_memops.steps.StepDriver` runs their
steps (arming up to ``depth`` steps, completing, draining, eager steps, aborts and
shutdown, counters). The plan's own step methods are the all-or-none primitives the
driver composes, each over every table at once::

    plan = RowsPlan.build({"layer2": t2, "layer7": t7}, max_rows=n_max, device=0)
    driver = StepDriver(plan)

    # capture (deferred mode): ids computed by the graph itself
    staged = driver.stage("layer2", ids, rows=n)   # publish + wait/copy on a side stream
    ...                                            # layers before the consumer
    staged.join()                                  # the consumer's edge
    rows = plan.staging("layer2", n)               # uint8 [n, row_bytes]

    # the primitives under the driver's verbs
    plan.begin(n)                  # arm every table (StepDriver.arm)
    plan.complete()                # the oldest step of every table (StepDriver.settle,
                                   # complete_oldest, drain)
    plan.publish_host(name, ids)   # host-known ids (StepDriver.publish_host)
    plan.stage_eager(name, ids, rows=n)   # an eager forward's rows (StepDriver.stage_eager)
    plan.gather_now(name, ids)     # the synchronous path, no step in flight
                                   # (StepDriver.gather_now drains first)
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
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
    NoArmedStepError,
    PleMemopsError,
    RowShapeError,
    StateError,
)
from .settings import DEFAULT_TIMEOUT, DEFAULT_WATCHDOG, DEFAULTS
from .table import MmapTable

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_WATCHDOG", "EagerStaged", "PlanLayer", "RowsPlan"]

log = logging.getLogger("ple_memops")

Heads = tuple[Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class PlanLayer:
    """One table of a plan and the objects that serve it."""

    name: str
    table: MmapTable
    rows: DeferredRows
    worker: GatherWorker | None
    """``None`` unless the plan runs in ``deferred`` mode."""


class EagerStaged:
    """One table's rows of an eager step, staged on a side stream by
    :meth:`RowsPlan.stage_eager`; :meth:`join` before the consumer."""

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


class RowsPlan:
    """See the module docs. Build with :meth:`build`; thread-compatible (one driving
    thread), the objects inside are thread-safe."""

    def __init__(
        self,
        layers: Sequence[PlanLayer],
        mode: str,
        reason: str | None,
        device: int | None,
        timeout: float,
    ) -> None:
        self._layers = {layer.name: layer for layer in layers}
        # Fixed for the plan's life; read on every step (arming, completing, counting).
        self._worker_list = tuple(layer.worker for layer in layers if layer.worker is not None)
        # Native halves read on every step (advance(), poison_cause): no Python layer
        # between; dropped at close so they keep nothing alive after it.
        self._cores = tuple(native_worker(w) for w in self._worker_list)
        self._rows_cores = tuple((layer.name, native_rows(layer.rows)) for layer in layers)
        self._max_rows = min((layer.rows.max_rows for layer in layers), default=0)
        self._mode = mode
        self._reason = reason
        self._device = device
        self.timeout = timeout
        self._closed = False
        self._gather_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._steppers: list[_native.Stepper] = []  # closed with the plan

    # -- construction -----------------------------------------------------------------

    @classmethod
    def build(
        cls,
        tables: Mapping[str, MmapTable] | Sequence[tuple[str, MmapTable]],
        *,
        max_rows: int,
        device: object = None,
        id_dtype: str = "int64",
        heads: Heads | Mapping[str, Heads] | None = None,
        deferred: bool = True,
        watchdog: float | None = DEFAULTS.watchdog,
        timeout: float = DEFAULTS.timeout,
        depth: int = DEFAULTS.depth,
        copy: str = DEFAULTS.copy,
        publish: str = DEFAULTS.publish,
        spin: float | None = DEFAULTS.spin,
        predict_ready: bool = False,
        track_arrival: bool = False,
        time_stalls: bool = False,
        skip_gather: bool = False,
        log_fallback: bool = True,
    ) -> RowsPlan:
        """One staging buffer of ``max_rows`` rows per table on ``device`` (``"cpu"``,
        ``"cuda:N"``, an ordinal, or ``None`` for CUDA if available), and a worker per
        table where the device defers. ``deferred=False`` forces the synchronous path.
        ``heads``: the per-head map of :class:`~ple_memops.GatherWorker`, one for all
        tables or one per table name. ``track_arrival`` counts fills the GPU had to wait
        for (one more stream write a step; see :class:`~ple_memops.DeferredRows`);
        ``time_stalls`` times each step's consumer stall on the GPU (:meth:`stall_samples`);
        ``skip_gather`` (diagnostics only: wrong rows) fills without reading the tables,
        and ``predict_ready`` places each worker's hot window where READY is expected,
        see :class:`~ple_memops.GatherWorker`. Raises
        only for bad arguments; a device that cannot defer gives a ``sync`` plan with
        :attr:`reason`, logged once unless ``log_fallback=False`` (for a caller that says
        it in its own words). The defaults are :data:`ple_memops.settings.DEFAULTS`."""
        items = list(tables.items()) if isinstance(tables, Mapping) else list(tables)
        if not items:
            raise InvalidArgumentError("a plan needs at least one table")
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"table names must be unique, got {names}")
        if not isinstance(max_rows, int) or max_rows <= 0:
            raise InvalidArgumentError(f"max_rows must be a positive int, got {max_rows!r}")
        DEFAULTS.replace(timeout=timeout)  # checked by the settings' rule
        torch = optional_torch()
        if torch is None:
            raise InvalidArgumentError("a RowsPlan needs torch (its staging buffers are tensors)")
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
        layers = _make_layers(
            torch, items, max_rows, ordinal, watchdog, force_sync, copy, track_arrival, time_stalls
        )
        mode = layers[0].rows.mode
        if mode == "deferred":
            try:
                layers = [
                    PlanLayer(
                        layer.name,
                        layer.table,
                        layer.rows,
                        GatherWorker(
                            layer.rows,
                            layer.table,
                            id_dtype=id_dtype,
                            heads=_heads_for(heads, layer.name),
                            publish=publish,
                            depth=depth,
                            spin=spin,
                            predict_ready=predict_ready,
                            skip_gather=skip_gather,
                        ),
                    )
                    for layer in layers
                ]
            except InvalidArgumentError:
                _close_layers(layers)
                raise
            except PleMemopsError as exc:
                # All or none: a worker that cannot start makes every layer synchronous.
                _close_layers(layers)
                reason = f"a gather worker could not start ({exc})"
                layers = _make_layers(
                    torch, items, max_rows, ordinal, watchdog, True, copy, track_arrival, False
                )
                mode = layers[0].rows.mode
        if reason is not None and log_fallback:
            log.warning(
                "ple_memops: PLE rows of %d table(s) use the %s path: %s",
                len(layers),
                mode,
                reason,
            )
        return cls(layers, mode, reason if mode != "deferred" else None, ordinal, timeout)

    # -- properties -------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"deferred"``, ``"sync"`` or ``"host"``: the same for every table."""
        return self._mode

    @property
    def deferred(self) -> bool:
        return self._mode == "deferred"

    @property
    def reason(self) -> str | None:
        """Why the plan does not defer (``None`` when it does)."""
        return self._reason

    @property
    def device(self) -> int | None:
        return self._device

    @property
    def layers(self) -> dict[str, PlanLayer]:
        return dict(self._layers)

    @property
    def names(self) -> list[str]:
        return list(self._layers)

    @property
    def in_flight(self) -> int:
        """Steps armed and not yet completed (the same for every worker)."""
        most = 0
        for w in self._worker_list:
            n = w.in_flight
            if n > most:
                most = n
        return most

    def staging(self, name: str, n: int | None = None) -> Any:
        """The stable ``uint8 [n, row_bytes]`` view that consumers of ``name`` read."""
        rows = self._layer(name).rows
        return rows.staging if n is None else rows.staging[:n]

    # -- captured (deferred) steps ----------------------------------------------------

    def stage(self, name: str, ids: Any, rows: int | None = None, count: Any = None) -> StagedRows:
        """Publish ``ids`` (a graph-static CUDA tensor) and fork the consumer's wait and
        copy onto a side stream; join it before the consumer. Deferred mode only."""
        layer = self._layer(name)
        if layer.worker is None:
            raise StateError(
                f"stage() needs the deferred path; this plan is {self._mode!r} ({self._reason})"
            )
        return layer.worker.stage(ids, rows, count)

    def stage_eager(self, name: str, ids: Any, rows: int | None = None) -> EagerStaged:
        """:meth:`stage` for an eager forward (not under capture), after :meth:`begin`: the
        publish of ``ids`` and the consumer's wait/copy run on a side stream of this
        table's, made to wait for the current stream, so the GPU work queued before the
        consumer's :meth:`EagerStaged.join` overlaps the host's gather (every table on
        its own worker, in parallel). ``ids`` is held until the join. Deferred mode only."""
        layer = self._layer(name)
        if layer.worker is None:
            raise StateError(
                f"stage_eager() needs the deferred path; this plan is {self._mode!r} "
                f"({self._reason}): gather_now() instead"
            )
        torch = optional_torch()
        if torch is None or not isinstance(ids, torch.Tensor) or ids.device.type != "cuda":
            raise InvalidArgumentError("stage_eager() needs the ids as a CUDA tensor")
        if torch.cuda.is_current_stream_capturing():
            raise StateError("stage_eager() is for eager forwards; under capture use stage()")
        # The rows' own stream, not a pooled one: vLLM computes on a pooled stream, and a
        # pooled side stream that turned out to be it would hold the forward at the wait.
        side = own_stream(layer.rows)
        if side.device != ids.device:
            raise InvalidArgumentError(
                f"stage_eager(): the ids are on {ids.device}, table {name!r} on {side.device}"
            )
        side.wait_stream(torch.cuda.current_stream(ids.device))  # the ids are computed
        with torch.cuda.stream(side):
            # Eagerly: issued on ``side``; the consumer's arrival is stamped at its join.
            staged = layer.worker.stage(ids, rows, consumer_joins=True)
        return EagerStaged(side, ids, staged, layer.rows)

    def begin(
        self, n: int, *, eager: bool = False, expected: Mapping[str, Any] | None = None
    ) -> None:
        """Arm every table's worker for a step of ``n`` rows (``eager``: an eager forward's
        step, not a replay; its fills are counted apart). ``expected``: per table, the ids
        the host expects the step to publish (``-1`` where unknown; see
        :meth:`GatherWorker.begin`): those rows are gathered before the GPU reaches the
        step, the published ids still decide. All or none: if any refuses, the plan
        aborts (so no captured consumer waits) and the error is raised."""
        self._check_open()
        if expected:
            unknown = sorted(set(expected) - set(self._layers))
            if unknown:
                raise InvalidArgumentError(f"expected ids for tables not in the plan: {unknown}")
        try:
            if not expected:  # every step: the workers' tuple, nothing looked up
                for w in self._workers():
                    w.begin(n, eager=eager)
            else:
                for layer in self._layers.values():
                    if layer.worker is not None:
                        ids = expected.get(layer.name)
                        layer.worker.begin(n, eager=eager, expected=ids)
        except BaseException as exc:
            self.abort(f"begin({n}) failed: {exc!r}")
            raise

    def advance(
        self, n: int, depth: int, *, eager: bool = False, timeout: float | None = None
    ) -> tuple[int, int, int]:
        """:meth:`complete` while ``depth`` or more steps are armed, then :meth:`begin` a
        step of ``n`` rows, in one native call for every table (a serving loop's step
        bookkeeping: each call between two engine steps costs cache misses). Returns
        ``(steps completed, ns completing, ns arming)``. The same all-or-none failure as
        :meth:`complete` and :meth:`begin`: every table's oldest step is completed even
        after one fails, then the plan aborts and the first error is raised. Bad
        arguments (a row count out of ``1..=max_rows``, ``depth`` below 1) raise before
        anything is completed or armed, and abort nothing."""
        if self._closed:
            raise ClosedError("plan is closed")
        if not 0 < n <= self._max_rows:
            raise RowShapeError(f"a step has 1..={self._max_rows} rows, got {n!r}")
        if not depth >= 1:
            raise InvalidArgumentError(f"depth must be at least 1 step, got {depth!r}")
        try:
            return _native.advance_workers(
                self._cores, n, bool(eager), depth, self.timeout if timeout is None else timeout
            )
        except BaseException as exc:
            self.abort(f"advance({n}) failed: {exc!r}")
            raise

    def stepper(self, depth: int, timeout: float | None = None) -> _native.Stepper:
        """:meth:`advance` with ``depth`` and ``timeout`` (default :attr:`timeout`) bound,
        as one native callable for a serving loop's every step: ``stepper(n, eager=False)``
        returns ``(steps completed, ns completing, ns arming)``, with no Python frame of
        the plan's between (each line a cold call touches after the engine's own work
        costs cache misses). Unlike :meth:`advance` it does not abort the plan on a
        failure: its caller does (:class:`~ple_memops.steps.StepDriver` and the vLLM
        hooks call :meth:`abort` through the driver), and a row count out of ``1..=
        max_rows`` raises :class:`~ple_memops.RowShapeError` before anything is
        completed or armed. It counts the steps it armed and completed (``armed``,
        ``completed``); the plan closes it when it closes (later calls raise
        :class:`~ple_memops.ClosedError`). Deferred mode only."""
        self._check_open()
        if not self._cores:
            raise StateError(
                f"stepper() needs the deferred path; this plan is {self._mode!r} ({self._reason})"
            )
        step = _native.Stepper(self._cores, depth, self.timeout if timeout is None else timeout)
        self._steppers.append(step)
        return step

    def publish_host(self, name: str, ids: Any, timeout: float | None = None) -> None:
        """Host-known ids (``name``'s table rows of the oldest armed step that has none
        yet) for the table's worker to gather and fill. Call after :meth:`begin`, before
        the launch (the gather overlaps it) or from any thread after it, never as a fill
        on the launching thread (see :meth:`GatherWorker.publish_from_host`). The graph
        must not publish ids of its own for that table. Deferred mode only; a failure
        aborts the plan and is raised, except :class:`~ple_memops.NoArmedStepError` (no
        armed step waits for ids: nothing was written, the plan stays usable)."""
        self._check_open()
        layer = self._layer(name)
        if layer.worker is None:
            raise StateError(
                f"publish_host() needs the deferred path; this plan is {self._mode!r} "
                f"({self._reason}): gather_now() before the launch"
            )
        # Host ids only: reading a CUDA tensor here would synchronise with the device.
        host = host_ids(
            ids, allow_device_sync=False, dtype=np.int64, flatten=True, error=RowShapeError
        )
        try:
            layer.worker.publish_from_host(host, self.timeout if timeout is None else timeout)
        except NoArmedStepError:
            raise  # misuse: nothing was written and no step is left waiting for it
        except BaseException as exc:
            self.abort(f"publish_host({name!r}) failed: {exc!r}")
            raise

    def complete(self, timeout: float | None = None) -> None:
        """Complete the oldest armed step of every table (waiting at most ``timeout``
        seconds each, default :attr:`timeout`). Any failure aborts the whole plan, then the
        first error is raised: no layer is left waiting and no step's rows are silently
        wrong."""
        self._check_open()
        t = self.timeout if timeout is None else float(timeout)
        first: BaseException | None = None
        for w in self._workers():
            try:
                w.complete(t)
            except BaseException as exc:
                if first is None:
                    first = exc
        if first is not None:
            self.abort(f"complete() failed: {first!r}")
            raise first

    # -- eager steps --------------------------------------------------------------------

    def gather_now(
        self, name: str, ids: Any, rows: int | None = None, *, stream: Any = None
    ) -> Any:
        """The synchronous path (eager steps, the ``sync`` fallback): copy ``ids`` to the
        host, gather from the table straight into the pinned slot, copy to the staging
        buffer on ``stream``, and return ``staging[:n]`` (``n = rows`` or ``len(ids)``;
        rows past ``len(ids)`` are zero). Same bytes as a deferred step. Needs no step in
        flight (``StepDriver.gather_now`` drains first). Ids in a CUDA tensor are copied to
        the host, which synchronises with the device: the eager path allows that on purpose
        (``allow_device_sync=True``); :meth:`publish_host` never does."""
        layer = self._layer(name)
        # The eager path: a CUDA tensor is copied to the host, which waits for the device.
        host, n = self._checked_ids(layer, ids, rows, allow_device_sync=True)
        return self._fill_host(layer, host, n, stream, "gather_now")

    def gather_many_now(
        self, ids: Mapping[str, Any], rows: int | None = None, *, stream: Any = None
    ) -> dict[str, Any]:
        """:meth:`gather_now` for several tables at once, from ids already on the host
        (never a device synchronisation: a CUDA tensor is refused): every table's gather
        runs on a thread of its own (the native gather releases the GIL), each straight
        into its pinned slot, then its copy to the staging buffer is issued on ``stream``
        (default: the caller's current stream). All or none: every id of every table is
        checked before anything is written, and any failure aborts the whole plan before
        the first error is raised. Returns ``{name: staging[:n]}``."""
        self._check_open()
        work = []
        for name, table_ids in ids.items():
            layer = self._layer(name)
            host, n = self._checked_ids(layer, table_ids, rows, allow_device_sync=False)
            work.append((layer, host, n))
        if stream is None and self._device is not None:
            torch = optional_torch()
            # Resolved here: a gather thread's current stream is not the caller's.
            stream = torch.cuda.current_stream(self._device)
        out: dict[str, Any] = {}
        first: BaseException | None = None
        if len(work) == 1:  # no thread for one table
            layer, host, n = work[0]
            try:
                out[layer.name] = self._fill_host(layer, host, n, stream)
            except BaseException as exc:
                first = exc
        else:
            if self._gather_pool is None:
                self._gather_pool = concurrent.futures.ThreadPoolExecutor(
                    min(8, len(self._layers)), thread_name_prefix="ple-gather"
                )
            futures = [
                (layer.name, self._gather_pool.submit(self._fill_host, layer, host, n, stream))
                for layer, host, n in work
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

    def _checked_ids(
        self, layer: PlanLayer, ids: Any, rows: int | None, *, allow_device_sync: bool
    ) -> tuple[Any, int]:
        """``ids`` on the host and the step's extent; a bad id raises before any step
        begins, and the table must have no step in flight."""
        host = host_ids(ids, allow_device_sync=allow_device_sync, dtype=np.int64, flatten=True)
        n = len(host) if rows is None else int(rows)
        if len(host) > n:
            raise InvalidArgumentError(
                f"{len(host)} ids for a step of {n} rows (table {layer.name!r})"
            )
        self._check_idle(layer)
        layer.table.check_ids(host)
        return host, n

    def _fill_host(
        self, layer: PlanLayer, host: Any, n: int, stream: Any, what: str = "gather_many_now"
    ) -> Any:
        return self._eager_step(
            layer, n, what, lambda r: r.fill_from(layer.table, host, stream=stream), stream
        )

    def dummy_now(self, name: str, rows: int, *, stream: Any = None) -> Any:
        """An eager step without data (warm-up, profiling, capture passes): the consumer
        reads whatever the staging buffer holds. Returns ``staging[:rows]``."""
        layer = self._layer(name)
        self._check_idle(layer)
        return self._eager_step(
            layer, rows, "dummy_now", lambda r: r.prepare_dummy(stream=stream), stream
        )

    @staticmethod
    def _eager_step(
        layer: PlanLayer,
        n: int,
        what: str,
        publish: Callable[[DeferredRows], None],
        stream: Any,
    ) -> Any:
        """One eager step of ``layer``'s rows: begin, ``publish`` (fill or dummy), the
        consumer inline on ``stream``, complete; any failure aborts the rows."""
        r = layer.rows
        r.begin(n)
        try:
            publish(r)
            r.enqueue(stream=stream, rows=n)
            r.complete()
        except BaseException as exc:
            r.abort(f"{what}({layer.name!r}) failed: {exc!r}")
            raise
        return r.staging[:n]

    # -- lifecycle ----------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Release every captured consumer for good and poison every table (idempotent)."""
        for layer in self._layers.values():
            layer.rows.abort(reason)

    def close(self) -> None:
        """Stop the workers and release everything (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._cores, self._rows_cores = (), ()
        steppers, self._steppers = self._steppers, []
        for step in steppers:
            step.close()
        pool, self._gather_pool = self._gather_pool, None
        if pool is not None:
            pool.shutdown(wait=True)  # a gather in progress ends (its reads are bounded)
        _close_layers(list(self._layers.values()))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def poison_cause(self) -> str | None:
        """Why a table's rows were poisoned (a failed fill, an abort, the watchdog), or
        ``None`` while every table is usable (or the plan is closed). Cheap: one native
        read a table."""
        for name, core in self._rows_cores:
            cause = core.poison_cause
            if cause is not None:
                return f"{name}: {cause}"
        return None

    def stall_samples(self) -> dict[str, StallSamples]:
        """Per table: the consumer stalls of every step timed since the last call (plans
        built with ``time_stalls``; empty otherwise), from the GPU's clock."""
        return {n: layer.rows.stall_samples() for n, layer in self._layers.items()}

    def stats(self) -> dict[str, tuple[Any, WorkerStats | None]]:
        """Per table: the rows' :class:`~ple_memops.Stats` and the worker's, if any."""
        return {
            n: (layer.rows.stats(), None if layer.worker is None else layer.worker.stats())
            for n, layer in self._layers.items()
        }

    def __enter__(self) -> RowsPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[PlanLayer]:
        return iter(self._layers.values())

    def __repr__(self) -> str:
        return (
            f"RowsPlan({len(self._layers)} tables, mode={self._mode!r}, "
            f"device={self._device}, reason={self._reason!r})"
        )

    # -- helpers ------------------------------------------------------------------------

    def _layer(self, name: str) -> PlanLayer:
        self._check_open()
        try:
            return self._layers[name]
        except KeyError:
            raise InvalidArgumentError(
                f"no table {name!r} in this plan (tables: {list(self._layers)})"
            ) from None

    def _workers(self) -> tuple[GatherWorker, ...]:
        return self._worker_list

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("plan is closed")

    def _check_idle(self, layer: PlanLayer) -> None:
        busy = layer.worker.in_flight if layer.worker is not None else layer.rows.in_flight
        if busy:
            raise StateError(
                f"{busy} step(s) of table {layer.name!r} still in flight; complete them before an "
                "eager step (StepDriver.gather_now and dummy_now drain first)"
            )


def _heads_for(heads: Heads | Mapping[str, Heads] | None, name: str) -> Heads | None:
    if heads is None:
        return None
    if isinstance(heads, Mapping):
        return heads.get(name)
    return heads


def _make_layers(
    torch: Any,
    items: list[tuple[str, MmapTable]],
    max_rows: int,
    ordinal: int | None,
    watchdog: float | None,
    force_sync: bool,
    copy: str,
    track_arrival: bool,
    time_stalls: bool,
) -> list[PlanLayer]:
    layers: list[PlanLayer] = []
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
            layers.append(PlanLayer(name, table, rows, None))
    except BaseException:
        _close_layers(layers)
        raise
    modes = {layer.rows.mode for layer in layers}
    if len(modes) > 1:  # pragma: no cover - the probe is cached per device
        _close_layers(layers)
        raise StateError(f"tables ended up in mixed modes {sorted(modes)}")
    return layers


def _close_layers(layers: Sequence[PlanLayer]) -> None:
    for layer in layers:
        if layer.worker is not None:
            layer.worker.close()
        layer.rows.close()
