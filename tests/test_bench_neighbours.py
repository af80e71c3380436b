"""bench_neighbours.py's summary and table, from a bench_step.py document (no GPU)."""

from __future__ import annotations

import bench_neighbours
import pytest


def _runs(periods: list[float], waited: int = 0) -> list[dict[str, object]]:
    return [{"period_us": p, "steps": 200, "waited": waited, "host_us": []} for p in periods]


def test_summary_is_each_batch_median_excess_and_waits() -> None:
    doc = {
        "8": {
            "static": _runs([100.0, 110.0, 90.0]),
            "worker-staged": _runs([120.0, 95.0, 105.0], 3),
        },
        "64": {"static": _runs([200.0]), "worker-staged": _runs([260.0], 50)},
    }
    rows = bench_neighbours.summarise("cpu-spin", doc)
    assert [(r["batch"], r["static_us"], r["staged_us"]) for r in rows] == [
        (8, 100.0, 105.0),
        (64, 200.0, 260.0),
    ]
    assert rows[0]["excess_us"] == pytest.approx(5.0) and rows[1]["excess_us"] == 60.0
    assert (rows[0]["waited"], rows[0]["steps"]) == (9, 600)
    text = bench_neighbours.table(rows)
    assert "| cpu-spin | 64 | 200.0 | 260.0 | +60.0 | 50/200 |" in text.splitlines()


def test_unknown_neighbours_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["bench_neighbours.py", "--neighbours", "none,gremlins"])
    with pytest.raises(SystemExit) as exc:
        bench_neighbours.main()
    assert exc.value.code == 2
