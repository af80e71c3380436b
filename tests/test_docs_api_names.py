"""The API the reference docs show exists: every ``rows.x``, ``table.x``, ``worker.x``,
``steps.x``, ``served.x`` and ``served.server.x`` in README.md, ARCHITECTURE.md and
docs/*.md (their Python examples and inline code) names an attribute of the class it
stands for, and no removed name is shown as current (a stale example fails here, not in
a reader's hands). The lab notes and the changelog are history and may name anything."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import ple_memops as pm
import ple_memops.steps
import ple_memops.table
from ple_memops.steps import Steps
from ple_memops.transformers._models import ServedModel
from ple_memops.transformers._serve import PleServer

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
CLASSES: dict[str, type] = {
    "rows": pm.DeferredRows,
    "table": pm.MmapTable,
    "gemma": pm.MmapTable,
    "worker": pm.GatherWorker,
    "steps": Steps,
    "served": ServedModel,
    "served.server": PleServer,
}
USE = re.compile(r"(?<![\w.])(served\.server|rows|table|gemma|worker|steps|served)\.([A-Za-z_]\w*)")
REMOVED = re.compile(
    r"\b(RowsPlan|StepDriver|PlanLike|StagedLike|Stepper|advance_workers|PlanLayer)\b"
    r"|(?<!\w)(plan|driver)\.[a-z_]+"
)
INLINE = re.compile(r"`([^`\n]+)`")
FILES = {"py", "pyi", "rs", "cu", "md", "sh", "so", "json", "toml", "txt", "png"}
"""``steps.py``, ``table.rs``: a file's name, not an attribute."""
MODULES = {"steps": ple_memops.steps, "table": ple_memops.table}
"""``table.native_table``: the package module of that name."""


def _code(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of the Python blocks' lines and of every inline code span."""
    out, fenced, lang = [], False, ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced, lang = not fenced, line[3:].strip()
            continue
        if fenced:
            if lang == "python":
                out.append((n, line.split("#", 1)[0]))
        else:
            out += [(n, span) for span in INLINE.findall(line)]
    return out


def _has(cls: type, name: str) -> bool:
    """``name`` is a class attribute (a method or property) or one its ``__init__`` (or
    another method) assigns on ``self``."""
    if hasattr(cls, name):
        return True
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=", source):
            return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_name_only_what_exists(doc: Path) -> None:
    missing, removed = [], []
    for n, text in _code(doc):
        for var, attr in USE.findall(text):
            if attr in FILES or hasattr(MODULES.get(var), attr):
                continue
            if not _has(CLASSES[var], attr):
                missing.append(f"line {n}: {var}.{attr} ({CLASSES[var].__name__} has no {attr})")
        removed += [f"line {n}: {m.group(0)}" for m in REMOVED.finditer(text)]
    assert not missing and not removed, (
        f"{doc.relative_to(ROOT)}: names that do not exist {missing}; removed names {removed}"
    )


def test_the_check_sees_a_stale_name(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "Use `steps.arm(n)` and `served.server.plan.begin(n)`.\n\n```python\n"
        "steps.no_such(1)  # steps.ignored in a comment\nrows.begin(n)\n```\n"
    )
    code = _code(doc)
    uses = [u for _, t in code for u in USE.findall(t)]
    assert ("steps", "no_such") in uses and ("steps", "ignored") not in uses
    assert ("served.server", "plan") in uses and not _has(PleServer, "plan")
    assert not _has(Steps, "no_such") and _has(Steps, "arm") and _has(pm.DeferredRows, "begin")
    assert [m.group(0) for _, t in code for m in REMOVED.finditer(t)] == ["plan.begin"]
