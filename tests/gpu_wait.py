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


def captured_after_warmup(torch: Any, body: Any, arm: Any, settle: Any, reset: Any = None) -> Any:
    """``body`` run once eagerly on a side stream between ``arm()`` and ``settle()`` (so
    every kernel it launches is loaded before capture: a first launch queued behind a
    pending wait would synchronise and hang), then ``reset()`` (if given) and ``body``
    captured into a ``torch.cuda.CUDAGraph``, which is returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        arm()
        body()
        settle()
    torch.cuda.synchronize()
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def replayed(graph: Any, times: int, arm: Any, settle: Any, end: Any) -> Any:
    """Replay ``graph`` ``times`` times, each armed with ``arm()`` and completed with
    ``settle()``; yields the replay's number (from 1) once ``end`` (an event recorded
    after it) completed, and fails the test if it never does."""
    for i in range(1, times + 1):
        arm()
        graph.replay()
        end.record()
        settle()
        assert done(end), f"replay {i} never finished"
        yield i
