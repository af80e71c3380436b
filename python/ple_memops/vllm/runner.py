"""Model Runner V2 with mmap PLE tables: the runner and CUDA graph manager the plugin
installs, and the load-time steps.

Imported only once the plugin is switched on (it subclasses vLLM's classes). For an
engine whose settings do not say ``mmap`` (or a model without mmap PLE tables) both
classes are vLLM's own, unchanged: every override first asks whether rows hooks exist
(with ``time_graphs`` the graph manager still times its FULL replays, see
:class:`GraphTimesLog`).

What each override adds (see :class:`~ple_memops.vllm.hooks.PleRunnerHooks`):

=====================================  ==================================================
``GPUModelRunner.load_model``          after vLLM loaded the model: open each PLE layer's
                                       table in the checkpoint, build the all-or-none steps,
                                       agree across ranks whether they defer
``GPUModelRunner.initialize_kv_cache`` the graph manager made our subclass (below)
``GPUModelRunner.execute_model``       one ``hooks.step``: an eager forward gathers before
                                       each consumer, a FULL replay is armed
``GPUModelRunner.sample_tokens``       the output checked when handed out, the engine's
                                       wait for it timed (``results``; with
                                       ``time_graphs`` also on the graphs' clock, hooks
                                       or none)
``GPUModelRunner.capture_model``       pending steps completed first
``GPUModelRunner.shutdown``            drain, synchronise the device, close the steps
``CudaGraphManager.capture``           each descriptor's warm-up without data, its capture
                                       recorded when the graph waits for rows
``CudaGraphManager.run_fullgraph``     armed first when the graph waits for rows; timed
                                       on the GPU with ``time_graphs``
``CudaGraphManager.release_graphs``    pending steps completed, the record dropped
=====================================  ==================================================
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu import cudagraph_utils
from vllm.v1.worker.gpu import model_runner as vllm_model_runner

from .._common import plan_device
from ..errors import InvalidArgumentError, UnsupportedError
from ..step_costs import GraphClock
from ..table import MmapTable
from .hooks import PleRunnerHooks, build_hooks
from .layer import find_tables
from .settings import engine_settings
from .tables import checkpoint_tensor_names, open_layer_table

__all__ = [
    "FORCE_SYNC_ENV",
    "GraphTimesLog",
    "PleCudaGraphManager",
    "PleGPUModelRunner",
    "agree_on_deferral",
    "attach_runner",
    "build_hooks",
    "checkpoint_dir",
    "forced_sync",
]

logger = logging.getLogger("ple_memops")

FORCE_SYNC_ENV = "PLE_MEMOPS_FORCE_SYNC"
"""``1`` makes every rank's tables synchronous as if its probe had failed; ``ranks=1`` (a
comma-separated list of world ranks) only those ranks' (the one-rank fault of a
tensor-parallel engine: the environment reaches every worker). For tests of the ranks'
agreement and the fallback; a user has no reason to set it."""


def forced_sync(value: str | None, rank: int) -> bool:
    """Whether :data:`FORCE_SYNC_ENV`'s ``value`` forces world rank ``rank`` synchronous;
    a value that is neither empty, ``0``, ``1`` nor ``ranks=R[,R...]`` raises
    :class:`InvalidArgumentError` naming the variable."""
    text = (value or "").strip()
    if text in ("", "0"):
        return False
    if text == "1":
        return True
    head, _, tail = text.partition("=")
    try:
        ranks = {int(r) for r in tail.split(",")} if head.strip() == "ranks" else None
    except ValueError:
        ranks = None
    if not ranks or min(ranks) < 0:
        raise InvalidArgumentError(
            f"{FORCE_SYNC_ENV} must be 1 (every rank), ranks=R[,R...] or empty, got {value!r}"
        )
    return rank in ranks


def _world_rank() -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0
    return int(dist.get_rank())


_BaseRunner: Any = vllm_model_runner.GPUModelRunner
_BaseManager: Any = cudagraph_utils.ModelCudaGraphManager


# -- the load-time steps -----------------------------------------------------------------


def checkpoint_dir(vllm_config: Any) -> str:
    """The local checkpoint directory, resolved the way vLLM's default loader does."""
    model_config = vllm_config.model_config
    if os.path.isdir(model_config.model):
        return str(model_config.model)
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(vllm_config.load_config)
    prepare = getattr(loader, "_prepare_weights", None)
    if prepare is None:
        raise UnsupportedError(
            "ple-memops mmap PLE tables read the checkpoint's safetensors files; load format "
            f"{vllm_config.load_config.load_format!r} ({type(loader).__name__}) has none"
        )
    folder = prepare(model_config.model, None, model_config.revision, False, None)[0]
    return str(folder)


