"""A real HTTP server on 127.0.0.1 (a free port) that takes alerts as a webhook would: each
POST's JSON kept, answered by a script of statuses (then 200), or never answered."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Webhook:
    """`with Webhook() as hook:` ... hook.url, hook.bodies (delivered: answered 2xx),
    hook.requests (every POST, answered or not)."""

    def __init__(self, statuses: list[int] | None = None, hang: bool = False,
                 path: str = "/services/T0/B0/s3cretT0KEN") -> None:
        self.statuses = list(statuses or [])        # answered in turn, then 200
        self.hang = hang                            # never answer (until the server stops)
        self.path = path
        self.requests: list[dict[str, Any]] = []
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.released = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{self.path}"

    def __enter__(self) -> "Webhook":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The bodies, once `count` were delivered (or the timeout passed)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and len(self.bodies) < count:
            time.sleep(0.02)
        return list(self.bodies)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(data)
                with hook.lock:
                    hook.requests.append({"path": self.path, "body": body,
                                          "type": self.headers.get("Content-Type")})
                    status = hook.statuses.pop(0) if hook.statuses else 200
                if hook.hang:
                    hook.released.wait(60)
                    return
                if 200 <= status < 300:
                    with hook.lock:
                        hook.bodies.append(body)
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:    # quiet
                pass

        return Handler
