"""The worker the plugin puts in place through vLLM's documented seam,
``ParallelConfig.worker_cls`` ("the full name of the worker class"): vLLM's GPU worker,
building the plugin's Model Runner V2 (:class:`~ple_memops.vllm.runner.PleGPUModelRunner`).

vLLM resolves the name in each worker process, so nothing of vLLM's is rebound: an
engine the plugin does not serve (another architecture, the mmap backend off, a CPU
engine) keeps vLLM's own worker and runner. :func:`place_worker` is called from the
config hooks of the architectures the plugin serves.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_worker import Worker

__all__ = ["VLLM_WORKER", "WORKER", "PleWorker", "place_worker"]

WORKER = "ple_memops.vllm.worker.PleWorker"
"""``worker_cls`` of an engine the plugin serves."""

VLLM_WORKER = "vllm.v1.worker.gpu_worker.Worker"
"""vLLM's own GPU worker, what ``auto`` resolves to on CUDA."""


class PleWorker(Worker):  # type: ignore[misc]
    """vLLM's GPU worker whose model runner is the plugin's Model Runner V2 (a
    multimodal encoder-only engine keeps vLLM's)."""

    def _make_model_runner(self) -> Any:
        if self.vllm_config.is_mm_encoder_only:
            return super()._make_model_runner()
        from .runner import PleGPUModelRunner

        return PleGPUModelRunner(self.vllm_config, self.device)


def place_worker(vllm_config: Any) -> str | None:
    """Name :data:`WORKER` as ``vllm_config``'s worker on a CUDA platform; returns what
    is refused (the caller raises it with the model's other refusals), ``None`` when
    placed or when the platform is not CUDA (that engine keeps vLLM's worker: a CPU
    engine's runner is vLLM's, and an mmap table then refuses its first forward)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    parallel = vllm_config.parallel_config
    if not getattr(vllm_config, "use_v2_model_runner", True):  # 0.34.0 has V2 alone
        return "Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0): the plugin serves Model Runner V2"
    if parallel.worker_cls not in ("auto", VLLM_WORKER, WORKER):
        return (
            f"worker_cls={parallel.worker_cls!r}: the plugin's runner comes with its own "
            f"worker ({WORKER}), in the place of vLLM's {VLLM_WORKER}"
        )
    parallel.worker_cls = WORKER
    return None
