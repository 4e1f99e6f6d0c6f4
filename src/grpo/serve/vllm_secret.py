"""The shared secret on every route of a vLLM server that `grpo serve --engine vllm` starts.

vLLM's own `--api-key` guards only its /v1, /v2, /inference and /cohere routes; the routes that
change the weights (/init_weight_transfer_engine, /update_weights, ...), pause the server or call
into its workers (/collective_rpc, which VLLM_SERVER_DEV_MODE opens with them) are open to whoever
reaches the port. `SharedSecret` is an ASGI middleware, given to vLLM by its own `--middleware`
option, that answers 401 to any request but /health and /version without `Authorization: Bearer
<secret>` (GRPO_SERVE_API_KEY, compared in constant time), as `grpo serve --engine hf` does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

API_KEY_ENV = "GRPO_SERVE_API_KEY"
OPEN_ROUTES = frozenset({"/health", "/version"})


class SharedSecret:
    """The ASGI middleware (see the module's docstring)."""

    def __init__(self, app) -> None:
        key = os.environ.get(API_KEY_ENV, "")
        if not key:
            raise RuntimeError(f"grpo serve --engine vllm: {API_KEY_ENV} is not set")
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        given = b""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                given = value
                break
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(token).digest(), self.digest)

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan events
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if path in OPEN_ROUTES or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {"error": {"message": "this endpoint takes the server's shared secret", "code": 401}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
