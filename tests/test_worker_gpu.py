"""GatherWorker on a real GPU: a captured graph computes ids with a kernel, publishes
them, and consumes the rows the native worker gathered; >= 1000 replays with changing
ids, bytes checked every replay; faults release the GPU and poison.

No test may hang: every wait for the GPU polls an event with a bound.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gpu_wait import captured_after_warmup, done, replayed
from safetensors.numpy import save_file

import ple_memops as pm

pytestmark = pytest.mark.gpu

TABLE_ROWS, WIDTH = 50_000, 160


@pytest.fixture(scope="module")
def table(random_tables: Any) -> Iterator[pm.MmapTable]:
    tensor = "embed_tokens_per_layer.weight"
    with random_tables(TABLE_ROWS, {"model": WIDTH}, tensor=tensor) as tables:
        yield tables["model"]


class IdGraph:
    """A graph that bumps a device counter, computes ``n`` ids from it with a kernel,
    publishes them, optionally sleeps on the GPU, then consumes the rows into ``out``.
    Replay ``i`` (counting from 1) uses the ids :meth:`ids_for` predicts."""

    def __init__(
        self,
        torch,
        worker: pm.GatherWorker,
        n: int,
        *,
        modulo: int = TABLE_ROWS,  # type: ignore[no-untyped-def]
        sleep_cycles: int = 0,
        poison_at: int | None = None,
        dtype: str = "int64",
        pre_sleep_cycles: int = 0,
    ) -> None:
        self.torch, self.n, self.modulo, self.poison_at = torch, n, modulo, poison_at
        rows = worker.rows
        tdt = torch.int64 if dtype == "int64" else torch.int32
        self.counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.lanes = torch.arange(n, dtype=torch.int64, device="cuda")
        self.ids = torch.zeros(n, dtype=tdt, device="cuda")
        self.out = torch.zeros_like(rows.staging)
        self.end = torch.cuda.Event()

        def body(warm: bool = False) -> None:
            if pre_sleep_cycles and not warm:
                torch.cuda._sleep(pre_sleep_cycles)  # GPU work before the ids exist
            self.counter.add_(1)
            v = (self.counter * 7919 + self.lanes * 104729) % modulo
            if poison_at is not None:
                v = torch.where((self.counter == poison_at) & (self.lanes == 0), TABLE_ROWS + 5, v)
            self.ids.copy_(v.to(tdt))
            worker.publish(self.ids)
            if sleep_cycles and not warm:
                torch.cuda._sleep(sleep_cycles)
            rows.enqueue(rows=n)
            self.out.copy_(rows.staging)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Eager warm-up through the worker itself: publish, enqueue before the fill (the
            # worker fills it; no host-thread sync can block it), complete.
            worker.begin(n)
            body(warm=True)
            worker.complete(timeout=10.0)
        torch.cuda.synchronize()
        self.counter.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body()

    def ids_for(self, i: int) -> np.ndarray:
        v = (i * 7919 + np.arange(self.n, dtype=np.int64) * 104729) % self.modulo
        if self.poison_at == i:
            v[0] = TABLE_ROWS + 5
        return v

    def replay(self) -> None:
        self.graph.replay()
        self.end.record()


def test_captured_ids_1000_replays(torch, table: pm.MmapTable, publish: str) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(64, WIDTH, device=0, watchdog=10.0, track_arrival=True)
    with pm.GatherWorker(rows, table, publish=publish) as w:
        g = IdGraph(torch, w, 48)
        for i in range(1, 1001):
            w.begin(64)
            g.replay()
            w.complete(timeout=10.0)
            assert done(g.end), f"replay {i} never finished"
            got = g.out.cpu().numpy()
            np.testing.assert_array_equal(
                got[:48], table.gather(g.ids_for(i)), err_msg=f"replay {i}"
            )
            assert not got[48:].any()
        s = w.stats()
        assert s.fills == 1001 and s.failures == 0 and s.publishes_captured == 1
        assert s.ready_to_filled_ns_last > 0
        assert rows.stats().fills == 1001


def test_own_threads_kept_awake_between_replays(  # type: ignore[no-untyped-def]
    torch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A table with gather threads of its own, its fills on them (48 rows from 16 up):
    every replay after the first fill keeps them awake while the GPU works towards READY
    (``warmed_steps``), and every replay's rows are the table's."""
    data = np.random.default_rng(5).integers(0, 256, (TABLE_ROWS, WIDTH), dtype=np.uint8)
    path = tmp_path_factory.mktemp("own") / "model.safetensors"
    save_file({"w": data.view(np.float16)}, str(path))
    rows = pm.DeferredRows(64, WIDTH, device=0, watchdog=10.0)
    with pm.MmapTable.open(path, "w", gather_threads=4, parallel_min_bytes=16 * WIDTH) as t:
        assert t.gather_threads == 4
        with pm.GatherWorker(rows, t) as w:
            # ~0.3 ms of GPU work before each replay's ids: the worker (and the warm jobs)
            # wait for READY.
            g = IdGraph(torch, w, 48, pre_sleep_cycles=500_000)
            for i in range(1, 301):
                w.begin(64)
                g.replay()
                w.complete(timeout=10.0)
                assert done(g.end), f"replay {i} never finished"
                got = g.out.cpu().numpy()
                np.testing.assert_array_equal(got[:48], data[g.ids_for(i)], err_msg=f"replay {i}")
            s = w.stats()
            # The warm-up step had no fill before it; every replay came after one on the pool.
            assert (s.fills, s.failures, s.warmed_steps) == (301, 0, 300), s


