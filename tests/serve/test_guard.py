"""The API-key guard in front of every route of the served model (serve.guard), as an ASGI app on its own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from visionrl.serve.guard import KeyGuard


def _call(guard: KeyGuard, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, list[str]]:
    """One HTTP request through the guard: (status sent, paths the wrapped app saw)."""
    seen: list[str] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        sent.append(message)

    guard.app = app
    asyncio.run(guard({"type": "http", "path": path, "headers": headers}, receive, send))
    return sent[0]["status"], seen


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> KeyGuard:
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    return KeyGuard(app=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/invocations", "/v1/chat/completions", "/metrics", "/tokenize", "/docs"])
def test_every_route_needs_the_key(guard: KeyGuard, path: str) -> None:
    for headers in ([], [(b"authorization", b"Bearer wrong")], [(b"authorization", b"s3cret")]):
        assert _call(guard, path, headers) == (401, [])  # the model never sees the request
    assert _call(guard, path, [(b"Authorization", b"Bearer s3cret")]) == (200, [path])


def test_health_probes_stay_open_and_no_key_means_no_check(
    guard: KeyGuard, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _call(guard, "/health", []) == (200, ["/health"])
    assert _call(guard, "/ping", []) == (200, ["/ping"])
    monkeypatch.delenv("VLLM_API_KEY")
    assert _call(KeyGuard(app=None), "/invocations", []) == (200, ["/invocations"])  # type: ignore[arg-type]
