"""The public :class:`MmapTable`: PLE rows served from a safetensors checkpoint through
a read-only memory map, gathered by native code with the GIL released."""

from __future__ import annotations

import os
from typing import Any, Literal, get_args

import numpy as np

from . import _native
from ._common import host_ids
from .errors import ClosedError, InvalidArgumentError

__all__ = ["Access", "ColdReads", "MmapTable", "native_table"]

Access = Literal["random", "normal"]
"""How rows are read: ``"random"`` (no read-around) or ``"normal"`` (the kernel's)."""
ColdReads = Literal["auto", "uring", "willneed", "pool", "fault"]
"""How a gather reads rows that are not known to be in the page cache."""


def sigbus_guard_active() -> bool:
    """Whether a SIGBUS on a table's mapping (its file shrank or failed under it) becomes a
    :class:`~ple_memops.TableIoError` now: true once a table has opened, while the
    process's SIGBUS handler is still the one it installed (a handler installed later
    that does not chain, e.g. ``faulthandler.enable()`` after the first open, makes it
    false: such a fault then kills the process)."""
    return _native.sigbus_guard_active()


def _as_ids(ids: Any) -> Any:
    # A table's gather runs on the hot path: a CUDA tensor is refused, never synchronised.
    return host_ids(ids, allow_device_sync=False)


def _as_out(out: Any) -> Any:
    """A destination as the numpy array the native gather writes (torch CPU tensors are
    viewed, not copied)."""
    if type(out) is np.ndarray:
        return out
    if hasattr(out, "data_ptr") and hasattr(out, "numpy"):  # a torch tensor
        if out.device.type != "cpu":
            raise InvalidArgumentError(f"out must be a CPU tensor, got one on {out.device}")
        if str(out.dtype) != "torch.uint8":
            raise InvalidArgumentError(f"out must be uint8, got {out.dtype}")
        if not out.is_contiguous():
            raise InvalidArgumentError("out must be contiguous")
        return out.numpy()  # shares memory with the tensor (pinned or not)
    raise InvalidArgumentError(
        f"out must be a numpy uint8 array or a torch CPU uint8 tensor, got {type(out)!r}"
    )


def _check_columns(columns: object) -> None:
    if columns is not None and not (
        isinstance(columns, tuple)
        and len(columns) == 2
        and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in columns)
    ):
        raise InvalidArgumentError(
            f"columns must be a (first, count) tuple of non-negative ints or None, got {columns!r}"
        )


def _check_threads(gather_threads: object) -> None:
    if gather_threads is not None and (
        not isinstance(gather_threads, int)
        or isinstance(gather_threads, bool)
        or not 2 <= gather_threads <= 64
    ):
        raise InvalidArgumentError(
            f"gather_threads must be an int from 2 to 64 or None (the shared pool), "
            f"got {gather_threads!r}"
        )


