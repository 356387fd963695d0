"""The operator console (``outbox console``): dead letters, failed outbox rows, unknown
effects and lag in server-rendered pages (Starlette + Jinja2, no JavaScript build, every
asset served by the console itself).

It lives in ``outbox/`` and imports no ``inbox`` or ``relay`` code: the dead-letter and
failed-row actions reach it as :class:`~outbox.console.ports.Backends`, built by the CLI
(``cli/console.py``), which may import every package (docs/architecture.md).
Needs the ``console`` extra (``pip install outbox-inbox[console]``).
"""

from outbox.console.app import create_app
from outbox.console.ports import Backends, DeadLetterStore, FailedRows
from outbox.console.security import check_bind

__all__ = ["Backends", "DeadLetterStore", "FailedRows", "check_bind", "create_app"]
