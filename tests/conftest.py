"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip, with the reason, where
no CUDA device is usable."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def torch() -> Any:
    """torch with CUDA initialised (GPU tests: the module is skipped without a device)."""
    import torch

    torch.cuda.init()
    return torch


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
