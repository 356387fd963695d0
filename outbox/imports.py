"""``MODULE:ATTR`` references: how a deployment names its own code on the command line and
in settings (a consumer app, a Kafka OAUTHBEARER token provider)."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path
from typing import Any

# An exception's message as shown in the one line that says why the import failed.
_MESSAGE_CHARS = 300


def import_target(target: str) -> Any:
    """The object ``module:attribute`` names. The current directory is importable too, as
    with ``python -m``. Raises ``ValueError`` with a message saying what is wrong: the
    module not found, or what failed while importing it (a missing dependency, a syntax
    error, an exception raised by its code) and where."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected MODULE:ATTR, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and f"{module_name}.".startswith(f"{exc.name}."):
            raise ValueError(
                f"cannot import {module_name!r}: no module named {exc.name!r} (not in the "
                "current directory or on PYTHONPATH)"
            ) from None
        raise ValueError(f"cannot import {module_name!r}: {_while_importing(exc)}") from None
    except Exception as exc:  # SyntaxError, or whatever the module's own code raised
        raise ValueError(f"cannot import {module_name!r}: {_while_importing(exc)}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attribute!r}") from None


def _while_importing(exc: Exception) -> str:
    """``importing it raised Class: message (file line N)``, on one line."""
    if isinstance(exc, SyntaxError):
        message, file, line = exc.msg, exc.filename, exc.lineno
    else:
        text = str(exc).strip()
        message = text.splitlines()[0] if text else ""
        # The innermost module-level line that ran: where the import stopped (the line
        # calling into a library, not the library's own frame; never importlib's).
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.name == "<module>"]
        file, line = (frames[-1].filename, frames[-1].lineno) if frames else (None, None)
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + "…"
    raised = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    where = f" ({_shown(file)} line {line})" if file else ""
    return f"importing it raised {raised}{where}"


def _shown(file: str) -> str:
    """The file relative to the current directory when it is below it."""
    path = Path(file)
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return file
