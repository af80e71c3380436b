"""Device-produced row ids: :class:`GatherWorker`."""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _native
from ._common import host_ids, optional_torch, row_count
from ._deferred import DeferredRows, StagedRows, native_rows, side_stream, stream_handle
from .errors import InvalidArgumentError, RowShapeError
from .settings import DEFAULTS
from .table import MmapTable, native_table

__all__ = ["GatherWorker", "WorkerStats"]

_LIVE: weakref.WeakSet[GatherWorker] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    # Stop the native threads and release any pending step before the interpreter goes.
    for worker in list(_LIVE):
        worker.close()


@dataclass(frozen=True)
class WorkerStats:
    """Counters and timings of one :class:`GatherWorker`."""

    steps: int
    fills: int
    failures: int
    ids_total: int
    ready_to_filled_ns_last: int
    """From the worker seeing the GPU's READY to its FILLED store."""
    ready_to_filled_ns_max: int
    ready_to_filled_ns_total: int
    eager_fills: int
    """Fills of steps begun with ``begin(eager=True)`` (an engine's eager forward),
    included in ``fills``; the others are replays."""
    eager_fill_ns_total: int
    """Their READY -> FILLED time, included in ``ready_to_filled_ns_total``."""
    armed_to_ready_ns_last: int
    """From ``begin()`` to READY: how far ahead of the GPU the host was."""
    publishes_captured: int
    publishes_eager: int
    publishes_host: int
    """Steps given host-known ids with :meth:`GatherWorker.publish_from_host`."""
    unarmed_replays: int
    """Replays that published ids with no step armed (each released with zero rows and
    reported as :class:`~ple_memops.UnarmedReplayError`)."""
    warmed_steps: int
    """Steps whose wait for READY kept the table's own gather threads awake (a table
    opened with ``gather_threads=``, when the previous fill ran on them)."""
    completes_waited: int = 0
    """Calls of :meth:`GatherWorker.complete` that found the step not yet filled and
    waited for the worker (with the GIL released); a serving loop's should be none."""
    complete_wait_ns_total: int = 0
    """How long those calls waited in all."""
    predicted_sleeps: int = 0
    """With ``predict_ready``: steps whose wait began with a sleep until shortly before
    their predicted READY."""
    ready_in_sleep: int = 0
    """Of those, the steps whose READY came during the sleep (seen up to 100 us late)."""
    expected_steps: int = 0
    """Steps begun with ``begin(expected=...)``: ids the host computed before the GPU."""
    expected_rows_early: int = 0
    """Their rows gathered before the step's READY (the expected ids)."""
    expected_rows_late: int = 0
    """Their rows gathered at READY because the host expected none there (``-1``)."""
    expected_rows_wrong: int = 0
    """Their rows gathered again at READY because the GPU published another id than the
    expected one: the published ids always win; non-zero means the expectation is wrong."""
    ordered_waits: int = 0
    """With ``Steps.build(read_in_order=True)``: steps whose reads from storage waited for an
    earlier table's reads of the same step."""
    ordered_wait_ns_total: int = 0
    """How long those waits took in all."""
    ordered_passed_over: int = 0
    """Steps that read without waiting for an earlier table any longer: its READY did not
    come within 0.5 ms, or its reads were not done within 100 ms."""


