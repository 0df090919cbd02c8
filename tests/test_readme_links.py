"""Every relative link in README.md, docs/results.md and docs/usage.md names an existing file."""
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
