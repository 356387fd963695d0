"""Griffe extension for the API reference: docstrings are written for Sphinx (roles such as
``:class:`~outbox.Outbox` ``, ``::`` literal blocks, doctest examples) and shown as Markdown,
since the site does not use Sphinx."""

from __future__ import annotations

from typing import Any

import griffe

from cli.reference import markdown_docstring


class SphinxDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **_: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