def test_int32_ids_with_per_head_vocabularies(torch, table: pm.MmapTable) -> None:  # type: ignore[no-untyped-def]
    heads = 4
    offsets, sizes = [0, 1000, 20_000, 40_000], [1000, 19_000, 20_000, 10_000]
    rows = pm.DeferredRows(64, WIDTH, device=0)
    with pm.GatherWorker(rows, table, heads=(offsets, sizes), id_dtype="int32") as w:
        g = IdGraph(torch, w, 16 * heads, modulo=1000, dtype="int32")
        for i in range(1, 101):
            w.begin(64)
            g.replay()
            w.complete(timeout=10.0)
            assert done(g.end)
            ids = g.ids_for(i)
            mapped = ids + np.tile(offsets, 16)
            np.testing.assert_array_equal(g.out.cpu().numpy(), table.gather(mapped))


def test_bad_id_from_the_gpu_releases_and_poisons(torch, table: pm.MmapTable, publish: str) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(16, WIDTH, device=0, watchdog=10.0)
    w = pm.GatherWorker(rows, table, publish=publish)
    g = IdGraph(torch, w, 16, poison_at=3)
    for _ in (1, 2):
        w.begin(16)
        g.replay()
        w.complete()
        assert done(g.end)
    w.begin(16)
    g.replay()
    with pytest.raises(pm.RowIdError, match=str(TABLE_ROWS + 5)):
        w.complete()
    assert done(g.end), "a bad id left the GPU waiting"
    assert not g.out.cpu().numpy().any()  # the consumer read zeros, not stale rows
    with pytest.raises(pm.PoisonedError):
        w.begin(16)
    for _ in range(2):  # the gate stays open
        g.replay()
        assert done(g.end)
    w.close()


def test_abort_mid_step_releases(torch, table: pm.MmapTable) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(16, WIDTH, device=0, watchdog=None)
    w = pm.GatherWorker(rows, table)
    g = IdGraph(torch, w, 16, pre_sleep_cycles=100_000_000)  # GPU busy before the publish
    w.begin(16)
    g.replay()
    rows.abort("scheduler cancelled the step")
    assert done(g.end), "abort did not release the GPU"
    with pytest.raises(pm.PoisonedError, match="cancelled"):
        w.complete()
    w.close()


