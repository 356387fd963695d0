"""The console's actions (POST): replay and purge dead letters, retry and discard failed
outbox rows, reconcile or give up effects. Each is two steps: the first POST shows what
would be done and how many (a confirmation page), the second (``confirmed=yes``) does it,
writes one audit line and redirects back (303, so a reload does not repeat it).
The guards (authentication, read-only, CSRF) ran before any of these (app.py ``action``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.console.filters import BadFilter, DeadLetterQuery, read_keys
from outbox.console.state import Console, Form, first
from outbox.ops.deadletters import DeadLetterFilter

CONFIRM_SHOWN = 20
_FAILED_LIMIT = 100_000  # rows one "everything shown" action on failed rows moves at most
_NOT_CARRIED = {"csrf", "confirmed"}


def _carried(form: Form) -> list[tuple[str, str]]:
    """The first POST's fields, carried by the confirmation form into the second."""
    return [(k, v) for k, values in form.items() if k not in _NOT_CARRIED for v in values]


def _done(path: str, params: dict[str, str], message: str) -> Response:
    return RedirectResponse(f"{path}?{urlencode({**params, 'done': message})}", status_code=303)


def _confirm(
    console: Console,
    request: Request,
    form: Form,
    *,
    title: str,
    count: int,
    items: Sequence[str],
    cancel: str,
    button: str,
    note: str = "",
) -> Response:
    return console.render(
        request,
        "confirm.html",
        title=title,
        count=count,
        items=items,
        fields=_carried(form),
        post_to=request.url.path,
        cancel=cancel,
        button=button,
        note=note,
    )


def _choice(form: Form, name: str, allowed: tuple[str, ...]) -> str:
    value = first(form, name)
    if value not in allowed:
        raise BadFilter(f"{name} must be one of {', '.join(allowed)}")
    return value


# ------------------------------------------------------------------------- dead letters


def _dead_letter_target(form: Form) -> tuple[str, DeadLetterFilter, DeadLetterQuery]:
    scope = _choice(form, "scope", ("selected", "group", "filtered"))
    query = DeadLetterQuery.read({k: v[0] for k, v in form.items() if v})
    if scope == "selected":
        keys = read_keys(form.get("key", []))
        if not keys:
            raise BadFilter("select at least one dead letter")
        return scope, DeadLetterFilter(keys=keys), query
    if scope == "group" and "group" not in query.values:
        raise BadFilter("no error group given")
    return scope, query.filter(), query


async def dead_letters(console: Console, request: Request, form: Form) -> Response:
    verb = _choice(form, "action", ("replay", "purge"))
    scope, where, query = _dead_letter_target(form)
    store = console.backends.dead_letters
    back = query.values if scope != "selected" else {}
    if verb == "replay":
        # Only what a replay can act on: one processed since would be refused anyway.
        where = replace(where, replayable=True)
    if first(form, "confirmed") != "yes":
        count = await store.count(where)
        shown = await store.list(where, CONFIRM_SHOWN)
        left_out = await store.count(replace(where, replayable=False)) - count
        note = f" ({left_out} processed since: not replayed)" if left_out else ""
        return _confirm(
            console,
            request,
            form,
            title=f"{verb.capitalize()} {count} dead letter{'s' if count != 1 else ''}",
            count=count,
            items=[f"{x.consumer} {x.event_id} ({x.error_class})" for x in shown],
            cancel=f"/dead-letters?{urlencode(back)}",
            button=f"Yes, {verb} {count}",
            note=note,
        )
    if verb == "replay":
        report = await store.replay(where)
        n, refused = len(report.replayed), len(report.refused)
        console.guard.audit("dlq.replay", n, f"scope={scope} refused={refused}")
        message = f"replayed {n}, refused {refused} (already processed)"
    else:
        n = await store.purge(where)
        console.guard.audit("dlq.purge", n, f"scope={scope}")
        message = f"purged {n}"
    return _done("/dead-letters", back, message)


# ---------------------------------------------------------------------- failed rows


def _ids(values: Sequence[str]) -> list[int]:
    try:
        return sorted({int(v) for v in values})
    except ValueError:
        raise BadFilter("a selected row id is not a number") from None


async def failed(console: Console, request: Request, form: Form) -> Response:
    verb = _choice(form, "action", ("retry", "discard"))
    scope = _choice(form, "scope", ("selected", "filtered"))
    topic = (first(form, "topic") or "").strip() or None
    if scope == "selected":
        ids = _ids(form.get("id", []))
        items = [f"#{i}" for i in ids[:CONFIRM_SHOWN]]
    else:
        # Every row of the filter, as ids: what the operator confirms is what is moved.
        rows, _ = await console.sync(console.backends.failed.list, topic, _FAILED_LIMIT)
        ids = [r.id for r in rows]
        items = [f"#{r.id} {r.topic} {r.event_type} {r.event_id}" for r in rows[:CONFIRM_SHOWN]]
    if not ids:
        raise BadFilter("no failed row selected")
    back = {"topic": topic} if topic else {}
    if first(form, "confirmed") != "yes":
        return _confirm(
            console,
            request,
            form,
            title=f"{verb.capitalize()} {len(ids)} failed outbox row{'s' if len(ids) != 1 else ''}",
            count=len(ids),
            items=items,
            cancel=f"/failed?{urlencode(back)}",
            button=f"Yes, {verb} {len(ids)}",
        )
    move = console.backends.failed.retry if verb == "retry" else console.backends.failed.discard
    moved = await console.sync(move, ids)
    console.guard.audit(f"failed.{verb}", len(moved), f"scope={scope}")
    return _done("/failed", back, f"{verb} {len(moved)}")


# -------------------------------------------------------------------------- effects

_EFFECT_VERDICTS = {
    "applied": "mark as applied (store the result; callers replay it)",
    "not_applied": "mark as not applied (the next caller calls the dependency again)",
    "give_up": "give up (settle as failed; callers get the failure, nobody calls again)",
}


async def effects(console: Console, request: Request, form: Form) -> Response:
    verdict = _choice(form, "action", tuple(_EFFECT_VERDICTS))
    key = first(form, "key") or ""
    result: Any = None
    if verdict == "applied":
        try:
            result = json.loads(first(form, "result") or "null")
        except ValueError as exc:
            raise BadFilter(f"the result is not valid JSON: {exc}") from None
    if first(form, "confirmed") != "yes":
        record = await console.sync(console.effects.get, console.sengine, key)
        return _confirm(
            console,
            request,
            form,
            title=f"Effect {key}: {_EFFECT_VERDICTS[verdict]}",
            count=1,
            items=[f"{record.key} ({record.state}, {record.dependency})"],
            cancel=f"/effects/show?{urlencode({'key': key})}",
            button="Yes, " + verdict.replace("_", " "),
        )
    if verdict == "give_up":
        await console.sync(console.effects.give_up, console.sengine, key)
    else:
        await console.sync(
            console.effects.resolve,
            console.sengine,
            key,
            applied=verdict == "applied",
            result=result,
        )
    console.guard.audit(f"effects.{verdict}", 1, f"key={key}")
    return _done("/effects", {"state": "unknown"}, f"effect {key}: {verdict.replace('_', ' ')}")
