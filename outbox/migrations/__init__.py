"""Shipped Alembic migrations. Run them with ``outbox db upgrade`` (see outbox.migrate)."""
