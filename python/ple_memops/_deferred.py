"""The public :class:`DeferredRows` type and the capability probe."""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native
from ._common import host_ids, optional_torch, parse_device, row_count
from .errors import InvalidArgumentError, RowShapeError, UnsupportedError
from .settings import DEFAULTS

if TYPE_CHECKING:
    import torch

    from .table import MmapTable

__all__ = [
    "Capability",
    "DeferredRows",
    "StagedRows",
    "StallSamples",
    "Stats",
    "create_group",
    "native_rows",
    "own_stream",
    "probe",
    "side_stream",
    "stamp_arrival",
    "stream_handle",
]

_LIVE: weakref.WeakSet[DeferredRows] = weakref.WeakSet()


@atexit.register
def _release_all_at_exit() -> None:
    # Interpreter exit: no graph may be left waiting on a flag nobody will fill.
    for rows in list(_LIVE):
        rows.close()


@dataclass(frozen=True)
class Check:
    """One piece of evidence the probe gathered."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Capability:
    """Whether ``device`` can run the deferred protocol, why not, and the evidence."""

    device: int
    supported: bool
    reason: str
    driver_version: int | None
    checks: tuple[Check, ...]


def probe(device: int = 0) -> Capability:
    """Probe CUDA device ``device`` (cached per process).

    Reads the driver version and device attributes, then runs the protocol for real on a
    private stream: a WAIT that must block until the host stores FILLED, the copy and the
    reset, then the same captured into a graph and replayed with fills in between. A
    machine without a driver or device gives ``supported=False`` with the reason; a
    failing driver call raises :class:`~ple_memops.CudaDriverError`.
    """
    d = _native.probe(int(device))
    return Capability(
        device=d["device"],
        supported=d["supported"],
        reason=d["reason"],
        driver_version=d["driver_version"],
        checks=tuple(Check(*c) for c in d["checks"]),
    )


@dataclass(frozen=True)
class Stats:
    """Counters and timings of one :class:`DeferredRows`."""

    steps: int
    fills: int
    dummies: int
    aborts: int
    watchdog_releases: int
    eager_enqueues: int
    captured_enqueues: int
    slot_busy: int
    gpu_waited: int
    """Fills that found the GPU already waiting (needs ``track_arrival=True``)."""
    fill_ns_last: int
    fill_ns_max: int
    fill_ns_total: int


@dataclass(frozen=True)
class StallSamples:
    """How long the GPU's consumer waited for its rows, one entry a step
    (:meth:`DeferredRows.stall_samples`)."""

    ns: tuple[int, ...]
    """Nanoseconds each step's consumer waited (0: the rows were there first), oldest
    first, from the GPU's own clock."""
    dropped: int
    """Steps timed but overwritten before they were read (the ring holds 8,192)."""


class StagedRows:
    """The consumer side of one step, forked onto a side stream by
    :meth:`GatherWorker.stage` (or :meth:`DeferredRows.stage`). Call :meth:`join` right
    before the first kernel that reads the rows."""

    def __init__(self, rows: DeferredRows, side: Any, n: int, keep: tuple[Any, ...] = ()) -> None:
        # side None: issued inline on the caller's stream (eager), nothing to join.
        self._rows, self._side, self._n = rows, side, n
        # Tensors the side stream reads (the published ids): under capture the capturing
        # stream does not wait for them before the join, so if the caller dropped the
        # last reference earlier, torch's allocator could hand their block to a later
        # allocation of the capturing stream, and a replay would overwrite the ids before
        # the publish read them. Held until join().
        self._keep: tuple[Any, ...] = keep

    @property
    def rows(self) -> int:
        """The step's extent (rows the consumer copies)."""
        return self._n

    def join(self, stream: Any = None) -> Any:
        """Make ``stream`` (default: torch's current stream) wait for the staged copy;
        returns ``staging[:rows]``. Under capture this is the graph edge from the copy to
        the consumer; every staged step must be joined before its capture ends."""
        if self._side is not None:
            torch = optional_torch()
            cur = torch.cuda.current_stream(self._rows.device) if stream is None else stream
            stamp_arrival(self._rows, cur)
            cur.wait_stream(self._side)
        self._keep = ()
        return self._rows.staging[: self._n]


