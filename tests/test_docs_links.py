"""Every relative link in the repository's Markdown names a file that exists and, where it
names a section, a heading that file has (GitHub's anchors), so moving a section never
leaves a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    p
    for p in [*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/*.md")]
    if ".vllm-bundle" not in p.parts
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[str]:
    links = []
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            links += LINK.findall(line)
    return links


def test_slug_follows_github() -> None:
    assert _slug(" Against vLLM 0.34.0's disk offload: Qwen4Exp (H100 host)") == (
        "against-vllm-0340s-disk-offload-qwen4exp-h100-host"
    )
    assert _slug(" `Steps` and **the defaults**") == "steps-and-the-defaults"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    dead = []
    for link in _links(doc):
        if re.match(r"[a-z]+:", link):
            continue  # http:, https:, mailto:
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            dead.append(f"{link}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            dead.append(f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not dead, f"{doc.relative_to(ROOT)} has dead links:\n  " + "\n  ".join(dead)
