"""A fake payment provider on real HTTP (stdlib ``http.server``, loopback only).

It counts effects (refunds actually made), honours an ``Idempotency-Key`` header the way
Stripe does (the same key returns the first refund, no new effect), has a "find by key"
endpoint for reconciliation, and misbehaves on request::

    POST /refunds                 {"charge": "ch_1", "amount": 1400000}  -> 201 refund
    GET  /refunds?idempotency_key=K                                      -> 200 refund | 404
    GET  /_stats                     -> {"effects": refunds made, "requests": refund POSTs}
    POST /_faults                 {"fault": "apply_then_timeout", "count": 1}

Faults (each applies to the next ``count`` refund requests): ``apply_then_timeout`` (the
refund is made, the answer comes after ``slow_seconds`` — past the client's timeout),
``apply_then_die`` (made, then the connection is reset without an answer), ``bad_gateway``
(made, then 502), ``unavailable`` (not made, 503 with ``Retry-After: 0``), ``reject``
(not made, 422).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

FAULTS = ("apply_then_timeout", "apply_then_die", "bad_gateway", "unavailable", "reject")


@dataclass
class Ledger:
    """The provider's own books (thread-safe)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    refunds: list[dict[str, Any]] = field(default_factory=list)
    by_key: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: int = 0
    faults: deque[str] = field(default_factory=deque)

    def next_fault(self) -> str | None:
        with self.lock:
            self.requests += 1
            return self.faults.popleft() if self.faults else None

    def apply(self, key: str | None, charge: str, amount: int) -> tuple[dict[str, Any], bool]:
        """Make the refund (or return the one made for ``key``); True when it is new."""
        with self.lock:
            if key is not None and key in self.by_key:
                return self.by_key[key], False
            refund = {
                "id": f"re_{len(self.refunds) + 1}",
                "charge": charge,
                "amount": amount,
                "idempotency_key": key,
            }
            self.refunds.append(refund)
            if key is not None:
                self.by_key[key] = refund
            return refund, True


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("content-length") or 0)
        return json.loads(self.rfile.read(length) or b"null")

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends a TCP RST, the client sees "connection reset".
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        books = self.server.books
        if url.path == "/_stats":
            with books.lock:
                stats = {"effects": len(books.refunds), "requests": books.requests}
            self._send(200, stats)
        elif url.path == "/refunds":
            key = (parse_qs(url.query).get("idempotency_key") or [""])[0]
            with books.lock:
                found = books.by_key.get(key)
            self._send(200, found) if found else self._send(404, {"error": "no such refund"})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        books = self.server.books
        body = self._body()
        if url.path == "/_faults":
            if body.get("fault") not in FAULTS:
                self._send(400, {"error": f"fault must be one of {FAULTS}"})
                return
            with books.lock:
                books.faults.extend([body["fault"]] * int(body.get("count", 1)))
            self._send(200, {"queued": len(books.faults)})
            return
        if url.path != "/refunds":
            self._send(404, {"error": "not found"})
            return
        fault = books.next_fault()
        if fault == "unavailable":
            self._send(503, {"error": "try later"}, {"retry-after": "0"})
            return
        amount = body.get("amount") if isinstance(body, dict) else None
        if fault == "reject" or not isinstance(amount, int) or amount <= 0:
            self._send(422, {"error": "amount must be a positive integer"})
            return
        refund, new = books.apply(self.headers.get("idempotency-key"), str(body["charge"]), amount)
        if fault == "apply_then_die":
            self._reset()
        elif fault == "apply_then_timeout":
            time.sleep(self.server.slow_seconds)
            self._send(201, refund)
        elif fault == "bad_gateway":
            self._send(502, {"error": "upstream went away"})
        else:
            self._send(201 if new else 200, refund)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    books: Ledger
    slow_seconds: float

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (timed out) before the slow answer: expected here.
        return


class FakeProvider:
    """``with FakeProvider() as provider: provider.url``: serves on 127.0.0.1 in a thread."""

    def __init__(self, slow_seconds: float = 3.0, port: int = 0) -> None:
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.books = Ledger()
        self._server.slow_seconds = slow_seconds
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def effects(self) -> int:
        with self._server.books.lock:
            return len(self._server.books.refunds)

    def fail_next(self, fault: str, count: int = 1) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}")
        with self._server.books.lock:
            self._server.books.faults.extend([fault] * count)

    def clear_faults(self) -> None:
        with self._server.books.lock:
            self._server.books.faults.clear()

    def start(self) -> FakeProvider:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