def agree_on_deferral(local: bool, group: Any = None) -> bool:
    """Whether every rank of the engine's world can defer (``local`` is this rank's
    verdict): a rank that falls back must not skip the captures its peers make (their
    collectives would wait for it), so one rank's ``False`` makes every rank's tables
    synchronous. ``group``: a torch process group (default: vLLM's world group on the
    CPU); one rank, or no distributed world, is its own verdict."""
    import torch.distributed as dist

    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            return local
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
        if world.world_size == 1:
            return local
        group = world.cpu_group
    verdict = torch.tensor([1 if local else 0], dtype=torch.int32)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
    return bool(verdict.item())


def attach_runner(runner: Any) -> PleRunnerHooks | None:
    """Open every mmap PLE table of ``runner.model`` (right after vLLM loaded it, outside
    any capture, before the profile run), build the steps and bind the layers. When the
    tables cannot defer (the probe or a worker fails on any rank), every rank's layers
    gather synchronously before their consumer and FULL CUDA graphs are kept where the
    model can recompute its ids before a replay (else turned off), with one warning naming
    the reason. ``None`` when the model has no mmap PLE table."""
    # In the order the forward consumes their rows (the order reads take, when in order).
    layers = sorted(find_tables(runner.model), key=lambda m: m.ple_memops_layer_index())
    if not layers:
        return None
    settings = engine_settings(runner.vllm_config)
    heads = {m.ple_memops_heads for m in layers}
    if len(heads) != 1:
        raise UnsupportedError(f"PLE layers disagree on row ids per token: {sorted(heads)}")
    (rows_per_token,) = heads
    ckpt = checkpoint_dir(runner.vllm_config)
    names = checkpoint_tensor_names(ckpt)
    compilation = runner.vllm_config.compilation_config
    max_tokens = max(
        int(runner.vllm_config.scheduler_config.max_num_batched_tokens),
        int(compilation.max_cudagraph_capture_size or 0),
    )
    ids_source = all(m.ple_memops_ids_source for m in layers)
    tables: dict[str, MmapTable] = {}
    # A tensor served as several column windows (a Gemma table split in two) is opened
    # once, and each window shares its mapping.
    bases: dict[tuple[str | None, str | None], MmapTable] = {}
    try:
        # first_layer_threads: for the first PLE layer's table, whose fill every step
        # waits for, among the tables that take them (a split Gemma row's first slice,
        # 512 B a token, does not: its rest's fill is the one a step waits for longest).
        leads = [m for m in layers if m.ple_memops_lead_threads]
        lead = min(leads, key=lambda m: m.ple_memops_layer_index()) if leads else None
        for module in layers:
            expect = module.ple_memops_expect()
            spec = module.ple_memops_table(names)
            base = None
            if spec.columns is not None:
                key = (spec.name, spec.pattern)
                if key not in bases:
                    bases[key] = MmapTable.open(ckpt, spec.name, pattern=spec.pattern)
                base = bases[key]
            tables[module.ple_memops_name] = open_layer_table(
                ckpt,
                spec,
                base=base,
                rows=expect.rows,
                row_bytes=expect.row_bytes,
                dtype=expect.dtype,
                scale=expect.scale,
                gather_threads=_own_threads(module, settings) if module is lead else None,
            )
        build: dict[str, Any] = dict(
            rows_per_token=rows_per_token,
            max_rows=max_tokens * rows_per_token,
            device=plan_device(runner.device),
            timeout=settings.timeout,
            copy=settings.copy,
            spin=settings.spin,
            predict_ready=settings.predict_ready,
            stats_every=settings.stats_every,
            time_stalls=settings.time_stalls,
            skip_gather=settings.diag_skip_gather,
            sync_graphs=ids_source,
            read_in_order=settings.read_in_order and all(m.ple_memops_staged_first for m in layers),
        )
        raw = os.environ.get(FORCE_SYNC_ENV)
        forced = forced_sync(raw, _world_rank())
        hooks = build_hooks(tables, deferred=not forced, **build)
        reason: str | None
        if forced:
            reason = f"{FORCE_SYNC_ENV}={raw} on this rank"
        else:
            reason = hooks.steps.reason
        if not agree_on_deferral(hooks.deferred) and hooks.deferred:
            hooks.shutdown()
            reason = "another rank of this engine cannot defer (its log says why)"
            hooks = build_hooks(tables, deferred=False, **build)
    except BaseException:
        for t in tables.values():
            t.close()
        raise
    finally:
        for t in bases.values():
            t.close()  # its windows keep the mapping
    for module in layers:
        module.ple_memops_bind(hooks, max_tokens)
    if settings.diag_skip_gather:
        logger.warning(
            "ple-memops: diagnostics: the PLE rows are NOT gathered (diag_skip_gather): every "
            "step's consumers read stale rows and the tokens are wrong; for timing only"
        )
    if hooks.deferred:
        logger.info(
            "ple-memops: %d PLE tables memory-mapped from %s; FULL CUDA graphs defer their "
            "rows (up to %d rows a step, %.0f s timeout)",
            len(tables),
            ckpt,
            max_tokens * rows_per_token,
            settings.timeout,
        )
    else:
        mode = compilation.cudagraph_mode
        if hooks.steps.mode == "host" and mode is not None and mode != CUDAGraphMode.NONE:
            # No CUDA device: no graph to keep.
            compilation.cudagraph_mode = CUDAGraphMode.NONE
            graphs = f"CUDA graphs are turned off (cudagraph_mode {mode.name} -> NONE)"
        elif not ids_source and mode is not None and mode != CUDAGraphMode.NONE:
            # The model cannot recompute its ids before a replay: no graph may read rows.
            compilation.cudagraph_mode = CUDAGraphMode.NONE
            graphs = (
                f"CUDA graphs are turned off (cudagraph_mode {mode.name} -> NONE: this "
                "model's graphs cannot compute their ids before a replay)"
            )
        elif mode is not None and mode != CUDAGraphMode.NONE:
            graphs = (
                f"CUDA graphs stay on (cudagraph_mode {mode.name}): before each replay a "
                "small graph computes the step's ids, they come to the host in one copy, "
                "every table is gathered in parallel and copied in, then the graph replays"
            )
        else:
            graphs = "CUDA graphs stay off"
        logger.warning(
            "ple-memops: deferred PLE rows are unavailable (%s); the %d mmap PLE tables "
            "are gathered on the host before each step (eager steps: one copy of all their "
            "ids, then the gathers in parallel); %s",
            reason,
            len(tables),
            graphs,
        )
    return hooks


