"""SageMaker's hosting contract without vLLM: the settings read from the environment, and the front against a
small stand-in for vLLM's server (what it forwards, the /ping answers in each state, a streamed answer passed
through as it comes, the adapter routes). The real container is exercised in tests/integration/test_sagemaker_container.py.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from visionrl.errors import InputError
from visionrl.serve import sagemaker_backend
from visionrl.serve.process import ServerHandle
from visionrl.serve.sagemaker import adapters_from_env, base_source, hosting_port, in_sagemaker
from visionrl.serve.sagemaker_backend import BASE_NAME, Backend
from visionrl.serve.sagemaker_front import ADAPTER_HEADER, Front, adapter_header, requested_model


def test_adapters_from_the_environment() -> None:
    assert adapters_from_env("color-v1=s3://b/color/v1, count=/models/count ,") == [
        "color-v1=s3://b/color/v1",
        "count=/models/count",
    ]
    assert adapters_from_env("") == adapters_from_env(None) == []
    with pytest.raises(InputError, match=r"VISIONRL_ADAPTERS entry 's3://b/x' is not NAME=SRC"):
        adapters_from_env("a=s3://b/a,s3://b/x")


def test_base_model_and_port_from_the_environment() -> None:
    env = {"SM_MODEL_DIR": "/opt/ml/model-x", "VISIONRL_BASE_MODEL": "s3://b/base"}
    assert base_source("/given", env) == "/given"
    assert base_source(None, env) == "s3://b/base"
    assert base_source(None, {"SM_MODEL_DIR": "/opt/ml/model-x"}) == "/opt/ml/model-x"
    assert base_source(None, {}) == "/opt/ml/model"
    assert hosting_port(None, {}) == 8080 and hosting_port(None, {"SAGEMAKER_BIND_TO_PORT": "9001"}) == 9001
    assert hosting_port(7000, {"SAGEMAKER_BIND_TO_PORT": "9001"}) == 7000
    with pytest.raises(InputError, match="SAGEMAKER_BIND_TO_PORT='x' is not a port number"):
        hosting_port(None, {"SAGEMAKER_BIND_TO_PORT": "x"})
    assert in_sagemaker({"SM_MODEL_DIR": "/m"}) and in_sagemaker({"VISIONRL_BASE_MODEL": "s3://b/m"})
    assert in_sagemaker({}) == Path("/opt/ml/model").is_dir()


def test_the_body_model_becomes_the_adapter_header() -> None:
    body = json.dumps({"model": "a1", "messages": []}).encode()
    assert adapter_header(body, {"Content-Type": "application/json"}) == {
        "Content-Type": "application/json",
        ADAPTER_HEADER: "a1",
    }
    given = {ADAPTER_HEADER.lower(): "a2"}  # the caller's header wins, whatever its case
    assert adapter_header(body, given) == given
    assert adapter_header(b'{"messages": []}', {}) == {}
    assert adapter_header(b"not json", {}) == {} and adapter_header(b"[1]", {}) == {}
    assert requested_model(body, {"x-amzn-sagemaker-adapter-identifier": "a3"}) == "a3"
    assert requested_model(body, {}) == "a1" and requested_model(b'{"model": ""}', {}) is None


def test_an_adapter_under_the_root_loads_once_on_its_first_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[tuple[str, str]] = []

    def load(url: str, name: str, src: str, **_: Any) -> Path:
        time.sleep(0.2)  # the download: a second request comes meanwhile
        loads.append((name, src))
        return Path(src)

    monkeypatch.setattr(sagemaker_backend, "load_adapter", load)
    backend = Backend("/m", ["a1=s3://b/a1"], cache_dir=None, extra=[], ready_timeout_s=1, echo=None, progress=None,
                      adapter_root="s3://b/adapters/")  # fmt: skip
    backend.handle = ServerHandle(["true"], url="http://127.0.0.1:9")
    threads = [threading.Thread(target=backend.ensure, args=("color-v3",)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for loaded in (BASE_NAME, "a1", None, "color-v3"):  # the base, a start-up adapter, no model, a loaded one
        backend.ensure(loaded)
    assert loads == [("color-v3", "s3://b/adapters/color-v3")] and "color-v3" in backend.loaded
    with pytest.raises(InputError, match="'..' is not an adapter name"):
        backend.ensure("..")
    without_root = Backend("/m", [], cache_dir=None, extra=[], ready_timeout_s=1, echo=None, progress=None)
    without_root.ensure("color-v4")  # nothing to load from: vLLM answers that the model does not exist
    assert len(loads) == 1


class _StandIn(BaseHTTPRequestHandler):
    """vLLM's server as the front sees it: /health, /invocations (echoes what it got), a streamed route."""

    protocol_version = "HTTP/1.1"
    health = 200
    seen: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._reply(self.health, {})
        self._reply(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                chunk = f"data: {i}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                time.sleep(0.3)
            self.wfile.write(b"0\r\n\r\n")
            return
        self._reply(200, {"choices": [{"message": {"content": "red"}}]})


@pytest.fixture
def front(tmp_path: Path) -> Iterator[tuple[str, Backend]]:
    """The front on a free port, its backend a stand-in vLLM (state set by each test)."""
    _StandIn.health, _StandIn.seen = 200, []
    vllm = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    backend = Backend(
        "/models/base", [], cache_dir=tmp_path, extra=[], ready_timeout_s=1, echo=None, progress=None
    )
    server = Front(("127.0.0.1", 0), backend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    backend.handle = ServerHandle(["true"], url=f"http://127.0.0.1:{vllm.server_address[1]}")
    try:
        yield f"127.0.0.1:{server.server_address[1]}", backend
    finally:
        for s in (server, vllm):
            s.shutdown()
            s.server_close()


def _call(host: str, method: str, path: str, payload: Any = None, headers: dict[str, str] | None = None
          ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    conn = http.client.HTTPConnection(host, timeout=10)
    try:
        body = None if payload is None else json.dumps(payload)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_ping_answers_in_every_state(front: tuple[str, Backend]) -> None:
    host, backend = front
    backend.stage = "vLLM is loading the model"
    status, _, body = _call(host, "GET", "/ping")
    assert status == 503 and json.loads(body) == {"status": "loading", "stage": "vLLM is loading the model"}
    status, _, body = _call(host, "POST", "/invocations", {"messages": []})
    assert status == 503 and json.loads(body)["status"] == "loading" and _StandIn.seen == []
    backend.state = "ready"
    assert _call(host, "GET", "/ping")[0] == 200 and _call(host, "POST", "/ping")[0] == 200
    _StandIn.health = 500  # vLLM's engine died: SageMaker must see it and replace the instance
    status, _, body = _call(host, "GET", "/ping")
    assert status == 503 and json.loads(body) == {"status": "unhealthy"}
    backend.state, backend.error = "failed", "base model '/models/base' is not a directory"
    status, _, body = _call(host, "GET", "/ping")
    assert status == 503 and json.loads(body)["error"] == backend.error


def test_invocations_are_forwarded_with_the_adapter_header(front: tuple[str, Backend]) -> None:
    host, backend = front
    backend.state = "ready"
    request = {"model": "a1", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": "Bearer k", "X-Amzn-SageMaker-Custom-Attributes": "c=1", "X-Other": "dropped"}
    status, _, body = _call(host, "POST", "/invocations", request, headers)
    assert status == 200 and json.loads(body) == {"choices": [{"message": {"content": "red"}}]}
    (seen,) = _StandIn.seen
    assert seen["path"] == "/invocations" and json.loads(seen["body"]) == request
    sent = {k.lower(): v for k, v in seen["headers"].items()}
    assert sent["x-amzn-sagemaker-adapter-identifier"] == "a1"
    assert sent["authorization"] == "Bearer k" and sent["x-amzn-sagemaker-custom-attributes"] == "c=1"
    assert sent["content-type"] == "application/json" and "x-other" not in sent


def test_a_streamed_answer_passes_through_as_it_comes(front: tuple[str, Backend]) -> None:
    host, backend = front
    backend.state = "ready"
    conn = http.client.HTTPConnection(host, timeout=10)
    conn.request("POST", "/stream", body="{}", headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Transfer-Encoding") == "chunked"
    first = response.read1(1024)
    assert first == b"data: 0\n\n"  # before the stand-in has written the rest (0.6 s later)
    assert first + response.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    conn.close()


def test_adapter_routes(front: tuple[str, Backend], tmp_path: Path) -> None:
    host, backend = front
    backend.state = "ready"
    status, _, body = _call(host, "POST", "/adapters", {"src": "s3://b/a"})
    assert status == 400 and '{"name": NAME, "src"' in json.loads(body)["error"]
    (tmp_path / "empty").mkdir()
    status, _, body = _call(host, "POST", "/adapters", {"name": "a9", "src": str(tmp_path / "empty")})
    assert status == 400 and "adapter" in json.loads(body)["error"] and _StandIn.seen == []
    status, _, body = _call(host, "DELETE", "/adapters/a%201")
    assert _StandIn.seen[0]["path"] == "/v1/unload_lora_adapter"
    assert json.loads(_StandIn.seen[0]["body"]) == {"lora_name": "a 1"}
    assert (status, json.loads(body)) == (200, {"message": "Adapter a 1 unregistered"})
