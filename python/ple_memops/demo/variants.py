"""The variants' host side: the module each one reads its rows through (:func:`installed`)
and what it does around each step's launch (:class:`Ops`, built per scheduling style).

The deferred variants run their steps through the server's
:class:`~ple_memops.steps.Steps` (arm, publish, complete the oldest beyond the
scheduling depth, drain, counters); the synchronous ones fill before the launch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .decode import GEMMA3N_TABLE, Decoder

__all__ = ["Ops", "deferred_ops", "fallback_ops", "installed", "sync_gather_ops", "uva_module"]


@dataclass
class Ops:
    """What a variant does around each step's launch."""

    arm: Callable[[int], None] = lambda k: None
    """Before the launch (deferred: begin the step)."""
    before: Callable[[int, Any], None] = lambda k, ids: None
    """Before the launch, with the step's ids on the host (synchronous paths)."""
    after_launch: Callable[[int], None] = lambda k: None
    """After the launch (deferred: complete the oldest step beyond the scheduling
    depth)."""
    finish: Callable[[], None] = lambda: None
    launching: Callable[[int, Callable[[], Any]], None] | None = None
    """Right before the launch, with a callable that returns the step's ids (blocking
    until they are known): hands them to another thread (deferred-host, async)."""
    close: Callable[[], None] = lambda: None
    """Always called when the ops are done with, after a failure too."""
    needs_ids_before: bool = False
    host_ns: list[int] = field(default_factory=list)
    stats: Callable[[], tuple[float | None, int | None]] = lambda: (None, None)


@contextlib.contextmanager
def installed(bench: Any, variant: str) -> Iterator[int | None]:
    """Install the module the variant reads its rows through; yields its pinned bytes."""
    import torch

    served = bench.served
    if variant == "gpu-table":
        mod = bench.stock.to(bench.device)
        served.install(GEMMA3N_TABLE, mod)
        try:
            yield 0
        finally:
            served.restore()
            bench.stock.to("cpu")
            if bench.cuda:
                torch.cuda.empty_cache()
    elif variant == "pinned-uva":
        mod, nbytes = uva_module(bench)
        served.install(GEMMA3N_TABLE, mod)
        try:
            yield nbytes
        finally:
            served.restore()
    else:
        yield None


def uva_module(bench: Any) -> tuple[Any, int]:
    """The stock module whose weight is a CUDA view of a pinned host copy of the table:
    the embedding kernel reads the rows over PCIe (what vLLM 0.33 ships)."""
    import copy

    import torch

    if bench.uva is None:
        # The stock (reference) module may already live on the GPU: pin a host copy.
        w = bench.stock.weight.detach().to("cpu")
        pinned = w.view(torch.int16).pin_memory()
        view = torch.as_tensor(_CudaArray(pinned, bench.device.index or 0), device=bench.device)
        mod = copy.copy(bench.stock)
        mod._parameters = dict(mod._parameters)
        mod._buffers = {k: v.to(bench.device) for k, v in mod._buffers.items()}
        mod.weight = torch.nn.Parameter(view.view(w.dtype), requires_grad=False)
        bench.uva = (mod, pinned, int(pinned.numel() * 2))
    return bench.uva[0], bench.uva[2]


def sync_gather_ops(bench: Any, dec: Decoder) -> tuple[Callable[[str], Ops], dict[str, Any], int]:
    import torch

    table = bench.table
    n = dec.batch
    staging = torch.zeros((n, table.row_bytes), dtype=torch.uint8, device=bench.device)
    host = torch.zeros((n, table.row_bytes), dtype=torch.uint8)
    if bench.cuda:
        host = host.pin_memory()

    def ops_for(style: str) -> Ops:
        ops = Ops(needs_ids_before=True)

        def before(k: int, ids: Any) -> None:
            t0 = time.perf_counter_ns()
            table.gather_into(ids, host)
            staging.copy_(host, non_blocking=True)
            ops.host_ns.append(time.perf_counter_ns() - t0)

        ops.before = before
        ops.stats = lambda: (_mean_us(ops.host_ns), None)
        return ops

    return ops_for, {GEMMA3N_TABLE: staging}, int(host.numel())


def fallback_ops(bench: Any, dec: Decoder) -> Callable[[str], Ops]:
    server = bench.served.server

    def ops_for(style: str) -> Ops:
        ops = Ops(needs_ids_before=True)

        def before(k: int, ids: Any) -> None:
            t0 = time.perf_counter_ns()
            server.fill_staging_from_host(ids, GEMMA3N_TABLE)
            ops.host_ns.append(time.perf_counter_ns() - t0)

        ops.before = before
        ops.stats = lambda: (_mean_us(ops.host_ns), None)
        return ops

    return ops_for


def deferred_ops(bench: Any, dec: Decoder, *, host: bool) -> Callable[[str], Ops]:
    """The deferred variants, through the server's steps. ``deferred-device``
    (``host=False``): the graph publishes the ids it computed, a native worker fills.
    ``deferred-host`` (``host=True``): host-known ids go to the table's worker
    (:meth:`~ple_memops.steps.Steps.publish_host`), which gathers and fills; the
    launching thread never fills. Under ``sync`` scheduling the ids are known before the
    launch and published then, so the gather overlaps the launch. Under ``async`` the ids
    of step k are step k-1's tokens, which reach the host only after step k was launched:
    the steps' publisher thread waits for them and publishes. (Filling on the launching
    thread after ``graph.replay()`` stalls at E2B shapes: with the copy-engine consumer
    and thousands of nodes behind its wait, the launch itself does not return before the
    wait was passed.)"""
    driver = bench.served.server.live_steps()
    n = dec.batch

    def ops_for(style: str) -> Ops:
        ops = Ops()
        base = driver.counters(GEMMA3N_TABLE)
        # sync: the step completes before the next launch; async: one step stays armed
        # ahead (depth 2) and the older one completes.
        limit = 1 if style == "async" else 0

        def arm(k: int) -> None:
            driver.arm(n)

        def publish(k: int, ids: Any) -> None:
            driver.publish_host(GEMMA3N_TABLE, ids)

        def launching(k: int, ids_of: Callable[[], Any]) -> None:
            driver.publish_host_later(GEMMA3N_TABLE, ids_of)

        def after_launch(k: int) -> None:
            driver.settle(limit)

        def stats() -> tuple[float | None, int | None]:
            got = driver.counters(GEMMA3N_TABLE).since(base)
            return got.mean_fill_us, (got.gpu_waited or None)

        ops.arm, ops.after_launch, ops.stats = arm, after_launch, stats
        # After a failure a publish still under way ends within its bounded wait (the
        # tables are aborted by then).
        ops.finish, ops.close = driver.drain, driver.stop_publisher
        if host and style == "async":
            ops.launching = launching
        elif host:
            ops.before = publish
        return ops

    return ops_for


class _CudaArray:
    """``__cuda_array_interface__`` over pinned host memory: on a UVA system the host
    address is the device address, so torch can wrap it as a CUDA tensor."""

    def __init__(self, pinned: Any, device: int) -> None:
        self._keep = pinned
        self.__cuda_array_interface__ = {
            "shape": tuple(pinned.shape),
            "typestr": "<i2",
            "data": (int(pinned.data_ptr()), False),
            "version": 3,
            "strides": None,
        }


def _mean_us(ns: list[int]) -> float | None:
    return float(np.mean(ns)) / 1e3 if ns else None
