"""The port SageMaker talks to (`visionrl serve --sagemaker`): answers /ping from the first second, hands every
other request to vLLM once it is ready (`visionrl.serve.sagemaker_backend`), and owns the adapter routes.

- `GET|POST /ping`: 503 with what is loading (or why it failed) until vLLM answers, then vLLM's health (200, or
  503 once its engine has died, so SageMaker replaces the instance); answered within SageMaker's 2 s.
- `POST /invocations` (and vLLM's `/v1/...` routes): forwarded as they came, the answer streamed back when vLLM
  streams. The adapter is the body's `model` or SageMaker's adapter header; the body's is copied into the header
  (`adapter_header`); one that is not loaded is loaded first from the adapter root, if there is one.
- `POST /adapters {"name", "src"}`, `DELETE /adapters/NAME`: SageMaker's adapter routes, `src` fetched and checked
  against its manifest as at start.
"""

from __future__ import annotations

import http.client
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from visionrl.errors import BAD_INPUT_ERRORS
from visionrl.serve.process import ServerError
from visionrl.serve.sagemaker_backend import Backend

ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
PING_TIMEOUT_S = 1.5  # SageMaker gives /ping 2 s
INVOCATION_TIMEOUT_S = 900.0  # the longest a forwarded request may take (SageMaker's own limit is lower)
FORWARDED_HEADERS = ("content-type", "accept", "authorization")  # and every X-Amzn-SageMaker-* header
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"})
GENERATING_PATHS = frozenset({"/invocations", "/v1/chat/completions", "/v1/completions"})


class Front(ThreadingHTTPServer):
    """One thread a request."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], backend: Backend) -> None:
        self.backend = backend
        super().__init__(address, _Handler)


def requested_model(body: bytes, headers: dict[str, str]) -> str | None:
    """The adapter a request names: SageMaker's header, else the JSON body's `model`."""
    for key, value in headers.items():
        if key.lower() == ADAPTER_HEADER.lower():
            return value
    try:
        model = json.loads(body).get("model") if body else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None  # vLLM answers a body that is not a JSON object itself
    return model if isinstance(model, str) and model else None


def adapter_header(body: bytes, headers: dict[str, str]) -> dict[str, str]:
    """The headers of an /invocations request with SageMaker's adapter header set to the body's `model` where the
    caller named the adapter only in the body: vLLM's /invocations takes the adapter from that header and replaces
    the body's `model` with it, with nothing when the header is absent, so the base model would answer a request
    for an adapter (docs/ENGINE_NOTES.md, SageMaker's /invocations)."""
    model = requested_model(body, headers)
    if model is None or any(k.lower() == ADAPTER_HEADER.lower() for k in headers):
        return headers
    return {**headers, ADAPTER_HEADER: model}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Front

    def log_message(self, format: str, *args: Any) -> None:
        if not self.path.startswith("/ping"):  # SageMaker pings every few seconds: keep the log readable
            status = args[1] if len(args) > 1 else ""
            sys.stderr.write(f"[sagemaker] {self.command} {self.path} -> {status}\n")

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def do_DELETE(self) -> None:
        self._route()

    def _route(self) -> None:
        path = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else b""
        backend = self.server.backend
        if path == "/ping":
            return self._ping()
        if backend.state != "ready" or backend.handle is None:
            return self._json(503, backend.status())
        if path == "/adapters" and self.command == "POST":
            return self._register(body)
        if path.startswith("/adapters/") and self.command == "DELETE":
            return self._adapter_call(backend.unregister, unquote(path[len("/adapters/") :]), "unregistered")
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() in FORWARDED_HEADERS or k.lower().startswith("x-amzn-sagemaker-")}  # fmt: skip
        if self.command == "POST" and path in GENERATING_PATHS:
            if not self._ensure_adapter(requested_model(body, headers)):
                return
            if path == "/invocations":
                headers = adapter_header(body, headers)
        self._forward(body, headers)

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _ping(self) -> None:
        backend = self.server.backend
        if backend.state != "ready" or backend.handle is None:
            return self._json(503, backend.status())
        conn = http.client.HTTPConnection(urlsplit(backend.handle.url).netloc, timeout=PING_TIMEOUT_S)
        try:  # vLLM's own health: 200 while its engine is alive
            conn.request("GET", "/health")
            status = conn.getresponse().status
        except OSError as err:
            return self._json(503, {"status": "failed", "error": f"vLLM does not answer ({err})"})
        finally:
            conn.close()
        self._json(200 if status == 200 else 503, {"status": "ready" if status == 200 else "unhealthy"})

    def _register(self, body: bytes) -> None:
        try:
            request = json.loads(body or b"{}")
            name, src = str(request["name"]), str(request["src"])
        except (json.JSONDecodeError, KeyError, TypeError):
            return self._json(
                400, {"error": 'POST /adapters takes {"name": NAME, "src": "s3://... or a folder"}'}
            )
        self._adapter_call(lambda n: self.server.backend.register(n, src), name, "registered")

    def _adapter_call(self, call: Any, name: str, done: str) -> None:
        try:
            call(name)
        except ServerError as err:
            return self._json(err.status or 502, {"error": str(err)})
        except BAD_INPUT_ERRORS as err:  # a damaged export, an unservable adapter, a bad name
            return self._json(400, {"error": str(err)})
        self._json(200, {"message": f"Adapter {name} {done}"})

    def _ensure_adapter(self, model: str | None) -> bool:
        """Load `model` from the adapter root if it is not loaded; False (the error sent) when that fails."""
        backend = self.server.backend
        try:
            backend.ensure(model)
            return True
        except ServerError as err:
            self._json(err.status or 502, {"error": str(err)})
        except BAD_INPUT_ERRORS as err:
            self._json(404, {"error": f"adapter {model!r} is not loaded, nor an export under "
                                      f"{backend.adapter_root}: {err}"})  # fmt: skip
        return False

    def _forward(self, body: bytes, headers: dict[str, str]) -> None:
        """The request to vLLM as it came; the answer back, streamed when vLLM streams (no Content-Length)."""
        handle = self.server.backend.handle
        assert handle is not None
        conn = http.client.HTTPConnection(urlsplit(handle.url).netloc, timeout=INVOCATION_TIMEOUT_S)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            response = conn.getresponse()
        except OSError as err:
            conn.close()
            return self._json(502, {"error": f"vLLM did not answer ({err})"})
        try:
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in HOP_HEADERS:
                    self.send_header(key, value)
            if response.length is not None:
                data = response.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := response.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            conn.close()
