"""A user's file that imports ``outbox`` and ``inbox`` type-checks with ``mypy --strict`` in
the repository's ``.venv``, with the configuration docs/howto/type-checking.md gives: the
packages are visible to the type checker (not only to the import system) and typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.snippets import snippets

pytestmark = pytest.mark.acceptance


def test_a_users_service_type_checks_with_mypy_strict(tmp_path: Path) -> None:
    blocks = snippets("docs/howto/type-checking.md")
    (tmp_path / "mypy.ini").write_text(blocks["mypy.ini"])
    (tmp_path / "service.py").write_text(blocks["service.py"])

    def mypy(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), *args],
            cwd=tmp_path,  # outside the checkout: the packages must come from the .venv
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    checked = mypy("service.py")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith("Success: no issues found in 1 source file")
    # The same file without the plugin: what the page says happens (so the page stays true).
    bare = mypy("--config-file", "/dev/null", "--strict", "service.py")
    assert bare.returncode == 1 and 'Missing named argument "database_url"' in bare.stdout
    assert "Cannot find implementation or library stub" not in bare.stdout, bare.stdout
