"""SageMaker's hosting contract in front of vLLM's OpenAI server: `visionrl serve --sagemaker`, which is what the
image runs as `docker run IMAGE serve` on a SageMaker endpoint.

The contract (docs/AWS.md): the container listens on port 8080 (`SAGEMAKER_BIND_TO_PORT` where SageMaker sets
another), `GET /ping` answers 200 once the model can answer and anything else before, `POST /invocations` takes the
request. vLLM's server has both routes but listens only after its model loaded, so a caller (and SageMaker's health
check) would see a refused connection rather than a 503 for the minutes an 8B model takes. Here a small front binds
the port at once and answers 503 (with what is loading) while, on a thread, the base model is fetched (a folder, the
model directory SageMaker mounts, or `s3://`), the adapters are fetched and checked against their manifests (as
`visionrl serve` does) and vLLM starts on 127.0.0.1; from then on every request goes through to vLLM unchanged
(`/invocations` takes the OpenAI chat request, images as data URLs; the adapter is the body's `model` or SageMaker's
`X-Amzn-SageMaker-Adapter-Identifier` header). `POST /adapters {"name", "src"}` and `DELETE /adapters/NAME`
(SageMaker's adapter routes) load and unload adapters at run time, `src` fetched and checked as at start.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlsplit

from visionrl.errors import BAD_INPUT_ERRORS, InputError, RunError
from visionrl.serve.adapters import load_adapter, unload_adapter
from visionrl.serve.model_source import local_model_dir
from visionrl.serve.process import ServerError, ServerHandle
from visionrl.serve.server import READY_TIMEOUT_S, prepare_server

PORT = 8080
PORT_ENV = "SAGEMAKER_BIND_TO_PORT"
MODEL_DIR_ENV = "SM_MODEL_DIR"
DEFAULT_MODEL_DIR = "/opt/ml/model"
BASE_ENV = "VISIONRL_BASE_MODEL"
ADAPTERS_ENV = "VISIONRL_ADAPTERS"
VLLM_ARGS_ENV = "VISIONRL_VLLM_ARGS"
ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
PING_TIMEOUT_S = 1.5  # SageMaker gives /ping 2 s
INVOCATION_TIMEOUT_S = 900.0  # the longest a forwarded request may take (SageMaker's own limit is lower)
FORWARDED_HEADERS = ("content-type", "accept", "authorization")  # and every X-Amzn-SageMaker-* header
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"})


def adapters_from_env(text: str | None) -> list[str]:
    """`VISIONRL_ADAPTERS` ("color-v1=s3://bucket/color/v1,count=s3://...") as `NAME=SRC` items."""
    items = [item.strip() for item in (text or "").split(",") if item.strip()]
    for item in items:
        name, sep, src = item.partition("=")
        if not (sep and name.strip() and src.strip()):
            raise InputError(
                f"{ADAPTERS_ENV} entry {item!r} is not NAME=SRC; write the adapters as "
                "'color-v1=s3://bucket/color/v1,count-v2=s3://bucket/count/v2'"
            )
    return items


def base_source(base: str | None, environ: Mapping[str, str]) -> str:
    """The base model: `base`, else $VISIONRL_BASE_MODEL, else the model directory SageMaker mounts."""
    return base or environ.get(BASE_ENV) or environ.get(MODEL_DIR_ENV) or DEFAULT_MODEL_DIR


def in_sagemaker(environ: Mapping[str, str]) -> bool:
    """Whether this looks like a SageMaker hosting container (`docker run IMAGE serve` with no base given): a base
    named by the environment, or SageMaker's model directory present."""
    return bool(environ.get(BASE_ENV) or environ.get(MODEL_DIR_ENV)) or Path(DEFAULT_MODEL_DIR).is_dir()


def hosting_port(port: int | None, environ: Mapping[str, str]) -> int:
    """`port`, else $SAGEMAKER_BIND_TO_PORT, else 8080."""
    text = environ.get(PORT_ENV, "") if port is None else str(port)
    try:
        return int(text) if text else PORT
    except ValueError:
        raise InputError(f"{PORT_ENV}={text!r} is not a port number") from None


