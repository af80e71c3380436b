"""Apply (or revert, or check) ple-memops's patch to an installed vLLM.

The patch is a unified diff against the released files of one vLLM version. It is applied
strictly: every hunk must find its exact context at its recorded line, in every file, or
nothing is written. A file that already carries the patch is left alone, so applying
twice changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PleMemopsError

__all__ = [
    "PATCH",
    "VLLM_VERSION",
    "WHY",
    "FileState",
    "PatchError",
    "apply",
    "file_states",
    "locate_vllm",
    "parse",
]

VLLM_VERSION = "0.33.0"
PATCH = Path(__file__).with_name("patches") / f"vllm-{VLLM_VERSION}.patch"

WHY = {
    "vllm/config/engram.py": (
        "EngramConfig.table_backend ('default' | 'mmap') and the PLE_MEMOPS_TABLE_BACKEND "
        "switch; refuses configurations the mmap backend does not support"
    ),
    "vllm/models/qwen4_exp/nvidia/ngram_embedding.py": (
        "the mmap table class (the table is never allocated), no vocabulary reduce-scatter "
        "for it, and its row shards skipped at load"
    ),
    "vllm/models/qwen4_exp/nvidia/model.py": (
        "stages every PLE layer's rows at the top of the forward; files holding only PLE "
        "rows are not read at load"
    ),
    "vllm/v1/worker/gpu/cudagraph_utils.py": (
        "warm-up and capture scopes per descriptor, the set of FULL graphs that wait for "
        "rows, pending steps completed before graphs are released"
    ),
    "vllm/v1/worker/gpu/model_runner.py": (
        "the rows plan built in load_model, FULL replays armed, eager/dummy steps scoped, "
        "pending steps completed before capture and at shutdown"
    ),
}


class PatchError(PleMemopsError):
    """The installed vLLM is not the version the patch is for, or its files differ from
    what the patch expects; nothing was written."""


@dataclass
class Hunk:
    old_start: int
    new_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    path: str
    hunks: list[Hunk] = field(default_factory=list)
    added: int = 0
    removed: int = 0


def parse(text: str) -> list[FilePatch]:
    """Parse a unified diff (``--- a/x`` / ``+++ b/x`` / ``@@ -l,n +l,n @@``)."""
    files: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"patch line {i + 1}: '---' without '+++'")
        path = lines[i + 1][4:].strip().split("\t")[0]
        if path.startswith("b/"):
            path = path[2:]
        fp = FilePatch(path)
        files.append(fp)
        i += 2
        while i < len(lines) and lines[i].startswith("@@ "):
            head = lines[i].split()
            try:
                old_start, old_len = _range(head[1][1:])
                new_start, new_len = _range(head[2][1:])
            except (IndexError, ValueError) as exc:
                raise PatchError(f"patch line {i + 1}: bad hunk header {lines[i]!r}") from exc
            hunk = Hunk(old_start, new_start)
            i += 1
            while len(hunk.old) < old_len or len(hunk.new) < new_len:
                if i >= len(lines):
                    raise PatchError(f"{path}: hunk at line {old_start} is truncated")
                tag, body = lines[i][:1], lines[i][1:]
                if tag == " ":
                    hunk.old.append(body)
                    hunk.new.append(body)
                elif tag == "-":
                    hunk.old.append(body)
                    fp.removed += 1
                elif tag == "+":
                    hunk.new.append(body)
                    fp.added += 1
                else:
                    raise PatchError(f"patch line {i + 1}: unexpected {lines[i]!r}")
                i += 1
            fp.hunks.append(hunk)
    if not files:
        raise PatchError("the patch holds no file")
    return files


def _range(text: str) -> tuple[int, int]:
    start, _, length = text.partition(",")
    return int(start), int(length) if length else 1


def _apply(lines: list[str], hunks: list[Hunk], reverse: bool) -> list[str] | int:
    """The patched lines, or the index of the first hunk that does not match."""
    out: list[str] = []
    pos = 0
    for index, h in enumerate(hunks):
        start, src, dst = (h.new_start, h.new, h.old) if reverse else (h.old_start, h.old, h.new)
        at = start - 1 if src else start
        if at < pos or lines[at : at + len(src)] != src:
            return index
        out += lines[pos:at] + dst
        pos = at + len(src)
    return out + lines[pos:]


@dataclass(frozen=True)
class FileState:
    path: str
    state: str
    """``"unpatched"``, ``"patched"`` or ``"differs"``."""
    detail: str
    result: tuple[str, ...] | None = None
    """The file's content after the requested operation (``None`` for ``"differs"``)."""
    delta: tuple[int, int] = (0, 0)
    """Lines added and removed by the patch."""