class DeferredRows:
    """One step's embedding rows, gathered by the host, consumed by GPU work that may be
    launched (or captured into a CUDA graph) before the host has them.

    Per step::

        rows.begin(n)          # the step's extent (the captured row count)
        graph.replay()         # the graph WAITs on the flag, copies, resets it
        rows.fill(host_rows)   # uint8 [k <= n, row_bytes]; rows k..n are zeroed
        rows.complete()

    In eager execution fill (or ``prepare_dummy()``) *before* ``enqueue()``: only graph
    replays may defer the fill (an eager WAIT behind an implicit synchronisation would
    deadlock). Where the device cannot defer (:attr:`mode` ``"sync"``) or there is no GPU
    (``"host"``), the same calls fill the staging buffer synchronously, so ``fill`` must
    come before the launch; results are byte-identical.

    ``abort()``, the watchdog (default 5 s), ``close()``, ``del`` and interpreter exit all
    release any GPU wait for good; after ``abort`` every call raises
    :class:`~ple_memops.PoisonedError` naming the first cause.

    Args:
        max_rows: rows the staging buffer holds.
        row_bytes: bytes per row.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an ordinal, or ``None`` (the
            staging buffer's device, else CUDA if available, else the host).
        staging: a contiguous ``uint8`` tensor (or, on the host, a numpy array) of shape
            ``[max_rows, row_bytes]`` that consumers read; allocated when omitted. It must
            stay alive as long as any graph that captured this object.
        watchdog: seconds a begun step may stay unfilled before the object aborts
            itself (a step a :class:`GatherWorker` fills: counted from when its ids
            arrive); ``None`` disables.
        force_sync: use the synchronous fallback even where deferral works.
        track_arrival: count fills that found the GPU already waiting (one more stream
            write a step).
        time_stalls: time how long each step's consumer waits for its rows on the GPU
            (two one-thread kernels a step writing the GPU's clock into pinned memory;
            read with :meth:`stall_samples`). Deferred mode only.
        copy: the device side of a deferred step. ``"kernel"``: one single-block kernel
            polls the flag, reads the mapped slot over PCIe, writes the staging buffer
            and resets the flag (lowest latency; holds one SM while waiting); above 64 KiB
            a step one warp polls, then a grid of blocks copies.
            ``"memop"``: ``cuStreamWaitValue64``, a copy-engine H2D, ``cuStreamWriteValue32``
            (holds no SM; more bandwidth for large steps). ``"kernel-fused"``: the
            single-block kernel at every size (one kernel node; one SM reads the whole
            step). ``"auto"`` (default): the kernel up to 64 KiB a step, memops above.

    Raises:
        InvalidArgumentError: a bad argument, named in the message (sizes, a staging
            buffer larger than the address space, a CUDA ordinal this machine lacks, ...).
        UnsupportedError: a CUDA device asked for where there is none.
    """

    def __init__(
        self,
        max_rows: int,
        row_bytes: int,
        *,
        device: object = None,
        staging: Any = None,
        watchdog: float | None = DEFAULTS.rows_watchdog,
        force_sync: bool = False,
        track_arrival: bool = False,
        copy: str = DEFAULTS.copy,
        time_stalls: bool = False,
    ) -> None:
        if not isinstance(max_rows, int) or not isinstance(row_bytes, int):
            raise InvalidArgumentError("max_rows and row_bytes must be ints")
        if max_rows <= 0 or row_bytes <= 0:
            raise InvalidArgumentError(
                f"max_rows and row_bytes must be positive, got {max_rows} and {row_bytes}"
            )
        if staging is not None and device is None:
            device = _staging_device(staging)
        ordinal = parse_device(device)
        if staging is None:
            staging = _allocate_staging(max_rows, row_bytes, ordinal, device)
        ptr = _check_staging(staging, max_rows, row_bytes, ordinal)
        self._staging = staging
        self._device = ordinal
        self._side: Any = None
        self._core: _native.DeferredRowsCore | None = _native.DeferredRowsCore(
            max_rows,
            row_bytes,
            ordinal,
            ptr,
            staging,
            watchdog,
            force_sync,
            track_arrival,
            copy,
            bool(time_stalls),
        )
        _LIVE.add(self)

    # -- properties -------------------------------------------------------------------

    @property
    def staging(self) -> Any:
        """The buffer consumers read: ``uint8 [max_rows, row_bytes]``."""
        return self._staging

    @property
    def mode(self) -> str:
        """``"deferred"``, ``"sync"`` (GPU without the capability) or ``"host"``."""
        return self._live().mode

    @property
    def deferred(self) -> bool:
        """True when fills may come after the launch."""
        return self.mode == "deferred"

    @property
    def copy(self) -> str:
        """The configured device side (:data:`~ple_memops.settings.COPIES`)."""
        return self._live().copy

    @property
    def fallback_reason(self) -> str | None:
        """Why this object does not defer, or ``None``."""
        return self._live().fallback_reason

    @property
    def times_stalls(self) -> bool:
        """Whether each step's consumer stall is timed (``time_stalls=True`` in deferred
        mode)."""
        return self._live().times_stalls

    def stall_samples(self) -> StallSamples:
        """The consumer stalls of every step timed since the last call, from the GPU's
        clock: for each step, how long the consumer waited at its join (or, consumed
        inline, at its wait) for the rows to be copied. Empty without stall timing."""
        ns, dropped = self._live().stall_samples()
        return StallSamples(tuple(ns), int(dropped))

    @property
    def device(self) -> int | None:
        """The CUDA ordinal, or ``None`` on the host."""
        return self._device

    @property
    def max_rows(self) -> int:
        return self._live().max_rows

    @property
    def row_bytes(self) -> int:
        return self._live().row_bytes

    @property
    def phase(self) -> str:
        """``idle``, ``pending``, ``filled``, ``poisoned`` or ``closed``."""
        return "closed" if self._core is None else self._core.phase

    @property
    def poison_cause(self) -> str | None:
        return None if self._core is None else self._core.poison_cause

    @property
    def closed(self) -> bool:
        return self.phase == "closed"

    # -- the step ---------------------------------------------------------------------

    def begin(self, rows: int | None = None) -> int:
        """Start a step of ``rows`` rows (default ``max_rows``); arms the watchdog.
        Returns the step's sequence number. ``rows`` outside ``1..max_rows`` raises
        :class:`~ple_memops.RowShapeError`, one that is not an int
        :class:`~ple_memops.InvalidArgumentError`."""
        core = self._live()
        return core.begin(core.max_rows if rows is None else row_count(rows, core.max_rows))

    def enqueue(self, stream: Any = None, rows: int | None = None) -> str:
        """Put the consumer's side on ``stream`` (default: torch's current stream).

        Under CUDA graph capture this records ``WAIT ; copy ; reset`` for ``rows`` rows
        (default ``max_rows``) and returns ``"captured"``; eagerly it needs the step
        already filled and returns ``"eager"``. In the fallback modes nothing is recorded
        (``"nothing"``)."""
        core = self._live()
        n = None if rows is None else row_count(rows, core.max_rows)
        return core.enqueue(self._stream_handle(stream), n)

    def stage(self, rows: int | None = None, *, stream: Any = None) -> StagedRows:
        """:meth:`enqueue` on a side stream forked from ``stream`` (default: the current
        stream), eagerly or under capture: the consumer's wait and copy run beside the
        work queued on ``stream`` until :meth:`StagedRows.join`, which the first kernel
        reading the rows must follow. Eagerly the consumer is issued inline on ``stream``
        (a fork would overlap nothing worth it). In the fallback modes the copy happened
        in :meth:`fill`, before the launch, and nothing is recorded."""
        if self._device is None:
            raise InvalidArgumentError("stage() needs a CUDA device; on the host use enqueue()")
        n = self.max_rows if rows is None else row_count(rows, self.max_rows)
        side = self._fork(stream)
        self._live().enqueue(
            self._stream_handle(stream if side is None else side), n, side is not None
        )
        return StagedRows(self, side, n)

    def _fork(self, stream: Any) -> Any:
        """Under capture: this object's side stream, made to wait for ``stream`` (default:
        the current one). Eagerly: ``None``, the caller issues inline on ``stream``: a
        fork here would have to keep the caller's tensors alive until the side stream is
        done with them (``record_stream``, or holding them). An engine's eager step that
        wants the overlap forks itself: ``Steps.stage_eager`` issues on
        :meth:`_own_stream` and holds the ids until its join."""
        torch = optional_torch()
        if torch is None:
            raise InvalidArgumentError("stage() needs torch")
        if not torch.cuda.is_current_stream_capturing():
            return None
        cur = torch.cuda.current_stream(self._device) if stream is None else stream
        side = self._own_stream()
        side.wait_stream(cur)
        return side

    def _own_stream(self) -> Any:
        """This object's side stream as a torch stream: the native core's own, never one of
        torch's pooled streams. torch hands out 32 pooled streams a device in turn, so a
        pooled stream can be the very stream being captured (a fork would then overlap
        nothing), or the engine's own compute stream (vLLM runs on a pooled one) or another
        library's, whose work would then queue behind a wait for rows."""
        if self._side is None:
            torch = optional_torch()
            self._side = torch.cuda.ExternalStream(
                self._live().side_stream(), device=torch.device("cuda", self._device)
            )
        return self._side

    @property
    def in_flight(self) -> int:
        """Steps begun and not yet completed (at most one unless a worker fills this)."""
        return 0 if self._core is None else self._core.in_flight

    def fill(self, rows: Any, *, stream: Any = None, busy_wait: float = 0.0) -> None:
        """Publish the pending step's rows: ``uint8 [k, row_bytes]`` (numpy or a torch CPU
        tensor), ``k`` at most the step's extent. Rows ``k..extent`` are zeroed. Releases
        the GIL. If the GPU still holds the previous fill, waits up to ``busy_wait``
        seconds, then raises :class:`~ple_memops.SlotBusyError`; nothing is written."""
        core = self._live()
        arr = _as_rows(rows, core.row_bytes)
        core.fill(arr, self._fill_stream(stream), float(busy_wait))

    def fill_from(
        self, table: MmapTable, ids: Any, *, stream: Any = None, busy_wait: float = 0.0
    ) -> None:
        """Gather rows ``ids`` of ``table`` straight into the pinned slot (native, GIL
        released; no intermediate array) and publish them, as :meth:`fill` does. Every id
        is checked first: a bad one raises :class:`~ple_memops.RowIdError` and nothing is
        written or signalled."""
        from .table import native_table

        core = self._live()
        host = host_ids(ids, allow_device_sync=False)
        core.fill_from(native_table(table), host, self._fill_stream(stream), float(busy_wait))

    def prepare_dummy(self, *, stream: Any = None, busy_wait: float = 0.0) -> None:
        """Publish the pending step without data (warm-up, profiling, capture passes)."""
        self._live().prepare_dummy(self._fill_stream(stream), float(busy_wait))

    def complete(self) -> None:
        """End the step. Raises :class:`~ple_memops.PoisonedError` if it was aborted."""
        self._live().complete()

    def abort(self, reason: str = "aborted") -> None:
        """Release any GPU wait for good and poison the object (idempotent)."""
        if self._core is not None:
            self._core.abort(str(reason))

    def wait_consumed(self, timeout: float = 5.0) -> bool:
        """Wait (GIL released) until the GPU consumed the last fill; False on timeout."""
        return self._live().wait_consumed(float(timeout))

    @contextlib.contextmanager
    def step(self, rows: int | None = None) -> Iterator[DeferredRows]:
        """``begin`` / ``complete`` around a block; any exception (KeyboardInterrupt
        included) aborts the object, so the GPU is released at once."""
        self.begin(rows)
        try:
            yield self
        except BaseException as exc:
            self.abort(f"exception in step: {exc!r}")
            raise
        self.complete()

    def stats(self) -> Stats:
        return Stats(**self._live().stats())

    # -- lifecycle --------------------------------------------------------------------

    def close(self) -> None:
        """Release any GPU wait for good and drop the native object (idempotent). Pinned
        memory that a graph captured is kept until process exit (see
        :func:`retained_bytes`); the rest is freed."""
        core, self._core = self._core, None
        self._side = None
        if core is not None:
            core.close()
        _LIVE.discard(self)

    def __enter__(self) -> DeferredRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._core is None:
            return "DeferredRows(closed)"
        c = self._core
        return (
            f"DeferredRows(max_rows={c.max_rows}, row_bytes={c.row_bytes}, mode={c.mode!r}, "
            f"device={self._device}, phase={c.phase!r})"
        )

    # -- helpers ----------------------------------------------------------------------

    def _live(self) -> _native.DeferredRowsCore:
        if self._core is None:
            from .errors import ClosedError

            raise ClosedError("object is closed")
        return self._core

    def _stream_handle(self, stream: Any) -> int:
        if self._device is None:
            return 0
        if stream is None:
            torch = optional_torch()
            if torch is None:
                raise InvalidArgumentError("pass stream= (a raw cudaStream_t) when torch is absent")
            return int(torch.cuda.current_stream(self._device).cuda_stream)
        if isinstance(stream, int):
            return stream
        handle = getattr(stream, "cuda_stream", None)
        if handle is None:
            raise InvalidArgumentError(
                f"stream must be a torch stream or a raw handle, got {stream!r}"
            )
        return int(handle)

    def _fill_stream(self, stream: Any) -> int | None:
        # Only the synchronous fallback uses the stream in fill (it enqueues the copy).
        if self._device is None or self._core is None or self._core.mode != "sync":
            return None
        return self._stream_handle(stream)


