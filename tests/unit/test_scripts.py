"""The test scripts CI runs name test files that exist.

pytest exits 4 ("file or directory not found") for one missing path, which fails CI only
after the ~45-minute main suite: a renamed test module must be caught here, in a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("scripts/test", "scripts/test-lowest", "scripts/test-pg18", ".ci/run")
TEST_PATH = re.compile(r"\btests/[\w/]+\.py\b")


def named_paths(text: str) -> list[str]:
    return sorted(set(TEST_PATH.findall(text)))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_test_file_a_script_names_exists(script: str) -> None:
    missing = [p for p in named_paths((ROOT / script).read_text()) if not (ROOT / p).is_file()]
    assert missing == [], f"{script} names test files that do not exist: {missing}"


def test_a_named_path_is_found() -> None:
    text = "pytest \\\n  tests/unit/test_gone.py \\\n  --deselect tests/integration/test_x.py::t"
    assert named_paths(text) == ["tests/integration/test_x.py", "tests/unit/test_gone.py"]
