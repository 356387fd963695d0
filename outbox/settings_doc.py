"""The configuration reference, generated from OutboxSettings so the README cannot drift."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from outbox.settings import OutboxSettings


def _default(field: FieldInfo) -> str:
    value: Any = field.get_default(call_default_factory=True)
    if isinstance(value, SecretStr):
        return "`postgresql+psycopg://outbox:…@127.0.0.1:54329/outbox`"
    return f"`{value}`"


def rows(
    model: type[BaseModel] = OutboxSettings, env: str = "OUTBOX_"
) -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every leaf setting."""
    out: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.extend(rows(annotation, f"{env}{name.upper()}__"))
        else:
            out.append((f"{env}{name.upper()}", _default(field), field.description or ""))
    return out


def markdown_table() -> str:
    lines = ["| environment variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{env}` | {default} | {desc} |" for env, default, desc in rows()]
    return "\n".join(lines)


START, END = "<!-- settings-table:start -->", "<!-- settings-table:end -->"


def with_table(readme: str) -> str:
    """``readme`` with the generated table between the settings-table markers."""
    head, _, rest = readme.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{markdown_table()}\n{END}{tail}"


if __name__ == "__main__":  # python -m outbox.settings_doc README.md
    import sys
    from pathlib import Path

    path = Path(sys.argv[1])
    path.write_text(with_table(path.read_text()))