class MmapTable:
    """A 2-D embedding table (or its row shards) in a safetensors checkpoint, memory-mapped
    read-only; :meth:`gather` copies rows by id in native code with the GIL released.

    Open with :meth:`open`. A row is the raw bytes of one row of the tensor
    (``row_bytes = cols * itemsize``); decode them with the table's :attr:`dtype` and, for
    FP8, multiply by :attr:`scale`. The checkpoint's files must not change while open.

    Thread-safe: any number of threads may gather at once. ``close()`` (or leaving a
    ``with`` block) releases the mapping once no gather is running.
    """

    def __init__(self, core: _native.MmapTableCore) -> None:
        """Wrap a native table; use :meth:`open`."""
        self._core: _native.MmapTableCore | None = core

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        name: str | None = None,
        *,
        pattern: str | None = None,
        prewarm_bytes: int | None = None,
        readahead: bool = False,
        rss_budget_bytes: int | None = None,
        parallel_min_bytes: int | None = None,
        gather_threads: int | None = None,
        access: Access = "random",
        cold_reads: ColdReads = "auto",
        adopt_resident: bool = True,
        columns: tuple[int, int] | None = None,
    ) -> MmapTable:
        """Open a table.

        Args:
            path: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a
                checkpoint directory holding either (the index wins).
            name: the exact tensor name, e.g.
                ``"model.language_model.embed_tokens_per_layer.weight"``.
            pattern: instead of ``name``, the shard names with ``{}`` for the shard index,
                e.g. ``"model.layers.2.ple.ple_embedding.ngram_embedding.shard_{}.weight"``;
                shards ``0..n`` must all exist and agree in dtype and width; their rows
                concatenate in shard order.
            prewarm_bytes: fault in the first this-many bytes of the table at open.
            readahead: kept for compatibility. It asked for a gather's cold reads to go out
                together, which every ``cold_reads`` but ``"fault"`` now does; with
                ``"fault"`` it is refused, otherwise it changes nothing.
            rss_budget_bytes: keep the table's pages in the page cache below about this
                many bytes: once the pages it has read exceed it, evict the least used
                (per-page access counts with aging), not the whole table.
            parallel_min_bytes: gathers of at least this many bytes use the native thread
                pool (default: the measured threshold, 256 KiB).
            gather_threads: ``None`` (default): those gathers run on the process's shared
                pool (up to 8 threads, shared by every table); 2 to 64: on that many
                threads of this table's own, started at open, so its gathers never queue
                behind other tables' (the first PLE layer of an engine, whose fill a step
                waits for while the later layers gather too).
            access: ``"random"`` (default): no read-around, so a cold row costs one read
                of its page(s) and the page cache grows by about that; ``"normal"``: the
                kernel's read-around and readahead (for tables read in long runs).
            cold_reads: how a gather reads rows whose pages the table has not read yet
                (rows it has read are copied straight from the mapping): ``"auto"``
                (default: ``"uring"`` where the kernel allows io_uring, else
                ``"willneed"``; :attr:`cold_reads` tells which), ``"uring"`` (one read per
                row on an io_uring, all submitted together; refused with
                :class:`~ple_memops.TableIoError` where io_uring is unavailable),
                ``"willneed"`` (``MADV_WILLNEED`` per row, then the copy), ``"pool"``
                (``pread`` on 32 threads), ``"fault"`` (one page fault at a time).
            adopt_resident: take the table's pages that are in the page cache already
                as read (:meth:`adopt_resident`), so a warm host's gathers copy them
                straight from the mapping instead of reading each cold first (measured:
                1024 rows of 256 B from a warm 1 GiB table, 670 -> 60 us a gather). Not
                under an RSS budget (it accounts for the pages the table read itself).
            columns: ``(first, count)``: serve columns ``first .. first + count`` of each
                row only, as a table of ``count`` columns (:attr:`row_bytes`,
                :attr:`shape` and every gather are the window's; a gather reads only those
                bytes of a row). Gemma's per-layer table holds every decoder layer's
                slice in one row; a window serves a layer's slice as a table of its own.
                ``None`` (default): whole rows.

        Raises:
            TableError: the checkpoint or tensor is missing, malformed or inconsistent.
            TableIoError: a file could not be read or advised, or ``cold_reads="uring"``
                where io_uring cannot be used.
            InvalidArgumentError: neither or both of ``name`` and ``pattern``, a pattern
                without exactly one ``{}``, an unknown ``access`` or ``cold_reads``,
                ``gather_threads`` outside 2-64, ``readahead=True`` with
                ``cold_reads="fault"``, or ``columns`` not a non-empty window of the row.
        """
        if (name is None) == (pattern is None):
            raise InvalidArgumentError("give exactly one of name= and pattern=")
        for what, v in (
            ("prewarm_bytes", prewarm_bytes),
            ("rss_budget_bytes", rss_budget_bytes),
            ("parallel_min_bytes", parallel_min_bytes),
        ):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise InvalidArgumentError(f"{what} must be a non-negative int or None, got {v!r}")
        _check_threads(gather_threads)
        _check_columns(columns)
        for what, choice, allowed in (
            ("access", access, get_args(Access)),
            ("cold_reads", cold_reads, get_args(ColdReads)),
        ):
            if not isinstance(choice, str) or choice not in allowed:
                raise InvalidArgumentError(
                    f"{what} must be one of {', '.join(map(repr, allowed))}, got {choice!r}"
                )
        core = _native.MmapTableCore(
            os.fspath(path),
            name,
            pattern,
            prewarm_bytes,
            bool(readahead),
            rss_budget_bytes,
            parallel_min_bytes,
            gather_threads,
            access,
            cold_reads,
            bool(adopt_resident),
            columns,
        )
        return cls(core)

    # -- properties -------------------------------------------------------------------

    @property
    def rows(self) -> int:
        """Rows in the table (all shards)."""
        return self._live().rows

    @property
    def gather_threads(self) -> int | None:
        """The table's own gather threads (``None``: it uses the shared pool)."""
        threads: int | None = self._live().gather_threads
        return threads

    @property
    def columns(self) -> tuple[int, int] | None:
        """The column window served, ``(first, count)`` (``None``: whole rows)."""
        window: tuple[int, int] | None = self._live().columns
        return window

    @property
    def parallel_min_bytes(self) -> int:
        """Gathers of at least this many bytes run on a pool, smaller ones inline."""
        return int(self._live().parallel_min_bytes)

    @property
    def row_bytes(self) -> int:
        """Bytes per row (of the column window, with ``columns``)."""
        return self._live().row_bytes

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` in elements of :attr:`dtype`."""
        core = self._live()
        return (core.rows, core.cols)

    @property
    def dtype(self) -> str:
        """The safetensors dtype: ``"F8_E4M3"``, ``"F8_E5M2"``, ``"BF16"``, ``"F16"`` or
        ``"F32"``."""
        return self._live().dtype

    @property
    def scale(self) -> float | None:
        """The scalar dequantization scale of an FP8 table, or ``None``. Looked for, per
        shard, as ``<tensor>_scale``, ``<tensor>.scale``, then ``<stem>.scale`` (where
        the tensor is ``<stem>.weight``); all shards must agree."""
        return self._live().scale

    @property
    def scale_tensor(self) -> str | None:
        """The name of the tensor :attr:`scale` came from."""
        return self._live().scale_tensor

    @property
    def files(self) -> list[str]:
        """The mapped checkpoint files."""
        return [os.fspath(p) for p in self._live().files]

    @property
    def shards(self) -> list[tuple[str, int]]:
        """``(tensor name, rows)`` per shard, in row order."""
        return self._live().shards

    @property
    def cold_reads(self) -> str:
        """The cold-read way in use: ``"uring"``, ``"willneed"``, ``"pool"`` or
        ``"fault"`` (``"auto"`` resolved at open)."""
        return self._live().cold_reads

    @property
    def cold_reads_reason(self) -> str | None:
        """Why ``cold_reads="auto"`` did not choose io_uring (e.g. a seccomp filter or an
        old kernel refused it), or ``None``."""
        return self._live().cold_reads_reason

    @property
    def access(self) -> str:
        """``"random"`` or ``"normal"``, as opened."""
        return self._live().access

    @property
    def closed(self) -> bool:
        return self._core is None

    # -- gathers ----------------------------------------------------------------------

    def gather(self, ids: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Rows ``ids`` as a new ``uint8`` array ``[len(ids), row_bytes]``.

        ``ids``: a 1-D integer numpy array (int64/int32 pass without a copy), a torch CPU
        tensor, or a sequence of ints. Duplicates are fine. Raises
        :class:`~ple_memops.RowIdError` for an id outside ``[0, rows)``, before anything is
        copied."""
        rows: np.ndarray[Any, np.dtype[np.uint8]] = self._live().gather(_as_ids(ids))
        return rows

    def gather_into(self, ids: Any, out: Any) -> None:
        """Copy rows ``ids`` into ``out``: a C-contiguous, writable ``uint8`` numpy array
        or torch CPU tensor (pinned or not) of shape ``[len(ids), row_bytes]``. Every id
        is checked first: on an id or argument error ``out`` is left untouched.

        Rows whose pages the table has read before are copied straight from the mapping;
        the others are read together first (see ``cold_reads``). A read error, or a row
        past the end of a file that shrank under the table, or on a page the kernel
        could not read through the mapping (SIGBUS, caught), raises
        :class:`~ple_memops.TableIoError` naming the file and offset; ``out`` is then
        zeroed."""
        self._live().gather_into(_as_ids(ids), _as_out(out))

    def check_ids(self, ids: Any) -> None:
        """Raise :class:`~ple_memops.RowIdError` unless every id is a row."""
        self._live().check_ids(_as_ids(ids))

    # -- page cache -------------------------------------------------------------------

    def resident_bytes(self) -> int:
        """Bytes of the table's pages in the page cache now (``mincore``; page-granular)."""
        return self._live().resident_bytes()

    def prewarm(self, budget: int | None = None) -> int:
        """Fault in the table's first ``budget`` bytes (all of it by default; capped by
        the RSS budget). Returns the bytes warmed."""
        if budget is None:
            budget = 2**64 - 1
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise InvalidArgumentError(f"budget must be a non-negative int, got {budget!r}")
        return self._live().prewarm(min(budget, 2**64 - 1))

    def adopt_resident(self) -> int:
        """Take the table's pages that are in the page cache now as read (``mincore``):
        their rows are then copied straight from the mapping rather than read cold
        first. :meth:`open` does this unless ``adopt_resident=False`` or under an RSS
        budget; call it again after something else (another process, a prewarm of the
        files) brought pages in. Returns the bytes adopted (pages not known before),
        within the known set's limit (half the machine's memory without a budget)."""
        return self._live().adopt_resident()

    def drop_pages(self) -> None:
        """Drop the table's pages from this process (``MADV_DONTNEED``) and from the page
        cache (``POSIX_FADV_DONTNEED``; clean pages no other mapping holds). The data is
        unaffected: later gathers read it back from the file."""
        self._live().drop_pages()

    def page_stats(self) -> dict[str, Any]:
        """Page-cache counters: ``row_hits`` / ``row_misses`` (rows copied straight from
        the mapping / read cold), ``pages_read`` (pages cold reads brought in),
        ``touched_bytes`` (bytes of the pages the table has read and not dropped since),
        ``budget_drops`` and ``pages_evicted`` (RSS-budget evictions), ``pages_forgotten``
        (without a budget, pages no longer assumed resident once they exceed half the
        machine's memory), ``pages_adopted`` (pages taken as read because they were
        cached already: :meth:`adopt_resident`), ``cold_fallbacks`` / ``last_fallback``
        (cold gathers that could not use io_uring on their thread), ``slow_copies``
        (gathers whose copy of rows known resident found their pages being faulted in from
        storage, dropped by the kernel behind the table's back, and read every row
        together instead), ``last_drop_error``, ``data_bytes``."""
        return self._live().page_stats()

    # -- lifecycle --------------------------------------------------------------------

    def window(
        self, columns: tuple[int, int] | None = None, *, gather_threads: int | None = None
    ) -> MmapTable:
        """Another table on the same open checkpoint, serving ``columns`` (``(first,
        count)`` of each stored row, as :meth:`open`'s ``columns``; ``None``: whole rows)
        with ``gather_threads`` of its own (as :meth:`open`'s). It shares this table's
        mappings, the pages it knows resident and its page counters (:meth:`page_stats`),
        so a process that serves one tensor as several windows maps it once (and its
        RSS counts the pages once). Closing either leaves the other open.

        Raises:
            InvalidArgumentError: ``columns`` not a non-empty window of the row, or
                ``gather_threads`` outside 2-64.
            ClosedError: this table is closed.
        """
        _check_columns(columns)
        _check_threads(gather_threads)
        return type(self)(self._live().window(columns, gather_threads))

    def close(self) -> None:
        """Release the mapping (idempotent; it stays while a :meth:`window` of it is
        open). A gather running in another thread keeps it alive until it returns; every
        later call raises :class:`~ple_memops.ClosedError`."""
        self._core = None

    def __enter__(self) -> MmapTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._core is None:
            return "MmapTable(closed)"
        c = self._core
        return (
            f"MmapTable({c.label}, dtype={c.dtype}, shape=({c.rows}, {c.cols}), "
            f"row_bytes={c.row_bytes}, shards={len(c.shards)})"
        )

    def _live(self) -> _native.MmapTableCore:
        core = self._core
        if core is None:
            raise ClosedError("table is closed")
        return core


def native_table(table: MmapTable) -> _native.MmapTableCore:
    """The native table behind ``table``, for the package's other native objects (the
    rows' ``fill_from``, the gather worker); raises :class:`~ple_memops.ClosedError` once
    the table is closed. Package-internal."""
    return table._live()