def _own_threads(module: Any, settings: Any) -> int | None:
    """The gather threads of its own for the table that takes ``first_layer_threads``:
    the setting's count, else the table's default (``0``: the shared pool)."""
    threads = settings.first_layer_threads
    if threads is None:
        threads = module.ple_memops_own_threads
    return threads or None


# -- the classes the plugin installs -----------------------------------------------------


class _CaptureScopes(cudagraph_utils.CudaGraphManager):
    """Between ``ModelCudaGraphManager`` and ``CudaGraphManager`` in the MRO: the former's
    ``capture(model, ...)`` hands its forward factory to the latter's ``capture``, which
    passes here first. Each descriptor's eager warm-up runs without data, and its capture
    inside the rows hooks' capture scope."""

    ple_rows: PleRunnerHooks | None = None

    def capture(self, create_forward_fn: Any, *args: Any, **kwargs: Any) -> None:
        hooks = self.ple_rows
        if hooks is None:
            return super().capture(create_forward_fn, *args, **kwargs)  # type: ignore[no-any-return]

        def scoped_factory(desc: Any, warmup: bool) -> Callable[[Any], None]:
            forward_fn = create_forward_fn(desc, warmup=warmup)

            def forward(cg_mode: Any) -> None:
                if warmup or not torch.cuda.is_current_stream_capturing():
                    # The eager warm-up (and a compiled PIECEWISE pass): no data.
                    with hooks.warmup():
                        return forward_fn(cg_mode)  # type: ignore[no-any-return]
                with hooks.capture(desc):
                    return forward_fn(cg_mode)  # type: ignore[no-any-return]

            return forward

        return super().capture(scoped_factory, *args, **kwargs)  # type: ignore[no-any-return]


class GraphTimesLog:
    """A :class:`~ple_memops.step_costs.GraphClock` around every FULL replay, and its
    ``ple-memops graphs`` log line every ``every`` seconds (the ``time_graphs`` setting)."""

    def __init__(self, every: float, clock: GraphClock | None = None) -> None:
        self.every = float(every)
        self.clock = clock or GraphClock()
        self._at = time.monotonic()

    def around(self, launch: Callable[[], Any], key: int | None = None) -> Any:
        out = self.clock.around(launch, key=key)
        now = time.monotonic()
        if now - self._at >= self.every:
            self.log(now)
        return out

    def log(self, now: float | None = None) -> str | None:
        """Log (and return) the line about the replays the GPU finished since the last;
        ``None`` if none did."""
        now = time.monotonic() if now is None else now
        times = self.clock.summary()
        last, self._at = self._at, now
        if times is None:
            return None
        line = f"ple-memops graphs, last {now - last:.1f} s: {times.text()}"
        logger.info("%s", line)
        return line


