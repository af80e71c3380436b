"""ple-memops: let a captured CUDA graph consume embedding rows that the host gathers
from a memory-mapped table *after* the graph was launched.

See :class:`DeferredRows` for the per-step protocol and :func:`probe` for the capability
check. Errors are in :mod:`ple_memops.errors`.
"""

from __future__ import annotations

from ._deferred import (
    Capability,
    Check,
    DeferredRows,
    StagedRows,
    StallSamples,
    Stats,
    create_group,
    probe,
    retained_bytes,
)
from ._worker import GatherWorker, WorkerStats
from .errors import (
    ClosedError,
    CudaDriverError,
    InvalidArgumentError,
    NoArmedStepError,
    PleMemopsError,
    PoisonedError,
    RowIdError,
    RowShapeError,
    SlotBusyError,
    StateError,
    TableError,
    TableIoError,
    UnarmedReplayError,
    UnsupportedError,
)
from .table import MmapTable, sigbus_guard_active

__all__ = [
    "Capability",
    "Check",
    "ClosedError",
    "CudaDriverError",
    "DeferredRows",
    "GatherWorker",
    "InvalidArgumentError",
    "MmapTable",
    "NoArmedStepError",
    "PleMemopsError",
    "PoisonedError",
    "RowIdError",
    "RowShapeError",
    "SlotBusyError",
    "StagedRows",
    "StallSamples",
    "StateError",
    "Stats",
    "TableError",
    "TableIoError",
    "UnarmedReplayError",
    "UnsupportedError",
    "WorkerStats",
    "create_group",
    "probe",
    "retained_bytes",
    "sigbus_guard_active",
]

__version__ = "0.1.0"
