"""The HTTP plumbing of `grpo serve`: a threading HTTP server (the standard library's) whose
handler bounds what it reads, checks the shared secret, and answers JSON.

A request's body is read only when it declares its length, at most wire.MAX_REQUEST_BYTES, within
the handler's socket timeout (REQUEST_SECONDS); every route but the open ones (`/health`,
`/version`) needs `Authorization: Bearer <secret>`, compared in constant time. A route is a
function of the parsed JSON body (None for GET) returning (status, JSON value); a `HTTPFailure`
it raises becomes that status with `{"error": {"message": ...}}`, as vLLM's server answers.
"""

from __future__ import annotations

import hmac
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

from grpo.config.errors import ConfigError
from grpo.rollout import wire

log = logging.getLogger(__name__)

REQUEST_SECONDS = 60.0
"""How long a client may take to send its request (a slow or silent client is dropped)."""
OPEN_ROUTES = frozenset({"/health", "/version"})

Route = Callable[[Any, dict], tuple[int, Any]]


class HTTPFailure(Exception):
    """An answer with an error status: `status`, a message, and optional extra fields."""

    def __init__(self, status: int, message: str, **extra):
        super().__init__(message)
        self.status, self.extra = status, extra


def _answer(handler: BaseHTTPRequestHandler, status: int, value: Any) -> None:
    body = wire.dumps(value)
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _failure(status: int, message: str, **extra) -> dict:
    return {"error": {"message": message, "code": status}, **extra}


def make_handler(routes: dict[tuple[str, str], Route], api_key: str) -> type:
    """A request handler class that serves `routes` ((method, path) -> route) behind `api_key`."""
    secret = api_key.encode()

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_SECONDS
        protocol_version = "HTTP/1.1"
        server_version = "grpo-serve"

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
            log.debug("%s " + format, self.address_string(), *args)

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "")
            token = given[7:].encode() if given.startswith("Bearer ") else b""
            return hmac.compare_digest(token, secret)

        def _body(self) -> Any:
            if self.headers.get("Transfer-Encoding"):
                raise HTTPFailure(411, "send the body with a Content-Length, not chunked")
            length = self.headers.get("Content-Length", "0")
            if not length.isdigit():
                raise HTTPFailure(400, "Content-Length is not a number")
            if int(length) > wire.MAX_REQUEST_BYTES:
                raise HTTPFailure(
                    413, f"the body is {length} bytes, over the bound of {wire.MAX_REQUEST_BYTES}"
                )
            data = self.rfile.read(int(length))
            if len(data) != int(length):
                raise HTTPFailure(400, "the body ended before its Content-Length")
            if not data:
                return {}
            try:
                return wire.loads(data, "the request body")
            except wire.WireError as error:
                raise HTTPFailure(400, str(error)) from None

        def _serve(self, method: str) -> None:
            # one request a connection: a refused request's body may be left unread
            self.close_connection = True
            path = urlsplit(self.path).path.rstrip("/") or "/"
            route = routes.get((method, path))
            try:
                if route is None:
                    known = any(p == path for _, p in routes)
                    raise HTTPFailure(405 if known else 404, f"no route {method} {path}")
                if path not in OPEN_ROUTES and not self._authorized():
                    raise HTTPFailure(401, "this endpoint takes the server's shared secret")
                body = self._body() if method == "POST" else None
                status, value = route(body, dict(self.headers))
            except HTTPFailure as failure:
                status, value = (
                    failure.status,
                    _failure(failure.status, str(failure), **failure.extra),
                )
            except Exception as error:  # a bug or a failed model call: said, never a traceback sent
                log.exception("grpo serve: %s %s failed", method, path)
                status, value = 500, _failure(500, f"{type(error).__name__}: {str(error)[:300]}")
            try:
                _answer(self, status, value)
            except ConnectionError:  # the client gave up (its timeout, a killed trainer)
                log.info("grpo serve: %s %s: the client left before its answer", method, path)

        def do_GET(self) -> None:  # noqa: N802 (the base class's name)
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

    return Handler


class Serving:
    """A running server: its address, and `shutdown` (from any thread)."""

    def __init__(self, httpd: ThreadingHTTPServer):
        self.httpd = httpd
        self.host, self.port = httpd.server_address[:2]
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start_thread(self) -> "Serving":
        """Serve in a daemon thread of this process (the tests' servers)."""
        self.thread = threading.Thread(target=self.serve_forever, name="grpo-serve", daemon=True)
        self.thread.start()
        return self

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def listen(host: str, port: int, handler: type) -> Serving:
    """A threading HTTP server bound to (host, port) (port 0: a free one); a ConfigError naming
    --host/--port when the address cannot be taken."""
    try:
        httpd = ThreadingHTTPServer((host, port), handler)
    except OSError as error:
        raise ConfigError(
            f"grpo serve: cannot listen on {host}:{port} ({error.strerror or error}); choose another "
            "--port (0: a free one) or --host"
        ) from None
    httpd.daemon_threads = True
    return Serving(httpd)
