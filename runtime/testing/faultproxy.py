"""A small HTTP proxy that injects the faults GCS clients meet: 5xx/429 answers, slow answers, dropped
connections (before and after the request reached the server), and holds on chosen requests.

It forwards real requests to a real server (the GCS emulator); only the faults are made up.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
FAULTS = ("error", "slow", "drop", "drop_after")


class FaultProxy:
    """Forward HTTP to ``upstream`` (host, port); each request meets a fault with probability ``rate``.

    Args:
        upstream: the real server.
        rate: probability of a fault per request.
        faults: which faults to draw from (see FAULTS).
        slow_s: how long a slow answer is held before it is forwarded.
        seed: seeds the fault draw, so a run is reproducible.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        rate: float = 0.0,
        faults: tuple[str, ...] = FAULTS,
        slow_s: float = 1.5,
        seed: int = 0,
    ) -> None:
        self.upstream = upstream
        self.rate = rate
        self.faults = faults
        self.slow_s = slow_s
        self.injected: Counter[str] = Counter()
        self.forwarded = 0
        self.seen: list[str] = []  # "METHOD path body-head" of every request, for tests to wait on
        self.hold_pattern: str | None = None  # requests whose path or body head contain it wait for release
        self.held = threading.Event()  # set once a request is being held
        self.release = threading.Event()
        self.discard_held = True  # a released held request is dropped, as if its sender had died mid-request
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                proxy._handle(self)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    def reseed(self, seed: int) -> None:
        with self._lock:
            self._random = random.Random(seed)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _draw(self) -> str | None:
        with self._lock:
            if self.rate and self._random.random() < self.rate:
                return self._random.choice(self.faults)
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        # The client may go away (a killed process, a client timeout): then there is nothing to answer.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._serve(h)

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        # Headers and body go out in separate writes: without NODELAY, Nagle and delayed ACKs add 40 ms each.
        h.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = _read_body(h)
        head = f"{h.command} {h.path} {body[:2048].decode('latin-1')}"
        with self._lock:
            self.seen.append(head)
        if self.hold_pattern is not None and self.hold_pattern in head:
            self.held.set()
            self.release.wait()
            if self.discard_held:
                _drop(h)
                return
        fault = self._draw()
        if fault is not None:
            with self._lock:
                self.injected[fault] += 1
        if fault == "error":
            status = self._random.choice((500, 502, 503, 429))
            payload = json.dumps({"error": {"code": status, "message": "injected fault"}}).encode()
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            return
        if fault == "drop":
            _drop(h)
            return
        if fault == "slow":
            time.sleep(self.slow_s)
        status, reason, headers, data = self._forward(h, body)
        if fault == "drop_after":
            _drop(h)  # the server applied the request; the client never hears so
            return
        h.send_response(status, reason)
        for key, value in headers:
            if key.lower() not in _HOP and key.lower() != "content-length":
                h.send_header(key, value)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _forward(self, h: BaseHTTPRequestHandler, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(h.command, h.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            with self._lock:
                self.forwarded += 1
            return response.status, response.reason, response.getheaders(), data
        finally:
            conn.close()


def _read_body(h: BaseHTTPRequestHandler) -> bytes:
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int(h.rfile.readline().strip().split(b";")[0], 16)
            if size == 0:
                h.rfile.readline()
                break
            parts.append(h.rfile.read(size))
            h.rfile.readline()
        return b"".join(parts)
    length = int(h.headers.get("Content-Length") or 0)
    return h.rfile.read(length) if length else b""


def _drop(h: BaseHTTPRequestHandler) -> None:
    h.close_connection = True
    with contextlib.suppress(OSError):
        h.connection.shutdown(socket.SHUT_RDWR)
