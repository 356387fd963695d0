"""A handler failure's stack trace as a dead letter keeps it: formatted once, when the
handler has failed (never for an event that succeeds), bounded, and safe to show.

* Frames and their source lines, as Python prints them, never local variables.
* The framework's own frames above the handler are left out (they are the same for every
  failure: the processor calling the handler); a chained cause is kept, as Python shows
  it ("The above exception was the direct cause...").
* The exception's message is :func:`inbox.failures.message_of`'s (a validation error's
  locations, not the payload it echoes; a database error without its SQL and parameters),
  and the whole text is scrubbed (:func:`outbox.scrub.scrub`): a URL with a password in a
  source line or a message is blanked.
* At most :data:`MAX_FRAMES` frames per exception and ``max_chars`` characters: a longer
  trace keeps its beginning and its end (the innermost frames and the message), and says
  how much was cut between.

The *first application frame* — the innermost frame outside the framework, the standard
library and installed packages, as ``path:line in function`` — names where the
application's code was when it failed: the console groups dead letters by it.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path

from outbox.scrub import scrub

MAX_FRAMES = 40
_CHAIN_DEPTH = 3  # chained causes kept, beyond the exception itself
_HERE = Path(__file__).resolve().parents[1]
# The framework's packages, then what is not the application's code at all.
_FRAMEWORK = tuple(f"{_HERE / name}{os.sep}" for name in ("inbox", "outbox", "relay", "cli"))


def _paths(*keys: str) -> tuple[str, ...]:
    return tuple({f"{Path(sysconfig.get_paths()[k]).resolve()}{os.sep}" for k in keys})


# Installed packages (an application installed as one, too), then the standard library (a
# virtual environment's own lib/pythonX.Y holds site-packages: installed roots are looked
# for under the site directories only).
_SITE = _paths("purelib", "platlib")
_LIBRARIES = _SITE + _paths("stdlib", "platstdlib")
_FILE_LINE = re.compile(r'^  File "(.+)", line (\d+), in (.+)$', re.M)
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def _framework(filename: str) -> bool:
    return filename.startswith(_FRAMEWORK)


def _installed_root(filename: str) -> str | None:
    """The top-level package directory of an installed module (None: not installed)."""
    for library in _SITE:
        if filename.startswith(library):
            top = filename[len(library) :].split(os.sep, 1)[0]
            return f"{library}{top}{os.sep}" if top else None
    return None


def _application(filename: str, root: str | None) -> bool:
    """The application's code: under ``root`` (its package, when it is installed), or
    anywhere but the framework, the standard library, installed packages and ``<...>``."""
    if root is not None and filename.startswith(root):
        return True
    return not (
        filename.startswith(_FRAMEWORK)
        or filename.startswith(_LIBRARIES)
        or filename.startswith("<")  # <frozen ...>, <string>
    )


def _stack(exc: BaseException) -> traceback.StackSummary:
    stack = traceback.extract_tb(exc.__traceback__, limit=-MAX_FRAMES)
    # The framework's frames above the first frame of someone else's code.
    skip = 0
    while skip < len(stack) - 1 and _framework(_resolved(stack[skip].filename)):
        skip += 1
    return traceback.StackSummary.from_list(stack[skip:])


def _resolved(filename: str) -> str:
    try:
        return str(Path(filename).resolve())
    except (OSError, ValueError):
        return filename


def _name(exc: BaseException) -> str:
    kind = type(exc)
    module = kind.__module__
    return (
        kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"
    )


def first_application_frame(exc: BaseException) -> str | None:
    """The innermost frame of the application's own code, as ``path:line in function``
    (relative to the working directory when under it); None when every frame is the
    framework's or a library's. An application installed as a package is told from its
    dependencies by the first frame below the framework's (the handler): its package."""
    files = [
        (_resolved(f.filename), f) for f in traceback.extract_tb(exc.__traceback__, -MAX_FRAMES)
    ]
    entry = next((name for name, _ in files if not _framework(name)), None)
    root = _installed_root(entry) if entry is not None else None
    for filename, frame in reversed(files):
        if _application(filename, root):
            return f"{_relative(filename)}:{frame.lineno} in {frame.name}"
    return None


def _relative(filename: str) -> str:
    try:
        return str(Path(filename).relative_to(Path.cwd()))
    except ValueError:
        return filename


def format_trace(
    exc: BaseException, max_chars: int, message: Callable[[BaseException], str]
) -> str:
    """The stack trace of ``exc`` (and its chained causes), bounded and scrubbed.
    ``message`` says what to print for each exception after its frames."""
    parts: list[str] = []
    seen: set[int] = set()

    def add(current: BaseException, depth: int) -> None:
        seen.add(id(current))
        cause = current.__cause__
        context = None if current.__suppress_context__ else current.__context__
        if depth < _CHAIN_DEPTH:
            if cause is not None and id(cause) not in seen:
                add(cause, depth + 1)
                parts.append(_CAUSE)
            elif context is not None and id(context) not in seen:
                add(context, depth + 1)
                parts.append(_CONTEXT)
        stack = _stack(current)
        if stack:
            parts.append("Traceback (most recent call last):\n")
            parts.extend(stack.format())
        parts.append(f"{_name(current)}: {message(current)}\n")

    add(exc, 0)
    return _bounded(scrub("".join(parts)), max_chars)


def _bounded(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    marker = "\n  ... {n} characters cut ...\n"
    room = max(0, max_chars - len(marker.format(n=len(text))))
    head = room // 4
    tail = room - head
    cut = len(text) - head - tail
    return text[:head] + marker.format(n=cut) + (text[-tail:] if tail else "")


def summary(trace: str, frames: int = 5) -> str:
    """The innermost ``frames`` frames of a trace :func:`format_trace` wrote, on one line
    (``helpers.py:12 in total < handlers.py:30 in handle``): for a log line."""
    found = _FILE_LINE.findall(trace)[-frames:]
    return " < ".join(f"{Path(f).name}:{n} in {fn}" for f, n, fn in reversed(found))
