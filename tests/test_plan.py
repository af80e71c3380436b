"""RowsPlan on the host: all tables share one mode, eager gathers give the table's bytes,
misuse is typed. (tests/test_plan_gpu.py covers the deferred mode on a GPU.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ple_memops as pm
from ple_memops.plan import RowsPlan

torch = pytest.importorskip("torch")

ROWS = 500


@pytest.fixture
def tables(random_tables: Any) -> Iterator[dict[str, pm.MmapTable]]:
    with random_tables(ROWS, {"layer2": 32, "layer5": 64}) as out:
        yield out


def test_host_plan_gathers_the_tables_bytes(
    tables: dict[str, pm.MmapTable], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ple_memops"):
        plan = RowsPlan.build(tables, max_rows=16, device="cpu")
    assert plan.mode == "host" and not plan.deferred
    assert "no CUDA device" in (plan.reason or "")
    assert sum("host path" in r.getMessage() for r in caplog.records) == 1
    assert plan.names == ["layer2", "layer5"]
    with plan:
        rng = np.random.default_rng(1)
        for _ in range(20):
            for name, table in tables.items():
                ids = rng.integers(0, ROWS, int(rng.integers(1, 17)))
                got = plan.gather_now(name, torch.from_numpy(ids), rows=16)
                assert isinstance(got, torch.Tensor) and got.shape == (16, table.row_bytes)
                np.testing.assert_array_equal(got[: len(ids)].numpy(), table.gather(ids))
                assert not got[len(ids) :].any()
        assert plan.staging("layer5").shape == (16, 64)
        dummy = plan.dummy_now("layer2", 4)
        assert dummy.shape == (4, 32)
        # No workers on the host: the step calls are no-ops, never errors.
        plan.begin(4)
        plan.complete()
        assert plan.in_flight == 0
        with pytest.raises(pm.StateError, match="deferred path"):
            plan.stage("layer2", torch.zeros(4, dtype=torch.int64), rows=4)
        with pytest.raises(pm.StateError, match="gather_now"):
            plan.publish_host("layer2", [1, 2])
    assert plan.closed
    with pytest.raises(pm.ClosedError):
        plan.gather_now("layer2", [1])


def test_gather_many_now_gathers_every_table_at_once(tables: dict[str, pm.MmapTable]) -> None:
    """Several tables from host ids, each gathered on a thread of its own: the tables'
    bytes, padded with zeros to the extent; all or none on a bad id; never a device
    synchronisation (ids in a CUDA tensor are refused, here a CPU run can only show the
    host kinds it takes)."""
    with RowsPlan.build(tables, max_rows=16, device="cpu", log_fallback=False) as plan:
        rng = np.random.default_rng(4)
        for _ in range(10):
            ids = {name: rng.integers(0, ROWS, int(rng.integers(1, 17))) for name in tables}
            got = plan.gather_many_now(
                {"layer2": torch.from_numpy(ids["layer2"]), "layer5": list(ids["layer5"])},
                rows=16,
            )
            for name, table in tables.items():
                n = len(ids[name])
                np.testing.assert_array_equal(got[name][:n].numpy(), table.gather(ids[name]))
                assert not got[name][n:].any()
                assert got[name].data_ptr() == plan.staging(name).data_ptr()
        before = {name: plan.staging(name).clone() for name in tables}
        with pytest.raises(pm.RowIdError):
            plan.gather_many_now({"layer2": [1, 2], "layer5": [3, ROWS]})
        for name in tables:  # nothing was written to either table
            assert torch.equal(plan.staging(name), before[name])
        with pytest.raises(pm.InvalidArgumentError, match="ids for a step of 1 rows"):
            plan.gather_many_now({"layer2": [1, 2]}, rows=1)
        one = plan.gather_many_now({"layer5": [7]})  # one table: no thread
        np.testing.assert_array_equal(one["layer5"].numpy(), tables["layer5"].gather([7]))


def test_bad_ids_raise_before_anything_changes(tables: dict[str, pm.MmapTable]) -> None:
    with RowsPlan.build(tables, max_rows=8, device="cpu") as plan:
        before = plan.gather_now("layer2", [1, 2], rows=4).clone()
        with pytest.raises(pm.RowIdError):
            plan.gather_now("layer2", [3, ROWS], rows=4)
        assert torch.equal(plan.staging("layer2", 4), before)
        # The table is still usable: the failed step never began.
        np.testing.assert_array_equal(
            plan.gather_now("layer2", [4], rows=4)[:1].numpy(), tables["layer2"].gather([4])
        )
        with pytest.raises(pm.InvalidArgumentError, match="ids for a step"):
            plan.gather_now("layer2", [1, 2, 3], rows=2)
        with pytest.raises(pm.InvalidArgumentError, match="no table"):
            plan.gather_now("layer9", [1])
        # Expected ids for a table the plan does not have: refused before anything is armed.
        with pytest.raises(pm.InvalidArgumentError, match=r"not in the plan: \['layer9'\]"):
            plan.begin(4, expected={"layer9": [1]})
        assert plan.in_flight == 0 and not plan.closed


@pytest.mark.parametrize(
    "kwargs",
    [{"max_rows": 0}, {"max_rows": 4, "timeout": 0.0}, {"max_rows": 4, "device": "gpu"}],
)
def test_bad_arguments(tables: dict[str, pm.MmapTable], kwargs: dict[str, object]) -> None:
    with pytest.raises(pm.InvalidArgumentError):
        RowsPlan.build(tables, **kwargs)  # type: ignore[arg-type]


def test_names_must_be_unique_and_present(tables: dict[str, pm.MmapTable]) -> None:
    t = tables["layer2"]
    with pytest.raises(pm.InvalidArgumentError, match="unique"):
        RowsPlan.build([("a", t), ("a", t)], max_rows=4, device="cpu")
    with pytest.raises(pm.InvalidArgumentError, match="at least one"):
        RowsPlan.build({}, max_rows=4, device="cpu")