def create_group(
    specs: Sequence[tuple[int, int]],
    *,
    device: object = None,
    watchdog: float | None = DEFAULTS.rows_watchdog,
    force_sync: bool = False,
    copy: str = DEFAULTS.copy,
) -> list[DeferredRows]:
    """Create one :class:`DeferredRows` per ``(max_rows, row_bytes)`` on one device, all
    deferred or all synchronous: decided once, before any capture, so a graph never mixes
    a deferred consumer with one that needs its fill before launch."""
    ordinal = parse_device(device)
    sync = force_sync or (ordinal is not None and not probe(ordinal).supported)
    group: list[DeferredRows] = []
    try:
        for max_rows, row_bytes in specs:
            group.append(
                DeferredRows(
                    max_rows,
                    row_bytes,
                    device="cpu" if ordinal is None else ordinal,
                    watchdog=watchdog,
                    force_sync=sync,
                    copy=copy,
                )
            )
    except BaseException:
        for r in group:
            r.close()
        raise
    modes = {r.mode for r in group}
    if len(modes) > 1:  # pragma: no cover - the probe is cached, so this cannot differ
        for r in group:
            r.close()
        raise InvalidArgumentError(f"group ended up in mixed modes {sorted(modes)}")
    return group


def retained_bytes() -> int:
    """Pinned bytes kept alive for captured graphs (freed by the driver at exit)."""
    return _native.retained_bytes()


