"""Serving PLE tables from the checkpoint: the table server and the module that replaces a
model's embedding table.

A :class:`PleServer` owns one :class:`~ple_memops.MmapTable` per PLE table and, once
:meth:`PleServer.prepare` was called (outside any capture), the tables'
:class:`~ple_memops.steps.Steps` with one staging buffer per table. The replacement
module (:class:`ServedTable`) has no parameter: its forward gathers rows by id.

- Eager calls (prefill, warm-up, no graph): the ids go to the host, the rows are gathered
  from the memory map and copied to the model's device, synchronously. No pinned memory.
- Under ``torch.cuda.graph`` capture, the step's rows come through the steps: the ids the
  model computed on the GPU are published (``steps.stage``) and the rows consumed from the
  staging buffer after the join, so the host fills them after the graph was launched. How
  the rows reach the staging buffer in a captured step is the server's ``source``:
  ``"device"`` (the published ids, a native worker; the default), ``"host"`` (the runner
  fills with ids it knows after the launch) or ``"staging"`` (nothing in the graph; the
  runner fills the staging buffer before the launch: the synchronous paths).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .._common import capturing, plan_device
from ..errors import InvalidArgumentError, StateError
from ..settings import DEFAULTS
from ..steps import Steps
from ..table import MmapTable
from ._errors import TableMismatchError

if TYPE_CHECKING:
    import torch

__all__ = ["PleServer", "ServedTable", "TableSpec"]

SOURCES = ("device", "host", "staging")

# safetensors dtype names of the tables a model's torch dtype can reinterpret.
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class TableSpec:
    """One PLE table: where it is in the checkpoint and what the model expects of it."""

    name: str
    """The server's key (e.g. ``"embed_tokens_per_layer"`` or ``"layers.2"``)."""
    tensor: str | None
    """The checkpoint tensor (one tensor), or ``None`` with :attr:`pattern`."""
    pattern: str | None
    """Row shards ``...shard_{}.weight`` concatenated in shard order, or ``None``."""
    rows: int
    cols: int
    dtype: torch.dtype
    ids_per_token: int
    """Rows one token needs (Gemma 3n: 1; Qwen4Exp: the n-gram heads)."""


class _Ticket:
    """The rows of one table in one captured (or forced graph-path) step, published but
    not yet consumed.

    ``ids``: the tensor the step published, held until :meth:`consume` has joined the
    side stream. Under capture the publish reads it on the rows' side stream, which the
    capturing stream does not wait for until the join; dropping the last reference
    earlier would let torch's allocator hand its block to a later allocation of the
    capturing stream (a late consumer placement runs layer 0 in between), and a replay
    could overwrite the ids before the publish reads them."""

    def __init__(self, server: PleServer, name: str, n: int, staged: Any, ids: Any = None) -> None:
        self.server, self.name, self.n, self.staged = server, name, n, staged
        self.ids: Any = ids

    def consume(self) -> torch.Tensor:
        """Make the current stream wait for the rows, then return the staging rows
        (``uint8 [n, row_bytes]`` on the model's device)."""
        if self.staged is not None:
            self.staged.join()
        self.ids = None  # joined: the publish is ordered before anything that follows
        return self.server.staging(self.name, self.n)


