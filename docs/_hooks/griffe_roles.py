"""Griffe extension for the API reference: the docstrings' Sphinx roles
(``:class:`~outbox.Outbox` ``) shown as Markdown code, since the site does not use Sphinx."""

from __future__ import annotations

from typing import Any

import griffe

from cli.reference import plain_roles


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **_: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
