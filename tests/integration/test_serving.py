"""From exported adapter to served endpoint, end to end on the tiny Qwen3-VL (slow):

two LoRA adapters (language model + vision merger, random non-zero B) are exported to a local S3 server
(moto, in a child process), one is served from s3:// at start and the other loaded at run time by the real vLLM OpenAI server
(CPU build); served evaluation through the openai client must give the same greedy answers as local vLLM
evaluation of the same adapter; a tampered or incomplete export is refused; unloading removes an adapter.
The server runs with an API key: without it every route but the health probes is refused (/invocations too).
The vLLM server is started once for the module (each start costs about 40-55 s).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.aws_local import moto_server, point_aws_at
from tests.integration.random_adapter import random_adapter

from visionrl.adapter.export import export_adapter
from visionrl.adapter.fetch import fetch_adapter
from visionrl.adapter.files import MANIFEST_NAME
from visionrl.adapter.manifest import verify_adapter
from visionrl.adapter.storage import filesystem
from visionrl.cli import main
from visionrl.errors import ExportError
from visionrl.eval.endpoint import evaluate_endpoint
from visionrl.eval.judged import parse_judges
from visionrl.eval.local import evaluate_local
from visionrl.serve.adapters import list_models, load_adapter, unload_adapter
from visionrl.serve.process import ServerError, ServerHandle, free_port
from visionrl.serve.server import start_server

pytestmark = pytest.mark.slow

BUCKET = "visionrl-test"
KEY = "test-key-7f3a"  # the server's API key
NUM_SAMPLES = 16
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with one bucket; the AWS environment points at it (fake keys)."""
    import boto3

    home = tmp_path_factory.mktemp("aws")
    with moto_server(home) as url, pytest.MonkeyPatch.context() as mp:
        point_aws_at(mp, url, home)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield f"s3://{BUCKET}"


@pytest.fixture(scope="module")
def exports(s3: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """a1 exported by the API, a2 by the `visionrl export` command, both to s3://."""
    root = tmp_path_factory.mktemp("adapters")
    a1 = random_adapter(tiny_model, root / "a1", seed=1)
    a2 = random_adapter(tiny_model, root / "a2", seed=2)
    manifest = export_adapter(a1, f"{s3}/a1")
    assert main(["export", str(a2), f"{s3}/a2"]) == 0
    return {"a1": a1, "a2": a2, "manifest": manifest, "root": root}


@pytest.fixture(scope="module")
def server(exports: dict[str, Any], tiny_model: Path, s3: str) -> Iterator[ServerHandle]:
    log = exports["root"] / "server.log"
    with start_server(str(tiny_model), {"a1": f"{s3}/a1"}, cache_dir=exports["root"] / "cache", log_path=log,
                      max_loras=2, api_key=KEY) as handle:  # fmt: skip
        yield handle


@pytest.fixture(scope="module")
def a2_copy(server: ServerHandle, exports: dict[str, Any], s3: str) -> Path:
    """a2, loaded at run time; returns the verified local copy the server reads."""
    return load_adapter(server.url, "a2", f"{s3}/a2", cache_dir=exports["root"] / "cache", api_key=KEY)


def test_exports_on_s3_verify_and_need_the_tower_flag(exports: dict[str, Any], s3: str) -> None:
    assert verify_adapter(f"{s3}/a1") == exports["manifest"]
    assert exports["manifest"]["serving"]["tower_connector_lora"] is True
    fs, root = filesystem(f"{s3}/a2")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(root)}
    assert {"adapter_config.json", "adapter_model.safetensors", MANIFEST_NAME} <= names


def test_server_lists_the_start_and_run_time_adapters(server: ServerHandle, a2_copy: Path) -> None:
    assert "--enable-tower-connector-lora" in server.command
    models = list_models(server.base_url, api_key=KEY)
    assert {"a1", "a2"} <= set(models) and len(models) == 3  # and the base model


def _answers(report: dict[str, Any]) -> list[tuple[str, str]]:
    # vLLM's detokenizer may put a space before the first word; rewards normalise whitespace too.
    return [(s["id"], (s["completion"] or "").strip()) for s in report["samples"]]


def _judge_template_and_words(model: Path, tmp_path: Path) -> tuple[Path, str]:
    """A judge template, and as its yes and no words the base model's two likeliest first tokens for one answer
    (a random tiny model says neither "yes" nor "no"; the words must be among the server's top log-probs)."""
    import torch
    from PIL import Image

    from visionrl.data.prompts import user_prompt
    from visionrl.models.loader import load_base_model, load_processor

    text = "{question}\nProposed answer: {completion}\nIs it right? Answer yes or no."
    template = tmp_path / "judge.txt"
    template.write_text(text + "\n")
    processor = load_processor(model)
    prompt = user_prompt(processor, text.format(question="What color is the shape?", completion="red"),
                         [Image.new("RGB", (64, 64), (200, 30, 30))])  # fmt: skip
    with torch.no_grad():
        enc = processor(text=[prompt.text], images=prompt.images, return_tensors="pt")
        top = load_base_model(model)(**enc).logits[0, -1].topk(2).indices
    first, second = (json.dumps(processor.tokenizer.decode([int(i)])) for i in top)
    return template, f"yes: [{first}], no: [{second}]"


