"""The tables' steps in deferred mode on a GPU: host-known ids handed to each table's worker with
``publish_host`` feed a captured graph's consumers; misuse is typed and loses nothing.

No test may hang: every wait for the GPU polls an event with a bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gpu_wait import done

import ple_memops as pm
from ple_memops.steps import Steps

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

ROWS = 5000


@pytest.fixture
def tables(random_tables: Any) -> Iterator[dict[str, pm.MmapTable]]:
    with random_tables(ROWS, {"layer2": 256, "layer5": 15360}) as out:
        yield out


def test_publish_host_feeds_captured_consumers(tables: dict[str, pm.MmapTable]) -> None:
    # 8 rows of 15,360 B: layer5 takes the copy-engine path, layer2 (2 KiB) the kernel.
    n = 8
    plan = Steps.build(tables, max_rows=n, device=0, watchdog=5.0, timeout=10.0)
    assert plan.mode == "deferred", plan.reason
    outs = {name: torch.zeros_like(plan.staging(name)) for name in plan.names}
    x = torch.zeros(64, device="cuda")
    with plan:
        for name in plan.names:  # the eager warm-up of the captured code
            plan.dummy_now(name, n)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            staged = [plan.stage_host_fed(name, rows=n) for name in plan.names]
            for _ in range(256):
                x.add_(1)
            for name, st in zip(plan.names, staged, strict=True):
                st.join()
                outs[name].copy_(plan.staging(name))
        rng = np.random.default_rng(2)
        end = torch.cuda.Event()
        # Misuse before any step: typed, nothing written, the steps still usable.
        with pytest.raises(pm.StateError, match="no armed step"):
            plan.publish_host("layer2", [1])
        plan.arm(n)
        with pytest.raises(pm.RowShapeError, match="on the host"):
            plan.publish_host("layer2", torch.zeros(2, dtype=torch.int64, device="cuda"))
        for name in plan.names:  # nothing was lost: the step still takes its ids
            plan.publish_host(name, [0])
        graph.replay()
        end.record()
        plan.settle(0)
        assert done(end)
        for _ in range(40):
            ids = {name: rng.integers(0, ROWS, int(rng.integers(1, n + 1))) for name in plan.names}
            plan.arm(n)
            for name in plan.names:
                plan.publish_host(name, ids[name])
            graph.replay()
            end.record()
            plan.settle(0)
            assert done(end)
            for name, table in tables.items():
                got = outs[name].cpu().numpy()
                k = len(ids[name])
                np.testing.assert_array_equal(got[:k], table.gather(ids[name]))
                assert not got[k:].any()
        # A bad id: the step's error at settle(), every table aborted, the GPU released.
        plan.arm(n)
        plan.publish_host("layer2", [1])
        plan.publish_host("layer5", [ROWS + 3])
        graph.replay()
        end.record()
        with pytest.raises(pm.RowIdError):
            plan.settle(0)
        assert done(end)
        with pytest.raises(pm.PoisonedError):
            plan.arm(n)
    assert plan.closed


def test_eager_steps_wait_for_rows_on_the_tables_own_streams(
    tables: dict[str, pm.MmapTable],
) -> None:
    """An eager step's publish and wait for rows go on each table's own stream, never on
    one of torch's pooled streams: torch hands out 32 a device in turn, vLLM computes on
    one, and a pooled stream that turned out to be the compute stream would hold the
    forward at the wait. After twice round the pool, the staged streams are none of its,
    not the current stream and not each other's, and the rows are the table's."""
    n = 8
    pooled = {torch.cuda.Stream().cuda_stream for _ in range(64)}
    compute = torch.cuda.Stream()  # a pooled stream as the current one, as vLLM's is
    plan = Steps.build(tables, max_rows=n, device=0, watchdog=5.0, timeout=10.0)
    assert plan.mode == "deferred", plan.reason
    end = torch.cuda.Event()
    with plan, torch.cuda.stream(compute):
        ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6], dtype=torch.int64, device="cuda")
        for step in range(2):  # the second step reuses the first's streams
            plan.arm(n, True)
            staged = {name: plan.stage_eager(name, ids, rows=n) for name in plan.names}
            streams = {name: st.stream.cuda_stream for name, st in staged.items()}
            assert not pooled & set(streams.values()), streams
            assert compute.cuda_stream not in streams.values()
            assert len(set(streams.values())) == len(streams)
            got = {name: st.join().clone() for name, st in staged.items()}
            end.record()
            assert done(end), f"eager step {step} never finished"
            plan.settle(0)
            want = ids.cpu().numpy()
            for name, table in tables.items():
                np.testing.assert_array_equal(got[name].cpu().numpy(), table.gather(want))
