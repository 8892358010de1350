"""docs/README.md, the documentation's index, links every page under docs/."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_docs_index_links_every_page_and_only_pages_that_exist() -> None:
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages - linked == set(), "pages missing from docs/README.md"
    assert linked - pages == set(), "docs/README.md links pages that do not exist"
