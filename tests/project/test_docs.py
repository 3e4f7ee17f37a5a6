"""The README is the front page and the rest lives in the MkDocs site under docs/: the README stays
short, mkdocs.yml's nav and the pages agree, and every relative link or image in the README and the
pages points at a file (and heading) that exists. Fast: the site itself is built by `make docs`
(strict), which `make test` runs."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MAX_README_LINES = 300
#: A Markdown link or image: ``[text](target)`` or ``![alt](target "title")``.
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def without_code(text: str) -> str:
    """The text without fenced blocks and inline code spans (their brackets are not links)."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`]*`", "", text)


def links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file (``http``, ``mailto`` and the like left out)."""
    found = LINK.findall(without_code(path.read_text()))
    return [target for target in found if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I)]


def slug(heading: str) -> str:
    """A heading's anchor as Python-Markdown's ``toc`` (MkDocs) and GitHub make it for these pages."""
    text = re.sub(r"[`*]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```[^\n]*$", "", path.read_text(), flags=re.M | re.S)
    return {slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)}


def nav_pages(nav: list) -> list[str]:
    """Every page file named in an mkdocs ``nav`` (entries may nest)."""
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            pages += nav_pages(value)
        elif not re.match(r"[a-z]+://", value):
            pages.append(value)
    return pages


def test_readme_is_a_short_front_page():
    count = len((ROOT / "README.md").read_text().splitlines())
    assert count <= MAX_README_LINES, f"README.md has {count} lines; at most {MAX_README_LINES}: move text to docs/"


def test_nav_lists_every_page_and_only_pages_that_exist():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), f"a page is listed twice in mkdocs.yml's nav: {listed}"
    missing = [page for page in listed if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml's nav lists pages that do not exist under docs/: {missing}"
    unlisted = sorted(page.name for page in PAGES if page.name not in listed)
    assert not unlisted, f"pages under docs/ missing from mkdocs.yml's nav: {unlisted}"


@pytest.mark.parametrize("path", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files_and_headings(path):
    targets = links(path)
    broken = []
    for target in targets:
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


def test_link_finder_sees_links_and_images():
    """The check above is not vacuous: the README links to the pages and shows a figure."""
    found = links(ROOT / "README.md")
    assert "docs/api.md" in found and any(t.startswith("docs/figures/") for t in found)
    assert "https://github.com/horovod/horovod" not in found
