"""A local HTTP server that behaves like the GCE metadata server, for the metadata watcher's tests."""

from __future__ import annotations

import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["NO_NOTIFICATIONS", "FakeMetadataServer"]

NO_NOTIFICATIONS = b"no notifications have been received yet, try again later"


class FakeMetadataServer:
    """Values with ETags; ``wait_for_change`` holds the request until the value changes or time runs out.

    ``unavailable[key] = n`` answers the next n requests for ``key`` with 503, as during maintenance.
    """

    def __init__(self, bind: str = "127.0.0.1") -> None:
        self.values: dict[str, tuple[int, bytes]] = {
            "instance/name": (200, b"meta-vm"),
            "instance/maintenance-event": (200, b"NONE"),
            "instance/upcoming-maintenance": (503, NO_NOTIFICATIONS),
            "instance/preempted": (200, b"FALSE"),
        }
        self.versions = dict.fromkeys(self.values, 1)
        self.unavailable: dict[str, int] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.changed = threading.Condition()
        self.closing = False  # ends the held long polls when the server stops
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                key = url.path.removeprefix("/computeMetadata/v1/")
                query = dict(urllib.parse.parse_qsl(url.query))
                status, body, etag = server.answer(key, query, self.headers.get("Metadata-Flavor"))
                self.send_response(status)
                if etag:
                    self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer((bind, 0), Handler)
        self.httpd.daemon_threads = True
        self.host = f"{bind}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def etag(self, key: str) -> str:
        return f"{abs(hash(key)) % 10_000:04d}{self.versions[key]:06d}"

    def answer(self, key: str, query: dict[str, str], flavor: str | None) -> tuple[int, bytes, str]:
        if flavor != "Google":
            return 403, b"Missing Metadata-Flavor:Google header.", ""
        with self.changed:
            self.requests.append((key, query))
            if key not in self.values:
                return 404, b"not found", ""
            if self.unavailable.get(key, 0) > 0:
                self.unavailable[key] -= 1
                return 503, b"", ""
            if query.get("wait_for_change") == "true" and query.get("last_etag") == self.etag(key):
                timeout = float(query.get("timeout_sec", "60"))
                self.changed.wait_for(lambda: self.closing or query.get("last_etag") != self.etag(key), timeout=timeout)
            status, body = self.values[key]
            return status, body, self.etag(key) if status == 200 else ""

    def set(self, key: str, body: bytes, status: int = 200) -> None:
        with self.changed:
            self.values[key] = (status, body)
            self.versions[key] += 1
            self.changed.notify_all()

    def __enter__(self) -> FakeMetadataServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
