"""Where Inductor places the functional PLE ops (``stage_ids``, ``read_rows``) in a compiled
graph, on the CPU: a toy forward stages the ids first, runs three matmuls (the GPU work the
host's gather should hide behind), then reads the rows for its last multiply; the script
compiles it with ``torch.compile`` (Inductor) and prints the order of the generated code's
calls, for ``ple_memops.vllm.ops`` and for an untagged twin of the pair. Inductor's
post-grad pass ``reorder_for_locality`` moves a functional op right before its first
consumer (so an untagged staging lands right before the join, and the gather overlaps
nothing) but never an op tagged ``nondeterministic_seeded``, as ``stage_ids`` is.

    python benchmarks/inductor_placement.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

from ple_memops.vllm import ops

_TWIN = torch.library.Library("ple_memops_twin", "FRAGMENT")  # type: ignore[no-untyped-call]


def _token(ids: torch.Tensor) -> torch.Tensor:
    return ids.new_empty((ids.numel(), 0))


def _rows(staged: torch.Tensor) -> torch.Tensor:
    return torch.ones(staged.shape[0], 16, dtype=torch.uint8)


def _rows_fake(staged: torch.Tensor) -> torch.Tensor:
    return staged.new_empty((staged.shape[0], 16), dtype=torch.uint8)


for _schema, _impl, _fake in (
    ("stage_ids(Tensor ids) -> Tensor", _token, _token),
    ("read_rows(Tensor staged) -> Tensor", _rows, _rows_fake),
):
    _name = _schema.split("(", 1)[0]
    _TWIN.define(_schema)  # type: ignore[no-untyped-call]
    _TWIN.impl(_name, _impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    torch.library.register_fake(f"ple_memops_twin::{_name}", _fake, lib=_TWIN)


class _Hooks:
    """The runner hooks the ops call, reduced to what the toy needs."""

    def stage_ids(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return _token(ids)

    def read_rows(self, name: str, staged: torch.Tensor) -> torch.Tensor:
        return _rows(staged)


class _Layer:
    ple_memops_hooks = _Hooks()


def compiled_order(
    stage: Callable[[torch.Tensor], torch.Tensor], read: Callable[[torch.Tensor], torch.Tensor]
) -> list[str]:
    """The calls of the toy forward's compiled code, in order."""
    w = [torch.randn(16, 16) for _ in range(3)]

    def forward(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        staged = stage(ids)  # first in the source
        h = torch.relu(x @ w[0])
        h = torch.relu(h @ w[1])
        h = torch.tanh(h @ w[2])
        return h * read(staged).float()

    args: tuple[Any, ...] = (torch.arange(4), torch.randn(4, 16))
    # Inductor's FX graph cache keys a graph without its ops' tags: compile afresh.
    with ops.layers({"table": _Layer()}), inductor_config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(torch.compile(forward, fullgraph=True), *args)
    order = []
    for line in codes[0].splitlines():
        line = line.strip()
        if ".stage_ids.default(" in line and "=" in line:
            order.append("stage_ids")
        elif ".read_rows.default(" in line and "=" in line:
            order.append("read_rows")
        elif line.startswith("extern_kernels.mm("):
            order.append("matmul")
    return order


def main() -> int:
    print("source order: stage_ids, matmul, matmul, matmul, read_rows")
    pairs = {
        "ple_memops.vllm.ops (stage_ids tagged)": (
            lambda ids: ops.stage_ids(ids, "table"),
            lambda staged: ops.read_rows(staged, 16, "table"),
        ),
        "an untagged twin": (
            torch.ops.ple_memops_twin.stage_ids,
            torch.ops.ple_memops_twin.read_rows,
        ),
    }
    for name, (stage, read) in pairs.items():
        order = compiled_order(stage, read)
        ahead = order.index("stage_ids") < order.index("matmul")
        verdict = "the staging stays ahead" if ahead else "the staging moved next to the join"
        print(f"{name}: {', '.join(order)} ({verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
