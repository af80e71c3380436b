"""One tensor-parallel rank of ``test_vllm_real.py::test_tensor_parallel_ranks_read_full_rows``
(run as ``python vllm_tp_rank.py RANK WORLD PORT CHECKPOINT OUT_JSON``, on the CPU, gloo).

With the plugin installed, loads the checkpoint twice through vLLM's default loader: with
the device table (each rank holds its vocabulary slice; lookups are combined by an
all-reduce) and with the mmap table (no slice: every rank reads full rows from the shared
page cache). Writes what it saw: both backends' PLE rows for the same ids, the table rows
each rank holds, how many all-reduces each backend's lookup ran, and what the ranks agreed
when only rank 1 could not defer (over vLLM's world group, gloo).
"""

from __future__ import annotations

import json
import os
import sys
import types

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> None:
    rank, world, port, ckpt, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    import torch
    from vllm.config import (
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.config.engram import EngramConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    from ple_memops.vllm import ops, plugin, runner

    plugin.install()

    def config(engram: EngramConfig, backend: str = "default") -> VllmConfig:
        return VllmConfig(
            model_config=ModelConfig(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16"),
            parallel_config=ParallelConfig(tensor_parallel_size=world),
            engram_config=engram,
            load_config=LoadConfig(load_format="safetensors"),
            additional_config={"ple_memops": {"table_backend": backend}},
        )

    def load(vc: VllmConfig) -> tuple[torch.nn.Module, object]:
        with set_current_vllm_config(vc):
            loader = get_model_loader(vc.load_config)
            with torch.device("cpu"):
                model = initialize_model(vllm_config=vc, model_config=vc.model_config)
            loader.load_weights(model, vc.model_config)
        return model, loader

    device_cfg = config(EngramConfig(cpu_offload=False))
    with set_current_vllm_config(device_cfg):
        init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(world, 1)
    device_model, _ = load(device_cfg)
    mmap_cfg = config(EngramConfig(), "mmap")
    mmap_model, _ = load(mmap_cfg)
    fake_runner = types.SimpleNamespace(
        model=mmap_model, vllm_config=mmap_cfg, device=torch.device("cpu")
    )
    with set_current_vllm_config(mmap_cfg):
        hooks = runner.attach_runner(fake_runner)
    assert hooks is not None
    # One rank that cannot defer makes every rank synchronous (over vLLM's world group).
    agreed = [runner.agree_on_deferral(rank != 1), runner.agree_on_deferral(True)]

    reduces = {"n": 0}
    original = GroupCoordinator.all_reduce

    def counting(self: GroupCoordinator, tensor: torch.Tensor) -> torch.Tensor:
        reduces["n"] += 1
        return original(self, tensor)

    GroupCoordinator.all_reduce = counting  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(5)
    report: dict[str, object] = {"rank": rank, "layers": {}}
    for i in (0, 2):
        ids = torch.randint(0, 128, (11,), generator=g, dtype=torch.int32)
        qsl = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
        ctx = torch.randint(0, 128, (3, 2), generator=g, dtype=torch.int32)
        hidden = torch.zeros(11, 256, dtype=torch.bfloat16)
        layer = device_model.model.layers[i].ple
        reduces["n"] = 0
        with set_current_vllm_config(device_cfg):
            want = layer.ple_embedding(hidden, ids, qsl, ctx)
        device_reduces = reduces["n"]
        mlayer = mmap_model.model.layers[i].ple
        reduces["n"] = 0
        layers = mmap_cfg.compilation_config.static_forward_context
        with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
            mlayer.start_prefetch(ids, qsl, ctx)
            got = mlayer.ple_embedding(hidden, ids, qsl, ctx)
        report["layers"][str(i)] = {  # type: ignore[index]
            "equal": bool(torch.equal(got.view(torch.uint8), want.view(torch.uint8))),
            "nonzero": bool(want.view(torch.uint8).any()),
            "device_rows": int(layer.ple_embedding.ngram_embedding.weight.shape[0]),
            "mmap_rows": int(mlayer.ple_embedding.ngram_embedding.weight.shape[0]),
            "device_reduces": device_reduces,
            "mmap_reduces": reduces["n"],
        }
    GroupCoordinator.all_reduce = original  # type: ignore[method-assign]
    report["plan_mode"] = hooks.plan.mode
    report["agreed"] = agreed
    hooks.shutdown()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
