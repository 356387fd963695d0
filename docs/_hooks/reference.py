"""MkDocs hook: fills the generated reference pages while the site is built.

A page asks for a generated block with ``<!-- generated: NAME -->`` on a line of its own;
NAME is a key of ``GENERATORS``. The blocks are rendered from the code on every build
(``mkdocs build``/``serve``), so they cannot drift from it; an unknown NAME fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from cli import reference
from outbox import settings_doc

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


def alerts_markdown() -> str:
    """The alert rules of ``deploy/prometheus/alerts.yml``, one row each."""
    rows = ["| alert | severity | fires when | meaning |", "| --- | --- | --- | --- |"]
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            expr = " ".join(str(rule["expr"]).split()).replace("|", "\\|")
            held = f" for {rule['for']}" if "for" in rule else ""
            notes = rule.get("annotations", {})
            meaning = " ".join(
                str(notes[k]).replace("|", "\\|") for k in ("summary", "description") if k in notes
            )
            rows.append(
                f"| `{rule['alert']}` | {rule['labels']['severity']} | `{expr}`{held} | {meaning} |"
            )
    return "\n".join(rows)


GENERATORS = {
    "settings": settings_doc.reference_markdown,
    "cli": reference.cli_markdown,
    "errors": reference.errors_markdown,
    "database-errors": reference.database_errors_markdown,
    "alerts": alerts_markdown,
}
_MARK = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.M)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return _MARK.sub(lambda m: GENERATORS[m[1]](), markdown)
