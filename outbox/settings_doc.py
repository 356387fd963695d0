"""The configuration reference, generated from OutboxSettings so no document can drift.

Two renderings of the same walk over the settings model: the compact table of
``outbox config reference`` (:func:`markdown_table`), and the documentation site's page, one
section per settings group with types and allowed ranges (:func:`reference_markdown`).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from outbox.settings import OutboxSettings


@dataclass(frozen=True)
class Setting:
    """One leaf setting as the reference shows it."""

    env: str  # the environment variable, e.g. OUTBOX_RELAY__BATCH_SIZE
    path: tuple[str, ...]  # attribute path on OutboxSettings, e.g. ("relay", "batch_size")
    type: str
    default: str
    bounds: str
    description: str


def _default(field: FieldInfo) -> str:
    value: Any = field.get_default(call_default_factory=True)
    if isinstance(value, SecretStr):
        return "`postgresql+psycopg://outbox:…@127.0.0.1:54329/outbox`"
    return f"`{value}`"


def _type(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        kinds = [_type(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (", optional" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is dict:
        return "JSON object"
    names = {SecretStr: "secret", Path: "file path", bool: "boolean", str: "string"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(field: FieldInfo) -> str:
    # pydantic keeps Field(ge=..., le=...) as annotated-types markers in ``metadata``.
    marks = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
    found = [
        f"{symbol} {getattr(item, attr)}"
        for item in field.metadata
        for attr, symbol in marks
        if getattr(item, attr, None) is not None
    ]
    return ", ".join(found)


def settings(
    model: type[BaseModel] = OutboxSettings, env: str = "OUTBOX_", path: tuple[str, ...] = ()
) -> list[Setting]:
    """Every leaf setting of ``model``, nested sections flattened in declaration order."""
    out: list[Setting] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.extend(settings(annotation, f"{env}{name.upper()}__", (*path, name)))
        else:
            out.append(
                Setting(
                    env=f"{env}{name.upper()}",
                    path=(*path, name),
                    type=_type(annotation),
                    default=_default(field),
                    bounds=_bounds(field),
                    description=field.description or "",
                )
            )
    return out


def rows(
    model: type[BaseModel] = OutboxSettings, env: str = "OUTBOX_"
) -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every leaf setting."""
    return [(s.env, s.default, s.description) for s in settings(model, env)]


def markdown_table() -> str:
    lines = ["| environment variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{env}` | {default} | {desc} |" for env, default, desc in rows()]
    return "\n".join(lines)


def _sections() -> list[tuple[str, str, list[Setting]]]:
    """(title, the section class's docstring, its settings); the top level first."""
    everything = settings()
    top = [s for s in everything if len(s.path) == 1]
    found = [("General", "Where the database and Kafka are, and what every component shares.", top)]
    for name, field in OutboxSettings.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            doc = inspect.cleandoc(section.__doc__ or "")
            mine = [s for s in everything if s.path[0] == name and len(s.path) > 1]
            found.append((f"`{name}` — `OUTBOX_{name.upper()}__*`", doc, mine))
    return found


def reference_markdown() -> str:
    """The settings reference page of the documentation site (Markdown)."""
    parts: list[str] = []
    for title, doc, members in _sections():
        parts += [f"## {title}", "", doc, ""]
        parts += ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
        for s in members:
            kind = f"{s.type} ({s.bounds})" if s.bounds else s.type
            default = "unset" if s.default == "`None`" else s.default
            parts.append(f"| `{s.env}` | {kind} | {default} | {s.description} |")
        parts.append("")
    return "\n".join(parts)
