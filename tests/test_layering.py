"""The engine integrations stand on one step object: every module of ``ple_memops.vllm``,
``ple_memops.transformers`` and ``ple_memops.demo`` reaches the core only through its
public modules (``steps.Steps`` for every step, ``table.MmapTable``, the errors, the
settings), never through the native extension or the core's private halves, so a step's
policy (depth, timeouts, all-or-none aborts, shutdown) lives in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "ple_memops"
INTEGRATIONS = ("vllm", "transformers", "demo")
CORE_PRIVATE = {"_native", "_worker", "_deferred"}
"""The native extension and the core's private halves of ``DeferredRows`` and
``GatherWorker``: only ``steps``, ``table`` and the device check use them."""


def _core_imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """Every ``ple_memops`` module (its top-level name) that ``path`` imports, with the
    line: relative imports above the module's own package, and absolute ones."""
    tree = ast.parse(path.read_text(), filename=str(path))
    depth = len(path.relative_to(package).parts) - 1  # 1 for ple_memops/vllm/x.py
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level <= depth:
                    continue  # within the integration's own package
                base = node.module or ""
                names = [base] if base else [a.name for a in node.names]
            elif (node.module or "").startswith("ple_memops"):
                rest = (node.module or "").removeprefix("ple_memops").lstrip(".")
                names = [rest] if rest else [a.name for a in node.names]
            else:
                continue
            found += [(node.lineno, n.split(".")[0]) for n in names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ple_memops."):
                    found.append((node.lineno, alias.name.split(".")[1]))
    return found


MODULES = sorted(p for pkg in INTEGRATIONS for p in (PACKAGE / pkg).rglob("*.py"))


def test_every_integration_is_found() -> None:
    assert {p.relative_to(PACKAGE).parts[0] for p in MODULES} == set(INTEGRATIONS)
    assert len(MODULES) >= 20


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_integrations_use_only_the_cores_public_modules(module: Path) -> None:
    private = [f"line {n}: {name}" for n, name in _core_imports(module) if name in CORE_PRIVATE]
    assert not private, f"{module.relative_to(PACKAGE)} reaches into the core: {private}"


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    fake = tmp_path / "ple_memops"
    (fake / "vllm").mkdir(parents=True)
    bad = fake / "vllm" / "bad.py"
    bad.write_text(
        "from .. import _native\nfrom .._worker import GatherWorker\n"
        "from ple_memops._deferred import DeferredRows\nfrom .hooks import x\n"
    )
    assert [name for _, name in _core_imports(bad, fake)] == ["_native", "_worker", "_deferred"]


def test_the_engine_integrations_build_their_steps_with_steps() -> None:
    users = {p.parent.name for p in MODULES if "steps" in {n for _, n in _core_imports(p)}}
    assert users >= {"vllm", "transformers"}
