"""An order API on FastAPI with idempotent POST /orders (see app.py)."""
