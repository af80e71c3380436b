"""benchmarks/bench_shared_table.py on this machine: processes serving one table through
MmapTable share one copy of it in the page cache, where private copies add one each (the
many-servers memory property of the mmap backend, counted from outside the processes)."""

from __future__ import annotations

import json
from pathlib import Path

import bench_shared_table as bench
import pytest


def test_mmap_servers_share_one_copy_and_copies_add_one_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shared.json"
    assert bench.main(
        ["--table-gib", "0.03", "--processes", "1,3", "--repeats", "1", "--dir", str(tmp_path),
         "--json", str(out)]
    ) == 0  # fmt: skip
    got = json.loads(out.read_text())
    size = got["table_bytes"]
    runs = {(r["backend"], r["processes"]): r for r in got["runs"]}
    for n in (1, 3):
        mmap = runs["mmap", n]
        # One copy in the page cache whatever the count; each process only its gather buffer.
        assert mmap["page_cache_bytes"] >= 0.95 * size
        assert mmap["private_bytes"] <= n * (bench.CHUNK_ROWS * bench.ROW_BYTES + (2 << 20))
        copy = runs["copy", n]
        assert copy["private_bytes"] >= 0.99 * n * size
        assert copy["page_cache_bytes"] <= 0.05 * size
    assert runs["mmap", 3]["copies"] < 1.25 < 2.9 < runs["copy", 3]["copies"]
    text = capsys.readouterr().out
    assert "| mmap | 3 |" in text and "| copy | 3 |" in text


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--backends", "mmap,uva"])
    assert "unknown backend 'uva'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--processes", "0"])


def test_a_file_system_that_keeps_its_pages_is_refused(tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    path = Path("/dev/shm") / f"ple-shared-{tmp_path.name}.safetensors"
    try:
        rows = bench.write_table(path, 1 << 20)
        with pytest.raises(RuntimeError, match="stay in the page cache"):
            bench.measure(path, rows * bench.ROW_BYTES, "mmap", 1, False)
    finally:
        path.unlink(missing_ok=True)
