"""The library apart from its harness: no module of the library imports the demo and
benchmark harness (``ple_memops.demo``), the harness imports only the library's public
API, and no benchmark imports a private name of the package. Read from the sources
(``ast``), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "ple_memops"
HARNESS = "ple_memops.demo"

# A benchmark's private import the package gives no public form of, and why.
BENCHMARK_PRIVATES = {
    # The storage and memory-latency probes exist only in the native module, for
    # bench_cold.py's floors.
    ("bench_cold.py", "ple_memops._native"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str | None) -> Iterator[tuple[str, str | None]]:
    """``(module, name)`` of every import in ``path`` (``name`` None for ``import m``),
    relative imports resolved against ``module`` (the file's own module name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert module is not None, f"{path}: a relative import outside the package"
                base = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                yield target, alias.name


def _targets(module: str, name: str | None) -> list[str]:
    """What an import may load: the module, and ``module.name`` where a name is one."""
    return [module] if name is None else [module, f"{module}.{name}"]


def _private(module: str, name: str | None) -> bool:
    return any(p.startswith("_") for p in module.split(".")) or bool(
        name and name.startswith("_") and name != "__version__"
    )


def _library_files() -> list[Path]:
    harness_dir = PACKAGE / "demo"
    return [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if harness_dir not in p.parents and p != PACKAGE / "__main__.py"
    ]


def test_the_library_never_imports_the_harness() -> None:
    files = _library_files()
    assert PACKAGE / "transformers" / "_models.py" in files
    assert PACKAGE / "vllm" / "plugin.py" in files
    bad = [
        f"{p.relative_to(ROOT)}: {target}"
        for p in files
        for module, name in _imports(p, _module_name(p))
        for target in _targets(module, name)
        if target == HARNESS or target.startswith(HARNESS + ".")
    ]
    assert not bad, bad


def test_importing_the_library_loads_no_harness() -> None:
    code = (
        "import sys, ple_memops, ple_memops.transformers, ple_memops.vllm; "
        f"print(sorted(m for m in sys.modules if m.startswith('{HARNESS}')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_harness_uses_the_public_api_only() -> None:
    files = sorted((PACKAGE / "demo").rglob("*.py"))
    assert len(files) > 5
    bad = [
        f"{p.relative_to(ROOT)}: {module}" + (f" import {name}" if name else "")
        for p in files
        for module, name in _imports(p, _module_name(p))
        if module.split(".")[0] == "ple_memops"
        and not (module == HARNESS or module.startswith(HARNESS + "."))
        and _private(module, name)
    ]
    assert not bad, bad


def test_no_benchmark_imports_a_private_name() -> None:
    files = sorted((ROOT / "benchmarks").glob("*.py"))
    assert files
    bad = [
        f"{p.name}: {module}" + (f" import {name}" if name else "")
        for p in files
        for module, name in _imports(p, None)
        if module.split(".")[0] == "ple_memops"
        and _private(module, name)
        and (p.name, module if name is None else f"{module}.{name}") not in BENCHMARK_PRIVATES
    ]
    assert not bad, bad


CPU_VLLM_FILES = ("test_vllm_real.py", "test_vllm_gemma4_real.py", "test_vllm_gemma3n_real.py")


def test_the_cpu_vllm_files_hide_no_device_where_vllm_is_absent(tmp_path: Path) -> None:
    """Those files hide CUDA from vLLM's CPU platform (``CUDA_VISIBLE_DEVICES=""``), which
    collected beside the GPU tests on a GPU host would leave them no device: where vLLM is
    absent they skip first and leave the environment alone."""
    import importlib.util
    import os

    import pytest

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: these files set up its CPU platform on purpose")
    tests = Path(__file__).resolve().parent
    code = (
        "import os, sys, pytest\n"
        f"rc = pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', "
        f"*[{str(tests)!r} + '/' + f for f in {CPU_VLLM_FILES!r}]])\n"
        "print('CVD', repr(os.environ.get('CUDA_VISIBLE_DEVICES')), 'rc', int(rc))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    got = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert "CVD None" in got.stdout, got.stdout[-2000:] + got.stderr[-2000:]
