"""What a captured Gemma 3n decode step needs from transformers' code (see the shared
notes on Gemma 3n): no host-to-device copy inside the forward, a device-side query offset
for the sliding-window mask, and static shapes (a static cache that stays in one phase).
Values are unchanged: these only move where a constant lives or which counter is read."""

from __future__ import annotations

import threading
import types
from typing import Any

__all__ = ["device_query_offset", "make_capturable"]

_LOCK = threading.Lock()
_PATCHED: dict[str, Any] = {}


class _MemoTorch(types.ModuleType):
    """Stands in for ``torch`` inside one transformers modeling module: ``torch.tensor`` of
    a Python scalar returns one tensor per (value, dtype, device), made on the first
    (eager) call. A host scalar without a device is kept in pinned memory, so the
    ``.to(device)`` that follows it is a copy a graph may capture. Everything else is
    torch itself."""

    def __init__(self, torch: Any) -> None:
        super().__init__("torch")
        self._torch = torch
        self._memo: dict[tuple[Any, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def tensor(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        torch = self._torch
        if args or not isinstance(data, (float, int)) or isinstance(data, bool):
            return torch.tensor(data, *args, **kwargs)
        if set(kwargs) - {"dtype", "device"}:
            return torch.tensor(data, *args, **kwargs)
        dev = kwargs.get("device")
        key = (type(data), data, kwargs.get("dtype"), None if dev is None else str(dev))
        got = self._memo.get(key)
        if got is None:
            got = torch.tensor(data, **kwargs)
            if dev is None and torch.cuda.is_available():
                got = got.pin_memory()
            self._memo[key] = got
        return got


def make_capturable(model_type: str = "gemma3n") -> None:
    """Patch transformers' ``modeling_<model_type>`` module (process-wide, idempotent) so
    its scalar constants are made once, outside capture."""
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
