"""The ``outbox`` command line: a thin typer adapter over the library packages."""
