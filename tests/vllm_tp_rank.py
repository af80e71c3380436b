"""One tensor-parallel rank of the vLLM tests' tensor-parallel checks, on the CPU over gloo
(run as ``python vllm_tp_rank.py FAMILY RANK WORLD PORT CHECKPOINT OUT_JSON``; FAMILY is
``qwen4exp`` for ``test_vllm_real.py::test_tensor_parallel_ranks_read_full_rows`` or
``gemma4`` for ``test_vllm_gemma4_real.py::test_tensor_parallel_ranks_read_full_rows``).

With the plugin installed, loads the checkpoint twice through vLLM's default loader: with
the device table (each rank holds its vocabulary slice; lookups are combined by an
all-reduce) and with the mmap table (no slice: every rank reads full rows from the shared
page cache). Writes what it saw: both backends' rows (Qwen4Exp's PLE outputs, Gemma 4's
per-layer inputs) for the same ids, the table rows each rank holds, how many all-reduces
each backend's lookup ran, and what the ranks agreed when only rank 1 could not defer
(over vLLM's world group, gloo).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


class Rank:
    """The rank's distributed environment, loader and all-reduce counter."""

    def __init__(self, rank: int, world: int, port: int, ckpt: str) -> None:
        self.rank, self.world, self.ckpt = rank, world, ckpt
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        from ple_memops.vllm import plugin

        plugin.install()
        with set_current_vllm_config(self.config("default")):
            init_distributed_environment(
                world_size=world,
                rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=rank,
                backend="gloo",
            )
            initialize_model_parallel(world, 1)

    def config(self, backend: str, **kw: Any) -> Any:
        from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig

        return VllmConfig(
            model_config=ModelConfig(model=self.ckpt, skip_tokenizer_init=True, dtype="bfloat16"),
            parallel_config=ParallelConfig(tensor_parallel_size=self.world),
            load_config=LoadConfig(load_format="safetensors"),
            additional_config={"ple_memops": {"table_backend": backend}},
            **kw,
        )

    def load(self, vc: Any) -> Any:
        import vllm_cpu  # beside this script

        return vllm_cpu.load_model(vc)[0]

    def attach(self, model: Any, vc: Any) -> Any:
        import vllm_cpu  # beside this script

        return vllm_cpu.attach_hooks(model, vc)

    @contextmanager
    def counting_reduces(self) -> Iterator[dict[str, int]]:
        """All-reduces over vLLM's groups while inside: ``{"n": count}``."""
        from vllm.distributed.parallel_state import GroupCoordinator

        count = {"n": 0}
        original = GroupCoordinator.all_reduce

        def counting(group: GroupCoordinator, tensor: Any) -> Any:
            count["n"] += 1
            return original(group, tensor)

        GroupCoordinator.all_reduce = counting  # type: ignore[method-assign]
        try:
            yield count
        finally:
            GroupCoordinator.all_reduce = original  # type: ignore[method-assign]

    def agreed(self) -> list[bool]:
        """One rank that cannot defer makes every rank synchronous (over the world group)."""
        from ple_memops.vllm import runner

        return [runner.agree_on_deferral(self.rank != 1), runner.agree_on_deferral(True)]


