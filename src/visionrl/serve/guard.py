"""The API key in front of every route of the served model, not only those under /v1.

vLLM's own key check guards paths under /v1; its SageMaker routes (`/invocations`), the tokenizer and scoring
routes, `/metrics` and the API docs answer without it. `KeyGuard` is an ASGI middleware that vLLM's server loads
(`--middleware visionrl.serve.guard.KeyGuard`): with a key set, every HTTP request needs `Authorization: Bearer
KEY`, except the health probes, which serve nothing but a status. The key comes from the server's environment
(never its command line, which any local user can read).
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from visionrl.serve.process import API_KEY_ENV

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# Probes of load balancers and SageMaker: a status code, no model output, no state change.
OPEN_PATHS = frozenset({"/health", "/ping"})
MIDDLEWARE = f"{__name__}.KeyGuard"


def authorized(headers: list[tuple[bytes, bytes]], key: str) -> bool:
    """True when the request's headers carry `Authorization: Bearer KEY` (compared in constant time)."""
    expected = f"Bearer {key}".encode()
    given = [value for name, value in headers if name.lower() == b"authorization"]
    return len(given) == 1 and hmac.compare_digest(given[0], expected)


class KeyGuard:
    """ASGI middleware: 401 for any HTTP request without the key, health probes excepted; no key set, no check."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.key = os.environ.get(API_KEY_ENV) or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.key is None
            or scope["type"] not in ("http", "websocket")
            or scope.get("path") in OPEN_PATHS
            or authorized(scope.get("headers", []), self.key)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: send the API key as `Authorization: Bearer KEY`"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": body})
