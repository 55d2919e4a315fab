"""SageMaker's hosting contract, end to end on the tiny Qwen3-VL (slow): `visionrl serve --sagemaker` as the image
runs it, with the base model and an adapter on a local S3 server (moto, 127.0.0.1) named by the environment as a
SageMaker endpoint's container gets them (VISIONRL_BASE_MODEL, VISIONRL_ADAPTERS), the real vLLM OpenAI server
(CPU build) behind it.

/ping answers 503 from the first second and 200 once the model answers; /invocations takes the OpenAI chat request
with an image, the adapter named in the body or by SageMaker's adapter header; adapters load and unload at run time
through /adapters, checked against their manifests; `visionrl eval --sagemaker-endpoint` through boto3's SageMaker
runtime client gives the answers `eval --endpoint` gives; `eval --endpoint --env` plays the local engine's episodes
(the tool loop client-side); SIGTERM stops the front and vLLM.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from tests.aws_local import moto_server, point_aws_at
from tests.integration.random_adapter import random_adapter

from visionrl.adapter.export import export_adapter
from visionrl.adapter.storage import filesystem
from visionrl.cli import main
from visionrl.config_env import EnvConfig
from visionrl.errors import InputError
from visionrl.eval.endpoint import evaluate_endpoint
from visionrl.eval.local import evaluate_local
from visionrl.openai_wire import image_data_url
from visionrl.serve.model_source import LISTING_NAME, local_model_dir
from visionrl.serve.process import ServerHandle, free_port

pytestmark = pytest.mark.slow

BUCKET = "visionrl-sm"
ENDPOINT_NAME = "visionrl-test-endpoint"
COLORS = [(220, 30, 30), (30, 200, 40), (40, 60, 220), (240, 220, 30)]


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory, pretrained_tiny_model: Path) -> Iterator[dict[str, Any]]:
    """moto S3 with the pre-trained tiny model (it answers a colour and ends its turn) under s3://BUCKET/base and
    adapters a1, a2 (exported) and bad (tampered)."""
    tiny_model = pretrained_tiny_model
    import boto3

    home = tmp_path_factory.mktemp("aws")
    with moto_server(home) as url, pytest.MonkeyPatch.context() as mp:
        point_aws_at(mp, url, home)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        fs, _ = filesystem(f"s3://{BUCKET}")
        fs.put(str(tiny_model), f"{BUCKET}/base", recursive=True)
        for name, seed in (("a1", 1), ("a2", 2), ("bad", 3)):
            export_adapter(random_adapter(tiny_model, home / name, seed=seed), f"s3://{BUCKET}/{name}")
        export_adapter(home / "a2", f"s3://{BUCKET}/root/a3")  # a2's weights under the adapter root as a3
        fs.pipe(f"{BUCKET}/bad/adapter_config.json", b'{"r": 8}')  # changed after its export
        yield {"url": url, "home": home, "env": dict(os.environ)}


def _get(url: str, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    host = url.split("://", 1)[1]
    conn = http.client.HTTPConnection(host, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _post(url: str, path: str, payload: Any, headers: dict[str, str] | None = None,
          method: str = "POST") -> tuple[int, Any]:  # fmt: skip
    host = url.split("://", 1)[1]
    conn = http.client.HTTPConnection(host, timeout=120)
    try:
        body = None if payload is None else json.dumps(payload)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def container(aws: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`visionrl serve --sagemaker` as a child process, with /ping polled from its first second until 200."""
    port = free_port()
    env = {**aws["env"], "VISIONRL_BASE_MODEL": f"s3://{BUCKET}/base", "VISIONRL_ADAPTERS": f"a1=s3://{BUCKET}/a1",
           "VISIONRL_MODEL_CACHE": str(aws["home"] / "models"), "VISIONRL_ADAPTER_CACHE": str(aws["home"] / "adapters"),
           "VISIONRL_VLLM_ARGS": "--max-loras 2", "VISIONRL_ADAPTER_ROOT": f"s3://{BUCKET}/root/"}  # fmt: skip
    command = [
        sys.executable,
        "-m",
        "visionrl.cli",
        "serve",
        "--sagemaker",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    handle = ServerHandle(
        command, url=f"http://127.0.0.1:{port}", env=env, log_path=aws["home"] / "container.log"
    )
    pings: list[tuple[int, Any]] = []
    with handle:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and handle.poll() is None:
            try:
                status, body = _get(handle.url, "/ping", timeout=2.0)
            except OSError:
                time.sleep(0.1)  # the front binds within a second of the start
                continue
            pings.append((status, json.loads(body or b"null")))
            if status == 200:
                break
            time.sleep(0.5)
        assert pings and pings[-1][0] == 200, handle.log_tail()
        yield {"handle": handle, "url": handle.url, "pings": pings}


def _chat(color: tuple[int, int, int]) -> list[dict[str, Any]]:
    image = image_data_url(Image.new("RGB", (64, 64), color))
    parts = [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": "What color is it?"},
    ]
    return [{"role": "user", "content": parts}]


def _answer(url: str, color: tuple[int, int, int], model: str | None, header: str | None = None) -> str:
    request: dict[str, Any] = {"messages": _chat(color), "max_tokens": 4, "temperature": 0.0}
    if model is not None:
        request["model"] = model
    headers = {"X-Amzn-SageMaker-Adapter-Identifier": header} if header else {}
    status, body = _post(url, "/invocations", request, headers)
    assert status == 200, body
    return str(body["choices"][0]["message"]["content"])


def test_ping_is_503_while_the_model_loads_then_200(container: dict[str, Any], aws: dict[str, Any]) -> None:
    statuses = [status for status, _ in container["pings"]]
    assert statuses[0] == 503 and statuses[-1] == 200 and set(statuses) == {503, 200}
    assert container["pings"][0][1]["status"] == "loading" and container["pings"][0][1]["stage"]
    # The base model came from S3 into the model cache, complete (its listing is written last).
    (copy,) = (aws["home"] / "models").iterdir()
    assert (copy / LISTING_NAME).is_file() and (copy / "config.json").is_file()


def test_invocations_take_the_adapter_from_the_body_or_the_header(container: dict[str, Any]) -> None:
    url = container["url"]
    by_body = [_answer(url, c, "a1") for c in COLORS]
    by_header = [_answer(url, c, None, header="a1") for c in COLORS]
    base = [_answer(url, c, None) for c in COLORS]
    assert by_body == by_header
    assert by_body != base  # the adapter is applied
    assert [_answer(url, c, "base") for c in COLORS] == base  # the base model's name at the endpoint
    assert all(answer for answer in by_body + base)


def test_adapters_load_and_unload_at_run_time(container: dict[str, Any]) -> None:
    url = container["url"]
    status, body = _post(url, "/adapters", {"name": "a2", "src": f"s3://{BUCKET}/a2"})
    assert (status, body["message"]) == (200, "Adapter a2 registered")
    status, models = _get(url, "/v1/models")
    assert status == 200 and {"a1", "a2"} <= {m["id"] for m in json.loads(models)["data"]}
    _answer(url, COLORS[0], "a2")  # 200: a2 answers

    status, body = _post(url, "/adapters", {"name": "bad", "src": f"s3://{BUCKET}/bad"})
    assert status == 400 and "does not match the sha256 in its manifest" in body["error"]
    status, body = _post(url, "/adapters", {"name": "x"})
    assert status == 400 and '{"name": NAME, "src"' in body["error"]

    a2 = [_answer(url, c, "a2") for c in COLORS]
    status, body = _post(url, "/adapters/a2", None, method="DELETE")
    assert (status, body["message"]) == (200, "Adapter a2 unregistered")
    status, body = _post(url, "/invocations", {"model": "a2", "messages": _chat(COLORS[0]), "max_tokens": 2})
    assert status == 404 and "is not loaded, nor an export under" in body["error"]  # not under the root

    # Under the adapter root: loaded on its first request, by the body's model or the header.
    assert [_answer(url, c, "a3") for c in COLORS] == a2  # the same weights as a2
    assert [_answer(url, c, None, header="a3") for c in COLORS] == a2
    status, models = _get(url, "/v1/models")
    assert "a3" in {m["id"] for m in json.loads(models)["data"]}


class _Runtime(BaseHTTPRequestHandler):
    """SageMaker's runtime API as boto3 calls it: POST /endpoints/NAME/invocations, handed to the container."""

    container_url = ""
    seen: list[tuple[str, str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        name = self.path.split("/")[2]
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((name, self.headers.get("Content-Type", "")))
        status, answer = _post(self.container_url, "/invocations", json.loads(body))
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_eval_through_the_sagemaker_runtime_equals_the_endpoint(
    container: dict[str, Any], color_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _Runtime.container_url, _Runtime.seen = container["url"], []
    runtime = ThreadingHTTPServer(("127.0.0.1", 0), _Runtime)
    threading.Thread(target=runtime.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv(
            "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", f"http://127.0.0.1:{runtime.server_address[1]}"
        )
        common = [
            "--model",
            "a1",
            "--data",
            str(color_data / "eval.jsonl"),
            "--max-samples",
            "8",
            "--max-tokens",
            "4",
        ]
        assert (
            main(["eval", "--sagemaker-endpoint", ENDPOINT_NAME, "--out", str(tmp_path / "sm.json"), *common])
            == 0
        )
        assert (
            main(["eval", "--endpoint", container["url"], "--out", str(tmp_path / "ep.json"), *common]) == 0
        )
    finally:
        runtime.shutdown()
        runtime.server_close()
    sm, ep = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("sm", "ep"))
    assert sm["num_samples"] == 8 and sm["num_failed"] == 0 and sm["engine"] == "sagemaker"
    assert sm["endpoint"] == f"sagemaker:{ENDPOINT_NAME}"
    assert [s["completion"] for s in sm["samples"]] == [s["completion"] for s in ep["samples"]]
    assert sm["accuracy"] == ep["accuracy"]
    assert _Runtime.seen == [(ENDPOINT_NAME, "application/json")] * 8


def test_episodes_through_the_endpoint_are_the_local_episodes(
    container: dict[str, Any], pretrained_tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    """`eval --endpoint URL --env JOB`: the tool loop runs client-side over the chat API (pictures in user and tool
    messages); greedy, the served episodes are the local engine's, turn for turn."""
    env = EnvConfig(name="tests.envs.sample_envs:ToolRetry", max_turns=3)
    common = {"data": str(color_data / "eval.jsonl"), "max_samples": 8, "max_tokens": 4, "env": env,
              "base": str(pretrained_tiny_model)}  # fmt: skip
    served = evaluate_endpoint(f"{container['url']}/v1", "base", out=str(tmp_path / "served.json"), **common)
    local = evaluate_local(adapter=None, out=str(tmp_path / "local.json"), engine="vllm", **common)
    assert served["num_failed"] == 0 and served["num_samples"] == 8
    assert [s["completion"] for s in served["samples"]] == [s["completion"] for s in local["samples"]]
    turns = "episode/turns_mean"
    assert served["episodes"][turns] == local["episodes"][turns] > 1.0  # wrong answers get another look
    assert served["episodes"]["episode/images_mean"] == local["episodes"]["episode/images_mean"]
    assert served["accuracy"] == local["accuracy"]


def test_sigterm_stops_the_front_and_vllm(container: dict[str, Any]) -> None:
    handle: ServerHandle = container["handle"]
    assert handle.pid is not None
    children = Path(f"/proc/{handle.pid}/task/{handle.pid}/children").read_text().split()
    assert children  # vLLM's server
    handle.send_signal(signal.SIGTERM)
    assert handle.wait(120) == 0
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_missing_base_model_ends_the_container_with_the_reason(tmp_path: Path) -> None:
    env = {**os.environ, "VISIONRL_BASE_MODEL": str(tmp_path / "no-model"), "VISIONRL_ADAPTERS": ""}
    run = subprocess.run(
        [sys.executable, "-m", "visionrl.cli", "serve", "--sagemaker", "--host", "127.0.0.1", "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1
    assert f"base model '{tmp_path / 'no-model'}' is not a directory" in run.stderr


def test_an_s3_base_model_is_downloaded_once_and_again_when_it_changes(
    aws: dict[str, Any], tmp_path: Path
) -> None:
    fs, _ = filesystem(f"s3://{BUCKET}")
    fs.pipe({f"{BUCKET}/m/config.json": b'{"model_type": "qwen3_vl"}', f"{BUCKET}/m/sub/w.bin": b"one"})
    heard: list[str] = []
    first = local_model_dir(f"s3://{BUCKET}/m/", tmp_path, progress=heard.append)
    assert (first / "sub" / "w.bin").read_bytes() == b"one" and len(heard) == 1 and "2 files" in heard[0]
    assert local_model_dir(f"s3://{BUCKET}/m", tmp_path, progress=heard.append) == first and len(heard) == 1
    fs.pipe(f"{BUCKET}/m/sub/w.bin", b"two!")  # replaced under the same name
    assert local_model_dir(f"s3://{BUCKET}/m", tmp_path, progress=heard.append) == first and len(heard) == 2
    assert (first / "sub" / "w.bin").read_bytes() == b"two!"
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial folder left
    with pytest.raises(InputError, match=rf"s3://{BUCKET}/nothing holds no config.json \(0 objects"):
        local_model_dir(f"s3://{BUCKET}/nothing", tmp_path)
