"""MmapTable through the public API: gathered bytes against torch.index_select on the
checkpoint as the safetensors package loads it, and every error case with its class."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ple_memops
from ple_memops import (
    ClosedError,
    InvalidArgumentError,
    MmapTable,
    RowIdError,
    TableError,
    TableIoError,
)

QWEN = "model.layers.2.ple.ple_embedding.ngram_embedding.shard_{}.weight"
GEMMA = "model.language_model.embed_tokens_per_layer.weight"

DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
}


def _rand(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 4).to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A [rows, cols] tensor as its raw bytes, [rows, row_bytes] uint8."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def _reference(tensors: list[torch.Tensor], ids: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    table = torch.cat([_bytes(t) for t in tensors])
    return torch.index_select(table, 0, torch.from_numpy(ids.astype(np.int64))).numpy()


def _sharded_checkpoint(
    d: Path, shards: list[torch.Tensor], files: int, extra: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write shards round-robin over `files` files plus a model.safetensors.index.json."""
    per_file: list[dict[str, torch.Tensor]] = [{} for _ in range(files)]
    weight_map: dict[str, str] = {}
    for k, t in enumerate(shards):
        f = (k * 7 + 3) % files  # not in shard order
        per_file[f][QWEN.format(k)] = t
    for name, t in (extra or {}).items():
        per_file[0][name] = t
    for f, tensors in enumerate(per_file):
        fname = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        save_file(tensors, str(d / fname))
        weight_map.update({n: fname for n in tensors})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return d