class Backend:
    """vLLM behind the front: the base model and adapters fetched, then the server started and waited for, on a
    thread. `state` is loading, ready or failed (then `error` says why)."""

    def __init__(self, base: str, adapters: Sequence[str], *, cache_dir: Path | None, extra: Sequence[str],
                 ready_timeout_s: float, echo: TextIO | None, progress: Any) -> None:  # fmt: skip
        self.base, self.adapters, self.cache_dir = base, list(adapters), cache_dir
        self.extra, self.ready_timeout_s, self.echo, self.progress = (
            list(extra),
            ready_timeout_s,
            echo,
            progress,
        )
        self.state, self.error, self.stage = "loading", "", "starting"
        self.handle: ServerHandle | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False

    def load(self) -> None:
        try:
            self.stage = f"fetching the base model {self.base}"
            model = local_model_dir(
                self.base, self.cache_dir and self.cache_dir / "models", progress=self.progress
            )
            self.stage = "fetching and checking the adapters"
            handle = prepare_server(str(model), self.adapters, extra=self.extra, echo=self.echo,
                                    cache_dir=self.cache_dir and self.cache_dir / "adapters")  # fmt: skip
            with self._lock:
                if self._stopping:
                    return
                self.handle = handle.start()
            self.stage = "vLLM is loading the model"
            handle.wait_ready(self.ready_timeout_s, progress=self.progress)
            self.state = "ready"
        except (InputError, RunError) as err:  # a bad base or adapter, vLLM failing to start
            self.state, self.error = "failed", str(err)
        finally:
            self.done.set()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        if self.handle is not None:
            self.handle.stop()

    def status(self) -> dict[str, Any]:
        return {"status": self.state, "stage": self.stage, **({"error": self.error} if self.error else {})}


