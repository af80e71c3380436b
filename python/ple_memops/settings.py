"""The defaults of ple-memops' step machinery, in one place: :class:`StepSettings` and
:data:`DEFAULTS`.

Every default argument of the core objects, the tables' steps and the engine
integrations comes from here (the names ``DEFAULT_TIMEOUT``, ``DEFAULT_WATCHDOG`` and
``DEPTH`` that other modules export are these values). Torch-free: any process may import
it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import InvalidArgumentError

__all__ = [
    "COPIES",
    "DEFAULTS",
    "DEFAULT_TIMEOUT",
    "DEFAULT_WATCHDOG",
    "DEPTH",
    "PUBLISHES",
    "StepSettings",
]

COPIES = ("auto", "kernel", "memop", "kernel-fused")
"""The device sides of a deferred step (``DeferredRows(copy=...)``)."""
PUBLISHES = ("kernel", "memop")
"""How a graph publishes device-produced ids (``GatherWorker(publish=...)``)."""


@dataclass(frozen=True)
class StepSettings:
    """How deferred steps are run. :data:`DEFAULTS` holds the defaults; ``replace(**kw)``
    gives a checked copy with some fields changed."""

    timeout: float = 30.0
    """Seconds the host waits for one step's fill when it completes it (``Steps``, the
    engine hooks), and for a host publish to be taken: above the longest GPU work
    an engine can queue ahead of a decode step (a large prefill)."""
    watchdog: float | None = 30.0
    """Seconds the GPU may wait for a step's rows once its ids reached the worker (the GPU
    is at the step) before it is released (``None``: never); work queued ahead of
    the step (a whole prefill) and time before the launch do not count."""
    depth: int = 2
    """Steps armed at once: under asynchronous scheduling the host launches step N+1
    before step N is completed."""
    copy: str = "auto"
    """The device side of a deferred step: ``"kernel"``, ``"memop"``, ``"kernel-fused"`` or
    ``"auto"`` (the kernel up to 64 KiB a step)."""
    publish: str = "kernel"
    """How a captured graph publishes its ids: ``"kernel"`` or ``"memop"``."""
    spin: float | None = None
    """Seconds a gather worker stays hot between steps (``None``: the native default,
    0.002)."""
    rows_watchdog: float | None = 5.0
    """The watchdog of a :class:`~ple_memops.DeferredRows` made on its own (outside ``Steps``)."""
    worker_timeout: float = 5.0
    """:meth:`GatherWorker.complete`'s default wait, used on its own (outside ``Steps``)."""

    def __post_init__(self) -> None:
        for name in ("timeout", "worker_timeout"):
            _positive(getattr(self, name), name)
        for name in ("watchdog", "rows_watchdog", "spin"):
            value = getattr(self, name)
            if value is not None:
                _positive(value, name, zero=name == "spin")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise InvalidArgumentError(f"depth must be an int >= 1, got {self.depth!r}")
        if self.copy not in COPIES:
            raise InvalidArgumentError(f"copy must be one of {COPIES}, got {self.copy!r}")
        if self.publish not in PUBLISHES:
            raise InvalidArgumentError(f"publish must be one of {PUBLISHES}, got {self.publish!r}")

    def replace(self, **changes: Any) -> StepSettings:
        """A copy with ``changes`` (checked); unknown names raise."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown settings {unknown}; known: {sorted(known)}")
        return replace(self, **changes)


def _positive(value: object, name: str, *, zero: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        seconds = float(value)  # type: ignore[arg-type]
        ok = math.isfinite(seconds) and (seconds >= 0 if zero else seconds > 0)
    if not ok:
        raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {value!r}")


DEFAULTS = StepSettings()
"""The defaults every module takes its default arguments from."""

DEFAULT_TIMEOUT: float = DEFAULTS.timeout
DEFAULT_WATCHDOG: float | None = DEFAULTS.watchdog
DEPTH: int = DEFAULTS.depth
