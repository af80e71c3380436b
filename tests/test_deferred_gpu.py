"""DeferredRows on a real GPU: eager and captured WAIT/copy/reset, >= 1000 replays with a
host fill after each launch, faults that must release the GPU, several objects in one
graph, the live probe, and the synchronous fallback giving the same bytes.

No test may hang: every wait for the GPU is bounded by ``done()``.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from gpu_wait import done

import ple_memops as pm

pytestmark = pytest.mark.gpu

ROW = 160


@pytest.fixture(params=["kernel", "memop", "kernel-fused"])
def copy(request: pytest.FixtureRequest) -> str:
    """Every device-side path runs every protocol test."""
    return str(request.param)


def host_rows(k: int, seed: int, width: int = ROW) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(k, width), dtype=np.uint8)


class Captured:
    """A graph that consumes ``rows`` and copies the staging buffer into ``out``."""

    def __init__(self, torch, dr: pm.DeferredRows, extent: int) -> None:  # type: ignore[no-untyped-def]
        self.out = torch.zeros_like(dr.staging)
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Eager warm-up, pre-signalled as the protocol demands.
            dr.begin(extent)
            dr.prepare_dummy()
            dr.enqueue(rows=extent)
            self.out.copy_(dr.staging)
            dr.complete()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert dr.wait_consumed(5.0)
        with torch.cuda.graph(self.graph):
            assert dr.enqueue(rows=extent) == ("captured" if dr.deferred else "nothing")
            self.out.copy_(dr.staging)
        self.end = torch.cuda.Event()

    def replay(self) -> None:
        self.graph.replay()
        self.end.record()


def test_probe_runs_live_checks(torch) -> None:  # type: ignore[no-untyped-def]
    cap = pm.probe(0)
    names = [c.name for c in cap.checks]
    assert names[:2] == ["driver", "attributes"]
    print(cap)
    name = torch.cuda.get_device_name(0)
    if "H200" in name or "H100" in name:
        assert cap.supported, cap.reason
    if cap.supported:
        assert names == ["driver", "attributes", "live_wait", "capture_replay", "kernel_replay"]
        assert all(c.passed for c in cap.checks)
        assert cap.driver_version and cap.driver_version >= 12000
    assert pm.probe(0) == cap  # cached


def test_probe_bad_ordinal_is_a_typed_error(torch) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(pm.InvalidArgumentError):
        pm.probe(torch.cuda.device_count() + 3)


def test_eager_wait_copy_reset(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    with pm.DeferredRows(16, ROW, device=0, copy=copy) as dr:
        assert dr.mode == "deferred"
        for seed in range(5):
            k = 3 + seed
            rows = host_rows(k, seed)
            dr.begin(16)
            dr.fill(rows)
            assert dr.enqueue() == "eager"
            got = dr.staging.cpu().numpy()
            dr.complete()
            np.testing.assert_array_equal(got[:k], rows)
            assert not got[k:].any()
            assert dr.wait_consumed(5.0)
        assert dr.stats().eager_enqueues == 5


def test_eager_enqueue_before_fill_is_refused(torch) -> None:  # type: ignore[no-untyped-def]
    with pm.DeferredRows(4, ROW, device=0) as dr:
        dr.begin(4)
        with pytest.raises(pm.StateError, match="eager enqueue before fill"):
            dr.enqueue()
        dr.fill(host_rows(4, 0))
        dr.enqueue()
        dr.complete()


def test_captured_replays_with_fill_after_launch(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    dr = pm.DeferredRows(32, ROW, device=0, watchdog=10.0, copy=copy)
    assert dr.copy == copy
    g = Captured(torch, dr, 32)
    rng = np.random.default_rng(1)
    for i in range(1000):
        k = int(rng.integers(0, 33))
        rows = host_rows(k, i)
        dr.begin(32)
        g.replay()  # launched first: the graph waits on the flag
        dr.fill(rows, busy_wait=5.0)
        dr.complete()
        assert done(g.end), f"replay {i} never finished"
        got = g.out.cpu().numpy()
        np.testing.assert_array_equal(got[:k], rows, err_msg=f"replay {i}")
        assert not got[k:].any(), f"replay {i}: padding not zero"
    s = dr.stats()
    assert s.fills == 1000 and s.steps == 1001 and s.captured_enqueues == 1
    dr.close()


def test_replay_really_waits_for_the_fill(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    dr = pm.DeferredRows(8, ROW, device=0, track_arrival=True, copy=copy)
    g = Captured(torch, dr, 8)
    dr.begin(8)
    g.replay()
    time.sleep(0.05)
    assert not g.end.query(), "the graph ran past the WAIT without a fill"
    rows = host_rows(8, 5)
    dr.fill(rows)
    dr.complete()
    assert done(g.end)
    np.testing.assert_array_equal(g.out.cpu().numpy(), rows)
    assert dr.stats().gpu_waited == 1
    dr.close()


def test_abort_releases_a_pending_replay_and_the_gate_stays_open(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    dr = pm.DeferredRows(8, ROW, device=0, copy=copy)
    g = Captured(torch, dr, 8)
    # Leave stale data in the slot, then abort a pending step: the consumer gets zeros.
    dr.begin(8)
    g.replay()
    dr.fill(host_rows(8, 1))
    dr.complete()
    assert done(g.end)
    dr.begin(8)
    g.replay()
    time.sleep(0.01)
    assert not g.end.query()
    dr.abort("request cancelled")
    assert done(g.end), "abort did not release the GPU"
    assert not g.out.cpu().numpy().any()
    with pytest.raises(pm.PoisonedError, match="request cancelled"):
        dr.complete()
    # The GPU's reset cannot close a poisoned gate: later replays never wait.
    for _ in range(3):
        g.replay()
        assert done(g.end), "a replay after abort waited"


def test_watchdog_releases_a_pending_replay(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    dr = pm.DeferredRows(8, ROW, device=0, watchdog=0.2, copy=copy)
    g = Captured(torch, dr, 8)
    dr.begin(8)
    g.replay()
    t0 = time.monotonic()
    assert done(g.end, timeout=5.0), "the watchdog did not release the GPU"
    assert time.monotonic() - t0 >= 0.1
    with pytest.raises(pm.PoisonedError, match="watchdog"):
        dr.complete()
    assert dr.stats().watchdog_releases == 1


def test_step_context_releases_on_keyboard_interrupt(torch) -> None:  # type: ignore[no-untyped-def]
    dr = pm.DeferredRows(8, ROW, device=0, watchdog=None)
    g = Captured(torch, dr, 8)
    with pytest.raises(KeyboardInterrupt), dr.step(8):
        g.replay()
        raise KeyboardInterrupt
    assert done(g.end)
    assert "KeyboardInterrupt" in (dr.poison_cause or "")


def test_del_releases_a_pending_replay(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    dr = pm.DeferredRows(8, ROW, device=0, watchdog=None, copy=copy)
    g = Captured(torch, dr, 8)
    retained = pm.retained_bytes()
    dr.begin(8)
    g.replay()
    del dr
    gc.collect()
    assert done(g.end), "dropping the object did not release the GPU"
    # The graph captured the object's pinned memory: it is retained, not freed.
    assert pm.retained_bytes() > retained
    g.replay()
    assert done(g.end)


def test_interpreter_exit_releases_a_pending_replay(torch) -> None:  # type: ignore[no-untyped-def]
    script = textwrap.dedent(
        """
        import torch, ple_memops as pm
        dr = pm.DeferredRows(8, 160, device=0, watchdog=None)
        out = torch.zeros_like(dr.staging)
        dr.begin(8); dr.prepare_dummy(); dr.enqueue(); out.copy_(dr.staging); dr.complete()
        torch.cuda.synchronize(); dr.wait_consumed(5.0)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dr.enqueue(rows=8); out.copy_(dr.staging)
        dr.begin(8)
        g.replay()
        print("exiting with a pending replay", flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "exiting" in r.stdout


def test_slot_busy_until_the_gpu_consumed(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    dr = pm.DeferredRows(4, ROW, device=0, copy=copy)
    g = Captured(torch, dr, 4)
    first, second = host_rows(4, 1), host_rows(4, 2)
    dr.begin(4)
    dr.fill(first)  # pre-signalled; nothing consumed it yet
    dr.complete()
    dr.begin(4)
    snapshot = bytes(dr._core.slot_snapshot())  # type: ignore[union-attr]
    with pytest.raises(pm.SlotBusyError):
        dr.fill(second)
    with pytest.raises(pm.SlotBusyError):
        dr.prepare_dummy()
    assert bytes(dr._core.slot_snapshot()) == snapshot  # type: ignore[union-attr]
    g.replay()  # consumes `first`
    assert dr.wait_consumed(5.0)
    np.testing.assert_array_equal(g.out.cpu().numpy(), first)
    dr.fill(second)
    g.replay()
    dr.complete()
    assert done(g.end)
    np.testing.assert_array_equal(g.out.cpu().numpy(), second)
    assert dr.stats().slot_busy == 2


def test_several_objects_in_one_graph(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    widths = [160, 320, 64]
    group = pm.create_group([(16, w) for w in widths], device=0, watchdog=10.0, copy=copy)
    assert {g.mode for g in group} == {"deferred"}
    outs = [torch.zeros_like(g.staging) for g in group]
    for g in group:
        g.begin(16)
        g.prepare_dummy()
        g.enqueue()
        g.complete()
    torch.cuda.synchronize()
    for g in group:
        assert g.wait_consumed(5.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for g, o in zip(group, outs, strict=True):
            g.enqueue(rows=16)
            o.copy_(g.staging)
    with pytest.raises(pm.StateError, match="already enqueued in this capture"):
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            group[0].enqueue(rows=16)
            group[0].enqueue(rows=16)
    end = torch.cuda.Event()
    rng = np.random.default_rng(3)
    for i in range(200):
        data = [host_rows(int(rng.integers(0, 17)), 100 * i + j, w) for j, w in enumerate(widths)]
        for g in group:
            g.begin(16)
        graph.replay()
        end.record()
        for j in rng.permutation(len(group)):  # fills in any order
            group[j].fill(data[j], busy_wait=5.0)
        for g in group:
            g.complete()
        assert done(end), f"replay {i}"
        for d, o in zip(data, outs, strict=True):
            got = o.cpu().numpy()
            np.testing.assert_array_equal(got[: len(d)], d)
            assert not got[len(d) :].any()


def test_sync_fallback_is_byte_identical(torch, copy: str) -> None:  # type: ignore[no-untyped-def]
    deferred = pm.DeferredRows(16, ROW, device=0, copy=copy)
    sync = pm.DeferredRows(16, ROW, device=0, force_sync=True)
    assert sync.mode == "sync" and "requested" in (sync.fallback_reason or "")
    gd, gs = Captured(torch, deferred, 16), Captured(torch, sync, 16)
    for i in range(50):
        rows = host_rows(int(np.random.default_rng(i).integers(0, 17)), i)
        deferred.begin(16)
        gd.replay()
        deferred.fill(rows, busy_wait=5.0)
        deferred.complete()
        sync.begin(16)
        sync.fill(rows)  # the fallback fills before the launch
        gs.replay()
        sync.complete()
        assert done(gd.end) and done(gs.end)
        assert torch.equal(gd.out, gs.out), f"step {i}"


def test_main_job_on_the_gpu(torch) -> None:  # type: ignore[no-untyped-def]
    r = subprocess.run(
        [sys.executable, "-m", "ple_memops", "check", "--steps", "50"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mode=deferred" in r.stdout and "50 replays" in r.stdout


def test_auto_path_switches_to_memops_for_large_steps(torch) -> None:  # type: ignore[no-untyped-def]
    # Rows of 8 KiB: 4 rows (32 KiB) take the kernel, 64 (512 KiB) and 640 (5 MiB) the
    # copy engine (above the kernel's 64 KiB). All the same bytes.
    width = 8192
    dr = pm.DeferredRows(640, width, device=0, copy="auto", watchdog=10.0)
    assert dr._core is not None and dr._core.kernel_max_bytes == 64 * 1024
    for extent in (4, 64, 640):
        g = Captured(torch, dr, extent)
        for i in range(12):
            rows = host_rows(max(1, extent - 3 * i), 1000 * extent + i, width)
            dr.begin(extent)
            g.replay()
            dr.fill(rows, busy_wait=5.0)
            dr.complete()
            assert done(g.end)
            got = g.out.cpu().numpy()
            np.testing.assert_array_equal(got[: len(rows)], rows)
            assert not got[len(rows) : extent].any()
    dr.close()


@pytest.mark.parametrize("large", ["kernel", "kernel-fused"])
@pytest.mark.parametrize("width", [15360, 1001])
def test_grid_copy_delivers_large_steps(torch, width: int, large: str) -> None:  # type: ignore[no-untyped-def]
    # Steps above the fused kernel's 64 KiB on the kernel path: one warp waits, a grid of
    # blocks copies and the last resets the flag ("kernel-fused": the one block copies all
    # of it). Gemma E2B's 64-token step (64 rows of 15 KiB, 30 blocks) and an odd width
    # (bytes past the last 16-byte word); two objects in one graph (each counts its own
    # blocks), replayed with partial fills, then eager.
    extent = 64 if width == 15360 else 300
    a = pm.DeferredRows(extent, width, device=0, copy=large, watchdog=10.0)
    b = pm.DeferredRows(extent, width, device=0, copy=large, watchdog=10.0)
    outs = [torch.zeros_like(a.staging), torch.zeros_like(b.staging)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for dr, out in zip((a, b), outs, strict=True):
            dr.begin(extent)
            dr.prepare_dummy()
            dr.enqueue(rows=extent)
            out.copy_(dr.staging)
            dr.complete()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert a.wait_consumed(5.0) and b.wait_consumed(5.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for dr, out in zip((a, b), outs, strict=True):
            assert dr.enqueue(rows=extent) == "captured"
            out.copy_(dr.staging)
    end = torch.cuda.Event()
    rng = np.random.default_rng(width)
    for i in range(200):
        ks = [int(rng.integers(1, extent + 1)) for _ in range(2)]
        rows = [host_rows(k, 7 * i + j, width) for j, k in enumerate(ks)]
        for dr in (a, b):
            dr.begin(extent)
        graph.replay()
        end.record()
        for dr, r in zip((b, a), rows[::-1], strict=True):  # filled in the other order
            dr.fill(r, busy_wait=5.0)
        for dr in (a, b):
            dr.complete()
        assert done(end), f"replay {i} never finished"
        for out, r in zip(outs, rows, strict=True):
            got = out.cpu().numpy()
            np.testing.assert_array_equal(got[: len(r)], r, err_msg=f"replay {i}")
            assert not got[len(r) :].any(), f"replay {i}: padding not zero"
    for seed in range(3):
        rows = host_rows(extent - seed, 10_000 + seed, width)
        a.begin(extent)
        a.fill(rows, busy_wait=5.0)
        assert a.enqueue() == "eager"
        got = a.staging.cpu().numpy()
        a.complete()
        np.testing.assert_array_equal(got[: len(rows)], rows)
        assert a.wait_consumed(5.0)
    assert a.stats().fills == 203 and b.stats().fills == 200
    a.close()
    b.close()
