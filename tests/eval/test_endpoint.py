"""Tests of served evaluation (`evaluate_endpoint`, `visionrl.endpoint_client`) against a small fake
OpenAI-compatible server on 127.0.0.1: image messages as base64 PNGs, scoring, failures (HTTP 500, a
server that hangs) counted per sample with retries, and the report format of local evaluation."""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from visionrl.errors import InputError
from visionrl.eval.endpoint import evaluate_endpoint, openai_asker, request_answers
from visionrl.openai_wire import chat_messages, image_data_url, openai_base_url

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255),
          "black": (0, 0, 0)}  # fmt: skip


def _decode(url: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert url.startswith(prefix)
    return Image.open(io.BytesIO(base64.b64decode(url[len(prefix) :])))


# --------------------------------------------------------------------------- message building


def test_image_placeholders_become_base64_pngs_in_order() -> None:
    first = Image.new("RGB", (5, 3), (10, 20, 30))
    second = Image.new("RGB", (2, 2), (200, 100, 0))
    second.putpixel((1, 1), (1, 2, 3))
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
    ]
    out = chat_messages(messages, [first, second])
    assert out[0] == messages[0]
    parts = out[1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text", "image_url"] and parts[1]["text"] == "and"
    for part, image in zip((parts[0], parts[2]), (first, second), strict=True):
        decoded = _decode(part["image_url"]["url"])
        assert decoded.format == "PNG" and decoded.size == image.size
        assert decoded.convert("RGB").tobytes() == image.tobytes()  # lossless
    assert messages[1]["content"][0] == {"type": "image"}  # the input is left as it was


def test_placeholders_and_images_must_match() -> None:
    image = Image.new("RGB", (2, 2))
    with pytest.raises(ValueError, match="more image placeholders"):
        chat_messages([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], [image])
    with pytest.raises(ValueError, match="1 image placeholder"):
        chat_messages([{"role": "user", "content": [{"type": "image"}]}], [image, image])


def test_openai_base_url() -> None:
    assert openai_base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert openai_base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    assert openai_base_url("https://gateway.example/models/x/v1") == "https://gateway.example/models/x/v1"


# --------------------------------------------------------------------------- fake server


class FakeChat(BaseHTTPRequestHandler):
    """Answers with the colour name of the image's top-left pixel, in as many tokens as words.

    A prompt text "fail" gets HTTP 500; "hang" gets no answer until the test ends.
    """

    requests: list[dict[str, Any]] = []
    release = threading.Event()
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.requests.append(body)
        parts = body["messages"][-1]["content"]
        text = next(p["text"] for p in parts if p["type"] == "text")
        if text == "hang":
            self.release.wait(30)
            return
        if text == "fail":
            self._send(500, {"error": {"message": "engine crashed", "code": 500}})
            return
        pixel = _decode(next(p for p in parts if p["type"] == "image_url")["image_url"]["url"]).getpixel(
            (0, 0)
        )
        answer = next(name for name, rgb in COLORS.items() if rgb == pixel)
        self._send(200, {
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f" {answer}"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
        })  # fmt: skip

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def endpoint() -> Iterator[str]:
    FakeChat.requests = []
    FakeChat.release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeChat)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        FakeChat.release.set()  # let hanging handlers finish before the server closes
        server.shutdown()
        server.server_close()
        thread.join()