class PleCudaGraphManager(_BaseManager, _CaptureScopes):
    """vLLM's ``ModelCudaGraphManager`` that arms the replays of graphs waiting for
    rows (``ple_rows``: the runner hooks, ``None`` for an engine without them) and times
    every replay on the GPU (``ple_clock``: with ``time_graphs``, else ``None``)."""

    ple_rows: PleRunnerHooks | None = None
    ple_clock: GraphTimesLog | None = None

    def run_fullgraph(self, desc: Any) -> Any:
        hooks, clock = self.ple_rows, self.ple_clock
        if hooks is None and clock is None:
            return super().run_fullgraph(desc)

        def launch() -> Any:
            return super(PleCudaGraphManager, self).run_fullgraph(desc)

        timed = launch
        if clock is not None:
            # Keyed by the graph's batch size: a load of varying batches compares at equal
            # sizes.
            size = getattr(desc, "num_tokens", None)
            key = int(size) if size is not None else None

            def timed() -> Any:
                return clock.around(launch, key)

        if hooks is None:
            return timed()
        return hooks.replay(desc, timed)

    def release_graphs(self) -> None:
        # vLLM's graphs are dropped even when ours raise (aborted steps: every GPU wait
        # is released, so nothing captured can hold the device).
        try:
            if self.ple_rows is not None:
                self.ple_rows.release_graphs()
        finally:
            super().release_graphs()


class PleGPUModelRunner(_BaseRunner):
    """vLLM's Model Runner V2 with the rows hooks of an mmap engine (see the module)."""

    ple_rows: PleRunnerHooks | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        if engine_settings(self.vllm_config).mmap:
            self.ple_rows = attach_runner(self)

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        manager: Any = getattr(self, "cudagraph_manager", None)
        settings = engine_settings(self.vllm_config)
        if manager is None or (self.ple_rows is None and not settings.time_graphs):
            return
        if type(manager) is not _BaseManager:
            raise UnsupportedError(
                f"ple-memops: the runner built a {type(manager).__qualname__}, not vLLM's "
                f"{_BaseManager.__qualname__}; the plugin arms only the latter's replays"
            )
        if self.ple_rows is not None:
            # A new manager (the profiling one is dropped): forget what the last captured.
            self.ple_rows.release_graphs()
        # Same layout, one class more in its MRO: the graphs it captures are armed (and
        # with time_graphs, timed).
        manager.__class__ = PleCudaGraphManager
        manager.ple_rows = self.ple_rows
        manager.ple_clock = (
            GraphTimesLog(settings.stats_every or 10.0) if settings.time_graphs else None
        )

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        hooks = self.ple_rows
        if hooks is None:
            return super().execute_model(*args, **kwargs)
        dummy = bool(kwargs.get("dummy_run", args[2] if len(args) > 2 else False))
        with hooks.step(dummy=dummy):
            return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        out = super().sample_tokens(*args, **kwargs)
        manager: Any = getattr(self, "cudagraph_manager", None)
        clock: GraphTimesLog | None = getattr(manager, "ple_clock", None)
        if clock is not None and out is not None and hasattr(out, "get_output"):
            # time_graphs, any plugin engine (the GPU table's too): the engine's wait
            # for the step's results, beside the graphs' times. The instrument's, not
            # counted as ours.
            out.get_output = clock.clock.results(out.get_output)
        hooks = self.ple_rows
        if hooks is None or out is None:
            return out
        return hooks.step_output(out)

    def capture_model(self, *args: Any, **kwargs: Any) -> int:
        hooks = self.ple_rows
        if hooks is not None:
            hooks.quiesce()
        size: int = super().capture_model(*args, **kwargs)
        if hooks is not None:
            hooks.build_ids_graphs()  # synchronous tables' graphs: outside any capture
        return size

    def shutdown(self) -> None:
        hooks = self.ple_rows
        if hooks is not None:
            # Drain (bounded; a failure releases every wait), then let the device finish
            # what it has, then free the rows it might have read.
            hooks.drain_for_shutdown()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            hooks.shutdown()
            for module in find_tables(self.model):
                module.ple_memops_bind(None, 0)
            self.ple_rows = None
        super().shutdown()
