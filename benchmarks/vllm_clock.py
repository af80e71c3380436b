"""The run's clock, for ``bench_vllm.py`` and its modules: ``T0`` (when the run started),
``DEADLINE`` (the monotonic time after which no new measurement starts; ``inf`` until
``main`` or the dry run sets it), ``left()`` (seconds to it) and ``log()`` (a line stamped
with the seconds since ``T0``).

``DEADLINE`` is this module's one mutable global: set it as ``vllm_clock.DEADLINE = ...``
and read it through ``left()`` (``from vllm_clock import DEADLINE`` would copy the value).
"""

from __future__ import annotations

import time

T0 = time.monotonic()
DEADLINE = float("inf")


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def left() -> float:
    return DEADLINE - time.monotonic()
