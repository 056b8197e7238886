"""A failing HTTP proxy for the S3 suite: forwards to a real S3 server (moto) and, seeded,
fails some requests the ways a network and a cloud fail.

Faults, each drawn per request with probability ``rate``:

* ``500`` / ``503``: an S3 error reply (``InternalError`` / ``SlowDown``); the request never
  reaches the server.
* ``drop``: the connection is closed before the request is forwarded.
* ``lost reply``: the request is forwarded (a PUT lands) and the connection closed before
  the reply: the client cannot know it succeeded.
* ``delay``: up to 0.3 s before forwarding.
* ``stall``: longer than the client's timeout, then forwarded: the client gives up on a
  request that may still land.

Requests come from several threads, so which request draws which fault depends on thread
timing: a seed replays the same mix, not always the same request sequence.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import random
import socket
import threading
import time
from collections import Counter

from tests.storage.emulators import LoopbackForwarder

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
    }
)
FAULTS = ("500", "503", "drop", "lost reply", "delay", "stall")
_ERRORS = {"500": (500, "InternalError"), "503": (503, "SlowDown")}


class FailingProxy(LoopbackForwarder):
    """Forwards to ``upstream`` (``http://host:port``) on a free loopback port, failing a
    seeded fraction ``rate`` of requests; :attr:`faults` counts what it did."""

    def __init__(self, upstream: str, *, seed: int, rate: float, stall_s: float) -> None:
        self.rate, self.stall_s = rate, stall_s
        self.faults: Counter[str] = Counter()
        self.enabled = True
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        super().__init__(upstream, _Handler, "failing-proxy")

    def draw(self) -> tuple[str | None, float]:
        """The fault for the next request (``None``: forward it untouched) and a delay."""
        with self._lock:
            if not self.enabled or self._rng.random() >= self.rate:
                return None, 0.0
            fault = self._rng.choice(FAULTS)
            self.faults[fault] += 1
            return fault, self._rng.uniform(0.0, 0.3)

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that gave up (timeout) closes its end first: not worth a traceback."""


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FailingProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as obstore's client expects

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would drown the soak's table

    def _handle(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self._reply(501, {}, b"chunked request bodies are not proxied")
            return
        fault, delay = self.server.draw()
        if fault in _ERRORS:
            status, code = _ERRORS[fault]
            xml = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            self._reply(status, {"Content-Type": "application/xml"}, xml)
            return
        if fault == "drop":
            self._drop()
            return
        if fault in ("delay", "stall"):
            time.sleep(delay if fault == "delay" else self.server.stall_s)
        try:
            status, headers, reply = self._forward(body)
        except (OSError, http.client.HTTPException) as exc:
            self._reply(502, {"Content-Type": "text/plain"}, f"proxy: {exc}".encode())
            return
        if fault == "lost reply":
            self._drop()
            return
        self._reply(status, headers, reply)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

    def _forward(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        connection = http.client.HTTPConnection(
            self.server.upstream_host, self.server.upstream_port, timeout=30
        )
        try:
            connection.request(self.command, self.path, body=body or None, headers=headers)
            response = connection.getresponse()
            data = response.read()
            kept = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP}
            return response.status, kept, data
        finally:
            connection.close()

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):  # the client went first
            self.connection.shutdown(socket.SHUT_RDWR)

    def _reply(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for key, value in headers.items():
            if key.lower() != "content-length":
                self.send_header(key, value)
        # A HEAD reply states the object's length without sending it.
        length = headers.get("Content-Length", headers.get("content-length"))
        self.send_header(
            "Content-Length", length if self.command == "HEAD" and length else str(len(body))
        )
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
