"""Glue the patched vLLM 0.33.0 calls: config resolution and the load-time plan.

Nothing here imports vLLM at module level; the functions that need it are only called
from inside vLLM.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError, UnsupportedError
from ..table import MmapTable
from . import ops
from .hooks import DEPTH, PleRunnerHooks
from .tables import checkpoint_tensor_names, find_layer_table, open_layer_table

__all__ = [
    "BACKEND_ENV",
    "TIMEOUT_ENV",
    "attach_runner",
    "build_hooks",
    "mmap_requested",
    "resolve_engram_config",
]

logger = logging.getLogger("ple_memops")

BACKEND_ENV = "PLE_MEMOPS_TABLE_BACKEND"
"""``PLE_MEMOPS_TABLE_BACKEND=mmap`` selects the mmap backend like
``--engram-config '{"table_backend": "mmap"}'``."""
TIMEOUT_ENV = "PLE_MEMOPS_TIMEOUT"
"""Seconds a step may wait for its rows (watchdog and completion), default 30."""
DEFAULT_TIMEOUT = 30.0

_LAYER = re.compile(r"layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding$")


def mmap_requested(table_backend: str) -> bool:
    """Whether the mmap backend is on: the config field, or the environment variable
    when the field is left at ``"default"``."""
    if table_backend not in ("default", "mmap"):
        raise InvalidArgumentError(
            f"table_backend must be 'default' or 'mmap', got {table_backend!r}"
        )
    env = os.environ.get(BACKEND_ENV, "").strip().lower()
    if env not in ("", "default", "mmap"):
        raise InvalidArgumentError(f"{BACKEND_ENV} must be 'mmap' or 'default', got {env!r}")
    return table_backend == "mmap" or env == "mmap"


def timeout_seconds() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidArgumentError(
            f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}"
        )
    return value


def resolve_engram_config(engram: Any, parallel_config: Any) -> None:
    """Called by the patched ``EngramConfig`` while vLLM resolves its config: applies the
    environment switch and refuses what the mmap backend does not support."""
    if not mmap_requested(engram.table_backend):
        return
    engram.table_backend = "mmap"
    refused = []
    pp = parallel_config.pipeline_parallel_size
    if pp > 1:
        refused.append(f"pipeline parallelism (pipeline_parallel_size={pp})")
    if engram.embedding_across_dp:
        refused.append("embedding_across_dp=True (each rank reads full rows itself)")
    if engram.dp_shared_memory:
        refused.append("dp_shared_memory=True (there is no pinned table to share)")
    if getattr(parallel_config, "use_ubatching", False):
        refused.append("microbatching / DBO (--enable-dbo)")
    try:
        from vllm.platforms import current_platform

        if current_platform.is_rocm():
            refused.append("ROCm (the AMD Qwen4Exp model is not patched)")
    except ImportError:  # pragma: no cover - called from inside vLLM
        pass
    if refused:
        raise UnsupportedError(
            "ple-memops mmap PLE tables do not support " + "; ".join(refused) + f". Unset "
            f"{BACKEND_ENV} / table_backend=mmap, or change the configuration"
        )
    # Pinned-table sharing between DP replicas has nothing to share here.
    engram.dp_shared_memory = False


def build_hooks(
    tables: Mapping[str, MmapTable],
    *,
    rows_per_token: int,
    max_rows: int,
    device: Any,
    timeout: float = DEFAULT_TIMEOUT,
    deferred: bool = True,
) -> PleRunnerHooks:
    """Build the all-or-none rows plan for ``tables`` (outside any capture) and the runner
    hooks around it, and bind the PLE ops of every layer to them."""
    from ..plan import RowsPlan

    plan = RowsPlan.build(
        dict(tables),
        max_rows=max_rows,
        device=device,
        id_dtype="int64",
        deferred=deferred,
        watchdog=timeout,
        timeout=timeout,
        depth=DEPTH,
        log_fallback=False,  # attach_runner logs the reason once, with what it changes
    )
    try:
        hooks = PleRunnerHooks(plan, rows_per_token=rows_per_token, timeout=timeout, depth=DEPTH)
    except BaseException:
        plan.close()
        raise
    for name in tables:
        ops.bind(name, hooks)
    return hooks


def checkpoint_dir(vllm_config: Any, model_loader: Any) -> str:
    """The local checkpoint directory, resolved the way vLLM's default loader does."""
    model_config = vllm_config.model_config
    if os.path.isdir(model_config.model):
        return str(model_config.model)
    prepare = getattr(model_loader, "_prepare_weights", None)
    if prepare is None:
        raise UnsupportedError(
            "ple-memops mmap PLE tables read the checkpoint's safetensors files; load format "
            f"{vllm_config.load_config.load_format!r} ({type(model_loader).__name__}) has none"
        )
    folder = prepare(model_config.model, None, model_config.revision, False, None)[0]
    return str(folder)