class Front(ThreadingHTTPServer):
    """The port SageMaker talks to; one thread a request."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], backend: Backend, cache_dir: Path | None) -> None:
        self.backend, self.cache_dir = backend, cache_dir
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Front

    def log_message(self, format: str, *args: Any) -> None:
        if not self.path.startswith("/ping"):  # SageMaker pings every few seconds: keep the log readable
            sys.stderr.write(
                f"[sagemaker] {self.command} {self.path} -> {args[1] if len(args) > 1 else ''}\n"
            )

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def do_DELETE(self) -> None:
        self._route()

    def _route(self) -> None:
        path = urlsplit(self.path).path
        body = self._body()
        backend = self.server.backend
        if path == "/ping":
            return self._ping()
        if backend.state != "ready" or backend.handle is None:
            return self._json(503, backend.status())
        if path == "/adapters" and self.command == "POST":
            return self._register(body, backend.handle)
        if path.startswith("/adapters/") and self.command == "DELETE":
            return self._unregister(unquote(path[len("/adapters/") :]), backend.handle)
        self._forward(body, backend.handle)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

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
        try:  # vLLM's own health: 200 while its engine is alive
            status = _request(backend.handle, "GET", "/health", b"", {}, PING_TIMEOUT_S)[0]
        except OSError as err:
            return self._json(503, {"status": "failed", "error": f"vLLM does not answer ({err})"})
        self._json(200 if status == 200 else 503, {"status": "ready" if status == 200 else "unhealthy"})

    def _register(self, body: bytes, handle: ServerHandle) -> None:
        try:
            request = json.loads(body or b"{}")
            name, src = request["name"], request["src"]
            load_adapter(handle.url, str(name), str(src), cache_dir=_sub(self.server.cache_dir, "adapters"))
        except (json.JSONDecodeError, KeyError, TypeError):
            return self._json(
                400, {"error": 'POST /adapters takes {"name": NAME, "src": "s3://... or a folder"}'}
            )
        except ServerError as err:
            return self._json(err.status or 502, {"error": str(err)})
        except BAD_INPUT_ERRORS as err:  # a damaged export, an unservable adapter, a bad name
            return self._json(400, {"error": str(err)})
        self._json(200, {"message": f"Adapter {name} registered"})

    def _unregister(self, name: str, handle: ServerHandle) -> None:
        try:
            unload_adapter(handle.url, name)
        except ServerError as err:
            return self._json(err.status or 502, {"error": str(err)})
        self._json(200, {"message": f"Adapter {name} unregistered"})

    def _forward(self, body: bytes, handle: ServerHandle) -> None:
        """The request to vLLM as it came; the answer back, streamed when vLLM streams (no Content-Length)."""
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() in FORWARDED_HEADERS or k.lower().startswith("x-amzn-sagemaker-")}  # fmt: skip
        if urlsplit(self.path).path == "/invocations":
            headers = adapter_header(body, headers)
        try:
            conn = http.client.HTTPConnection(urlsplit(handle.url).netloc, timeout=INVOCATION_TIMEOUT_S)
            conn.request(self.command, self.path, body=body or None, headers=headers)
            response = conn.getresponse()
        except OSError as err:
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


def adapter_header(body: bytes, headers: dict[str, str]) -> dict[str, str]:
    """The headers of an /invocations request with SageMaker's adapter header set to the body's `model` where the
    caller named the adapter only in the body: vLLM's /invocations takes the adapter from that header and replaces
    the body's `model` with it, with nothing when the header is absent, so the base model would answer a request
    for an adapter (docs/ENGINE_NOTES.md, SageMaker's /invocations)."""
    if any(k.lower() == ADAPTER_HEADER.lower() for k in headers):
        return headers
    try:
        model = json.loads(body).get("model") if body else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return headers  # vLLM answers a body that is not a JSON object itself
    return {**headers, ADAPTER_HEADER: model} if isinstance(model, str) and model else headers


def _sub(folder: Path | None, name: str) -> Path | None:
    return None if folder is None else folder / name


def _request(handle: ServerHandle, method: str, path: str, body: bytes, headers: dict[str, str],
             timeout_s: float) -> tuple[int, bytes]:  # fmt: skip
    conn = http.client.HTTPConnection(urlsplit(handle.url).netloc, timeout=timeout_s)
    try:
        conn.request(method, path, body=body or None, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def serve_sagemaker(
    base: str | None = None,
    adapters: Sequence[str] = (),
    *,
    host: str = "0.0.0.0",
    port: int | None = None,
    extra: Sequence[str] = (),
    cache_dir: str | os.PathLike[str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    out: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """`visionrl serve --sagemaker`: the front on `host:port` at once, the model behind it as it loads; runs until
    SIGTERM/SIGINT (0) or until loading fails or vLLM dies (1, the reason on stderr). Adapters are `adapters`
    plus $VISIONRL_ADAPTERS; $VISIONRL_VLLM_ARGS adds vLLM flags (e.g. "--max-loras 4 --max-lora-rank 64")."""
    environ = os.environ if environ is None else environ
    out = out or sys.stdout
    named = adapters_from_env(environ.get(ADAPTERS_ENV)) + list(adapters)
    extra = shlex.split(environ.get(VLLM_ARGS_ENV, "")) + list(extra)
    cache = Path(cache_dir) if cache_dir is not None else None
    say = lambda text: print(f"[sagemaker] {text}", file=sys.stderr, flush=True)  # noqa: E731
    backend = Backend(base_source(base, environ), named, cache_dir=cache, extra=extra,
                      ready_timeout_s=ready_timeout_s, echo=sys.stderr, progress=say)  # fmt: skip
    try:
        front = Front((host, hosting_port(port, environ)), backend, cache)
    except OSError as err:
        raise InputError(f"cannot listen on {host}:{hosting_port(port, environ)} ({err.strerror or err}); "
                         "another server may hold the port") from None  # fmt: skip
    url = f"http://{host}:{front.server_address[1]}"
    print(f"SageMaker hosting contract at {url} (/ping, /invocations, /adapters); loading {backend.base}",
          file=out, flush=True)  # fmt: skip
    return _run(front, backend, url, out)


def _run(front: Front, backend: Backend, url: str, out: TextIO) -> int:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    threading.Thread(target=front.serve_forever, name="sagemaker-front", daemon=True).start()
    threading.Thread(target=backend.load, name="sagemaker-load", daemon=True).start()
    start, code, announced = time.monotonic(), 0, False
    try:
        while not stop.wait(0.5):
            if backend.state == "failed":
                print(f"error: {backend.error}", file=sys.stderr, flush=True)
                code = 1
                break
            if backend.state == "ready" and not announced:
                print(
                    f"ready after {time.monotonic() - start:.0f} s: {url}/invocations", file=out, flush=True
                )
                announced = True
            handle = backend.handle
            exited = handle.poll() if handle is not None and announced else None
            if handle is not None and exited is not None:
                print(f"error: vLLM exited with code {exited}; its last log lines:\n{handle.log_tail()}",
                      file=sys.stderr, flush=True)  # fmt: skip
                code = 1
                break
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        front.shutdown()
        front.server_close()
        backend.stop()
    return code