# -- the package-internal interface ------------------------------------------------------
# What the gather worker (and anything else of the package that drives the native rows
# object) may use of a DeferredRows beyond its public API. Nothing else of another module
# touches its private attributes.


def native_rows(rows: DeferredRows) -> _native.DeferredRowsCore:
    """The native object behind ``rows`` (:class:`~ple_memops.ClosedError` once closed)."""
    return rows._live()


def stream_handle(rows: DeferredRows, stream: Any) -> int:
    """``stream`` (a torch stream, a raw handle, or ``None``: torch's current stream on
    the rows' device) as the raw ``cudaStream_t`` the native calls take (0 on the host)."""
    return rows._stream_handle(stream)


def own_stream(rows: DeferredRows) -> Any:
    """The rows' own side stream (see :meth:`DeferredRows._own_stream`): where an eager
    step's publish and wait for rows go, apart from every other stream in the process."""
    return rows._own_stream()


def stamp_arrival(rows: DeferredRows, stream: Any) -> None:
    """With stall timing, stamp on ``stream`` that the consumer of a step enqueued with
    ``joins=True`` (on a side stream) reached its join; call right before joining."""
    rows._live().stamp_arrival(rows._stream_handle(stream))


def side_stream(rows: DeferredRows, stream: Any) -> Any:
    """Under capture: the rows' own side stream, made to wait for ``stream``; eagerly
    ``None`` (issue inline on ``stream``). See :meth:`DeferredRows.stage`."""
    return rows._fork(stream)