def _plan_device(device: Any) -> Any:
    """A runner's ``torch.device`` as the plan wants it: a CUDA ordinal, or ``"cpu"``."""
    if device.type == "cuda":
        return 0 if device.index is None else int(device.index)
    return "cpu"


def attach_runner(runner: Any, model_loader: Any) -> PleRunnerHooks | None:
    """Called by the patched ``GPUModelRunner.load_model`` right after the model loaded
    (outside any capture, before the profile run): opens every mmap PLE table, builds
    the plan and binds the layers. When the plan cannot defer (the probe says ``sync``),
    all layers gather synchronously before their consumer and FULL CUDA graphs are
    turned off, with one warning naming the reason. ``None`` when the model (on this
    rank) has no mmap PLE table."""
    from vllm.config.compilation import CUDAGraphMode

    from .qwen4exp import find_mmap_embeddings, layer_weight_scale

    layers = find_mmap_embeddings(runner.model)
    if not layers:
        return None
    heads = {m.ple_memops_heads for m in layers}
    if len(heads) != 1:
        raise UnsupportedError(f"PLE layers disagree on row ids per token: {sorted(heads)}")
    (rows_per_token,) = heads
    ckpt = checkpoint_dir(runner.vllm_config, model_loader)
    names = checkpoint_tensor_names(ckpt)
    tables: dict[str, MmapTable] = {}
    try:
        for module in layers:
            match = _LAYER.search(module.ple_memops_name)
            if match is None:
                raise UnsupportedError(f"cannot tell the decoder layer of {module.ple_memops_name}")
            spec = find_layer_table(names, int(match.group(1)))
            tables[module.ple_memops_name] = open_layer_table(
                ckpt,
                spec,
                rows=int(module.org_vocab_size),
                row_bytes=module.row_bytes,
                dtype=module.table_dtype,
                scale=layer_weight_scale(module),
            )
        compilation = runner.vllm_config.compilation_config
        max_tokens = max(
            int(runner.vllm_config.scheduler_config.max_num_batched_tokens),
            int(compilation.max_cudagraph_capture_size or 0),
        )
        timeout = timeout_seconds()
        hooks = build_hooks(
            tables,
            rows_per_token=rows_per_token,
            max_rows=max_tokens * rows_per_token,
            device=_plan_device(runner.device),
            timeout=timeout,
        )
    except BaseException:
        for t in tables.values():
            t.close()
        raise
    for module in layers:
        module.ple_memops_hooks = hooks
    if hooks.deferred:
        logger.info(
            "ple-memops: %d PLE tables memory-mapped from %s; FULL CUDA graphs defer their "
            "rows (up to %d rows a step, %.0f s timeout)",
            len(tables),
            ckpt,
            max_tokens * rows_per_token,
            timeout,
        )
    else:
        mode = compilation.cudagraph_mode
        if mode is not None and mode != CUDAGraphMode.NONE:
            compilation.cudagraph_mode = CUDAGraphMode.NONE
            graphs = f"CUDA graphs are turned off (cudagraph_mode {mode.name} -> NONE)"
        else:
            graphs = "CUDA graphs stay off"
        logger.warning(
            "ple-memops: deferred PLE rows are unavailable (%s); the %d mmap PLE tables "
            "are gathered on the host before each step's consumer and %s",
            hooks.plan.reason,
            len(tables),
            graphs,
        )
    return hooks
