"""The PLE rows custom ops: ``torch.ops.ple_memops.stage_rows`` and ``join_rows`` (for an
eager model), ``stage_ids`` and ``read_rows`` (for a model ``torch.compile`` compiles).

A leaf module: it imports torch only and knows nothing of the runner. Both ops mutate a
caller-provided output (the steps' staging view a consumer reads) and return nothing, so
Dynamo keeps them and their order; the layer travels as a string and is looked up where
the engine keeps its layers, vLLM's idiom for attention: the forward context's
``no_compile_layers[layer_name]`` (the mmap table registers itself there), or, for a
runner without a vLLM forward context, the mapping of :func:`layers`. The layer found
must carry its runner hooks as ``ple_memops_hooks``. Registered with ``torch.library``
once, the same way whatever was imported first, with fake implementations for
``torch.compile``.

An eager model calls::

    out = hooks.output(name, tokens)          # uint8 [tokens * H, row_bytes]
    stage_rows(ids, out, name)                # early: publish (captured) or gather (eager)
    ...                                       # GPU work the host gather overlaps
    join_rows(out, name)                      # right before the first consumer of out

A compiled model calls the functional pair instead: Inductor (vLLM's inductor config has
no auto-functionalization v2) hands a mutating op a clone of a graph input, never the
staging buffer a captured consumer must read, and reuses the memory of the ids as soon
as the op that read them returns, while the rows are gathered from them later::

    staged = stage_ids(ids, name)             # the ids copied to the hooks' own buffer,
                                              # then staged; an empty [rows, 0] token
    ...
    rows = read_rows(staged, row_bytes, name) # joined, then copied: uint8 [rows, row_bytes]
"""

# No ``from __future__ import annotations``: the op schemas are inferred from these
# functions' annotations, which must be real types.

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..errors import StateError

__all__ = ["join_rows", "layers", "read_rows", "stage_ids", "stage_rows"]

_LIB = torch.library.Library("ple_memops", "FRAGMENT")  # type: ignore[no-untyped-call]
_LAYERS: "contextvars.ContextVar[Mapping[str, Any] | None]" = contextvars.ContextVar(
    "ple_memops_layers", default=None
)


@contextlib.contextmanager
def layers(mapping: Mapping[str, Any]) -> Iterator[None]:
    """The layers the ops resolve by name while the block runs, for runners without a
    vLLM forward context (each value carries ``ple_memops_hooks``)."""
    token = _LAYERS.set(mapping)
    try:
        yield
    finally:
        _LAYERS.reset(token)


def _layer(name: str) -> Any:
    mapping = _LAYERS.get()
    if mapping is None and "vllm.forward_context" in sys.modules:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if is_forward_context_available():
            mapping = get_forward_context().no_compile_layers
    if mapping is None:
        raise StateError(
            f"ple-memops: no forward context names the PLE layer {name!r} (the ops run "
            "inside a vLLM forward, or inside ple_memops.vllm.ops.layers(...))"
        )
    layer = mapping.get(name)
    hooks = getattr(layer, "ple_memops_hooks", None)
    if hooks is None:
        raise StateError(
            f"ple-memops: the PLE layer {name!r} has no steps bound (the plugin's "
            "Model Runner V2 binds it at load time; `python -m ple_memops.vllm check` "
            "tells whether the plugin is installed)"
        )
    return hooks


def _stage_rows(ids: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    _layer(layer_name).stage(layer_name, ids, output)


def _join_rows(output: torch.Tensor, layer_name: str) -> None:
    _layer(layer_name).join(layer_name, output)


def _stage_rows_fake(ids: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


def _join_rows_fake(output: torch.Tensor, layer_name: str) -> None:
    return None


def _stage_ids(ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    return _layer(layer_name).stage_ids(layer_name, ids)  # type: ignore[no-any-return]


def _read_rows(staged: torch.Tensor, row_bytes: int, layer_name: str) -> torch.Tensor:
    return _layer(layer_name).read_rows(layer_name, staged)  # type: ignore[no-any-return]


def _stage_ids_fake(ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    return ids.new_empty((ids.numel(), 0))


def _read_rows_fake(staged: torch.Tensor, row_bytes: int, layer_name: str) -> torch.Tensor:
    return staged.new_empty((staged.shape[0], row_bytes), dtype=torch.uint8)


def _register(
    schema: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    tags: tuple[torch.Tag, ...] = (),
) -> None:
    """Define the op ``schema`` names on :data:`_LIB`, with ``impl`` for every backend and
    ``fake`` for ``torch.compile``."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=tags)  # type: ignore[no-untyped-call]
    _LIB.impl(name, impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    torch.library.register_fake(f"ple_memops::{name}", fake, lib=_LIB)


_register(
    "stage_rows(Tensor ids, Tensor(a!) output, str layer_name) -> ()", _stage_rows, _stage_rows_fake
)
_register("join_rows(Tensor(a!) output, str layer_name) -> ()", _join_rows, _join_rows_fake)
# Tagged as RNG-like (its result stands for state outside its inputs: the ids handed to
# the host): Inductor's reorder_for_locality moves any other functional op right before
# its only consumer, read_rows, and the host's gather would then overlap nothing; it never
# moves an op that consumes RNG state (torch 2.14, vLLM 0.33.0's pin; torch 2.11 still
# does: benchmarks/inductor_placement.py shows where).
_register(
    "stage_ids(Tensor ids, str layer_name) -> Tensor",
    _stage_ids,
    _stage_ids_fake,
    tags=(torch.Tag.nondeterministic_seeded,),
)
_register(
    "read_rows(Tensor staged, int row_bytes, str layer_name) -> Tensor", _read_rows, _read_rows_fake
)


def stage_rows(ids: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """Stage layer ``layer_name``'s rows for ``ids`` into ``output`` (see the module)."""
    torch.ops.ple_memops.stage_rows(ids, output, layer_name)


def join_rows(output: torch.Tensor, layer_name: str) -> None:
    """Make ``output`` ready for its consumer (see the module)."""
    torch.ops.ple_memops.join_rows(output, layer_name)


def stage_ids(ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    """Stage layer ``layer_name``'s rows for ``ids`` (a compiled model); returns the token
    :func:`read_rows` takes (see the module)."""
    staged: torch.Tensor = torch.ops.ple_memops.stage_ids(ids, layer_name)
    return staged


def read_rows(staged: torch.Tensor, row_bytes: int, layer_name: str) -> torch.Tensor:
    """The rows :func:`stage_ids` staged, ready: a new ``uint8 [rows, row_bytes]``."""
    rows: torch.Tensor = torch.ops.ple_memops.read_rows(staged, row_bytes, layer_name)
    return rows