# -- staging and row validation --------------------------------------------------------


def _staging_device(staging: Any) -> object:
    if isinstance(staging, np.ndarray):
        return "cpu"
    dev = getattr(staging, "device", None)
    if dev is None:
        raise InvalidArgumentError(
            f"staging must be a torch tensor or numpy array, got {type(staging)!r}"
        )
    return "cpu" if dev.type == "cpu" else f"cuda:{dev.index if dev.index is not None else 0}"


def _allocate_staging(max_rows: int, row_bytes: int, ordinal: int | None, device: object) -> Any:
    nbytes = max_rows * row_bytes
    if nbytes > sys.maxsize:
        raise InvalidArgumentError(
            f"max_rows * row_bytes ({max_rows} * {row_bytes} = {nbytes} bytes) is more than "
            f"one buffer can hold here (at most {sys.maxsize} bytes)"
        )
    if ordinal is None:
        return np.zeros((max_rows, row_bytes), dtype=np.uint8)
    torch = optional_torch()
    if torch is None:
        raise InvalidArgumentError("a CUDA staging buffer needs torch; pass device='cpu'")
    if not torch.cuda.is_available():
        raise UnsupportedError(
            f"device={device!r}: no CUDA device here; pass device='cpu' (or None: CUDA "
            "where there is a device, else the host)"
        )
    count = int(torch.cuda.device_count())
    if ordinal >= count:
        raise InvalidArgumentError(
            f"device={device!r}: no CUDA device {ordinal} here ({count} device(s): 0..{count - 1})"
        )
    return torch.zeros((max_rows, row_bytes), dtype=torch.uint8, device=f"cuda:{ordinal}")


