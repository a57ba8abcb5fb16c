"""JSON over HTTP for rewards that call a server (`http`, `vlm_judge`): one deadline for a whole
request (connect, send, every byte of the reply), and retries with exponential backoff and jitter for
as long as the outage budget allows.

Retried: no connection, no complete reply within the deadline, HTTP 429 and 5xx. Not retried (the
server answered, and would answer the same again): other HTTP errors and replies that are not JSON.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from rayflow.errors import ConfigError
from rayflow.rewards.validation import check_number

_CHUNK = 65536


class ServerError(RuntimeError):
    """The server answered, and retrying would not change its answer."""


class Unavailable(RuntimeError):
    """No usable answer this time (connection, deadline, 429/5xx): worth retrying."""


def check_url(url: Any, key: str) -> None:
    if not isinstance(url, str) or urllib.parse.urlparse(url).scheme not in ("http", "https"):
        raise ConfigError(key, url, "an http:// or https:// URL")


def check_client_kwargs(kwargs: dict, key: str) -> None:
    """The kwargs a reward passes to its JsonClient: url, timeout_s (one request's deadline), max_outage_s (the
    retry budget)."""
    check_url(kwargs.get("url"), f"{key}.url")
    check_number(kwargs.get("timeout_s", 60.0), f"{key}.timeout_s", "a finite number of seconds > 0", lambda v: v > 0)
    check_number(kwargs.get("max_outage_s", 0.0), f"{key}.max_outage_s", "a finite number of seconds >= 0 (0: no retries)",
                 lambda v: v >= 0)


def _error_detail(body: bytes) -> str:
    """The server's {"error": "..."} message, or the start of its body when it sent something else."""
    text = body.decode(errors="replace")
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return text[:500]
    return str(reply["error"])[:500] if isinstance(reply, dict) and "error" in reply else text[:500]


@dataclass
class JsonClient:
    url: str
    timeout_s: float = 60.0
    """Deadline of one request, from connecting to the last byte of the reply."""
    max_outage_s: float = 0.0
    """Keep retrying failed requests (with backoff) until this long after the first one started; 0: no retry."""
    backoff_s: float = 0.5
    """First retry delay; doubled each retry up to max_backoff_s, times a random factor in [0.5, 1.5)."""
    max_backoff_s: float = 30.0
    name: str = "http"
    """The reward's name, for messages."""
    headers: dict[str, str] | None = None

    def post(self, body: dict) -> Any:
        """The server's JSON reply to `body`, after retries; raises RuntimeError naming the reward and URL."""
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return self._post_once(body)
            except ServerError as e:
                raise RuntimeError(f"{self.name} reward {self.url}: {e}") from None
            except Unavailable as e:
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.5)
                attempt += 1
                if time.monotonic() - start + delay > self.max_outage_s:
                    raise RuntimeError(
                        f"{self.name} reward {self.url}: {e} (after {attempt} attempt(s) in "
                        f"{time.monotonic() - start:.1f}s; reward.max_outage_s={self.max_outage_s})"
                    ) from None
                time.sleep(delay)

    def _post_once(self, body: dict) -> Any:
        """One request under one deadline: the reply is read in a thread that the caller waits for at most
        timeout_s (a server that trickles bytes cannot hold the call past it)."""
        deadline = time.monotonic() + self.timeout_s
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["raw"] = self._exchange(body, deadline)
            except BaseException as e:  # handed to the waiting caller
                result["error"] = e

        thread = threading.Thread(target=run, daemon=True, name=f"rayflow-{self.name}-request")
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive() or ("raw" not in result and "error" not in result):
            raise Unavailable(f"no reply within timeout_s={self.timeout_s}s")
        if "error" in result:
            raise result["error"]
        try:
            return json.loads(result["raw"])
        except ValueError as e:  # json.JSONDecodeError, or bytes that are not text
            raise ServerError(f"the response is not JSON ({e})") from None

    def _exchange(self, body: dict, deadline: float) -> bytes:
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", **(self.headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                chunks = []
                # read1 returns what has arrived (read(n) waits for n bytes, so a trickle kept this thread and its
                # connection alive long after the caller gave up); with the deadline checked after each piece, the
                # thread ends within timeout_s of it.
                while chunk := response.read1(_CHUNK):
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise Unavailable(f"no reply within timeout_s={self.timeout_s}s")
                return b"".join(chunks)
        except urllib.error.HTTPError as e:
            detail = f"HTTP {e.code}: {_error_detail(e.read())}"
            raise (Unavailable if e.code == 429 or e.code >= 500 else ServerError)(detail) from None
        except (TimeoutError, urllib.error.URLError) as e:
            if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
                raise Unavailable(f"no reply within timeout_s={self.timeout_s}s") from None
            raise Unavailable(f"unreachable ({e})") from None
        except (OSError, http.client.HTTPException) as e:  # e.g. the server closed the connection without a reply
            raise Unavailable(f"the connection failed ({e!r})") from None