class GatherWorker:
    """Fill a :class:`DeferredRows` from a table with row ids that the GPU produces, with
    no host synchronisation in the step.

    Inside the graph, after the kernel that computes the ids, :meth:`publish` copies them
    (and optionally a device count) into a pinned, mapped mailbox and stores READY. A
    native thread (no GIL) sees READY, maps the ids to rows, gathers them from ``table``
    into the slot and stores FILLED; the rows' consumer, enqueued later on the same
    stream, waits for that. Per step::

        worker.begin(n)            # the step's extent; arms the worker
        graph.replay()             # computes ids, publishes, ..., consumes rows
        ...                        # the host is free: no sync, no gather on this thread
        worker.complete()          # waits (bounded) for the fill; raises the worker's error

    An id out of range (or any failure of the gather) aborts the rows object: the GPU is
    released and reads zeros, ``complete()`` raises the typed error
    (:class:`~ple_memops.RowIdError`, ...) and later calls raise
    :class:`~ple_memops.PoisonedError`. ``close()``, ``del`` and interpreter exit stop the
    thread and release a pending step.

    Args:
        rows: the object to fill (deferred mode on a GPU, or host mode).
        table: a :class:`~ple_memops.MmapTable` whose rows are ``rows.row_bytes`` wide.
        max_ids: ids a step may publish (default ``rows.max_rows``).
        id_dtype: ``"int64"`` or ``"int32"``: the dtype of the published tensor.
        heads: ``(offsets, sizes)`` for per-head vocabularies: ids come as
            ``[token, head]`` row-major, head ``h``'s id must be in ``0..sizes[h]`` and
            maps to row ``offsets[h] + id``. ``None``: the id is the row.
        publish: ``"kernel"`` (one small kernel; default) or ``"memop"`` (copy-engine D2H
            copies and a stream write).
        depth: steps that may be armed at once (default 2: a host running one step ahead,
            as under asynchronous scheduling, arms step N+1 before step N's fill).
        spin: seconds the worker stays hot (spinning, then yielding) while it waits for
            ids or for the next step, before short sleeps (default 0.002). A sleeping
            worker sees READY late: on a VM, waking an idle vCPU can take longer than the
            gather itself. Past ``spin`` with nothing armed the worker naps (50 us at a
            time) for 50 ms before it blocks, so the host's :meth:`begin` at a serving
            loop's pace never pays a wake-up (a syscall and an interrupt, 5-20 us on a
            VM).
        predict_ready: place the hot window where READY is expected instead of at
            :meth:`begin`: once three steps were armed ahead of their READY, the worker
            sleeps (100 us at a time, READY checked between) until 90% of the earliest of
            the last eight arm-to-READY times, less 100 us, then is hot for ``spin``. A
            worker armed a whole step ahead (asynchronous scheduling) then keeps no CPU
            busy through the step before, and is hot when READY comes; a READY earlier
            than any recent one is seen up to 100 us late. Eager steps
            (``begin(eager=True)``) are neither predicted nor learnt from. Off by default.
        skip_gather: diagnostics only: fill each step without reading the table (the
            consumer reads whatever bytes the slot held), to time the protocol without
            the host's gather. Never for serving: the rows are wrong.
    """

    def __init__(
        self,
        rows: DeferredRows,
        table: MmapTable,
        *,
        max_ids: int | None = None,
        id_dtype: str = "int64",
        heads: tuple[Sequence[int], Sequence[int]] | None = None,
        publish: str = DEFAULTS.publish,
        depth: int = DEFAULTS.depth,
        spin: float | None = DEFAULTS.spin,
        skip_gather: bool = False,
        predict_ready: bool = False,
    ) -> None:
        if id_dtype not in ("int64", "int32"):
            raise InvalidArgumentError(f"id_dtype must be 'int64' or 'int32', got {id_dtype!r}")
        offsets: list[int] | None = None
        sizes: list[int] | None = None
        if heads is not None:
            offsets, sizes = [int(v) for v in heads[0]], [int(v) for v in heads[1]]
        core = native_rows(rows)
        self._rows = rows
        self._table = table
        self._id_dtype = id_dtype
        self._core: _native.GatherWorkerCore | None = _native.GatherWorkerCore(
            core,
            native_table(table),
            core.max_rows if max_ids is None else int(max_ids),
            8 if id_dtype == "int64" else 4,
            offsets,
            sizes,
            publish,
            int(depth),
            None if spin is None else float(spin),
            bool(skip_gather),
            bool(predict_ready),
        )
        _LIVE.add(self)

    @property
    def rows(self) -> DeferredRows:
        return self._rows

    @property
    def table(self) -> MmapTable:
        return self._table

    @property
    def max_ids(self) -> int:
        return self._live().max_ids

    @property
    def depth(self) -> int:
        """Steps that may be armed at once."""
        return self._live().depth

    @property
    def in_flight(self) -> int:
        """Steps armed and not yet completed."""
        return 0 if self._core is None else self._core.in_flight

    def publish(self, ids: Any, count: Any = None, *, stream: Any = None) -> None:
        """Enqueue the publish of ``ids`` (a contiguous 1-D CUDA tensor of ``id_dtype``
        with at most ``max_ids`` elements) on ``stream`` (default: torch's current
        stream), eagerly or under capture. ``count``: an optional CUDA int32 scalar
        tensor with the number of valid ids (clamped to ``ids.numel()``). Both tensors
        must outlive every graph that captured the publish."""
        core = self._live()
        torch = optional_torch()
        if torch is None or not isinstance(ids, torch.Tensor) or ids.device.type != "cuda":
            raise RowShapeError("ids must be a CUDA tensor (use publish_from_host on the host)")
        want = torch.int64 if self._id_dtype == "int64" else torch.int32
        if ids.dtype != want or ids.dim() != 1 or not ids.is_contiguous():
            raise RowShapeError(
                f"ids must be a contiguous 1-D {self._id_dtype} tensor, got {ids.dtype} "
                f"of shape {list(ids.shape)}"
            )
        if ids.device.index != self._rows.device:
            raise RowShapeError(f"ids are on {ids.device}, the rows on cuda:{self._rows.device}")
        count_ptr = 0
        if count is not None:
            if (
                not isinstance(count, torch.Tensor)
                or count.device != ids.device
                or count.dtype != torch.int32
                or count.numel() != 1
            ):
                raise RowShapeError("count must be a one-element int32 tensor on the ids' device")
            count_ptr = int(count.data_ptr())
        handle = stream_handle(self._rows, stream)
        core.publish(handle, int(ids.data_ptr()), int(ids.numel()), count_ptr)

    def stage(
        self,
        ids: Any,
        rows: int | None = None,
        count: Any = None,
        *,
        stream: Any = None,
        consumer_joins: bool = False,
    ) -> StagedRows:
        """Fork the step's device side onto the rows' own side stream: publish ``ids``,
        then the consumer's wait/copy/reset for ``rows`` rows (default ``ids.numel()``),
        under capture. The layers queued on ``stream`` (default: the current stream)
        between this call and :meth:`StagedRows.join` run while the host gathers; neither
        the publish nor the wait sits on their path. Eagerly both are issued inline on
        ``stream`` (and ``join`` does nothing); ``consumer_joins=True`` says the consumer
        runs on another stream that joins ``stream`` later (as :meth:`Steps.stage_eager`
        does), so stall timing stamps its arrival there
        (:func:`~ple_memops._deferred.stamp_arrival`), not before the wait."""
        torch = optional_torch()
        if torch is None or not isinstance(ids, torch.Tensor) or ids.device.type != "cuda":
            raise RowShapeError("ids must be a CUDA tensor (use publish_from_host on the host)")
        n = int(ids.numel()) if rows is None else row_count(rows, self._rows.max_rows)
        side = side_stream(self._rows, stream)
        rows_core = native_rows(self._rows)
        if side is None:  # eager: inline on the caller's stream
            self.publish(ids, count, stream=stream)
            rows_core.enqueue(stream_handle(self._rows, stream), n, consumer_joins)
            return StagedRows(self._rows, None, n)
        with torch.cuda.stream(side):
            self.publish(ids, count, stream=side)
            rows_core.enqueue(stream_handle(self._rows, side), n, True)
        return StagedRows(self._rows, side, n, keep=(ids, count))

    def publish_from_host(self, ids: Any, timeout: float = DEFAULTS.timeout) -> None:
        """Give the oldest armed step that has no ids yet the ids the host knows (1-D,
        int64/int32/list/CPU tensor); the worker thread gathers them and fills. The call
        only copies the ids, so it may come before the launch (the gather then overlaps
        it) or from another thread after it: the thread that launches the graph never
        fills. That matters: with the copy-engine consumer and thousands of nodes behind
        its wait, ``graph.replay()`` itself may not return until the wait was passed, so a
        fill from the launching thread after the launch stalls until the watchdog
        (docs/lab/transformers.md, "A launch that waits for the GPU"). Also the feed of
        host mode and of tests.

        One call per armed step, in step order; a step given host ids must come from a
        graph that does not publish its own. Refused with a typed error, nothing written:
        no armed step waiting for ids (:class:`~ple_memops.NoArmedStepError`, a
        :class:`StateError`), ids that do not fit int32
        ids (:class:`RowIdError`), the previous step's ids still untaken after
        ``timeout`` seconds, a closed or poisoned worker. Releases the GIL."""
        # Host ids only: reading a CUDA tensor here would synchronise with the device.
        arr = host_ids(ids, allow_device_sync=False, dtype=np.int64, error=RowShapeError)
        self._live().publish_from_host(arr, float(timeout))

    def _simulate_replay_publish(self, ids: Any) -> None:
        """Tests only: store ids and READY in the mailbox unchecked, as a replay would."""
        self._live()._simulate_replay_publish(np.ascontiguousarray(ids, dtype=np.int64))

    def begin(self, rows: int | None = None, *, eager: bool = False, expected: Any = None) -> int:
        """Start a step of ``rows`` rows (default ``max_rows``) and arm the worker. Up to
        :attr:`depth` steps may be armed at once; the worker fills them in order.
        ``eager=True`` marks an eager forward's step (not a graph replay): the same
        protocol, its fill counted apart in :meth:`stats` (``eager_fills``).

        ``expected``: the ids the host expects the step to publish, where it knows them
        before the GPU does (a prefill chunk's, from the prompt), ``-1`` where it does not
        (host integers, any shape read in row-major order, at most ``rows``). The worker
        gathers those rows into the slot as soon as the GPU has consumed the previous
        step's, before this step's READY; at READY it compares and gathers only the rows
        whose published id differs or was ``-1``. The graph publishes its ids as usual
        and they always decide the rows: a wrong expectation costs a late gather
        (counted in ``expected_rows_wrong``), never a wrong row."""
        core = self._live()
        n = self._rows.max_rows if rows is None else row_count(rows, self._rows.max_rows)
        if expected is None:
            return core.begin(n, bool(eager))
        arr = host_ids(
            expected, allow_device_sync=False, dtype=np.int64, flatten=True, error=RowShapeError
        )
        return core.begin(n, bool(eager), arr)

    def complete(self, timeout: float = DEFAULTS.worker_timeout) -> None:
        """Wait up to ``timeout`` seconds (GIL released) for the worker's fill of the
        oldest armed step, then end it. Raises the worker's error if a gather failed, or
        :class:`~ple_memops.UnarmedReplayError` if a replay published ids nobody armed
        the worker for. Give ``timeout`` more than the GPU work queued ahead of the step
        (a long prefill): it bounds how long the host waits, not the GPU."""
        self._live().complete(float(timeout))

    def stats(self) -> WorkerStats:
        return WorkerStats(**self._live().stats())

    def close(self) -> None:
        """Stop the worker thread (idempotent); a pending step is aborted."""
        core, self._core = self._core, None
        if core is not None:
            core.close()
        _LIVE.discard(self)

    def __enter__(self) -> GatherWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> _native.GatherWorkerCore:
        if self._core is None:
            from .errors import ClosedError

            raise ClosedError("worker is closed")
        return self._core


def native_worker(worker: GatherWorker) -> _native.GatherWorkerCore:
    """The worker's native half (for the tables' native ``_native.Steps``);
    raises :class:`~ple_memops.ClosedError` once the worker is closed."""
    return worker._live()
