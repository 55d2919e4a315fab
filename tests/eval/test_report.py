"""`EvalSettings`, the part both evaluators share: the data check, the rewards, ablation and the written report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from visionrl.errors import InputError
from visionrl.eval.report import EvalSettings
from visionrl.types import Generation, PromptItem


def _prompts() -> list[PromptItem]:
    colours = ("red", "blue", "green")
    return [
        PromptItem(f"q{i}", [Image.new("RGB", (4, 4), c)], c, {"id": i}, f"s{i}")
        for i, c in enumerate(colours)
    ]


@pytest.fixture
def data(tmp_path: Path) -> str:
    path = tmp_path / "eval.jsonl"
    path.write_text("{}\n")  # only its existence is checked here
    return str(path)


def test_a_missing_data_file_is_refused_with_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(InputError, match=f"data file '{missing}' not found"):
        EvalSettings(str(missing), str(tmp_path / "r.json"))


def test_an_unknown_reward_is_refused(data: str, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no-such-reward"):
        EvalSettings(data, str(tmp_path / "r.json"), rewards=("no-such-reward",)).reward_fn()


def test_images_are_permuted_only_when_ablation_is_asked(data: str, tmp_path: Path) -> None:
    prompts = _prompts()
    kept = EvalSettings(data, str(tmp_path / "r.json")).prompts(prompts)
    assert kept is prompts
    permuted = EvalSettings(data, str(tmp_path / "r.json"), ablate_images=True, seed=3).prompts(prompts)
    assert [p.answer for p in permuted] == ["red", "blue", "green"]
    # A single cycle over three samples: no prompt keeps its own image.
    assert all(new.images[0] is not old.images[0] for new, old in zip(permuted, prompts, strict=True))


def test_report_scores_the_answers_and_writes_what_it_returns(data: str, tmp_path: Path) -> None:
    out = tmp_path / "reports" / "r.json"
    settings = EvalSettings(data, str(out), max_tokens=5, seed=7)
    calls = []

    def answer() -> list[Generation]:
        calls.append(1)
        return [
            Generation("red", 2, 10.0, "stop"),
            Generation("green", 2, 30.0, "stop"),  # wrong: the answer is blue
            Generation(None, 0, 5.0, None, "TimeoutError: slow"),
        ]

    with settings.reward_fn() as reward_fn:
        report = settings.report(
            _prompts(), answer, reward_fn, model="m @ url", extra={"engine": "endpoint", "base": None}
        )
    assert calls == [1]
    assert (report["num_samples"], report["num_failed"], report["num_correct"]) == (3, 1, 1)
    assert report["accuracy"] == 0.5  # 1 correct of the 2 that did not fail
    assert report["latency_ms_p50"] == 10.0 and report["num_tokens"] == 4
    assert report["rewards"] == ["exact_match"] and report["max_tokens"] == 5 and report["seed"] == 7
    assert report["engine"] == "endpoint" and report["model"] == "m @ url" and report["data"] == data
    assert report["ablate_images"] is False and report["duration_s"] >= 0
    assert json.loads(out.read_text()) == report
    assert out.with_suffix(".md").is_file()