def _write_data(folder: Path, rows: list[tuple[str, str, str]]) -> Path:
    """A JSONL eval set: one record per (image colour, prompt text, answer)."""
    lines = []
    for i, (color, text, answer) in enumerate(rows):
        Image.new("RGB", (8, 8), COLORS[color]).save(folder / f"{i}.png")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        lines.append(
            json.dumps({"id": f"s{i}", "images": [f"{i}.png"], "messages": messages, "answer": answer})
        )
    (folder / "eval.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "eval.jsonl"


ROWS = [
    ("red", "What color?", "red"),  # right
    ("blue", "What color?", "blue"),  # right
    ("green", "What color?", "red"),  # wrong
    ("white", "fail", "white"),  # HTTP 500, retried, then failed
    ("black", "hang", "black"),  # times out, retried, then failed
]


def test_evaluate_endpoint_scores_and_counts_failures(endpoint: str, tmp_path: Path) -> None:
    data = _write_data(tmp_path, ROWS)
    out = tmp_path / "report.json"
    report = evaluate_endpoint(endpoint, "a1", str(data), str(out), concurrency=5, max_tokens=3,
                               timeout_s=0.5, max_retries=1)  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert "| num_failed | 2 |" in out.with_suffix(".md").read_text()
    assert (report["num_samples"], report["num_failed"], report["num_correct"]) == (5, 2, 2)
    assert report["accuracy"] == pytest.approx(2 / 3)  # failed samples are not in the denominator
    samples = {s["id"]: s for s in report["samples"]}
    assert [samples[f"s{i}"]["completion"] for i in range(3)] == [" red", " blue", " green"]
    assert [samples[f"s{i}"]["correct"] for i in range(5)] == [True, True, False, False, False]
    assert "InternalServerError" in samples["s3"]["error"] and "engine crashed" in samples["s3"]["error"]
    assert "Timeout" in samples["s4"]["error"] and samples["s4"]["completion"] is None
    assert report["num_tokens"] == 6  # usage.completion_tokens of the three answers
    assert report["tokens_per_s"] == pytest.approx(6 / report["duration_s"])
    assert all(samples[f"s{i}"]["latency_ms"] > 0 for i in range(3))
    assert report["latency_ms_p50"] <= report["latency_ms_p95"]
    # One retry each for the 500 and the timeout: 3 + 2 + 2 requests.
    texts = [r["messages"][-1]["content"][1]["text"] for r in FakeChat.requests]
    assert (texts.count("What color?"), texts.count("fail"), texts.count("hang")) == (3, 2, 2)
    request = FakeChat.requests[0]
    assert request["model"] == "a1" and request["temperature"] == 0.0 and request["max_tokens"] == 3
    assert "logit_bias" not in request


REPORT_KEYS = {"accuracy", "num_samples", "num_failed", "num_correct", "mean_reward", "latency_ms_p50",
               "latency_ms_p95", "tokens_per_s", "num_tokens", "duration_s", "model", "data", "ablate_images",
               "created", "samples", "rewards", "max_tokens", "seed", "engine", "base"}  # fmt: skip
SAMPLE_KEYS = {"id", "answer", "completion", "reward", "rewards", "correct", "num_tokens", "latency_ms",
               "finish_reason", "error"}  # fmt: skip


def test_report_has_the_fields_of_local_evaluation(endpoint: str, tmp_path: Path) -> None:
    data = _write_data(tmp_path, ROWS[:2])
    report = evaluate_endpoint(endpoint.removesuffix("/v1"), "a1", str(data), str(tmp_path / "r.json"))
    assert REPORT_KEYS <= set(report) and report["engine"] == "endpoint"
    assert all(set(s) == SAMPLE_KEYS for s in report["samples"])
    assert report["accuracy"] == 1.0 and report["num_failed"] == 0


def test_ablation_sends_every_sample_another_image(endpoint: str, tmp_path: Path) -> None:
    rows = [(color, "What color?", color) for color in COLORS]
    data = _write_data(tmp_path, rows)
    report = evaluate_endpoint(
        endpoint, "a1", str(data), str(tmp_path / "r.json"), ablate_images=True, seed=1
    )
    assert [s["id"] for s in report["samples"]] == [f"s{i}" for i in range(5)]
    assert [s["answer"] for s in report["samples"]] == list(COLORS)
    assert report["num_correct"] == 0  # a derangement: no sample sees its own colour
    assert sorted(s["completion"].strip() for s in report["samples"]) == sorted(COLORS)


def test_forbidden_tokens_are_sent_as_logit_bias(endpoint: str, tmp_path: Path) -> None:
    image = Image.new("RGB", (4, 4), COLORS["red"])
    requests = [chat_messages([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                              [image])]  # fmt: skip
    with openai_asker(endpoint, timeout_s=10, max_retries=0, api_key=None) as ask:
        (answer,) = request_answers(ask, "m", requests, max_tokens=2, forbidden_token_ids=[5, 9])
    assert answer.text == " red" and answer.num_tokens == 2 and answer.error is None
    assert FakeChat.requests[0]["logit_bias"] == {"5": -100, "9": -100}


def test_unreachable_endpoint_fails_every_sample_without_raising(tmp_path: Path) -> None:
    from visionrl.serve.process import free_port

    data = _write_data(tmp_path, ROWS[:2])
    report = evaluate_endpoint(f"http://127.0.0.1:{free_port()}/v1", "a1", str(data), str(tmp_path / "r.json"),
                               timeout_s=2, max_retries=0)  # fmt: skip
    assert report["num_failed"] == 2 and report["accuracy"] == 0.0
    assert all("APIConnectionError" in s["error"] for s in report["samples"])


def test_bad_arguments_are_input_errors(tmp_path: Path) -> None:
    data = _write_data(tmp_path, ROWS[:1])
    with pytest.raises(InputError, match="--model"):
        evaluate_endpoint("http://127.0.0.1:1/v1", None, str(data), str(tmp_path / "r.json"))
    with pytest.raises(InputError, match="data file"):
        evaluate_endpoint(
            "http://127.0.0.1:1/v1", "a1", str(tmp_path / "none.jsonl"), str(tmp_path / "r.json")
        )
    with pytest.raises(InputError, match="concurrency"):
        evaluate_endpoint("http://127.0.0.1:1/v1", "a1", str(data), str(tmp_path / "r.json"), concurrency=0)
    assert not (tmp_path / "r.json").exists()


def test_data_url_is_a_png() -> None:
    assert image_data_url(Image.new("RGB", (1, 1))).startswith("data:image/png;base64,iVBOR")


def test_cli_exits_1_when_too_many_requests_failed(
    endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 of 5 requests fail (HTTP 500 and a timeout): 0.4 > the default 0.1, so exit 1 with the first errors and
    the report still written; allowing half to fail exits 0; a server that is not there fails all: exit 1."""
    from visionrl.cli import main
    from visionrl.serve.process import free_port

    data = str(_write_data(tmp_path, ROWS))
    argv = ["eval", "--endpoint", endpoint, "--model", "a1", "--data", data, "--out", str(tmp_path / "r.json"),
            "--timeout", "0.5", "--max-tokens", "3"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"error: 2 of 5 requests to {endpoint} failed, more than --max-failed-fraction=0.1" in err
    assert (
        "  - s3: InternalServerError" in err and "engine crashed" in err and "  - s4: APITimeoutError" in err
    )
    assert json.loads((tmp_path / "r.json").read_text())["num_failed"] == 2
    assert main([*argv, "--max-failed-fraction", "0.5"]) == 0
    gone = ["eval", "--endpoint", f"http://127.0.0.1:{free_port()}/v1", "--model", "a1", "--data", data,
            "--out", str(tmp_path / "gone.json"), "--timeout", "1"]  # fmt: skip
    assert main(gone) == 1
    assert "5 of 5 requests" in capsys.readouterr().err


def test_cli_reads_another_layout_by_its_keys(
    endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Geometry3K-style test split (`problem`, `image`, `solution`) evaluated as it is, by the layout flags."""
    from visionrl.cli import main

    rows = [("red", "red"), ("blue", "blue"), ("green", "red")]
    lines = []
    for i, (color, answer) in enumerate(rows):
        Image.new("RGB", (8, 8), COLORS[color]).save(tmp_path / f"g{i}.png")
        lines.append(json.dumps({"problem": "<image>What color?", "image": f"g{i}.png", "solution": answer}))
    data = tmp_path / "geo.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "geo.json"
    argv = ["eval", "--endpoint", endpoint, "--model", "a1", "--data", str(data), "--out", str(out),
            "--max-tokens", "3", "--prompt-key", "problem", "--image-key", "image", "--answer-key", "solution"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["num_samples"] == 3 and report["accuracy"] == pytest.approx(2 / 3)
    assert main(argv[:-6]) == 2  # without them the records have no `images` field: a clear error, exit 2
    assert "set data.image_key to the column that holds them" in capsys.readouterr().err
