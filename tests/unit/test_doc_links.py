"""The front page and docs/ point only at things that exist: every relative link resolves to a file
or folder of the repository (and a `#anchor` to a heading of the linked page), every repository path
they name in backticks exists, and the README stays a front page."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 150

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title"); not images
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
PATH_LIKE = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".proto", ".toml", ".json", ".cpp", ".h")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            base = slug(match.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_the_pages_exist():
    assert (ROOT / "README.md").exists()
    names = {page.name for page in PAGES}
    assert {"architecture.md", "protocol.md", "operations.md", "benchmarks.md"} <= names


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_in_backticks_exists(page):
    """`specmesh/decoding/state.py`, `configs/ray.yaml`, `tests/contract/`: a file or folder path whose
    first folder is one of the repository's must exist."""
    top_level = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    text = FENCE.sub("", page.read_text())
    missing = []
    for span in CODE_SPAN.findall(text):
        if not PATH_LIKE.match(span) or not (span.endswith(FILE_SUFFIXES) or span.endswith("/")):
            continue  # a principal (`coordinator/gateway/alice`), a dotted name, a command
        if "/" in span and span.split("/")[0] in top_level and not (ROOT / span).exists():
            missing.append(span)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


@functools.cache
def _markdown_names() -> set[str]:
    names = set()
    for _folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.endswith(".egg-info") and d != "__pycache__"]
        names.update(name for name in files if name.endswith(".md"))
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_named_is_in_the_repository(page):
    """A page cited by name (`DESIGN.md`, `engine.md`), linked or not, is a markdown file of the repository."""
    cited = set(re.findall(r"(?<![\w/.-])([A-Za-z_][\w-]*\.md)\b", page.read_text()))
    missing = sorted(cited - _markdown_names())
    assert not missing, f"{page.relative_to(ROOT)} cites pages the repository does not have: {missing}"


def test_slugs_follow_github():
    assert slug("Supervision: which layer restarts what") == "supervision-which-layer-restarts-what"
    assert slug("Security: TLS, tokens and principals") == "security-tls-tokens-and-principals"
    assert slug("The `specmesh` CLI") == "the-specmesh-cli"
