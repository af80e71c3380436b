"""The exceptions ple-memops raises. Every one derives from :class:`PleMemopsError`.

The native core maps each of its error kinds to exactly one class here (see
``_native.error_kinds()``); the classes also derive from the builtin that fits, so
``except ValueError`` keeps working for bad input.
"""

from __future__ import annotations

__all__ = [
    "ClosedError",
    "CudaDriverError",
    "InvalidArgumentError",
    "NoArmedStepError",
    "PleMemopsError",
    "PoisonedError",
    "RowIdError",
    "RowShapeError",
    "SlotBusyError",
    "StateError",
    "TableError",
    "TableIoError",
    "UnarmedReplayError",
    "UnsupportedError",
]


class PleMemopsError(Exception):
    """Base class of every ple-memops error."""


class UnsupportedError(PleMemopsError):
    """The deferred path cannot run here (no driver, no device, a missing capability)."""


class CudaDriverError(PleMemopsError, RuntimeError):
    """A CUDA driver call failed; the message names the call and the device."""


class PoisonedError(PleMemopsError, RuntimeError):
    """The object was aborted (by ``abort()``, the watchdog or a failed fill); the message
    carries the first cause. Every later call raises this."""


class ClosedError(PleMemopsError, RuntimeError):
    """The object was closed."""


class StateError(PleMemopsError, RuntimeError):
    """A lifecycle call out of order (fill twice, complete without fill, ...)."""


class UnarmedReplayError(StateError):
    """A graph replay published ids to a :class:`~ple_memops.GatherWorker` with no step
    armed (replayed without ``begin()``). Its consumer was released with zero rows, never
    another step's; the rows object is poisoned, so later calls raise
    :class:`PoisonedError`."""


class NoArmedStepError(StateError):
    """Host ids given to a :class:`~ple_memops.GatherWorker` (``publish_from_host``,
    ``Steps.publish_host``) with no armed step waiting for ids: misuse, nothing was
    written and no step is left waiting for them (so nothing needs releasing)."""


class SlotBusyError(StateError):
    """The GPU has not consumed the previous fill yet; nothing was written."""


class RowShapeError(PleMemopsError, ValueError):
    """Rows of the wrong dtype, width or count; nothing was written."""


class InvalidArgumentError(PleMemopsError, ValueError):
    """A bad argument (sizes, device, staging buffer, timeouts)."""


class TableError(PleMemopsError, ValueError):
    """A memory-mapped table could not be opened or failed validation."""


class TableIoError(TableError, OSError):
    """An I/O error on a table's file."""


class RowIdError(PleMemopsError, IndexError):
    """A row id outside the table; checked before anything is written."""
