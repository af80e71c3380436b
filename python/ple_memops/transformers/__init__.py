"""Serve the per-layer-embedding tables of Hugging Face transformers models (Gemma 3n,
Qwen4Exp) from their checkpoints, for eager calls and for captured CUDA-graph decode steps.

```python
import torch, transformers
from ple_memops.transformers import serve

model = transformers.Gemma3nForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)  # CPU
served = serve(model, ckpt)          # the PLE table's Parameter is dropped, rows come from
model.to("cuda")                     #   the memory-mapped checkpoint: never on the GPU
served.prepare(max_tokens=64)        # the steps of captured decode (outside capture)
```

Importing this package does not import transformers or torch; :func:`serve` does. The
demo and the benchmark that run these models (``python -m ple_memops demo|bench``) are
:mod:`ple_memops.demo`, outside the library.
"""

from __future__ import annotations

from ._errors import TableMismatchError, TableMissingError, UnsupportedModelError
from ._models import ServedModel, serve

__all__ = [
    "ServedModel",
    "TableMismatchError",
    "TableMissingError",
    "UnsupportedModelError",
    "serve",
]
