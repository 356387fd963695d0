"""A TCP proxy a test can cut: the database "goes away" for one client (the console under
test) while the shared server keeps serving every other test."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target``; :meth:`cut` closes the listener and every
    forwarded connection (new ones are refused), :meth:`restore` listens again."""

    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self.target = target
        self.port = port
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._open = self._open, set()
        for s in [listener, *sockets]:
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def tcp_proxy(target: tuple[str, int]) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target)
    proxy.restore()
    try:
        yield proxy
    finally:
        proxy.cut()
