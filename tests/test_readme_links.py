"""Every relative link in README.md, docs/results.md and docs/usage.md names an existing file, and
every #anchor in README.md and docs/ names a heading of the page it points at."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", ["README.md", "docs/results.md", "docs/usage.md"])
def test_relative_links_exist(page):
    path = ROOT / page
    targets = [t for t in LINK.findall(path.read_text()) if "://" not in t]
    missing = [t for t in targets if not (path.parent / t).exists()]
    assert targets or page == "docs/usage.md"
    assert not missing, f"{page}: {missing}"


ANCHORED = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated heading numbered -1, -2, ...; headings inside code blocks do not count."""
    found, seen, in_code = set(), {}, False
    for line in page.read_text().split("\n"):
        in_code ^= line.startswith("```")
        heading = re.match(r"#+ (.*)", line)
        if heading and not in_code:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_anchor_names_a_heading_of_its_page():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in ANCHORED.findall(page.read_text()):
            linked = page.parent / target if target else page
            if "://" not in target and linked.suffix == ".md" and linked.exists() \
                    and anchor not in heading_anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, "\n".join(broken)
