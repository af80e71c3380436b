"""The PLE rows custom ops: ``torch.ops.ple_memops.stage_rows`` and ``join_rows``.

Both mutate a caller-provided output (the plan's staging view a consumer reads) and return
nothing, so Dynamo keeps them and their order; the layer travels as a string and resolves
to the runner hooks bound to it (:func:`bind`). Inside vLLM they are registered with
vLLM's own ``direct_register_custom_op`` (on the platform's dispatch key); without vLLM,
with ``torch.library`` (any device). Either way a fake implementation is registered for
``torch.compile``.

The model calls::

    out = hooks.output(name, tokens)          # uint8 [tokens * H, row_bytes]
    stage_rows(ids, out, name)                # early: publish (captured) or gather (eager)
    ...                                       # GPU work the host gather overlaps
    join_rows(out, name)                      # right before the first consumer of out
"""

# No ``from __future__ import annotations``: the op schemas are inferred from these
# functions' annotations, which must be real types.

import sys
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from ..errors import StateError

if TYPE_CHECKING:
    from .hooks import PleRunnerHooks

__all__ = ["bind", "join_rows", "register", "registered_with", "stage_rows", "unbind_all"]

_LIB = torch.library.Library("ple_memops", "FRAGMENT")  # type: ignore[no-untyped-call]
_LOCK = threading.Lock()
_REGISTERED: str | None = None
_BOUND: "weakref.WeakValueDictionary[str, PleRunnerHooks]" = weakref.WeakValueDictionary()


def bind(name: str, hooks: "PleRunnerHooks") -> None:
    """Route the ops for layer ``name`` to ``hooks`` (replacing a previous binding)."""
    _BOUND[name] = hooks


def unbind_all(hooks: "PleRunnerHooks") -> None:
    for name, bound in list(_BOUND.items()):
        if bound is hooks:
            del _BOUND[name]


def _hooks_for(name: str) -> "PleRunnerHooks":
    hooks = _BOUND.get(name)
    if hooks is None:
        raise StateError(
            f"ple-memops: no rows plan is bound to the PLE layer {name!r}: the runner "
            "builds it at load time (vLLM: Model Runner V2's load_model with the ple-memops "
            "patch applied; `python -m ple_memops.vllm apply --check` tells)"
        )
    return hooks


def _stage_rows(ids: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    _hooks_for(layer_name).stage(layer_name, ids, output)


def _join_rows(output: torch.Tensor, layer_name: str) -> None:
    _hooks_for(layer_name).join(layer_name, output)


def _stage_rows_fake(ids: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


def _join_rows_fake(output: torch.Tensor, layer_name: str) -> None:
    return None


def register() -> str:
    """Register both ops once per process (done when this module is imported); returns
    ``"vllm"`` or ``"torch"``: vLLM's helper is used when vLLM is already imported (this
    never imports it), as it is when the patched vLLM imports this module."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED is not None:
            return _REGISTERED
        helper = None
        if "vllm" in sys.modules:
            try:
                from vllm.utils.torch_utils import direct_register_custom_op

                helper = direct_register_custom_op
            except ImportError:  # pragma: no cover - a vLLM without the helper
                helper = None
        if helper is not None:
            helper(
                op_name="stage_rows",
                op_func=_stage_rows,
                mutates_args=["output"],
                fake_impl=_stage_rows_fake,
                target_lib=_LIB,
            )
            helper(
                op_name="join_rows",
                op_func=_join_rows,
                mutates_args=["output"],
                fake_impl=_join_rows_fake,
                target_lib=_LIB,
            )
            _REGISTERED = "vllm"
        else:
            _LIB.define("stage_rows(Tensor ids, Tensor(a!) output, str layer_name) -> ()")  # type: ignore[no-untyped-call]
            _LIB.define("join_rows(Tensor(a!) output, str layer_name) -> ()")  # type: ignore[no-untyped-call]
            _LIB.impl("stage_rows", _stage_rows, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
            _LIB.impl("join_rows", _join_rows, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
            torch.library.register_fake("ple_memops::stage_rows", _stage_rows_fake, lib=_LIB)
            torch.library.register_fake("ple_memops::join_rows", _join_rows_fake, lib=_LIB)
            _REGISTERED = "torch"
        return _REGISTERED


def registered_with() -> str | None:
    """``"vllm"``, ``"torch"``, or ``None`` before :func:`register`."""
    return _REGISTERED


def stage_rows(ids: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """Stage layer ``layer_name``'s rows for ``ids`` into ``output`` (see the module)."""
    torch.ops.ple_memops.stage_rows(ids, output, layer_name)


def join_rows(output: torch.Tensor, layer_name: str) -> None:
    """Make ``output`` ready for its consumer (see the module)."""
    torch.ops.ple_memops.join_rows(output, layer_name)


register()
