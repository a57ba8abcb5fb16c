"""A local reward server speaking the `http` reward's protocol (rayflow/rewards/http.py), for tests.

It serves POSTs on 127.0.0.1 (port chosen by the OS) from a thread of the test process, keeps every
request body it received, and answers what `respond(call_index, body)` returns: (status, payload),
payload a JSON-able object or raw bytes.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from rayflow.rewards.http import decode_jpeg

Respond = Callable[[int, dict], "tuple[int, Any]"]


def mean_red(body: dict) -> list[float]:
    """The example server's reward: mean red channel in [0, 1] of each decoded image."""
    return [decode_jpeg(text)[..., 0].double().mean().item() / 255.0 for text in body["images"]]


def score_mean_red(call_index: int, body: dict) -> tuple[int, Any]:
    return 200, {"rewards": mean_red(body)}


class RewardServer:
    """Context manager: `with RewardServer(respond) as server: make_reward("http", url=server.url)`."""

    def __init__(self, respond: Respond = score_mean_red):
        self.respond = respond
        self.requests: list[dict] = []
        self.stopping = threading.Event()
        """Set on exit: a handler that waits on it (a slow server) ends with the test."""
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/score"

    def __enter__(self) -> "RewardServer":
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    index = len(server.requests)
                    server.requests.append(body)
                status, payload = server.respond(index, body)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                    pass

            def log_message(self, *args):  # keep the test output clean
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