def qwen4exp(r: Rank) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.engram import EngramConfig

    from ple_memops.vllm import ops

    device_cfg = r.config("default", engram_config=EngramConfig(cpu_offload=False))
    device_model = r.load(device_cfg)
    mmap_cfg = r.config("mmap", engram_config=EngramConfig())
    mmap_model = r.load(mmap_cfg)
    hooks = r.attach(mmap_model, mmap_cfg)
    report: dict[str, Any] = {"rank": r.rank, "layers": {}, "agreed": r.agreed()}
    g = torch.Generator().manual_seed(5)
    for i in (0, 2):
        ids = torch.randint(0, 128, (11,), generator=g, dtype=torch.int32)
        qsl = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
        ctx = torch.randint(0, 128, (3, 2), generator=g, dtype=torch.int32)
        hidden = torch.zeros(11, 256, dtype=torch.bfloat16)
        layer = device_model.model.layers[i].ple
        with set_current_vllm_config(device_cfg), r.counting_reduces() as device_reduces:
            want = layer.ple_embedding(hidden, ids, qsl, ctx)
        mlayer = mmap_model.model.layers[i].ple
        layers = mmap_cfg.compilation_config.static_forward_context
        with (
            set_current_vllm_config(mmap_cfg),
            hooks.eager(dummy=False),
            ops.layers(layers),
            r.counting_reduces() as mmap_reduces,
        ):
            mlayer.start_prefetch(ids, qsl, ctx)
            got = mlayer.ple_embedding(hidden, ids, qsl, ctx)
        report["layers"][str(i)] = {
            "equal": bool(torch.equal(got.view(torch.uint8), want.view(torch.uint8))),
            "nonzero": bool(want.view(torch.uint8).any()),
            "device_rows": int(layer.ple_embedding.ngram_embedding.weight.shape[0]),
            "mmap_rows": int(mlayer.ple_embedding.ngram_embedding.weight.shape[0]),
            "device_reduces": device_reduces["n"],
            "mmap_reduces": mmap_reduces["n"],
        }
    report["plan_mode"] = hooks.steps.mode
    hooks.shutdown()
    return report


def gemma4(r: Rank) -> dict[str, Any]:
    """The per-layer inputs of the text model: the rows' lookup counted apart (the
    token embedding and the projection are vLLM's in both backends)."""
    import torch
    from vllm.config import set_current_vllm_config

    from ple_memops.vllm import ops

    stock_cfg = r.config("default")
    stock = r.load(stock_cfg)
    mmap_cfg = r.config("mmap")
    model = r.load(mmap_cfg)
    hooks = r.attach(model, mmap_cfg)
    report: dict[str, Any] = {"rank": r.rank, "inputs": [], "agreed": r.agreed()}
    layers = mmap_cfg.compilation_config.static_forward_context

    def inputs(m: Any, ids: Any, scope: Callable[[], Any]) -> tuple[Any, int]:
        lm = m.model
        with scope():
            embeds = lm.embed_input_ids(ids.clamp(0, lm.config.vocab_size - 1))
            with r.counting_reduces() as reduces:
                rows = lm.get_per_layer_inputs(ids)
            return lm.project_per_layer_inputs(embeds, rows), reduces["n"]

    @contextmanager
    def mmap_scope() -> Iterator[None]:
        with set_current_vllm_config(mmap_cfg), hooks.eager(dummy=False), ops.layers(layers):
            yield

    g = torch.Generator().manual_seed(7)
    for n in (1, 9, 40):
        ids = torch.randint(0, 128, (n,), generator=g, dtype=torch.int64)
        ids[-1] = -1  # outside the table: row 0
        want, stock_reduces = inputs(stock, ids, lambda: set_current_vllm_config(stock_cfg))
        got, mmap_reduces = inputs(model, ids, mmap_scope)
        report["inputs"].append(
            {
                "equal": bool(torch.equal(got, want)),
                "nonzero": bool(want.abs().sum() > 0),
                "stock_reduces": stock_reduces,
                "mmap_reduces": mmap_reduces,
            }
        )
    report["stock_rows"] = int(stock.model.embed_tokens_per_layer.weight.shape[0])
    report["mmap_rows"] = int(model.model.embed_tokens_per_layer.weight.shape[0])
    report["plan_mode"] = hooks.steps.mode
    hooks.shutdown()
    return report


def main() -> None:
    family, rank, world, port, ckpt, out = sys.argv[1:7]
    r = Rank(int(rank), int(world), int(port), ckpt)
    report = {"qwen4exp": qwen4exp, "gemma4": gemma4}[family](r)
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