def _check_staging(staging: Any, max_rows: int, row_bytes: int, ordinal: int | None) -> int:
    shape = tuple(staging.shape)
    if shape != (max_rows, row_bytes):
        raise InvalidArgumentError(f"staging must have shape {(max_rows, row_bytes)}, got {shape}")
    if isinstance(staging, np.ndarray):
        if ordinal is not None:
            raise InvalidArgumentError(
                "a numpy staging buffer lives on the host; device must be 'cpu'"
            )
        if (
            staging.dtype != np.uint8
            or not staging.flags.c_contiguous
            or not staging.flags.writeable
        ):
            raise InvalidArgumentError("staging must be a writable, C-contiguous uint8 array")
        return int(staging.ctypes.data)
    torch = optional_torch()
    if torch is None or not isinstance(staging, torch.Tensor):
        raise InvalidArgumentError(
            f"staging must be a torch tensor or numpy array, got {type(staging)!r}"
        )
    if staging.dtype != torch.uint8 or not staging.is_contiguous():
        raise InvalidArgumentError(
            f"staging must be a contiguous uint8 tensor, got {staging.dtype}"
        )
    want = "cpu" if ordinal is None else f"cuda:{ordinal}"
    dev = staging.device
    have = "cpu" if dev.type == "cpu" else f"cuda:{dev.index if dev.index is not None else 0}"
    if have != want:
        raise InvalidArgumentError(f"staging is on {have}, but the object is for {want}")
    return int(staging.data_ptr())


def _as_rows(rows: Any, row_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    if not isinstance(rows, np.ndarray):
        torch = optional_torch()
        if torch is not None and isinstance(rows, torch.Tensor):
            if rows.device.type != "cpu":
                raise RowShapeError(f"rows must be on the host, got a tensor on {rows.device}")
            if rows.dtype != torch.uint8:
                raise RowShapeError(f"rows must be uint8, got {rows.dtype}")
            rows = rows.detach().numpy()
        else:
            raise RowShapeError(
                f"rows must be a numpy array or torch CPU tensor, got {type(rows)!r}"
            )
    if rows.dtype != np.uint8:
        raise RowShapeError(f"rows must be uint8, got {rows.dtype}")
    if rows.ndim != 2 or rows.shape[1] != row_bytes:
        raise RowShapeError(f"rows must have shape [n, {row_bytes}], got {list(rows.shape)}")
    return np.ascontiguousarray(rows)


if TYPE_CHECKING:  # keep the name referenced for type checkers
    _T = torch.Tensor
