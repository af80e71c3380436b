"""Cold tables on a real GPU: the table is evicted before every step, and the
rows a captured graph consumes must still be the table's, whether the host fills them
right after the launch (``fill_from``) or the worker gathers device-produced ids; a cold
read that fails releases the GPU (its consumer reads zeros) and raises ``TableIoError``.

No test may hang: every wait for the GPU polls an event with a bound.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpu_wait import done
from safetensors.numpy import save_file

import ple_memops as pm

pytestmark = pytest.mark.gpu

WIDTH = 160


def _write(path: Path, rows: int, seed: int = 0) -> None:
    data = np.random.default_rng(seed).integers(0, 256, (rows, WIDTH), dtype=np.uint8)
    save_file({"w": data.view(np.float16)}, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages, which the eviction can drop
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def cold_table(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("cold") / "model.safetensors"
    _write(path, 400_000)  # 64 MiB
    t = pm.MmapTable.open(path, "w")
    t.drop_pages()
    if t.resident_bytes() != 0:
        t.close()
        pytest.skip(f"pages of {path} cannot leave the page cache (tmpfs?)")
    yield t
    t.close()


def evict(table: pm.MmapTable) -> None:
    table.drop_pages()
    assert table.resident_bytes() == 0, "the table did not leave the page cache"


def test_fill_from_after_launch_from_an_evicted_table(torch, cold_table: pm.MmapTable) -> None:  # type: ignore[no-untyped-def]
    n = 256
    rows = pm.DeferredRows(n, WIDTH, device=0, watchdog=10.0)
    out = torch.zeros_like(rows.staging)
    end = torch.cuda.Event()

    def body() -> None:
        torch.cuda._sleep(200_000)  # GPU work before the consumer
        rows.enqueue(rows=n)
        out.copy_(rows.staging)

    rows.begin(n)
    rows.prepare_dummy()
    body()
    rows.complete()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    rng = np.random.default_rng(1)
    for step in range(30):
        k = int(rng.integers(1, n + 1))
        ids = rng.integers(0, cold_table.rows, k)
        evict(cold_table)
        rows.begin(n)
        g.replay()
        end.record()
        rows.fill_from(cold_table, ids, busy_wait=5.0)
        rows.complete()
        assert done(end), f"step {step} never finished"
        got = out.cpu().numpy()
        np.testing.assert_array_equal(got[:k], cold_table.gather(ids), err_msg=f"step {step}")
        assert not got[k:].any()
    rows.close()


class IdGraph:
    """Ids computed by a kernel from a device counter, published, ~GPU work, consumed."""

    def __init__(
        self, torch: Any, worker: pm.GatherWorker, n: int, total: int, fixed: Any = None
    ) -> None:
        rows = worker.rows
        self.n, self.total = n, total
        self.counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.lanes = torch.arange(n, dtype=torch.int64, device="cuda")
        self.ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        self.out = torch.zeros_like(rows.staging)
        self.end = torch.cuda.Event()
        const = None if fixed is None else torch.as_tensor(fixed, device="cuda")

        def body(work: bool) -> None:
            self.counter.add_(1)
            if const is None:
                self.ids.copy_((self.counter * 7919 + self.lanes * 104729) % total)
            else:
                self.ids.copy_(const)
            worker.publish(self.ids)
            if work:
                torch.cuda._sleep(200_000)
            rows.enqueue(rows=n)
            self.out.copy_(rows.staging)

        worker.begin(n)
        body(False)
        worker.complete(timeout=30.0)
        torch.cuda.synchronize()
        self.counter.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body(True)

    def ids_for(self, i: int) -> np.ndarray[Any, Any]:
        return (i * 7919 + np.arange(self.n, dtype=np.int64) * 104729) % self.total

    def replay(self) -> None:
        self.graph.replay()
        self.end.record()


def test_worker_gathers_cold_rows_of_device_ids(torch, cold_table: pm.MmapTable) -> None:  # type: ignore[no-untyped-def]
    n = 512
    rows = pm.DeferredRows(n, WIDTH, device=0, watchdog=10.0)
    with pm.GatherWorker(rows, cold_table) as w:
        g = IdGraph(torch, w, n, cold_table.rows)
        misses = cold_table.page_stats()["row_misses"]
        for i in range(1, 31):
            evict(cold_table)
            w.begin(n)
            g.replay()
            w.complete(timeout=30.0)
            assert done(g.end), f"replay {i} never finished"
            np.testing.assert_array_equal(
                g.out.cpu().numpy(), cold_table.gather(g.ids_for(i)), err_msg=f"replay {i}"
            )
        assert cold_table.page_stats()["row_misses"] - misses >= 30 * n  # they were cold
        assert w.stats().failures == 0


@pytest.mark.parametrize("way", ["uring", "pool"])
def test_a_failed_cold_read_releases_the_gpu(torch, tmp_path: Path, way: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "model.safetensors"
    _write(path, 8192)  # 1.25 MiB
    probe = pm.MmapTable.open(path, "w")
    if way == "uring" and probe.cold_reads != "uring":
        pytest.skip(f"io_uring is not available here: {probe.cold_reads_reason}")
    probe.close()
    table = pm.MmapTable.open(path, "w", cold_reads=way)  # type: ignore[arg-type]
    n = 16
    rows = pm.DeferredRows(n, WIDTH, device=0, watchdog=10.0)
    w = pm.GatherWorker(rows, table)
    fixed = np.arange(8192 - n, 8192, dtype=np.int64)  # rows in the half cut off below
    g = IdGraph(torch, w, n, table.rows, fixed=fixed)
    table.drop_pages()
    if table.resident_bytes() != 0:
        w.close()
        pytest.skip(f"pages of {path} cannot leave the page cache (tmpfs?)")
    os.truncate(path, os.path.getsize(path) // 2)  # stands in for a failing device
    w.begin(n)
    g.replay()
    with pytest.raises(pm.TableIoError):
        w.complete(timeout=30.0)
    assert done(g.end), "a failed read left the GPU waiting"
    assert not g.out.cpu().numpy().any()  # the consumer read zeros, not stale rows
    with pytest.raises(pm.PoisonedError):
        w.begin(n)
    w.close()
    table.close()