class PleServer:
    """The PLE tables of one model, served from its checkpoint. Built by
    :func:`ple_memops.transformers.serve`."""

    def __init__(self, checkpoint: str, specs: list[TableSpec], tables: dict[str, MmapTable]):
        self.checkpoint = checkpoint
        self.specs = {s.name: s for s in specs}
        self.tables = tables
        self.steps: Steps | None = None
        self.source = "device"
        self.graph_path = False
        """Take the captured-step path in eager calls too (CPU tests of that path)."""
        self._staging_override: dict[str, torch.Tensor] = {}
        self._deferred_consume: dict[str, Callable[[_Ticket], None]] = {}
        self.eager_gathers = 0
        self.eager_rows = 0

    # -- setup ----------------------------------------------------------------------

    @staticmethod
    def check_table(spec: TableSpec, table: MmapTable) -> None:
        """Refuse a table whose dtype, width or row count disagrees with the model."""
        import torch

        want = str(spec.dtype).replace("torch.", "")
        have = _DTYPES.get(table.dtype)
        where = spec.tensor or spec.pattern
        if have != want:
            raise TableMismatchError(
                f"table {where!r} is {table.dtype}, the model's embedding is {want}: "
                "load the model in the table's dtype (rows are served as stored)"
            )
        itemsize = torch.empty(0, dtype=spec.dtype).element_size()
        if table.row_bytes != spec.cols * itemsize:
            raise TableMismatchError(
                f"table {where!r} has rows of {table.row_bytes} bytes, the model needs "
                f"{spec.cols} x {itemsize} = {spec.cols * itemsize}"
            )
        if table.rows < spec.rows:
            raise TableMismatchError(
                f"table {where!r} has {table.rows} rows, the model's embedding {spec.rows}"
            )

    def prepare(
        self,
        max_tokens: int,
        *,
        device: Any = None,
        deferred: bool = True,
        source: str = "device",
        watchdog: float | None = DEFAULTS.watchdog,
        depth: int = DEFAULTS.depth,
        timeout: float | None = None,
        track_arrival: bool = False,
        log_fallback: bool = True,
    ) -> Any:
        """Build the tables' :class:`~ple_memops.steps.Steps` for captured steps of up to
        ``max_tokens`` tokens (call outside any capture: it allocates pinned memory and runs
        the probe), closing the previous ones. ``deferred=False`` forces the synchronous
        fallback; ``source`` says how captured steps get their rows (module docs);
        ``track_arrival`` counts fills the GPU waited for; ``depth`` and ``timeout`` (the
        seconds a completion waits for a step's fill) as ``Steps.build``'s;
        ``log_fallback=False``: tables that do not defer are not logged (``steps.reason``
        says why, for a caller that says it in its own words). Returns the steps
        (``steps.mode`` tells which), also :attr:`steps`."""
        if source not in SOURCES:
            raise InvalidArgumentError(f"source must be one of {SOURCES}, got {source!r}")
        if capturing():
            raise StateError("prepare() allocates pinned memory: call it outside graph capture")
        self.close_steps()
        max_rows = max(s.ids_per_token for s in self.specs.values()) * int(max_tokens)
        self.steps = Steps.build(
            dict(self.tables),
            max_rows=max_rows,
            device=plan_device(device),
            id_dtype="int64",
            deferred=deferred,
            watchdog=watchdog,
            depth=depth,
            timeout=DEFAULTS.timeout if timeout is None else timeout,
            track_arrival=track_arrival,
            log_fallback=log_fallback,
        )
        self.source = source
        return self.steps

    def live_steps(self) -> Steps:
        """:attr:`steps`, or :class:`~ple_memops.StateError` before :meth:`prepare`."""
        if self.steps is None:
            raise StateError("no steps: call prepare() first")
        return self.steps

    def close_steps(self) -> None:
        """Shut the current steps down (idempotent)."""
        steps, self.steps = self.steps, None
        if steps is not None:
            steps.shutdown()

    def close(self) -> None:
        """Close the steps and the tables (idempotent)."""
        self.close_steps()
        for t in self.tables.values():
            t.close()

    @property
    def table_bytes(self) -> int:
        return sum(t.rows * t.row_bytes for t in self.tables.values())

    # -- the rows of a forward ---------------------------------------------------------

    def staging(self, name: str, n: int) -> torch.Tensor:
        """The rows a captured step reads: ``uint8 [n, row_bytes]``."""
        if name in self._staging_override:
            return self._staging_override[name][:n]
        out: torch.Tensor = self.live_steps().staging(name, n)
        return out

    @contextlib.contextmanager
    def staging_buffers(self, buffers: dict[str, torch.Tensor]) -> Iterator[None]:
        """Within the block, captured steps read ``buffers`` (the runner fills them before
        the launch) instead of the steps' staging: the vLLM-PR-style synchronous path."""
        old = dict(self._staging_override)
        self._staging_override.update(buffers)
        try:
            yield
        finally:
            self._staging_override = old

    def rows_for(self, name: str, ids: torch.Tensor) -> torch.Tensor | _Ticket:
        """The rows of ``ids`` (any shape, int64, on the model's device) as ``uint8
        [ids.numel(), row_bytes]``; under capture a :class:`_Ticket` if a later consumer
        was registered for this table (see :meth:`consume_later`)."""
        if not (self.graph_path or capturing()):
            return self.gather_eager(name, ids)
        flat = ids.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        n = int(flat.numel())
        staged = None
        published = None
        if name not in self._staging_override:
            if self.steps is None:
                raise StateError("no steps: call prepare() before capturing a step")
            steps = self.steps
            if steps.deferred and self.source == "device":
                # Publish the ids the graph computed; the worker gathers after the launch.
                staged = steps.stage(name, flat, rows=n)
                published = flat
            elif steps.deferred and self.source == "host":
                # The runner publishes ids it knows (to the worker), around the launch.
                staged = steps.stage_host_fed(name, rows=n)
        ticket = _Ticket(self, name, n, staged, published)
        hook = self._deferred_consume.get(name)
        if hook is not None:
            hook(ticket)
            return ticket
        return ticket.consume()

    def consume_later(self, name: str, hook: Callable[[_Ticket], None] | None) -> None:
        """Captured steps hand ``name``'s ticket to ``hook`` instead of consuming at once
        (a later consumer placement); ``None`` restores the default."""
        if hook is None:
            self._deferred_consume.pop(name, None)
        else:
            self._deferred_consume[name] = hook

    def gather_eager(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Synchronous gather: ids to the host, rows from the memory map, copied to the
        ids' device. Not for capture."""
        import torch

        host = ids.reshape(-1).to("cpu", torch.int64).numpy()
        rows = self.tables[name].gather(np.ascontiguousarray(host))
        self.eager_gathers += 1
        self.eager_rows += int(host.size)
        out = torch.from_numpy(rows)
        return out.to(ids.device) if ids.device.type != "cpu" else out

    # -- the runner's side of a captured step ------------------------------------------

    def fill_staging_from_host(self, ids: np.ndarray[Any, Any], name: str) -> None:
        """The synchronous fallback through the steps: gather ``ids`` into the staging
        buffer on the current stream before the launch."""
        self.live_steps().gather_now(name, ids)


def _make_served_table() -> type:
    import torch

    class _Served(torch.nn.Module):
        """Replaces a model's PLE embedding: no parameter; rows come from the server."""

        def __init__(
            self,
            server: PleServer,
            spec: TableSpec,
            *,
            scale: float | None,
            map_out_of_table: bool,
            device: Any,
        ) -> None:
            super().__init__()
            self.server = server
            self.table_name = spec.name
            self.cols = spec.cols
            self.table_rows = spec.rows
            self.row_dtype = spec.dtype
            self.map_out_of_table = map_out_of_table
            self.scalar_embed_scale = scale
            # The anchor keeps the module's device and dtype visible to code that asks
            # `module.weight.device` (Qwen4Exp does), without holding the table.
            self.register_buffer(
                "_anchor", torch.empty(0, dtype=spec.dtype, device=device), persistent=False
            )
            if scale is not None:
                self.register_buffer(
                    "embed_scale",
                    torch.tensor(scale, dtype=torch.float32, device=device),
                    persistent=False,
                )

        @property
        def weight(self) -> torch.Tensor:
            return cast("torch.Tensor", self._anchor)

        def map_ids(self, ids: torch.Tensor) -> torch.Tensor:
            if not self.map_out_of_table:
                return ids
            # Stock semantics (Gemma3nModel; the 5.24 text model): ids outside the table
            # (vision/audio soft tokens) read row 0.
            in_table = torch.logical_and(ids >= 0, ids < self.table_rows)
            return torch.where(in_table, ids, torch.zeros_like(ids))

        def decode(self, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
            out = rows.view(self.row_dtype).view(*shape, self.cols)
            if self.scalar_embed_scale is not None:
                scale = cast("torch.Tensor", self.embed_scale)
                out = out * scale.to(self.row_dtype)
            return out

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            ids = self.map_ids(input_ids.long())
            got = self.server.rows_for(self.table_name, ids)
            if isinstance(got, _Ticket):
                # A later consumer decodes the rows; this value is never read.
                return torch.empty((*ids.shape, self.cols), dtype=self.row_dtype, device=ids.device)
            return self.decode(got, ids.shape)

        def extra_repr(self) -> str:
            return f"table={self.table_name!r}, cols={self.cols}, served from the checkpoint"

    return _Served


_SERVED_CLS: type | None = None


def ServedTable(*args: Any, **kwargs: Any) -> Any:
    """Build the replacement module (a ``torch.nn.Module``; torch is imported lazily)."""
    global _SERVED_CLS
    if _SERVED_CLS is None:
        _SERVED_CLS = _make_served_table()
    return _SERVED_CLS(*args, **kwargs)


def is_served(module: Any) -> bool:
    return _SERVED_CLS is not None and isinstance(module, _SERVED_CLS)
