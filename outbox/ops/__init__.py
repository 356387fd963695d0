"""Operations: outbox and consumer lag, ``doctor`` checks, retention cleanup.

``store`` is the only module here that writes SQL; ``kafka_probe`` is the read-only Kafka
view that ``lag`` and ``doctor`` share. The CLI (``outbox lag|doctor|cleanup``) is a thin
adapter over these modules::

    from outbox.ops.cleanup import run_cleanup
    from outbox.ops.lag import collect
"""
