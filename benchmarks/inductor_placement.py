"""Where Inductor places the functional PLE ops (``stage_ids``, ``read_rows``) in a compiled
graph, on the CPU: a toy forward stages the ids first, runs three matmuls (the GPU work the
host's gather should hide behind), then reads the rows for its last multiply; the script
compiles it with ``torch.compile`` (Inductor) and prints the order of the generated code's
calls. Inductor's post-grad pass ``reorder_for_locality`` moves a functional op right before
its first consumer, so the staging lands right before the join unless the staging has an
earlier consumer (or runs outside the compiled region, as the multimodal Gemma classes'
does).

    python benchmarks/inductor_placement.py
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.utils import run_and_get_code

from ple_memops.vllm import ops


class _Hooks:
    """The runner hooks the ops call, reduced to what the toy needs."""

    def stage_ids(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return ids.new_empty((ids.numel(), 0))

    def read_rows(self, name: str, staged: torch.Tensor) -> torch.Tensor:
        return torch.ones(staged.shape[0], 16, dtype=torch.uint8)


class _Layer:
    ple_memops_hooks = _Hooks()


def main() -> int:
    w = [torch.randn(16, 16) for _ in range(3)]

    def forward(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        staged = ops.stage_ids(ids, "table")  # first in the source
        h = torch.relu(x @ w[0])
        h = torch.relu(h @ w[1])
        h = torch.tanh(h @ w[2])
        rows = ops.read_rows(staged, 16, "table").float()
        return h * rows

    args: tuple[Any, ...] = (torch.arange(4), torch.randn(4, 16))
    with ops.layers({"table": _Layer()}):
        _, codes = run_and_get_code(torch.compile(forward, fullgraph=True), *args)
    order = []
    for line in codes[0].splitlines():
        line = line.strip()
        if "= torch.ops.ple_memops.stage_ids" in line:
            order.append("stage_ids")
        elif "= torch.ops.ple_memops.read_rows" in line:
            order.append("read_rows")
        elif line.startswith("extern_kernels.mm("):
            order.append("matmul")
    print("source order:   stage_ids, matmul, matmul, matmul, read_rows")
    print(f"compiled order: {', '.join(order)}")
    staged_first = order.index("stage_ids") < order.index("matmul")
    print("the staging stays ahead of the matmuls" if staged_first else
          "Inductor moved the staging after the matmuls, next to the join")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
