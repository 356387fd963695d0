"""Errors of the effect ledger, rooted in :class:`outbox.errors.OutboxError`.

Messages name the key (an intent-derived id, never a secret) and never the payload.
"""

from __future__ import annotations

from typing import Any

from outbox.errors import NotFound, OutboxError


class EffectError(OutboxError):
    """Base of the effect ledger's errors."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


class EffectConflict(EffectError):
    """The key was already used with other arguments (another payload hash). Not retriable:
    a different action needs a different key."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"effect {key} was already claimed with other arguments; "
            "a different action needs a different key",
            key,
        )


class EffectInProgress(EffectError):
    """Another caller holds the key right now (its call is running, or it died less than a
    lease ago). Retriable: ask again after ``retry_after`` seconds."""

    retriable = True

    def __init__(self, key: str, retry_after: float = 1.0) -> None:
        super().__init__(f"effect {key} is in progress elsewhere; retry later", key)
        self.retry_after = max(0.1, retry_after)


class EffectLeaseLost(EffectInProgress):
    """This caller's claim was taken over before its call started; nothing was called."""


class EffectOutcomeUnknown(EffectError):
    """An attempt may or may not have taken effect and there is no way to tell (no
    ``reconcile``, or it failed). The key is parked in state ``unknown``: nobody calls it
    again until ``outbox effects resolve`` (or a later caller with a ``reconcile``) decides.
    Not retriable."""

    def __init__(self, key: str, detail: str = "") -> None:
        super().__init__(
            f"effect {key}: outcome unknown{f' ({detail})' if detail else ''}; it is not "
            "called again until an operator runs `outbox effects resolve`",
            key,
        )


class EffectFailed(EffectError):
    """The effect failed permanently; the failure is stored and every later caller with the
    key gets it again (``error``: the stored description), without a call."""

    def __init__(self, key: str, error: dict[str, Any], replayed: bool) -> None:
        kind = error.get("type", "Error")
        super().__init__(
            f"effect {key} failed permanently: {kind}: {error.get('message', '')}", key
        )
        self.error = error
        self.replayed = replayed


class EffectResultInvalid(EffectError):
    """The call succeeded but returned a value that is not JSON. The effect is recorded as
    done with a ``null`` result (it happened; it must not happen again) and this is raised
    so the programming error is seen."""

    def __init__(self, key: str, type_name: str) -> None:
        super().__init__(
            f"effect {key} happened but its result ({type_name}) is not JSON-serializable; "
            "stored as null — return plain JSON values (dict, list, str, int, float, bool, None)",
            key,
        )


class EffectNotFound(EffectError, NotFound):
    """No ledger record has this key (operators' ``show``/``resolve``)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no effect with key {key}", key)


class EffectNotResolvable(EffectError):
    """``resolve`` only decides records in state ``unknown`` or a ``pending`` one whose
    lease has run out (its caller died)."""

    def __init__(self, key: str, state: str) -> None:
        super().__init__(
            f"effect {key} is {state}; only an unknown effect (or a pending one past its "
            "lease) can be resolved",
            key,
        )
