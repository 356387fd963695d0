# Image for the relay and consumer daemons and the operator console (docker-compose.yml, profile "app").
# Tags are exact versions; .dockerignore keeps .venv, .services, caches and .git out of the
# build context.
FROM python:3.11.14-slim-bookworm
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY outbox ./outbox
COPY relay ./relay
COPY inbox ./inbox
COPY cli ./cli
COPY examples ./examples
# The versions CI tested (constraints.txt, scripts/lock), not whatever is newest today.
RUN pip install --no-cache-dir -c constraints.txt ".[asgi,console]"
ENV PYTHONPATH=/app
USER nobody
ENTRYPOINT []
