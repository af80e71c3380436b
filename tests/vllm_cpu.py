"""What the CPU tests against the real vLLM share (``test_vllm_real.py``,
``test_vllm_gemma4_real.py``): a one-rank gloo world as vLLM's CPU workers set it up, and
vLLM's default loader. Imported after vLLM is known to be importable."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config

__all__ = [
    "attach_hooks",
    "dist",
    "free_port",
    "installed",
    "load_model",
    "run_tp_ranks",
    "spy_loaded_files",
    "token_ids",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def dist() -> Iterator[None]:
    """A one-rank gloo world, as vLLM's CPU workers set it up."""
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def load_model(vc: VllmConfig) -> tuple[torch.nn.Module, Any]:
    """vLLM's default loader in the model's dtype, as the engine runs it, minus the CPU
    kernel packing after loading (it needs vLLM's compiled ``_C`` extension, which the
    CPU wheel does not carry): linear layers compute with ``torch.nn.functional.linear``."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vc):
        loader = get_model_loader(vc.load_config)
        with torch.device("cpu"), set_default_torch_dtype(vc.model_config.dtype):
            model = initialize_model(vllm_config=vc, model_config=vc.model_config)
        loader.load_weights(model, vc.model_config)
    for module in model.modules():
        if hasattr(module, "quant_method") and not hasattr(module, "cpu_linear"):
            module.cpu_linear = torch.nn.functional.linear
    return model, loader


def spy_loaded_files(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The names of the safetensors files vLLM's default loader keeps to read, one list a
    load (after it asked the model which checkpoint weights it does not use), until
    ``monkeypatch`` is undone."""
    from pathlib import Path

    from vllm.model_executor.model_loader import default_loader

    kept: list[list[str]] = []
    real_filter = default_loader.filter_safetensors_files_by_weight_name

    def spy(files: list[str], is_unused: Any) -> list[str]:
        result = real_filter(files, is_unused)
        kept.append([Path(f).name for f in result])
        return result

    monkeypatch.setattr(default_loader, "filter_safetensors_files_by_weight_name", spy)
    return kept


def run_tp_ranks(family: str, ckpt: Path, out: Path, world: int = 2) -> list[dict[str, Any]]:
    """``vllm_tp_rank.py`` as ``world`` tensor-parallel ranks (processes, gloo on the CPU)
    on ``ckpt``; each rank's report, by rank. Any rank's failure fails with its output."""
    port = free_port()
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    env.pop("PLE_MEMOPS_TABLE_BACKEND", None)
    script = Path(__file__).with_name("vllm_tp_rank.py")
    procs = []
    for rank in range(world):
        argv = [sys.executable, str(script), family, str(rank), str(world), str(port),
                str(ckpt), str(out / f"rank{rank}.json")]  # fmt: skip
        procs.append(
            subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
        )
    outputs = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=300)
            outputs.append(text)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def installed() -> Iterator[Any]:
    """The plugin installed in this process, as vLLM's loader does with the switch on (the
    module puts vLLM back afterwards)."""
    from ple_memops.vllm import plugin

    record = plugin.install()
    yield record
    record.undo()


def attach_hooks(model: Any, vc: VllmConfig) -> Any:
    """The rows hooks vLLM's model runner would attach to ``model`` right after loading it
    (on the CPU: a host plan)."""
    import types

    from ple_memops.vllm import runner

    fake = types.SimpleNamespace(model=model, vllm_config=vc, device=torch.device("cpu"))
    with set_current_vllm_config(vc):
        hooks = runner.attach_runner(fake)
    assert hooks is not None
    return hooks


def token_ids(n: int, seed: int, first: int, last: int | None = None) -> torch.Tensor:
    """``n`` random token ids below 128, the first one ``first`` and (if given) then the
    last one ``last``: ids outside a per-layer table, which read its row 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (n,), generator=g, dtype=torch.int64)
    ids[0] = first
    if last is not None:
        ids[-1] = last
    return ids