def test_a_table_truncated_under_a_waiting_graph_releases_and_raises(  # type: ignore[no-untyped-def]
    torch, tmp_path, publish: str
) -> None:
    """The table's file is cut to 16 KiB while a replayed graph waits for rows the worker
    must gather from it (their pages resident after earlier replays). The worker's copy
    hits SIGBUS on the mapping: the process lives, the GPU is released (the consumer reads
    zeros), the next call raises TableIoError naming the file and offset, and the device
    stays usable."""
    import os

    data = np.random.default_rng(17).integers(0, 256, (TABLE_ROWS, WIDTH), dtype=np.uint8)
    path = tmp_path / "model.safetensors"
    save_file({"embed_tokens_per_layer.weight": data.view(np.float16)}, str(path))
    t = pm.MmapTable.open(path, "embed_tokens_per_layer.weight")
    rows = pm.DeferredRows(16, WIDTH, device=0, watchdog=10.0)
    w = pm.GatherWorker(rows, t, publish=publish)
    g = IdGraph(torch, w, 16, pre_sleep_cycles=200_000_000)  # GPU busy before the publish
    for i in (1, 2):  # warm: the rows' pages are resident and known to the table
        w.begin(16)
        g.replay()
        w.complete(timeout=10.0)
        assert done(g.end), f"replay {i} never finished"
        np.testing.assert_array_equal(g.out.cpu().numpy(), data[g.ids_for(i)])
    w.begin(16)
    g.replay()  # the graph now sleeps, then publishes and waits for the fill
    os.truncate(path, 16 << 10)
    with pytest.raises(pm.TableIoError, match="offset") as e:
        w.complete(timeout=10.0)
    assert str(path) in str(e.value)
    assert done(g.end), "the truncated table left the GPU waiting"
    assert not g.out.cpu().numpy().any()  # the consumer read zeros, not stale rows
    assert rows.phase == "poisoned"
    with pytest.raises(pm.PoisonedError):
        w.begin(16)
    w.close()
    # The device is fine, and so are the rows still inside the file (row 1 is at offset
    # < 16 KiB), gathered onto it through new rows from the same table.
    rows2 = pm.DeferredRows(16, WIDTH, device=0, watchdog=10.0)
    rows2.begin(1)
    rows2.fill_from(t, [1])
    rows2.enqueue()
    out = rows2.staging[:1].clone()
    end = torch.cuda.Event()
    end.record()
    rows2.complete()
    assert done(end), "the GPU is not usable after the truncated table"
    np.testing.assert_array_equal(out.cpu().numpy(), data[[1]])
    with pytest.raises(pm.TableIoError):
        t.gather(g.ids_for(3))  # the lost rows stay lost
    rows2.close()
    t.close()


def test_the_watchdog_does_not_count_gpu_work_before_the_step(torch, table: pm.MmapTable) -> None:  # type: ignore[no-untyped-def]
    """A worker's step is watched from when its ids arrive (the GPU reached the step): GPU
    work before the publish (about 0.2 s here, four times the watchdog) releases nothing,
    and the rows are right. (A step whose GPU waits too long is released: the host-filled
    replays of test_deferred_gpu.py.)"""
    rows = pm.DeferredRows(16, WIDTH, device=0, watchdog=0.05)
    w = pm.GatherWorker(rows, table)
    g = IdGraph(torch, w, 16, pre_sleep_cycles=400_000_000)  # GPU busy before the publish
    w.begin(16)
    g.replay()
    w.complete(timeout=5.0)
    assert done(g.end)
    assert rows.stats().watchdog_releases == 0 and rows.poison_cause is None
    np.testing.assert_array_equal(g.out.cpu().numpy()[:16], table.gather(g.ids_for(1)))
    w.close()


def test_closing_the_worker_releases_a_pending_step(torch, table: pm.MmapTable) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(16, WIDTH, device=0, watchdog=None)
    w = pm.GatherWorker(rows, table)
    g = IdGraph(torch, w, 16, pre_sleep_cycles=100_000_000)
    w.begin(16)
    g.replay()
    del w  # the last reference: the native worker's drop must release the step
    gc.collect()
    assert done(g.end), "dropping the worker did not release the GPU"


def test_device_count_limits_the_rows(torch, table: pm.MmapTable, publish: str) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(32, WIDTH, device=0, watchdog=10.0)
    with pm.GatherWorker(rows, table, publish=publish) as w:
        ids = torch.arange(100, 132, dtype=torch.int64, device="cuda")
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        out = torch.zeros_like(rows.staging)
        graph = torch.cuda.CUDAGraph()
        # eager warm-up, then capture
        count.fill_(32)
        w.begin(32)
        w.publish(ids, count)
        rows.enqueue(rows=32)
        out.copy_(rows.staging)
        w.complete(timeout=10.0)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            w.publish(ids, count)
            rows.enqueue(rows=32)
            out.copy_(rows.staging)
        end = torch.cuda.Event()
        for k in (5, 32, 1, 17):
            count.fill_(k)  # a device-side count, as a model's real token count would be
            w.begin(32)
            graph.replay()
            end.record()
            w.complete(timeout=10.0)
            assert done(end)
            got = out.cpu().numpy()
            np.testing.assert_array_equal(got[:k], table.gather(np.arange(100, 100 + k)))
            assert not got[k:].any()


