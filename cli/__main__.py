"""``python -m cli`` runs the ``outbox`` command (used to spawn daemons from the venv)."""

from cli.app import main

main()
