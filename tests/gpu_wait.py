"""Bounded waits for the GPU tests: a stuck WAIT must fail a test, never hang it, so no
test synchronises with the device; it polls an event with a deadline instead."""

from __future__ import annotations

import time
from typing import Any


def done(event: Any, timeout: float = 10.0) -> bool:
    """Whether ``event`` (a ``torch.cuda.Event``) completed within ``timeout`` seconds."""
    t0 = time.monotonic()
    while not event.query():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.0002)
    return True
