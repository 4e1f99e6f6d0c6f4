"""The HTTP side of the `server` engine: one bounded exchange with a generation server at a time.

Every exchange has a deadline for all of it (connect, send, headers, body), read in chunks with the
socket's timeout set to what is left, so a server that stalls or trickles ends it with `TimedOut`
(naming the config key that bounds it), never a hang; and a limit on the answer's bytes, past
which it is refused without being read further. A server that is not there (refused, reset,
closed mid-answer) is `Unreachable`; one that answers with an error status is `Refused`.
"""

from __future__ import annotations

import http.client
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from grpo.rollout import wire

CHUNK = 1 << 16


class ServerError(RuntimeError):
    """The generation server could not serve the run; the message is one line that says what
    happened and what to do."""


class Unreachable(ServerError):
    """Nothing answers at the server's address (refused, reset, or the connection closed)."""


class TimedOut(ServerError):
    """An exchange took longer than the config key `key` allows."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


class Refused(ServerError):
    """The server answered with an error status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class HTTPClient:
    """Requests to one server (`url`: http://HOST:PORT[/prefix]) with its shared secret."""

    def __init__(self, url: str, api_key: str | None):
        parts = urlsplit(url)
        self.url = url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.api_key = api_key

    def local_address(self, timeout: float) -> str:
        """The address this machine reaches the server from (where the server can reach it back)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
                return sock.getsockname()[0]
        except OSError as error:
            raise Unreachable(f"nothing answers at {self.url} ({error})") from None

    def call(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        timeout: float,
        key: str,
        limit: int = 1 << 20,
    ) -> Any:
        """The JSON answer of `method path` (with `body` as JSON), all of it within `timeout`
        seconds (else TimedOut naming `key`) and `limit` bytes (else Refused)."""
        deadline = time.monotonic() + timeout
        data = None if body is None else wire.dumps(body)
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        what = f"{method} {path}"
        try:
            connection.request(method, self.prefix + path, body=data, headers=headers)
            _left(connection, deadline, what, key)
            response = connection.getresponse()
            payload = _read(response, connection, deadline, limit, what, key)
        except TimeoutError:
            raise TimedOut(
                f"{what} to {self.url} took longer than {key}={timeout:g} s", key
            ) from None
        except (ConnectionError, http.client.HTTPException, OSError) as error:
            raise Unreachable(
                f"{what} to {self.url} failed: {type(error).__name__}: {error}"
            ) from None
        finally:
            connection.close()
        if response.status != 200:
            raise Refused(
                f"{what} to {self.url} was refused: HTTP {response.status} {_message(payload)}",
                response.status,
            )
        if not payload:  # vLLM's /health answers 200 with no body
            return None
        try:
            return wire.loads(payload, f"the answer to {what}")
        except wire.WireError as error:
            raise Refused(f"{error}", response.status) from None


def _left(connection: http.client.HTTPConnection, deadline: float, what: str, key: str) -> None:
    """The socket's timeout set to the time left before `deadline` (TimeoutError when none is)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(what)
    if connection.sock is not None:
        connection.sock.settimeout(left)


def _read(response, connection, deadline: float, limit: int, what: str, key: str) -> bytes:
    """The answer's body, at most `limit` bytes, before `deadline`."""
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise Refused(
            f"the answer to {what} is {int(length)} bytes, over its bound of {limit}", 413
        )
    parts, size = [], 0
    while True:
        _left(connection, deadline, what, key)
        chunk = response.read1(CHUNK) if hasattr(response, "read1") else response.read(CHUNK)
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > limit:
            raise Refused(f"the answer to {what} is over its bound of {limit} bytes", 413)
        parts.append(chunk)


def _message(payload: bytes) -> str:
    """The error message of an answer (vLLM's {"error": {"message": ...}}, or its text), short."""
    try:
        value = wire.loads(payload, "an error answer")
        error = value.get("error") if isinstance(value, dict) else None
        text = error.get("message") if isinstance(error, dict) else (error or value)
    except wire.WireError:
        text = payload[:300].decode("utf-8", "replace")
    return " ".join(str(text).split())[:300]