def locate_vllm(site: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """The directory holding the ``vllm`` package and vLLM's installed version; ``site``
    names a site-packages directory instead of the importable vLLM (found without
    importing it)."""
    if site is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            raise PatchError("vLLM is not installed in this environment (pip install vllm==0.33.0)")
        root = Path(spec.origin).resolve().parent.parent
        version = importlib.metadata.version("vllm")
    else:
        root = Path(site)
        dists = list(importlib.metadata.distributions(name="vllm", path=[str(root)]))
        if not dists or not (root / "vllm").is_dir():
            raise PatchError(f"{root}: no installed vllm package there")
        version = dists[0].version
    if version != VLLM_VERSION:
        raise PatchError(
            f"ple-memops's patch is for vllm {VLLM_VERSION}; the installed vllm is {version} "
            f"({root / 'vllm'})"
        )
    return root, version


def file_states(root: Path, patch: list[FilePatch], *, revert: bool = False) -> list[FileState]:
    """What applying (or reverting) ``patch`` under ``root`` would do to each file."""
    states = []
    for fp in patch:
        path = root / fp.path
        added, removed = fp.added, fp.removed
        if not path.is_file():
            states.append(FileState(fp.path, "differs", "missing"))
            continue
        with open(path, encoding="utf-8", newline="") as f:
            lines = f.read().splitlines(keepends=True)
        forward = _apply(lines, fp.hunks, reverse=False)
        backward = _apply(lines, fp.hunks, reverse=True)
        if isinstance(forward, list):
            result = None if revert else tuple(forward)
            states.append(FileState(fp.path, "unpatched", "", result, (added, removed)))
        elif isinstance(backward, list):
            result = tuple(backward) if revert else None
            states.append(FileState(fp.path, "patched", "", result, (added, removed)))
        else:
            states.append(FileState(fp.path, "differs", _mismatch(lines, fp.hunks[forward])))
    return states


def _mismatch(lines: list[str], hunk: Hunk) -> str:
    at = hunk.old_start - 1
    for k, want in enumerate(hunk.old):
        have = lines[at + k] if at + k < len(lines) else "<end of file>"
        if have != want:
            return f"line {at + k + 1} is {have.rstrip()!r}, the patch expects {want.rstrip()!r}"
    return f"hunk at line {hunk.old_start} overlaps the previous one"  # pragma: no cover


def _write(path: Path, lines: tuple[str, ...]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write("".join(lines))
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def apply(
    *,
    site: str | os.PathLike[str] | None = None,
    check: bool = False,
    revert: bool = False,
    patch_file: str | os.PathLike[str] = PATCH,
) -> tuple[Path, list[FileState], bool]:
    """Apply (or with ``revert`` undo) the patch to the vLLM found via importlib (or in
    ``site``). With ``check`` nothing is written. Returns the vLLM root, each file's state
    *before* the call, and whether files were (or, with ``check``, would be) changed.
    Raises :class:`PatchError` before writing anything when a file differs."""
    root, _ = locate_vllm(site)
    patch = parse(Path(patch_file).read_text(encoding="utf-8"))
    states = file_states(root, patch, revert=revert)
    bad = [s for s in states if s.state == "differs"]
    if bad:
        raise PatchError(
            f"vllm {VLLM_VERSION} at {root / 'vllm'} differs from what the patch expects "
            "(modified by hand, or by another patch); nothing was written: "
            + "; ".join(f"{s.path}: {s.detail}" for s in bad)
        )
    todo = [s for s in states if s.result is not None]
    if not check:
        for s in todo:
            assert s.result is not None
            _write(root / s.path, s.result)
    return root, states, bool(todo)