def _adversarial_ids(rows: int, boundaries: list[int], rng: np.random.Generator) -> list[Any]:
    edges = [0, rows - 1, 0, rows - 1]
    for b in boundaries:
        edges += [b - 1, b, b + 1 if b + 1 < rows else b]
    return [
        np.array(edges, dtype=np.int64),
        np.array(edges, dtype=np.int32),
        rng.integers(0, rows, 4096, dtype=np.int64),
        rng.integers(0, rows, 16, dtype=np.int32),
        np.full(300, rows // 2, dtype=np.int64),  # all duplicates
        np.arange(rows - 1, -1, -1, dtype=np.int64),  # every row, reversed
        np.empty(0, dtype=np.int64),
    ]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_single_file_matches_index_select(tmp_path: Path, dtype: str) -> None:
    t = _rand(513, 80, DTYPES[dtype], 1)
    path = tmp_path / "model.safetensors"
    save_file({GEMMA: t, "other.weight": _rand(3, 3, torch.float32, 2)}, str(path))
    loaded = load_file(str(path))[GEMMA]
    rng = np.random.default_rng(0)
    with MmapTable.open(path, GEMMA) as table:
        assert table.rows == 513
        assert table.shape == (513, 80)
        assert table.row_bytes == 80 * t.element_size()
        assert table.dtype == dtype
        assert table.scale is None
        assert table.files == [str(path)]
        for ids in _adversarial_ids(513, [], rng):
            want = _reference([loaded], ids)
            np.testing.assert_array_equal(table.gather(ids), want)
            out = np.empty((len(ids), table.row_bytes), np.uint8)
            table.gather_into(ids, out)
            np.testing.assert_array_equal(out, want)
            dst = torch.empty((len(ids), table.row_bytes), dtype=torch.uint8)
            table.gather_into(torch.from_numpy(ids), dst)
            np.testing.assert_array_equal(dst.numpy(), want)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("files", [1, 3])
def test_sharded_checkpoint_matches_index_select(tmp_path: Path, dtype: str, files: int) -> None:
    rows = [100, 37, 1, 64, 250]
    shards = [_rand(r, 160, DTYPES[dtype], 10 + k) for k, r in enumerate(rows)]
    d = _sharded_checkpoint(tmp_path, shards, files)
    loaded: dict[str, torch.Tensor] = {}
    for f in d.glob("*.safetensors"):
        loaded.update(load_file(str(f)))
    ref = [loaded[QWEN.format(k)] for k in range(len(rows))]
    boundaries = list(np.cumsum(rows)[:-1])
    total = sum(rows)
    with MmapTable.open(d, pattern=QWEN) as table:
        assert table.rows == total
        assert table.shards == [(QWEN.format(k), r) for k, r in enumerate(rows)]
        assert len(table.files) == files
        for ids in _adversarial_ids(total, boundaries, np.random.default_rng(1)):
            np.testing.assert_array_equal(table.gather(ids), _reference(ref, ids))
    # The same through the index file path, with the pool forced on.
    with MmapTable.open(
        d / "model.safetensors.index.json", pattern=QWEN, parallel_min_bytes=0
    ) as table:
        ids = np.random.default_rng(2).integers(0, total, 5000)
        np.testing.assert_array_equal(table.gather(ids), _reference(ref, ids))
        assert table.gather_threads is None and table.parallel_min_bytes == 0
    # And on threads of the table's own, beside a table on the shared pool, both at once.
    own = MmapTable.open(d, pattern=QWEN, parallel_min_bytes=0, gather_threads=3)
    shared = MmapTable.open(d, pattern=QWEN, parallel_min_bytes=0)
    assert own.gather_threads == 3 and shared.gather_threads is None
    ids = np.random.default_rng(3).integers(0, total, 4000)
    want, bad = _reference(ref, ids), []

    def gather(t: MmapTable) -> None:
        for _ in range(10):
            if not np.array_equal(t.gather(ids), want):
                bad.append(t.gather_threads)

    threads = [threading.Thread(target=gather, args=(t,)) for t in (own, shared, own, shared)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    own.close()
    shared.close()
    assert not bad


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_a_column_window_serves_each_rows_slice(tmp_path: Path, dtype: str) -> None:
    # Gemma's per-layer table: a row holds every layer's slice (here 5 layers of 32).
    t = _rand(700, 5 * 32, DTYPES[dtype], 4)
    path = tmp_path / "model.safetensors"
    save_file({GEMMA: t}, str(path))
    loaded = load_file(str(path))[GEMMA]
    ids = np.random.default_rng(5).integers(0, 700, 3000)
    for first, count in [(0, 32), (32, 4 * 32), (159, 1)]:
        want = loaded[:, first : first + count][torch.from_numpy(ids)]
        for pool in (None, 0):
            with MmapTable.open(path, GEMMA, columns=(first, count), parallel_min_bytes=pool) as w:
                assert w.columns == (first, count)
                assert w.shape == (700, count)
                assert w.row_bytes == count * t.element_size()
                np.testing.assert_array_equal(w.gather(ids), _bytes(want).numpy())
                out = torch.empty((len(ids), w.row_bytes), dtype=torch.uint8)
                w.gather_into(torch.from_numpy(ids), out)
                np.testing.assert_array_equal(out.numpy(), _bytes(want).numpy())
    with MmapTable.open(path, GEMMA) as whole:
        assert whole.columns is None and whole.shape == (700, 160)


def test_windows_of_one_table_share_its_mapping(tmp_path: Path) -> None:
    t = _rand(300, 4 * 32, torch.bfloat16, 6)
    path = tmp_path / "model.safetensors"
    save_file({GEMMA: t}, str(path))

    def mappings() -> int:
        # Areas of a mapping of the file that begin at its offset 0: one a mapping (advice
        # on part of a mapping splits it into areas at other offsets).
        areas = [m.split() for m in Path("/proc/self/maps").read_text().splitlines()]
        return sum(m[-1] == str(path) and int(m[2], 16) == 0 for m in areas)

    before = mappings()
    base = MmapTable.open(path, GEMMA)
    first = base.window((0, 32))
    rest = base.window((32, 96), gather_threads=2)
    assert mappings() - before == 1  # one mapping for the three
    assert (first.columns, rest.columns, base.columns) == ((0, 32), (32, 96), None)
    assert (rest.gather_threads, base.gather_threads) == (2, None)
    ids = np.random.default_rng(7).integers(0, 300, 500)
    base.close()  # the windows keep the mapping
    np.testing.assert_array_equal(first.gather(ids), _bytes(t[:, :32][ids]).numpy())
    np.testing.assert_array_equal(rest.gather(ids), _bytes(t[:, 32:][ids]).numpy())
    assert rest.page_stats()["row_hits"] == first.page_stats()["row_hits"]  # shared
    with pytest.raises(ClosedError):
        base.window((0, 1))
    with pytest.raises(InvalidArgumentError, match="columns"):
        first.window((120, 9))
    with pytest.raises(InvalidArgumentError, match="gather_threads"):
        first.window((0, 1), gather_threads=1)
    first.close()
    rest.close()
    assert mappings() == before


@pytest.mark.parametrize("columns", [(0, 0), (160, 1), (100, 61), (-1, 2), (1.0, 2), [0, 2], (0,)])
def test_a_column_window_outside_the_row_is_refused(tmp_path: Path, columns: object) -> None:
    save_file({GEMMA: _rand(8, 160, torch.bfloat16, 1)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(InvalidArgumentError, match="columns"):
        MmapTable.open(tmp_path / "m.safetensors", GEMMA, columns=columns)  # type: ignore[arg-type]


@pytest.mark.parametrize("threads", [0, 1, 65, True, 2.0, "4"])
def test_gather_threads_is_checked(tmp_path: Path, threads: object) -> None:
    save_file({"w": _rand(8, 8, torch.float32, 1)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(InvalidArgumentError, match="gather_threads must be an int from 2 to 64"):
        MmapTable.open(tmp_path / "m.safetensors", "w", gather_threads=threads)  # type: ignore[arg-type]


def test_ids_in_other_forms(tmp_path: Path) -> None:
    t = _rand(50, 8, torch.float32, 3)
    save_file({"w": t}, str(tmp_path / "m.safetensors"))
    table = MmapTable.open(tmp_path / "m.safetensors", "w")
    want = _reference([t], np.array([3, 1, 49]))
    for ids in (
        [3, 1, 49],
        (3, 1, 49),
        np.array([3, 1, 49], dtype=np.uint16),
        np.array([3, 1, 49], dtype=np.uint64),
        np.array([3, 99, 1, 0, 49, 7])[::2][[0, 1, 2]],
        np.array([[3, 3], [1, 1], [49, 49]])[:, 0],  # strided view
        torch.tensor([3, 1, 49], dtype=torch.int32),
    ):
        np.testing.assert_array_equal(table.gather(ids), want)
    assert table.gather([]).shape == (0, 32)


def test_fp8_scale(tmp_path: Path) -> None:
    w = _rand(20, 16, torch.float8_e4m3fn, 4)
    name = "model.layers.2.ple.embedding.weight"
    path = tmp_path / "m.safetensors"
    save_file({name: w, name + "_scale": torch.tensor(0.0625)}, str(path))
    table = MmapTable.open(path, name)
    assert table.scale == 0.0625
    assert table.scale_tensor == name + "_scale"
    # Sharded, scale per shard, all equal.
    shards = [_rand(5, 16, torch.float8_e4m3fn, k) for k in range(3)]
    scales = {QWEN.format(k) + "_scale": torch.tensor(0.5) for k in range(3)}
    d = tmp_path / "sharded"
    d.mkdir()
    _sharded_checkpoint(d, shards, 2, extra=scales)
    assert MmapTable.open(d, pattern=QWEN).scale == 0.5


def test_open_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file(
        {"w": _rand(8, 4, torch.bfloat16, 0), "v": torch.zeros(4, dtype=torch.float32)}, str(good)
    )
    raw = good.read_bytes()

    def write(name: str, data: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(data)
        return p

    cases: list[tuple[Path, dict[str, Any], type[Exception], str]] = [
        (good, {"name": "missing"}, TableError, "no tensor named"),
        (good, {"pattern": "w{}.x"}, TableError, "no tensor matches"),
        (good, {"name": "v"}, TableError, "2-D"),
        (write("trunc.safetensors", raw[:-5]), {"name": "w"}, TableError, "truncated"),
        (write("long.safetensors", raw + b"\0"), {"name": "w"}, TableError, "trailing"),
        (
            write("junk.safetensors", b"\x10\0\0\0\0\0\0\0{not json at all"),
            {"name": "w"},
            TableError,
            "malformed header",
        ),
        (
            write("huge.safetensors", b"\xff" * 8 + b"{}"),
            {"name": "w"},
            TableError,
            "malformed header",
        ),
        (write("tiny.safetensors", b"\x01"), {"name": "w"}, TableError, "too short"),
        (tmp_path / "absent.safetensors", {"name": "w"}, TableIoError, "absent.safetensors"),
        (good, {"pattern": "w"}, InvalidArgumentError, "exactly one"),
        (good, {}, InvalidArgumentError, "exactly one of name"),
        (good, {"name": "w", "pattern": "w{}"}, InvalidArgumentError, "exactly one of name"),
        (good, {"name": "w", "prewarm_bytes": -1}, InvalidArgumentError, "prewarm_bytes"),
    ]
    for path, kwargs, cls, needle in cases:
        with pytest.raises(cls, match=needle) as info:
            MmapTable.open(path, **kwargs)
        if cls is TableError:
            assert path.name in str(info.value), str(info.value)

    i32 = tmp_path / "i32.safetensors"
    save_file({"w": torch.zeros(4, 4, dtype=torch.int32)}, str(i32))
    with pytest.raises(TableError, match="unsupported dtype I32") as e:
        MmapTable.open(i32, "w")
    assert "i32.safetensors" in str(e.value) and '"w"' in str(e.value)


def test_shard_errors(tmp_path: Path) -> None:
    def ckpt(name: str, tensors: dict[str, torch.Tensor]) -> Path:
        p = tmp_path / name
        save_file(tensors, str(p))
        return p

    b = torch.bfloat16
    cases = [
        ({"s0": _rand(2, 4, b, 0), "s2": _rand(2, 4, b, 0)}, "shard 1 of .* is missing"),
        (
            {"s0": _rand(2, 4, b, 0), "s1": _rand(2, 4, b, 0), "s01": _rand(2, 4, b, 0)},
            "duplicate shard 1",
        ),
        ({"s0": _rand(2, 4, b, 0), "s1": _rand(2, 4, torch.float16, 0)}, "is F16 but shard"),
        ({"s0": _rand(2, 4, b, 0), "s1": _rand(2, 6, b, 0)}, "has 6 columns"),
    ]
    for i, (tensors, needle) in enumerate(cases):
        with pytest.raises(TableError, match=needle) as e:
            MmapTable.open(ckpt(f"c{i}.safetensors", tensors), pattern="s{}")
        assert f"c{i}.safetensors" in str(e.value)

    # Index-level problems.
    d = tmp_path / "idx"
    d.mkdir()
    save_file({"s0": _rand(2, 4, b, 0), "s1": _rand(2, 4, b, 1)}, str(d / "a.safetensors"))
    save_file({"s1": _rand(2, 4, b, 1)}, str(d / "b.safetensors"))
    index = d / "model.safetensors.index.json"
    for weight_map, cls, needle in [
        ({"s0": "a.safetensors", "s1": "b.safetensors"}, TableError, 'duplicate tensor "s1"'),
        ({"s0": "a.safetensors", "s1": "gone.safetensors"}, TableIoError, "gone.safetensors"),
        ({"s0": "../a.safetensors"}, TableError, "inside the checkpoint"),
        ({"s0": "b.safetensors"}, TableError, "not in this file's header"),
    ]:
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(cls, match=needle):
            MmapTable.open(d, pattern="s{}")
    index.write_text("{ nope")
    with pytest.raises(TableError, match="malformed index") as e:
        MmapTable.open(d, pattern="s{}")
    assert "model.safetensors.index.json" in str(e.value)


def test_bad_ids_leave_destination_untouched(tmp_path: Path) -> None:
    t = _rand(10, 8, torch.float32, 5)
    save_file({"w": t}, str(tmp_path / "m.safetensors"))
    table = MmapTable.open(tmp_path / "m.safetensors", "w")
    for ids, pos, bad in [([0, 9, 10], 2, 10), ([-1, 0], 0, -1), ([5] * 100 + [2**40], 100, 2**40)]:
        out = np.full((len(ids), 32), 0xAB, np.uint8)
        with pytest.raises(
            RowIdError, match=f"row id {bad} out of range .* 10 rows \\(position {pos}\\)"
        ):
            table.gather_into(np.array(ids, dtype=np.int64), out)
        assert (out == 0xAB).all()
        with pytest.raises(IndexError):  # RowIdError is an IndexError
            table.gather(ids)
    dst = torch.full((2, 32), 7, dtype=torch.uint8)
    with pytest.raises(RowIdError):
        table.gather_into(torch.tensor([1, 11], dtype=torch.int32), dst)
    assert (dst == 7).all()
    with pytest.raises(RowIdError):
        table.check_ids(np.array([2**63 - 1], dtype=np.uint64) + np.uint64(1))
    table.check_ids([0, 9])


def test_bad_destinations_and_ids(tmp_path: Path) -> None:
    save_file({"w": _rand(10, 8, torch.float32, 6)}, str(tmp_path / "m.safetensors"))
    table = MmapTable.open(tmp_path / "m.safetensors", "w")
    ids = np.array([1, 2], dtype=np.int64)
    bad_outs: list[tuple[Any, str]] = [
        (np.zeros((2, 31), np.uint8), "shape"),
        (np.zeros((3, 32), np.uint8), "shape"),
        (np.zeros((2, 32), np.int8), "uint8"),
        (np.zeros((2, 64), np.uint8)[:, ::2], "C-contiguous"),
        (np.zeros(64, np.uint8), "2-D"),
        (torch.zeros((2, 32), dtype=torch.int8), "uint8"),
        (torch.zeros((32, 2), dtype=torch.uint8).t(), "contiguous"),
        ([[0] * 32] * 2, "numpy uint8 array or a torch"),
    ]
    for out, needle in bad_outs:
        with pytest.raises(InvalidArgumentError, match=needle):
            table.gather_into(ids, out)
    ro = np.zeros((2, 32), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="out"):
        table.gather_into(ids, ro)
    for bad_ids, needle in [
        (np.array([[1, 2]]), "1-D"),
        (np.array([1.0, 2.0]), "integers"),
        (np.zeros((2, 2), np.int64), "1-D"),
    ]:
        with pytest.raises(InvalidArgumentError, match=needle):
            table.gather(bad_ids)
    # ids and destination sharing memory.
    buf = np.zeros((2, 32), np.uint8)
    with pytest.raises(InvalidArgumentError):
        table.gather_into(buf.view(np.int64)[0, :2], buf)


def test_close_and_context_manager(tmp_path: Path) -> None:
    save_file({"w": _rand(4, 4, torch.float32, 7)}, str(tmp_path / "m.safetensors"))
    with MmapTable.open(tmp_path / "m.safetensors", "w") as table:
        assert "MmapTable(" in repr(table)
    assert table.closed and repr(table) == "MmapTable(closed)"
    table.close()  # idempotent
    for call in (lambda: table.rows, lambda: table.gather([0]), table.resident_bytes):
        with pytest.raises(ClosedError):
            call()


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_page_cache_controls(tmp_path: Path) -> None:
    rows = 1 << 14  # 4 MiB of BF16 rows of 256 B
    path = tmp_path / "big.safetensors"
    save_file({"w": _rand(rows, 128, torch.bfloat16, 8)}, str(path))
    _sync(path)  # only clean pages can leave the page cache
    table = MmapTable.open(path, "w")
    total = table.page_stats()["data_bytes"]
    assert total == rows * 256
    table.drop_pages()
    cold = table.resident_bytes()
    assert cold < total // 4
    assert table.prewarm(total // 2) == total // 2
    assert table.resident_bytes() >= total // 2
    assert table.prewarm() == total
    assert table.resident_bytes() >= total
    table.drop_pages()
    assert table.resident_bytes() < total // 4

    budget = 1 << 20
    capped = MmapTable.open(path, "w", rss_budget_bytes=budget, readahead=True)
    capped.drop_pages()
    first = np.arange(0, 200 * 16, 16)  # 200 distinct pages
    capped.gather(first)
    assert capped.page_stats()["touched_bytes"] == 200 * 4096
    warm = capped.resident_bytes()
    assert warm >= 200 * 4096
    rows_back = capped.gather(np.arange(200 * 16, 300 * 16, 16))  # crosses the budget
    stats = capped.page_stats()
    assert stats["budget_drops"] >= 1 and stats["last_drop_error"] is None
    # Only the excess leaves (the least used pages), not the whole table.
    assert stats["touched_bytes"] == budget
    assert stats["pages_evicted"] == 300 - budget // 4096
    assert budget - 4 * 4096 <= capped.resident_bytes() <= budget + 4 * 4096
    np.testing.assert_array_equal(rows_back, table.gather(np.arange(200 * 16, 300 * 16, 16)))

    warmed = MmapTable.open(path, "w", prewarm_bytes=total)
    assert warmed.resident_bytes() >= total


def test_exported() -> None:
    assert "MmapTable" in ple_memops.__all__
    assert ple_memops.MmapTable is MmapTable
