"""What a captured Gemma 3n decode step needs from transformers' code (see the shared
notes on Gemma 3n): no host-to-device copy inside the forward, a device-side query offset
for the sliding-window mask, and static shapes (a static cache that stays in one phase).
Values are unchanged: these only move where a constant lives or which counter is read."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["capture_scope", "device_query_offset", "make_capturable", "memoised_constants"]

_LOCK = threading.Lock()
_PATCHED: dict[str, Any] = {}


class _MemoTorch(types.ModuleType):
    """Stands in for ``torch`` inside one transformers modeling module. Within
    :func:`capture_scope` (the runner's forwards), ``torch.tensor`` of a Python scalar
    returns one tensor per (value, dtype, device), made on the first (eager) call; a
    scalar made without a device is made on the scope's device, so the ``.to(device)``
    that follows it in the modeling code copies nothing (a graph cannot capture a copy
    from pageable host memory). Outside the scope (module construction, weight init)
    and for anything else it is torch itself, so no module ever shares a buffer."""

    def __init__(self, torch: Any) -> None:
        super().__init__("torch")
        self._torch = torch
        self._memo: dict[tuple[Any, ...], Any] = {}
        self._scope = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def tensor(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        torch = self._torch
        default = getattr(self._scope, "device", None)
        if (
            default is None
            or args
            or not isinstance(data, (float, int))
            or isinstance(data, bool)
            or set(kwargs) - {"dtype", "device"}
        ):
            return torch.tensor(data, *args, **kwargs)
        dev = torch.device(kwargs.get("device") or default)
        key = (type(data), data, kwargs.get("dtype"), str(dev))
        got = self._memo.get(key)
        if got is None:
            got = torch.tensor(data, dtype=kwargs.get("dtype"), device=dev)
            self._memo[key] = got
        return got


@contextlib.contextmanager
def capture_scope(device: Any) -> Iterator[None]:
    """Within the block, the patched modules' scalar constants are memoised on
    ``device`` (see :func:`make_capturable`)."""
    proxies = [vars(m)["torch"] for m in _PATCHED.values()]
    olds = []
    for p in proxies:
        olds.append(getattr(p._scope, "device", None))
        p._scope.device = device
    try:
        yield
    finally:
        for p, old in zip(proxies, olds, strict=True):
            p._scope.device = old


def make_capturable(model_type: str = "gemma3n") -> None:
    """Patch transformers' ``modeling_<model_type>`` module (process-wide, idempotent) so
    that, within :func:`capture_scope`, its scalar constants are made once, on the model's
    device, during the eager warm-up."""
    import importlib

    import torch

    with _LOCK:
        if model_type in _PATCHED:
            return
        mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        if isinstance(vars(mod)["torch"], _MemoTorch):
            _PATCHED[model_type] = mod
            return
        vars(mod)["torch"] = _MemoTorch(torch)
        _PATCHED[model_type] = mod


def memoised_constants() -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every scalar constant the patched modules made so far, as ``(key, tensor)``: the
    tensors themselves, which captured graphs read (the runner's state checks sum them)."""
    for mod in list(_PATCHED.values()):
        yield from list(vars(mod)["torch"]._memo.items())


def device_query_offset(cache: Any) -> Any:
    """Make ``cache`` report the query offset from each layer's device counter (the one
    ``StaticLayer.update`` advances in place) instead of the sliding layers' host int,
    which a captured graph would freeze. Returns the cache."""

    stock = cache.get_query_offset
    import torch

    def get_query_offset(layer_idx: int = 0) -> Any:
        counter = getattr(cache.layers[layer_idx], "cumulative_length", None)
        return counter if isinstance(counter, torch.Tensor) else stock(layer_idx)

    cache.get_query_offset = get_query_offset
    return cache
