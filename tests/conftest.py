"""Shared fixtures, and the rule that names the test files.

The name says where a file runs: ``test_*_gpu.py`` needs a CUDA GPU (its tests carry
``@pytest.mark.gpu`` and skip, with the reason, where no CUDA device is usable);
``test_*_real.py`` needs the real vLLM package, in its own environment (``scripts/test.sh``
builds it; elsewhere the file skips); every other ``test_*.py`` runs on any CPU machine.
Modules without the ``test_`` prefix are helpers, imported through pytest's ``pythonpath``
(``pyproject.toml``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import ple_memops as pm

# The stand-in runner's checks are assertions: keep pytest's report of their values.
pytest.register_assert_rewrite("vllm_stand_in")


@pytest.fixture(scope="module")
def torch() -> Any:
    """torch with CUDA initialised (GPU tests: the module is skipped without a device)."""
    import torch

    torch.cuda.init()
    return torch


@pytest.fixture(params=["kernel", "memop"])
def publish(request: pytest.FixtureRequest) -> str:
    """Each way a worker publishes its ids on the GPU (``GatherWorker(publish=...)``)."""
    return str(request.param)


RandomTables = Callable[..., AbstractContextManager[dict[str, "pm.MmapTable"]]]


@pytest.fixture(scope="session")
def random_tables(tmp_path_factory: pytest.TempPathFactory) -> RandomTables:
    """Tables of random bytes: ``with random_tables(rows, {name: width, ...}) as tables``
    writes ``<name>.safetensors`` for each name into a fresh directory, one float16 tensor
    (``tensor=``, ``"ple.weight"`` unless given) of ``rows`` rows of ``width`` bytes, drawn
    in order from one generator seeded 0; opens each as a table and closes them when the
    block ends. A fixture of any scope yields inside the block."""
    import numpy as np
    from safetensors.numpy import save_file

    import ple_memops as pm

    @contextmanager
    def make(
        rows: int, widths: dict[str, int], *, tensor: str = "ple.weight"
    ) -> Iterator[dict[str, pm.MmapTable]]:
        directory = tmp_path_factory.mktemp("ckpt")
        rng = np.random.default_rng(0)
        tables: dict[str, pm.MmapTable] = {}
        try:
            for name, width in widths.items():
                data = rng.integers(0, 256, (rows, width), dtype=np.uint8)
                path = directory / f"{name}.safetensors"
                save_file({tensor: data.view(np.float16)}, str(path))
                tables[name] = pm.MmapTable.open(path, tensor)
            yield tables
        finally:
            for t in tables.values():
                t.close()

    return make


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(marker)


class FakeStream:
    """A stream whose queue stamps timing events at ``now`` (us) and has finished up to
    ``done``: what ``GraphClock`` reads, without a GPU. ``event()`` makes one event and
    counts it in ``made``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.done = float("inf")
        self.made = 0

    def event(self) -> FakeEvent:
        self.made += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.at = stream, None

    def record(self, stream: object = None) -> None:
        self.at = self.stream.now

    def query(self) -> bool:
        return self.at is not None and self.at <= self.stream.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) / 1e3  # ms, as CUDA's


@pytest.fixture
def fake_stream() -> FakeStream:
    """A :class:`FakeStream` for a ``GraphClock(event=fake_stream.event)``."""
    return FakeStream()
