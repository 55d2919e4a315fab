"""Evaluation without a model: scoring and report numbers checked by hand with a fake engine and a fake
clock, the Markdown twin, and image ablation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from visionrl.errors import InputError
from visionrl.eval.local import evaluate_prompts
from visionrl.eval.report import nearest_rank, summarize, write_report
from visionrl.eval.scoring import ablate, score_generations
from visionrl.rewards import RewardSpec, build_reward_fn
from visionrl.types import Completion, Generation, PromptItem, SamplingSpec

# --------------------------------------------------------------------------- fake engine


class FakeClock:
    """A clock the fake engine advances, so latencies are exact numbers, not wall time."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Answers from a fixed table; a prompt whose text is "boom" makes the whole call raise ValueError, one
    whose text is "rejected" gets no completions (an engine that skipped it and served the rest).

    Each call takes 0.1 s of fake time per prompt (0.05 s for a call that fails).
    """

    def __init__(self, answers: dict[str, str], clock: FakeClock) -> None:
        self.answers = answers
        self.clock = clock
        self.calls: list[tuple[list[str], SamplingSpec]] = []

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        self.calls.append(([p.text for p in prompts], spec))
        if any(p.text == "boom" for p in prompts):
            self.clock.now += 0.05
            raise ValueError("prompt is too long")
        self.clock.now += 0.1 * len(prompts)
        out = []
        for i, p in enumerate(prompts):
            if p.text == "rejected":  # the engine skipped this prompt alone: no completions
                out.append([])
                continue
            text = self.answers[p.text]
            ids = list(range(len(text.split()) + 1))  # words + end of sequence
            out.append([Completion(i, ids, text, [0.0] * len(ids), "stop")])
        return out


def _prompt(text: str, answer: str, images: list[Image.Image] | None = None) -> PromptItem:
    return PromptItem(
        text=text, images=images or [], answer=answer, record={"id": text}, sample_id=f"id-{text}"
    )


def test_evaluate_prompts_counts_correct_failed_and_latency_by_hand() -> None:
    clock = FakeClock()
    engine = FakeEngine({"q1": "red", "q2": "blue", "q3": "Green", "q4": "yellow sky"}, clock)
    prompts = [
        _prompt("q1", "red"),  # right
        _prompt("q2", "red"),  # wrong
        _prompt("boom", "red"),  # fails
        _prompt("q3", "green"),  # right (exact_match normalises case)
        _prompt("q4", "yellow"),  # wrong: exact_match compares the whole answer
    ]
    with build_reward_fn([RewardSpec("exact_match")]) as reward_fn:
        records = evaluate_prompts(engine, prompts, reward_fn, max_tokens=7, batch_size=3, clock=clock)

    assert all(spec == SamplingSpec(n=1, greedy=True, max_tokens=7) for _, spec in engine.calls)
    # Batch [q1, q2, boom] fails and is retried prompt by prompt; batch [q3, q4] succeeds.
    assert [texts for texts, _ in engine.calls] == [
        ["q1", "q2", "boom"],
        ["q1"],
        ["q2"],
        ["boom"],
        ["q3", "q4"],
    ]
    assert [r["id"] for r in records] == ["id-q1", "id-q2", "id-boom", "id-q3", "id-q4"]
    assert [r["correct"] for r in records] == [True, False, False, True, False]
    assert [r["reward"] for r in records] == [1.0, 0.0, None, 1.0, 0.0]
    assert [r["num_tokens"] for r in records] == [2, 2, 0, 2, 3]
    failed = records[2]
    assert failed["completion"] is None and failed["error"] == "ValueError: prompt is too long"
    assert all(r["error"] is None for i, r in enumerate(records) if i != 2)
    # Latency: a lone retry is its own time (0.1 s, failure 0.05 s); the batch of two took 0.2 s -> 100 ms each.
    assert [r["latency_ms"] for r in records] == pytest.approx([100.0, 100.0, 50.0, 100.0, 100.0])

    report = summarize(records, model="m", data="d.jsonl", started=0.0, duration_s=2.0, ablate_images=False)
    assert report["num_samples"] == 5
    assert report["num_failed"] == 1
    assert report["accuracy"] == pytest.approx(2 / 4)  # correct / (samples - failed)
    assert report["mean_reward"] == pytest.approx(2 / 4)
    assert report["tokens_per_s"] == pytest.approx((2 + 2 + 2 + 3) / 2.0)
    assert report["created"] == "1970-01-01T00:00:00+00:00"


def test_a_prompt_the_engine_rejected_is_one_failed_record_not_a_failed_batch() -> None:
    from visionrl.eval.local import REJECTED

    clock = FakeClock()
    engine = FakeEngine({"q1": "red", "q2": "blue"}, clock)
    prompts = [_prompt("q1", "red"), _prompt("rejected", "red"), _prompt("q2", "blue")]
    with build_reward_fn([RewardSpec("exact_match")]) as reward_fn:
        records = evaluate_prompts(engine, prompts, reward_fn, max_tokens=2, batch_size=8, clock=clock)
    assert [texts for texts, _ in engine.calls] == [["q1", "rejected", "q2"]]  # one call, no retries
    assert [r["correct"] for r in records] == [True, False, True]
    assert records[1]["completion"] is None and records[1]["error"] == REJECTED
    report = summarize(records, model="m", data="d.jsonl", started=0.0, duration_s=1.0, ablate_images=False)
    assert (report["num_failed"], report["accuracy"]) == (1, 1.0)  # 2 correct of the 2 answered


def test_correct_means_half_of_the_positive_weight() -> None:
    # exact_match + exact_match(first_word), weights 1 and 1: the best total is 2, correct needs >= 1.
    specs = [RewardSpec("exact_match"), RewardSpec("exact_match", kwargs={"first_word": True})]
    prompts = [_prompt(q, "blue") for q in ("a", "b", "c")]
    gens = [Generation("blue"), Generation("blue sky"), Generation("sky blue")]
    with build_reward_fn(specs) as reward_fn:
        records = score_generations(prompts, gens, reward_fn)
    assert [r["reward"] for r in records] == [2.0, 1.0, 0.0]
    assert [r["correct"] for r in records] == [True, True, False]
    assert records[1]["rewards"] == {"exact_match#0": 0.0, "exact_match#1": 1.0}


def test_score_generations_needs_a_positive_weight() -> None:
    with build_reward_fn([RewardSpec("exact_match", weight=-1.0)]) as reward_fn:
        with pytest.raises(ValueError, match="positive weight"):
            score_generations([_prompt("a", "x")], [Generation("x")], reward_fn)


def test_nearest_rank_percentiles_by_hand() -> None:
    # n = 5: p50 rank ceil(2.5) = 3, p95 rank ceil(4.75) = 5.
    assert nearest_rank([50.0, 10.0, 40.0, 20.0, 30.0], 50) == 30.0
    assert nearest_rank([50.0, 10.0, 40.0, 20.0, 30.0], 95) == 50.0
    # n = 20 (values 1..20): p95 rank is exactly 19 (not 20 from a float 19.000...01), p50 rank 10.
    values = [float(v) for v in range(20, 0, -1)]
    assert nearest_rank(values, 95) == 19.0
    assert nearest_rank(values, 50) == 10.0
    assert nearest_rank([7.0], 50) == 7.0
    assert nearest_rank([], 50) is None
    with pytest.raises(ValueError):
        nearest_rank([1.0], 0)


def _record(i: int, latency: float, correct: bool, error: str | None = None) -> dict[str, Any]:
    return {
        "id": f"s{i}", "answer": "red", "completion": None if error else "red", "reward": None if error else float(correct),
        "rewards": None, "correct": correct, "num_tokens": 0 if error else 2, "latency_ms": latency,
        "finish_reason": None if error else "stop", "error": error,
    }  # fmt: skip


def test_summarize_leaves_failed_samples_out_of_latency_and_accuracy() -> None:
    records = [
        _record(0, 40.0, True),
        _record(1, 10.0, False),
        _record(2, 9999.0, False, error="TimeoutError: 60 s"),
        _record(3, 30.0, True),
        _record(4, 20.0, True),
        _record(5, 50.0, False),
    ]
    report = summarize(
        records,
        model="m",
        data="d",
        started=0.0,
        duration_s=1.0,
        ablate_images=True,
        extra={"engine": "fake"},
    )
    assert report["num_failed"] == 1
    assert report["accuracy"] == pytest.approx(3 / 5)
    assert report["latency_ms_p50"] == 30.0  # of [10, 20, 30, 40, 50]: rank 3
    assert report["latency_ms_p95"] == 50.0  # rank 5; the failed 9999 ms is not counted
    assert report["engine"] == "fake" and report["ablate_images"] is True
    assert report["samples"] is records


def test_summarize_when_everything_failed() -> None:
    records = [_record(0, 5.0, False, error="ConnectionError: refused")]
    report = summarize(records, model="m", data="d", started=0.0, duration_s=1.0, ablate_images=False)
    assert report["accuracy"] == 0.0 and report["num_failed"] == 1
    assert report["latency_ms_p50"] is None and report["mean_reward"] is None


def test_write_report_json_and_markdown(tmp_path: Path) -> None:
    records = [_record(i, 10.0 * (i + 1), i % 2 == 0) for i in range(12)]
    records[1]["completion"] = "a | b\nc"
    report = summarize(records, model="m", data="d", started=0.0, duration_s=1.0, ablate_images=False)
    out = tmp_path / "new" / "dir" / "report.json"
    write_report(report, out)

    assert json.loads(out.read_text()) == report
    md = (tmp_path / "new" / "dir" / "report.md").read_text()
    assert "| accuracy | 0.500 |" in md
    assert "| num_samples | 12 |" in md
    assert "a \\| b c" in md  # pipes escaped, line breaks flattened: the table stays a table
    assert "| s9 |" in md and "| s10 |" not in md  # the first 10 samples only
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.json", "report.md"]  # no temp files left
    with pytest.raises(InputError, match=r"\.md"):
        write_report(report, tmp_path / "report.md")


# --------------------------------------------------------------------------- ablation


def _image(shade: int) -> Image.Image:
    return Image.new("RGB", (4, 4), (shade, 0, 0))


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ablate_is_a_derangement_that_keeps_answers(n: int, seed: int) -> None:
    prompts = [_prompt(f"q{i}", f"a{i}", [_image(i)]) for i in range(n)]
    ablated = ablate(prompts, seed)
    shade = [p.images[0].getpixel((0, 0))[0] for p in ablated]
    assert all(shade[i] != i for i in range(n))  # nobody keeps their own image
    assert sorted(shade) == list(range(n))  # every image used exactly once
    assert [(p.text, p.answer, p.sample_id) for p in ablated] == [
        (p.text, p.answer, p.sample_id) for p in prompts
    ]
    assert [p.images[0].getpixel((0, 0))[0] for p in prompts] == list(range(n))  # input left unchanged


def test_ablate_swaps_only_between_equal_image_counts() -> None:
    prompts = [
        _prompt("a", "x", [_image(0)]),
        _prompt("b", "x", [_image(1), _image(2)]),
        _prompt("c", "x", [_image(3)]),
        _prompt("d", "x", []),
        _prompt("e", "x", [_image(4), _image(5)]),
        _prompt("f", "x", [_image(6), _image(7), _image(8)]),  # alone with three images: kept
    ]
    ablated = ablate(prompts, seed=0)
    shades = [[im.getpixel((0, 0))[0] for im in p.images] for p in ablated]
    assert shades == [[3], [4, 5], [0], [], [1, 2], [6, 7, 8]]


def test_ablate_differs_by_seed() -> None:
    prompts = [_prompt(f"q{i}", "x", [_image(i)]) for i in range(8)]
    orders = {tuple(p.images[0].getpixel((0, 0))[0] for p in ablate(prompts, seed)) for seed in range(5)}
    assert len(orders) > 1