def test_fill_from_after_launch(torch, table: pm.MmapTable) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(16, WIDTH, device=0)
    out = torch.zeros_like(rows.staging)
    rows.begin(16)
    rows.prepare_dummy()
    rows.enqueue()
    rows.complete()
    torch.cuda.synchronize()
    assert rows.wait_consumed(5.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows.enqueue(rows=16)
        out.copy_(rows.staging)
    end = torch.cuda.Event()
    rng = np.random.default_rng(5)
    for _ in range(50):
        ids = rng.integers(0, TABLE_ROWS, int(rng.integers(1, 17)))
        rows.begin(16)
        graph.replay()
        end.record()
        rows.fill_from(table, ids, busy_wait=5.0)
        rows.complete()
        assert done(end)
        got = out.cpu().numpy()
        np.testing.assert_array_equal(got[: len(ids)], table.gather(ids))
        assert not got[len(ids) :].any()


def test_sync_fallback_refuses_a_worker(torch, table: pm.MmapTable) -> None:  # type: ignore[no-untyped-def]
    rows = pm.DeferredRows(16, WIDTH, device=0, force_sync=True)
    with pytest.raises(pm.UnsupportedError, match="deferred protocol"):
        pm.GatherWorker(rows, table)


@pytest.mark.parametrize("copy", ["kernel", "memop"])
@pytest.mark.parametrize("when", ["before", "thread"])
def test_host_ids_behind_thousands_of_kernels(  # type: ignore[no-untyped-def]
    torch, table: pm.MmapTable, copy: str, when: str
) -> None:
    """Host-known ids through the worker for a consumer with 8192 kernels behind its wait:
    the launch of such a graph with a copy-engine consumer does not return before the
    wait was passed (a fill on the launching thread after it stalls until the watchdog;
    benchmarks/diagnose_hf.py shows it). Published before the launch, or from another
    thread after it, every step's rows arrive and no watchdog fires."""
    import threading

    n, kernels = 8, 8192
    rows = pm.DeferredRows(n, WIDTH, device=0, copy=copy, watchdog=5.0)
    worker = pm.GatherWorker(rows, table)
    out = torch.zeros_like(rows.staging)
    x = torch.zeros(256, device="cuda")
    try:
        rows.begin(n)  # the eager warm-up of the captured code, pre-filled
        rows.prepare_dummy()
        rows.stage(rows=n).join()
        rows.complete()
        torch.cuda.synchronize()
        assert rows.wait_consumed(5.0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            staged = rows.stage(rows=n)  # the wait and copy only: the host publishes
            staged.join()
            out.copy_(rows.staging)
            for _ in range(kernels):
                x.add_(1)
        end = torch.cuda.Event()
        rng = np.random.default_rng(11)
        for _ in range(6):
            ids = rng.integers(0, TABLE_ROWS, int(rng.integers(1, n + 1)))
            worker.begin(n)
            if when == "before":
                worker.publish_from_host(ids)
                graph.replay()
            else:
                t = threading.Thread(target=worker.publish_from_host, args=(ids,), daemon=True)
                t.start()
                graph.replay()
                t.join(10.0)
                assert not t.is_alive()
            end.record()
            worker.complete(timeout=10.0)
            assert done(end, 20.0)
            got = out.cpu().numpy()
            np.testing.assert_array_equal(got[: len(ids)], table.gather(ids))
            assert not got[len(ids) :].any()
        assert rows.phase != "poisoned", rows.poison_cause
        assert rows.stats().watchdog_releases == 0
        assert worker.stats().publishes_host == 6
    finally:
        worker.close()
        rows.close()
        torch.cuda.synchronize()


_PUBLISH_UNDER_CAPTURE = """
import sys, time
import numpy as np
import torch
from safetensors.numpy import save_file
import ple_memops as pm

path, publish, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = np.zeros((1024, 160), dtype=np.uint8)
save_file({"t.weight": data.view(np.float16)}, path)
table = pm.MmapTable.open(path, "t.weight")
rows = pm.DeferredRows(64, 160, device=0, watchdog=10.0)
worker = pm.GatherWorker(rows, table, publish=publish)
ids = torch.zeros(16, dtype=torch.int64, device="cuda")
side = torch.cuda.Stream()
t0 = time.monotonic()
for i in range(count):
    if i % 256 == 0:
        time.sleep(0.003)  # past the worker's hot window: idle, checking every 1 ms
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        worker.publish(ids)
    del graph
print(f"published {count} times under capture in {time.monotonic() - t0:.1f} s", flush=True)
worker.close()
rows.close()
"""


@pytest.mark.parametrize("publish", ["kernel", "memop"])
def test_publishes_under_capture_never_deadlock_an_idle_worker(  # type: ignore[no-untyped-def]
    torch, tmp_path, publish: str
) -> None:
    """An engine's captures publish while the worker has nothing armed and checks its
    mailbox under its control lock every millisecond. A publish that held the mailbox's
    lock while taking the control lock deadlocked with it, with the GIL held: the vLLM
    engine froze at its first FULL capture on an H200. Thousands of captured publishes
    against an idle worker, in a subprocess bounded by a timeout."""
    import subprocess
    import sys

    count = 6000
    try:
        done_ = subprocess.run(
            [sys.executable, "-c", _PUBLISH_UNDER_CAPTURE, str(tmp_path / "t.safetensors"),
             publish, str(count)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"deadlocked: {count} publishes under capture did not finish in 120 s: {exc}")
    assert done_.returncode == 0, done_.stderr[-3000:]
    assert f"published {count} times under capture" in done_.stdout
    print(done_.stdout.strip())


@pytest.mark.parametrize("copy", ["kernel", "memop"])
def test_stage_on_a_side_branch_joined_at_the_consumer(  # type: ignore[no-untyped-def]
    torch, table: pm.MmapTable, copy: str
) -> None:
    # stage() under capture: the publish and the wait/copy on a side branch joined at the
    # consumer, GPU work between them; the right rows in 200 replays.
    n = 48
    rows = pm.DeferredRows(64, WIDTH, device=0, copy=copy, watchdog=10.0)
    with pm.GatherWorker(rows, table) as w:
        counter = torch.zeros(1, dtype=torch.int64, device="cuda")
        lanes = torch.arange(n, dtype=torch.int64, device="cuda")
        ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        out = torch.zeros_like(rows.staging)

        def body() -> None:
            counter.add_(1)
            ids.copy_((counter * 7919 + lanes * 104729) % TABLE_ROWS)
            staged = w.stage(ids, rows=n)
            torch.cuda._sleep(20_000)  # the model's layers before the consumer
            out[:n].copy_(staged.join())

        # Eagerly first (issued inline, filled by the worker), then captured.
        arm, settle = (lambda: w.begin(n)), (lambda: w.complete(timeout=10.0))
        graph = captured_after_warmup(torch, body, arm, settle, reset=counter.zero_)
        for i in replayed(graph, 200, arm, settle, torch.cuda.Event()):
            want = table.gather((i * 7919 + np.arange(n, dtype=np.int64) * 104729) % TABLE_ROWS)
            np.testing.assert_array_equal(out[:n].cpu().numpy(), want, err_msg=f"replay {i}")
        s = w.stats()
        assert s.fills == 201 and s.failures == 0 and s.publishes_captured == 1


def test_expected_ids_wait_for_the_slot_and_the_published_ids_win(  # type: ignore[no-untyped-def]
    torch, table: pm.MmapTable
) -> None:
    """Two graphs share one worker, each busy on the GPU before its ids exist; the host
    arms the second one's step with the ids it expects (two unknown, one wrong) while the
    first's rows are not yet consumed. The worker's early gather must wait for the first
    step's copy (each graph reads its own rows) and the published ids decide every row."""
    n = 48
    rows = pm.DeferredRows(64, WIDTH, device=0, watchdog=10.0)
    with pm.GatherWorker(rows, table) as w:
        first = IdGraph(torch, w, n, pre_sleep_cycles=2_000_000)
        second = IdGraph(torch, w, n, modulo=TABLE_ROWS - 17, pre_sleep_cycles=2_000_000)
        rounds = 40
        for i in range(1, rounds + 1):
            expected = second.ids_for(i).copy()
            expected[[3, 4]] = -1
            expected[7] = (expected[7] + 1) % TABLE_ROWS
            w.begin(64)
            first.replay()
            w.begin(64, eager=i % 2 == 0, expected=expected)
            second.replay()
            w.complete(timeout=10.0)
            w.complete(timeout=10.0)
            assert done(second.end), f"round {i} never finished"
            for g in (first, second):
                got = g.out.cpu().numpy()
                np.testing.assert_array_equal(got[:n], table.gather(g.ids_for(i)), err_msg=f"{i}")
                assert not got[n:].any()
        s = w.stats()
        assert s.failures == 0 and s.expected_steps == rounds
        assert (s.expected_rows_early, s.expected_rows_late, s.expected_rows_wrong) == (
            rounds * (n - 2),
            rounds * 2,
            rounds,
        )
        assert rows.stats().watchdog_releases == 0
    rows.close()
