"""Code blocks of the README and the documentation that tests run as printed.

A block is marked by an HTML comment on the line before its fence::

    <!-- snippet: NAME -->
    ```python

NAME is how a test asks for the block (the tutorial's blocks are named after the files a
reader saves them as). Every marked block must be run by a test: ``RUN`` says which, and
``tests/unit/test_docs.py`` fails on a marked block missing from it (or listed but gone).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A marker is a line of its own (so a page can mention the syntax in running text).
_MARKER = re.compile(r"^<!-- snippet: ([\w.-]+)[^>]*-->$", re.M)
_SNIPPET = re.compile(r"^<!-- snippet: ([\w.-]+)[^>]*-->\n```\w+\n(.*?)^```", re.S | re.M)

# page -> the blocks tests run, and the test that runs them
RUN = {
    "README.md": ({"producer", "consumer"}, "tests/acceptance/test_readme_snippets.py"),
    "docs/tutorial.md": (
        {"shop_db.py", "place_order.py", "shipping.py"},
        "tests/acceptance/test_doc_snippets.py",
    ),
    "docs/concepts/canonical-json.md": ({"test-vector"}, "tests/unit/test_docs.py"),
    "docs/howto/project-into-table.md": (
        {"projection.py"},
        "tests/integration/test_project_into_table_doc.py",
    ),
    "docs/howto/testing.md": (
        {"pytest.ini", "conftest.py", "test_shipping.py"},
        "tests/acceptance/test_doc_snippets.py",
    ),
    "docs/howto/type-checking.md": ({"mypy.ini", "service.py"}, "tests/acceptance/test_typing.py"),
}


def pages() -> list[Path]:
    """The README and every page of the documentation."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def markers(page: Path) -> list[str]:
    """The names of every snippet marker on ``page`` (with a block after it or not)."""
    return _MARKER.findall(page.read_text())


def snippets(page: str) -> dict[str, str]:
    """NAME -> the text of the fenced block right after ``<!-- snippet: NAME -->``."""
    return {m[1]: m[2] for m in _SNIPPET.finditer((ROOT / page).read_text())}
