"""How counts read in what operators see (CLI output, findings, pages): ``1 dead letter``,
``2 dead letters``, never ``1 dead letters`` or ``row(s)``."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``counted(1, "handler")`` -> ``1 handler``; ``counted(3, "handler")`` -> ``3 handlers``;
    an irregular plural is given: ``counted(2, "entry", "entries")``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
