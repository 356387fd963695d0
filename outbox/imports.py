"""``MODULE:ATTR`` references: how a deployment names its own code on the command line and
in settings (a consumer app, a Kafka OAUTHBEARER token provider)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_target(target: str) -> Any:
    """The object ``module:attribute`` names. The current directory is importable too, as
    with ``python -m``. Raises ``ValueError`` with a message saying what is wrong."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected MODULE:ATTR, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attribute!r}") from None
