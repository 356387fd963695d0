"""Payments example: idempotent POST /refunds, atomic with the outbox (see app.py)."""
