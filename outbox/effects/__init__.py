"""The side-effect ledger: external effects (payments, e-mails, partner calls) at most once
per intent-derived key, with ambiguous outcomes reconciled instead of retried blindly.

``ledger`` holds the :class:`Effects` front (``run`` / ``run_async``), ``classify`` the three
failure classes, ``store`` its SQL, ``errors`` its error tree, ``metrics`` its Prometheus
series::

    from outbox.effects import NOT_APPLIED, Effects, EffectOutcomeUnknown, key_for
"""

from outbox.effects.classify import Ambiguous, Classifier, EffectClass, classify
from outbox.effects.errors import (
    EffectConflict,
    EffectError,
    EffectFailed,
    EffectInProgress,
    EffectLeaseLost,
    EffectNotFound,
    EffectNotResolvable,
    EffectOutcomeUnknown,
    EffectResultInvalid,
)
from outbox.effects.ledger import NOT_APPLIED, Effects, effect_key, key_for
from outbox.effects.records import EffectRecord

__all__ = [
    "NOT_APPLIED",
    "Ambiguous",
    "Classifier",
    "EffectClass",
    "EffectConflict",
    "EffectError",
    "EffectFailed",
    "EffectInProgress",
    "EffectLeaseLost",
    "EffectNotFound",
    "EffectNotResolvable",
    "EffectOutcomeUnknown",
    "EffectRecord",
    "EffectResultInvalid",
    "Effects",
    "classify",
    "effect_key",
    "key_for",
]
