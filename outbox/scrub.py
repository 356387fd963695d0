"""The one rule for text that came from outside the framework (handler errors, driver
messages, stack traces) before an operator sees it: URLs are blanked — a database or broker
URL may carry a password — and so are ``password=...`` pairs of a libpq connection string.

Used wherever such text leaves for a person: the dead letter's message and trace as they
are stored (inbox/failures.py), ``outbox dlq show``, the console (every value a page renders
goes through it: outbox/console/state.py) and the consumer's log lines.
"""

from __future__ import annotations

import re

# scheme://anything up to white space: the whole URL, not only its password, since a
# password with unusual characters may not end where a URL parser thinks it does.
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
_PASSWORD = re.compile(r"\b(password|passwd)\s*=\s*\S+", re.I)


def scrub(text: object) -> str:
    """``text`` with every URL blanked to ``<url>`` and every ``password=...`` to
    ``password=<hidden>``.

    >>> scrub("cannot reach postgresql://svc:pw@db.internal:5432/pay (timeout)")
    'cannot reach <url> (timeout)'
    >>> scrub("host=db password=pw dbname=pay")
    'host=db password=<hidden> dbname=pay'
    """
    return _PASSWORD.sub(r"\1=<hidden>", _URL.sub("<url>", str(text)))
