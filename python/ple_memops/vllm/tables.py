"""Find and open PLE tables in a safetensors checkpoint, by the checkpoint's own tensor
names (no engine needed).

* Qwen4Exp: each PLE layer's n-gram table, stored as row shards ``<prefix>layers.<i>.ple.
  ple_embedding.ngram_embedding.shard_<k>.weight`` (concatenated in shard order;
  ``<prefix>`` is e.g. ``model.`` or ``model.language_model.``) or, unsharded, as
  ``...ngram_embedding.weight``.
* Gemma 4 / Gemma 3n: one table for all layers, ``<prefix>embed_tokens_per_layer.weight``
  (``[vocab_size_per_layer_input, num_hidden_layers * hidden_size_per_layer_input]``).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import TableError
from ..table import MmapTable

__all__ = [
    "LayerTable",
    "checkpoint_tensor_names",
    "find_layer_table",
    "find_per_layer_table",
    "is_per_layer_table_weight",
    "is_table_weight",
    "open_layer_table",
]

_TABLE_WEIGHT = re.compile(
    r"(?:^|\.)layers\.\d+\.ple\.ple_embedding\.ngram_embedding\.(?:shard_\d+\.)?weight$"
)
_PER_LAYER_WEIGHT = re.compile(r"(?:^|\.)embed_tokens_per_layer\.weight$")
_INDEX = "model.safetensors.index.json"

# vLLM / torch dtype names -> the safetensors dtype MmapTable reports.
TABLE_DTYPES = {
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float32": "F32",
}


def is_table_weight(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is (a row shard of) a PLE n-gram table, which
    the mmap backend serves from the file instead of loading (its scale is not)."""
    return _TABLE_WEIGHT.search(name) is not None


def is_per_layer_table_weight(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a Gemma per-layer embedding table."""
    return _PER_LAYER_WEIGHT.search(name) is not None


def _header_names(path: Path) -> list[str]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise TableError(f"{path}: not a safetensors file (shorter than its header size)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100_000_000:
            raise TableError(f"{path}: safetensors header of {size} bytes is implausible")
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"]


def checkpoint_tensor_names(checkpoint: str | os.PathLike[str]) -> list[str]:
    """Every tensor name in a checkpoint directory (its index when present, else the
    headers of its ``.safetensors`` files), a single ``.safetensors`` file, or an index."""
    path = Path(checkpoint)
    if path.is_dir() and (path / _INDEX).is_file():
        path = path / _INDEX
    if path.is_file() and path.name.endswith(".json"):
        try:
            return list(json.loads(path.read_text())["weight_map"])
        except (KeyError, ValueError, TypeError) as exc:
            raise TableError(f"{path}: not a safetensors index ({exc})") from exc
    if path.is_file():
        return _header_names(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise TableError(f"{path}: no .safetensors files and no {_INDEX}")
        return [name for f in files for name in _header_names(f)]
    raise TableError(f"{path}: no such checkpoint file or directory")


@dataclass(frozen=True)
class LayerTable:
    """How to open one layer's table: exactly one of ``name`` and ``pattern``; ``columns``
    (``(first, count)``): only that window of each row (:meth:`MmapTable.open`)."""

    layer_index: int
    name: str | None = None
    pattern: str | None = None
    columns: tuple[int, int] | None = None


def find_layer_table(names: Iterable[str], layer_index: int) -> LayerTable:
    """The tensor(s) holding the n-gram table of decoder layer ``layer_index`` (0-based)."""
    stem = rf"layers\.{layer_index}\.ple\.ple_embedding\.ngram_embedding"
    shard = re.compile(rf"^(.*?){stem}\.shard_\d+\.weight$")
    whole = re.compile(rf"^(.*?){stem}\.weight$")
    shard_prefixes, whole_names = set(), []
    for name in names:
        if m := shard.match(name):
            shard_prefixes.add(m.group(1))
        elif whole.match(name):
            whole_names.append(name)
    tail = f"layers.{layer_index}.ple.ple_embedding.ngram_embedding"
    if len(shard_prefixes) + len(whole_names) > 1:
        found = sorted(f"{p}{tail}.shard_*" for p in shard_prefixes) + sorted(whole_names)
        raise TableError(
            f"PLE table of layer {layer_index} is ambiguous in the checkpoint: {found}"
        )
    if shard_prefixes:
        (prefix,) = shard_prefixes
        return LayerTable(layer_index, pattern=f"{prefix}{tail}.shard_{{}}.weight")
    if whole_names:
        return LayerTable(layer_index, name=whole_names[0])
    raise TableError(
        f"the checkpoint holds no PLE table for layer {layer_index} "
        f"(no '...{tail}.shard_<k>.weight' or '...{tail}.weight')"
    )


def find_per_layer_table(names: Iterable[str]) -> LayerTable:
    """The Gemma per-layer embedding table (``...embed_tokens_per_layer.weight``), one
    tensor for every decoder layer; :class:`TableError` when there is none or several."""
    found = sorted(n for n in names if is_per_layer_table_weight(n))
    if len(found) > 1:
        raise TableError(f"the per-layer embedding table is ambiguous in the checkpoint: {found}")
    if not found:
        raise TableError(
            "the checkpoint holds no per-layer embedding table (no "
            "'...embed_tokens_per_layer.weight')"
        )
    return LayerTable(0, name=found[0])


def open_layer_table(
    checkpoint: str | os.PathLike[str],
    spec: LayerTable,
    *,
    rows: int | None = None,
    row_bytes: int | None = None,
    dtype: str | None = None,
    scale: float | None = None,
    gather_threads: int | None = None,
    base: MmapTable | None = None,
) -> MmapTable:
    """Open ``spec`` in ``checkpoint`` and check it against what the model expects
    (each check only when its value is given); a mismatch raises :class:`TableError`
    naming the layer and the tensors, and closes the table. ``gather_threads``: see
    :meth:`MmapTable.open`. ``base``: ``spec``'s tensor opened already; the table is a
    :meth:`~MmapTable.window` of it (one mapping for every window of a tensor)."""
    if base is not None:
        table = base.window(spec.columns, gather_threads=gather_threads)
    else:
        table = MmapTable.open(
            checkpoint,
            spec.name,
            pattern=spec.pattern,
            gather_threads=gather_threads,
            columns=spec.columns,
        )
    what = spec.pattern or spec.name
    if spec.columns is not None:
        what = f"{what}, columns {spec.columns[0]}..{sum(spec.columns)}"
    problems = []
    if rows is not None and table.rows != rows:
        problems.append(f"{table.rows} rows, the model has {rows}")
    if row_bytes is not None and table.row_bytes != row_bytes:
        problems.append(f"rows of {table.row_bytes} bytes, the model's are {row_bytes}")
    if dtype is not None and table.dtype != dtype:
        problems.append(f"dtype {table.dtype}, the model's is {dtype}")
    if scale is not None and table.scale is not None and table.scale != scale:
        problems.append(f"scale {table.scale}, the model loaded {scale}")
    if problems:
        table.close()
        raise TableError(
            f"PLE table of layer {spec.layer_index} ({what}) does not match the model: "
            + "; ".join(problems)
        )
    return table
