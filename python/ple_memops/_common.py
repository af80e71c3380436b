"""Package-internal helpers every layer shares: the optional torch import, device names,
capture detection, and the one conversion of row ids to a host array.

Nothing here is public API; the names carry no underscore so that other modules of the
package may import them (no module imports another's private helpers).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, RowIdError, RowShapeError

__all__ = [
    "capturing",
    "cuda_available",
    "host_ids",
    "optional_torch",
    "parse_device",
    "plan_device",
    "row_count",
]

# numpy type numbers the native gather takes as-is (int64/int32 in every platform spelling).
_NATIVE_ID_NUMS = frozenset(np.dtype(t).num for t in (np.int64, np.int32, np.intp, np.longlong))


def optional_torch() -> Any:
    """The ``torch`` module, or ``None`` where it is not installed."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional on CPU-only machines
        return None
    return torch


def cuda_available() -> bool:
    torch = optional_torch()
    return bool(torch is not None and torch.cuda.is_available())


def parse_device(device: object) -> int | None:
    """``None`` for the host, else a CUDA ordinal (``"cpu"``, ``"cuda"``, ``"cuda:N"``, an
    int, or ``None``: CUDA device 0 if available, else the host)."""
    if device is None:
        return 0 if cuda_available() else None
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise InvalidArgumentError(f"device must be a CUDA ordinal >= 0, got {device}")
        return device
    text = str(device)
    if text == "cpu":
        return None
    if text == "cuda":
        # Without a device, 0: what needs one says there is none.
        return int(optional_torch().cuda.current_device()) if cuda_available() else 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise InvalidArgumentError(
        f"device must be 'cpu', 'cuda', 'cuda:N', an int or None, got {device!r}"
    )


def row_count(value: object, max_rows: int, name: str = "rows") -> int:
    """``value``, a step's row count, as an int: one that is not an integer raises
    :class:`~ple_memops.InvalidArgumentError`, a negative one
    :class:`~ple_memops.RowShapeError` (as the native core does for 0 and for more than
    ``max_rows``), each naming ``name``."""
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}") from None
    if n < 0:
        raise RowShapeError(f"{name} must be between 1 and max_rows ({max_rows}), got {n}")
    return n


def plan_device(device: Any) -> Any:
    """An engine's device as ``Steps.build`` takes it: a ``torch.device`` becomes ``"cpu"`` or a
    CUDA ordinal (index ``None`` is 0); ``None`` becomes 0 where CUDA is available, else
    ``"cpu"``; anything else passes (``Steps.build`` parses it)."""
    if device is None:
        return 0 if cuda_available() else "cpu"
    if hasattr(device, "type"):
        return "cpu" if device.type == "cpu" else int(device.index or 0)
    return device


def capturing(tensor: Any = None) -> bool:
    """Whether the current CUDA stream is capturing a graph. With ``tensor``: only when
    the tensor is on a CUDA device (a CPU tensor's step is never captured)."""
    if tensor is not None and getattr(getattr(tensor, "device", None), "type", None) != "cuda":
        return False
    torch = optional_torch()
    return bool(
        torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    )


def host_ids(
    ids: Any,
    *,
    allow_device_sync: bool,
    dtype: Any = None,
    flatten: bool = False,
    error: type[Exception] = InvalidArgumentError,
) -> Any:
    """``ids`` as a 1-D integer numpy array on the host: the one conversion of row ids.

    ``ids``: a numpy array, a torch tensor or a sequence of ints. An int64/int32 numpy
    array passes without a copy; a CPU tensor is viewed.

    ``allow_device_sync``: what a CUDA tensor does. ``False`` (every hot path: a table's
    gather, a worker's host publish, ``Steps.publish_host``): it is refused with
    ``error`` (default :class:`~ple_memops.InvalidArgumentError`; the worker raises
    :class:`~ple_memops.RowShapeError`), because reading it would synchronise the host
    with the device. ``True`` (the eager path, ``Steps.gather_now``): it is copied to
    the host, which waits for the device, on purpose.

    ``dtype``: ``None`` keeps int64/int32 ids as they are and converts other integer
    dtypes to int64 (a uint64 id beyond int64 raises :class:`~ple_memops.RowIdError`);
    ``np.int64`` makes a C-contiguous int64 array. ``flatten``: any shape is read in
    row-major order; otherwise ids that are not 1-D, like ids that are not integers (an
    empty sequence is fine), raise ``error``.
    """
    if type(ids) is np.ndarray and ids.dtype.num in _NATIVE_ID_NUMS and dtype is None:
        if flatten:
            return ids.reshape(-1)
        return ids  # ndim and strides are checked natively
    if hasattr(ids, "detach") and hasattr(ids, "numpy"):  # a torch tensor
        if ids.device.type != "cpu":
            if not allow_device_sync:
                raise error(
                    f"ids must be on the host, got a tensor on {ids.device} (reading it "
                    "would synchronise with the device; device-produced ids: publish() or "
                    "stage())"
                )
            ids = ids.detach().reshape(-1).to("cpu")
        ids = ids.detach().numpy()
    arr = np.asarray(ids)
    if flatten:
        arr = arr.reshape(-1)
    if arr.ndim != 1:
        raise error(f"ids must be 1-D, got shape {list(arr.shape)}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.empty(0, np.int64)
        raise error(f"ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        pos = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise RowIdError(f"row id {int(arr[pos])} out of range (position {pos})")
    if dtype is not None:
        return np.ascontiguousarray(arr, dtype=dtype)
    if arr.dtype.num in _NATIVE_ID_NUMS:
        return arr
    return arr.astype(np.int64)