def _judged(report: dict[str, Any]) -> list[float | None]:
    return [s["judge"]["judge"] for s in report["samples"]]


def test_served_answers_equal_local_vllm_answers(
    server: ServerHandle,
    a2_copy: Path,
    exports: dict[str, Any],
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = str(color_data / "eval.jsonl")
    common = {"data": data, "max_samples": NUM_SAMPLES, "max_tokens": MAX_TOKENS}
    served = {
        "a1": evaluate_endpoint(
            server.base_url,
            "a1",
            out=str(tmp_path / "a1.json"),
            concurrency=4,
            base=str(tiny_model),
            api_key=KEY,
            **common,
        ),  # fmt: skip
        "base": evaluate_endpoint(
            server.base_url,
            str(tiny_model),
            out=str(tmp_path / "base.json"),
            base=str(tiny_model),
            api_key=KEY,
            **common,
        ),  # fmt: skip
    }
    # a2 through the command line, as a user would, its answers judged by the served base model too (--judge).
    template, words = _judge_template_and_words(tiny_model, tmp_path)
    judge = (f"{{backend: endpoint, base_url: '{server.base_url}', model: '{tiny_model}', template: {template}, "
             f"api_key_env: JUDGE_TEST_KEY, {words}}}")  # fmt: skip
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    argv = ["eval", "--endpoint", server.base_url, "--model", "a2", "--base", str(tiny_model), "--data", data,
            "--out", str(tmp_path / "a2.json"), "--max-samples", str(NUM_SAMPLES), "--max-tokens", str(MAX_TOKENS)]  # fmt: skip
    assert main([*argv, "--api-key", KEY, "--judge", judge]) == 0
    served["a2"] = json.loads((tmp_path / "a2.json").read_text())

    local_judge = parse_judges(f"{{backend: engine, template: {template}, {words}}}")
    for name, adapter in (("a1", str(exports["a1"])), ("a2", str(a2_copy))):
        local = evaluate_local(base=str(tiny_model), adapter=adapter, out=str(tmp_path / f"local-{name}.json"),
                               engine="vllm", judges=local_judge if name == "a2" else None, **common)  # fmt: skip
        if name == "a2":  # the served base model judged as the local engine's base did (its adapter off)
            assert served["a2"]["judges"]["judge"]["num_judged"] == NUM_SAMPLES
            assert _judged(served["a2"]) == pytest.approx(_judged(local), abs=2e-3)
            assert len(set(_judged(local))) > 1  # the scores depend on the answer and the image
        report = served[name]
        assert report["num_samples"] == NUM_SAMPLES and report["num_failed"] == 0
        assert abs(report["accuracy"] - local["accuracy"]) <= 0.02, name
        assert _answers(report) == _answers(local), name
        assert [s["num_tokens"] for s in report["samples"]] == [s["num_tokens"] for s in local["samples"]]
        assert set(report["samples"][0]) == set(local["samples"][0])  # one report format
        assert report["latency_ms_p50"] is not None and report["tokens_per_s"] > 0
    # The adapters change the answers (LoRA is applied), and differently.
    assert _answers(served["a1"]) != _answers(served["base"])
    assert _answers(served["a1"]) != _answers(served["a2"])


def test_tampered_and_incomplete_exports_are_refused(
    server: ServerHandle, exports: dict[str, Any], s3: str, tmp_path: Path
) -> None:
    export_adapter(exports["a1"], f"{s3}/a3")
    fs, root = filesystem(f"{s3}/a3")
    weights = f"{root}/adapter_model.safetensors"
    data = bytearray(fs.cat_file(weights))
    data[len(data) // 2] ^= 0xFF  # one byte changed, size kept
    fs.pipe_file(weights, bytes(data))
    with pytest.raises(
        ExportError, match=r"adapter_model\.safetensors in s3://.*/a3 does not match the sha256"
    ):
        fetch_adapter(f"{s3}/a3", tmp_path / "cache")
    with pytest.raises(ExportError, match=r"adapter_model\.safetensors"):
        load_adapter(server.url, "a3", f"{s3}/a3", cache_dir=tmp_path / "cache", api_key=KEY)
    fs.rm(f"{root}/{MANIFEST_NAME}")
    with pytest.raises(ExportError, match="not a complete export"):
        load_adapter(server.url, "a3", f"{s3}/a3", cache_dir=tmp_path / "cache", api_key=KEY)
    assert "a3" not in list_models(server.url, api_key=KEY)


def test_unload_removes_an_adapter(
    server: ServerHandle, exports: dict[str, Any], s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)  # the clients' default: the variable the server reads too
    load_adapter(server.url, "a1-again", f"{s3}/a1", cache_dir=exports["root"] / "cache")
    assert "a1-again" in list_models(server.url)
    unload_adapter(server.url, "a1-again")
    assert "a1-again" not in list_models(server.url)
    with pytest.raises(ServerError, match="a1-again") as err:
        unload_adapter(server.url, "a1-again")
    assert err.value.status == 404


def test_without_the_api_key_no_route_is_served(
    server: ServerHandle, a2_copy: Path, exports: dict[str, Any], color_data: Path, tmp_path: Path
) -> None:
    """No key or a wrong one: 401 for completions, the model list and run-time load/unload (the adapter
    stays loaded, no new one appears), and for every other route the server lists, /invocations included;
    the key is not on the server's command line; the health probes stay open."""
    from visionrl.serve.process import http_json

    routes = json.loads(http_json("GET", server.url + "/openapi.json", api_key=KEY))["paths"]
    assert "/invocations" in routes and len(routes) > 10
    for path, methods in routes.items():
        url = server.url + re.sub(r"\{[^}]*\}", "x", path)
        for method in (m.upper() for m in methods):
            if path in ("/health", "/ping"):
                continue
            with pytest.raises(ServerError) as err:
                http_json(method, url, {} if method in ("POST", "PUT") else None)
            assert err.value.status == 401, (method, path)

    assert KEY not in " ".join(server.command)
    chat = {"model": "a2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    calls = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", chat),
             ("POST", "/v1/load_lora_adapter", {"lora_name": "intruder", "lora_path": str(a2_copy)}),
             ("POST", "/v1/unload_lora_adapter", {"lora_name": "a2"})]  # fmt: skip
    for key in (None, "wrong-key"):
        for method, path, body in calls:
            with pytest.raises(ServerError) as err:
                http_json(method, server.url + path, body, api_key=key)
            assert err.value.status == 401, (key, path)
    assert set(list_models(server.url, api_key=KEY)) >= {"a1", "a2"}
    assert "intruder" not in list_models(server.url, api_key=KEY)
    http_json("GET", server.url + "/health")  # no key needed: load balancers probe it
    http_json("GET", server.url + "/ping")  # nor SageMaker's probe
    report = evaluate_endpoint(server.base_url, "a2", str(color_data / "eval.jsonl"), str(tmp_path / "r.json"),
                               max_samples=2, max_tokens=2, max_retries=0, api_key="wrong-key")  # fmt: skip
    assert report["num_failed"] == 2 and "AuthenticationError" in report["samples"][0]["error"]


def test_a_judge_behind_the_served_endpoint(
    server: ServerHandle, exports: dict[str, Any], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """backend endpoint: the served adapter a1 as the judge. The share of yes among the server's top log-probs of the
    first token equals transformers' on the same prompt and image; the text mode returns the judge's answer; a
    wrong key and a dead endpoint are failures counted per request, not a hang."""
    import torch
    from peft import PeftModel
    from PIL import Image

    from visionrl.data.prompts import user_prompt
    from visionrl.judge.endpoint import EndpointJudge
    from visionrl.models.loader import load_base_model, load_processor
    from visionrl.rewards.judge import JudgeFailure, JudgeRequest, JudgeSpec

    processor = load_processor(tiny_model)
    model = PeftModel.from_pretrained(load_base_model(tiny_model), str(exports["a1"])).eval()
    text = "is the shape red ? answer yes or no"
    image = Image.new("RGB", (64, 64), (255, 255, 255))
    image.paste((220, 40, 40), (8, 8, 48, 40))
    prompt = user_prompt(processor, text, [image])
    with torch.no_grad():
        logits = model(**processor(text=[prompt.text], images=prompt.images, return_tensors="pt")).logits[
            0, -1
        ]
    first, second = (processor.tokenizer.decode([int(i)]) for i in logits.topk(2).indices)
    expected = float(torch.softmax(logits.topk(2).values, -1)[0])
    monkeypatch.setenv("JUDGE_TEST_KEY", KEY)
    common = {"backend": "endpoint", "template": "unused.txt", "model": "a1", "base_url": server.base_url}
    spec = JudgeSpec.from_kwargs({**common, "api_key_env": "JUDGE_TEST_KEY", "yes": [first], "no": [second]})
    request = JudgeRequest(text, (image,))
    judge = EndpointJudge(spec)
    share = judge.judge([request, request])
    assert share == [pytest.approx(expected, abs=1e-3)] * 2
    words = EndpointJudge(JudgeSpec.from_kwargs({**spec.__dict__, "score": "tag", "max_tokens": 3})).judge(
        [request]
    )
    assert isinstance(words[0], str) and words[0].split()[0] == first.strip()
    wrong_key = EndpointJudge(JudgeSpec.from_kwargs({**common, "retries": 0})).judge([request])[0]
    assert isinstance(wrong_key, JudgeFailure) and "AuthenticationError" in wrong_key.message
    dead = {**common, "base_url": f"http://127.0.0.1:{free_port()}/v1", "retries": 0, "timeout_s": 5}
    failed = EndpointJudge(JudgeSpec.from_kwargs(dead)).judge([request])[0]
    assert isinstance(failed, JudgeFailure) and "APIConnectionError" in failed.message
