"""The state checks of a run: exact checksums of what a decode step reads besides its rows
(the KV cache, the cache counters, the decode token and position, the prefill's logits,
the memoised constants and the weights), compared with the recording's."""

from __future__ import annotations

from typing import Any

from .capture import memoised_constants
from .decode import Decoder, Record, bits

__all__ = ["check_state", "state_digest"]


def check_state(
    bench: Any, dec: Decoder, prefill_logits: Any, record: Record, recording: bool
) -> list[str] | None:
    """Checksums of the state a run's steps start from (see the module docs); the
    recording keeps its own, every other run returns what differs from them."""
    got = state_digest(bench, dec, prefill_logits)
    if recording:
        record.state = got
        return None
    if record.state is None:
        return None
    diff: list[str] = []
    for k in sorted(set(got) | set(record.state)):
        const = k.startswith(_CONST)
        if const and (k not in got or k not in record.state):
            continue  # made since (another code path's first call): not a change
        name = _CONST if const else k
        if got.get(k) != record.state.get(k) and name not in diff:
            diff.append(name)
    return diff


def state_digest(
    bench: Any, dec: Decoder, prefill_logits: Any = None
) -> dict[str, tuple[int, int]]:
    """Exact checksums (integer sums of the bits and of their squares, order-free) of
    what a decode step reads besides its rows: per cache layer its keys and values and
    counters, the decode token and position, the given prefill logits, the memoised
    constants, and the weights (the model's without the PLE module in place, the stock
    PLE module's and the served one's buffers)."""
    out: dict[str, tuple[int, int]] = {}
    for i, layer in enumerate(dec.cache.layers):
        if not getattr(layer, "is_initialized", False) or getattr(layer, "keys", None) is None:
            continue  # not written yet, or a KV-shared layer's placeholder
        out[f"kv-cache layer {i}"] = _checksum([layer.keys, layer.values])
        counters = [layer.cumulative_length]
        host = getattr(layer, "cumulative_length_int", None)
        out[f"cache counters layer {i}"] = _add(_checksum(counters), (host or 0, 0))
    out["decode token/position"] = _checksum([dec.tok, dec.pos])
    if prefill_logits is not None:
        out["prefill logits"] = _checksum([prefill_logits])
    for key, t in memoised_constants():
        out[f"{_CONST} {key}"] = _checksum([t])
    served = bench.served
    slots = {id(getattr(parent, attr)) for parent, attr in served.owners.values()}
    seen: set[tuple[int, int]] = set()
    weights: list[Any] = []

    def take(mod: Any, skip: set[int]) -> None:
        for sub in mod.modules():
            if id(sub) in skip:
                continue
            for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
                key = (t.data_ptr(), t.numel())
                if key not in seen:
                    seen.add(key)
                    weights.append(t)

    take(served.model, _submodules(served.model, slots))
    take(bench.stock, set())
    for mod in served.modules.values():
        take(mod, set())
    out["weights"] = _checksum(weights)
    return out


_CONST = "memoised constants"


def _submodules(root: Any, ids: set[int]) -> set[int]:
    """Ids of the modules in ``ids`` and of everything under them, within ``root``."""
    out: set[int] = set()
    for mod in root.modules():
        if id(mod) in ids:
            out.update(id(m) for m in mod.modules())
    return out


def _checksum(tensors: list[Any]) -> tuple[int, int]:
    """(sum of the elements' bits, sum of their squares), as int64 with wraparound: exact
    and independent of the reduction's order, so equal data always gives equal sums."""
    import torch

    chunk = 1 << 25
    accs: dict[Any, Any] = {}
    for t in tensors:
        t = t.detach()
        if t.numel() == 0:
            continue
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        flat = flat.view(torch.uint8) if flat.element_size() == 1 else bits(flat)
        acc = accs.get(flat.device)
        if acc is None:
            acc = accs[flat.device] = torch.zeros(2, dtype=torch.int64, device=flat.device)
        for i in range(0, flat.numel(), chunk):
            part = flat[i : i + chunk].to(torch.int64)
            acc[0] += part.sum()
            acc[1] += (part * part).sum()
    out = (0, 0)
    for acc in accs.values():
        a, b = acc.tolist()
        out = _add(out, (a, b))
    return out


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    wrap = 1 << 64
    return (a[0] + b[0]) % wrap, (a[1] + b[1]) % wrap
