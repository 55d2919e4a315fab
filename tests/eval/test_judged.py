"""Judged evaluation (`visionrl eval --judge SPEC`): what SPEC may be, the judges' scores per sample and their
summary (means and shares derived by hand), failures counted and left out, and the report's Markdown columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from visionrl.errors import InputError
from visionrl.eval.judged import check_judges_for, failed_judges, judge_records, parse_judges
from visionrl.eval.report import render_markdown
from visionrl.rewards.judge import JudgeFailure, JudgeRequest
from visionrl.types import PromptItem


@pytest.fixture
def template(tmp_path: Path) -> Path:
    path = tmp_path / "t.txt"
    path.write_text("{question}\n{completion}\nRight? yes or no\n")
    return path


def test_a_spec_is_a_job_file_an_entry_file_or_an_inline_mapping(tmp_path: Path, template: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        "rewards:\n  - name: exact_match\n"
        f"  - name: judge\n    kwargs: {{backend: engine, template: {template}}}\n"
        f"  - name: judge\n    kwargs: {{backend: vllm, model: m, template: {template}, timeout_s: 5}}\n"
    )
    judges = parse_judges(str(job))
    assert [(k, s.backend) for k, s in judges] == [("judge#0", "engine"), ("judge#1", "vllm")]
    assert judges[1][1].timeout_s == 5 and all(s.max_failed_steps == 0 for _, s in judges)  # never stops eval
    entry = tmp_path / "entry.yaml"
    entry.write_text(f"name: judge\nkwargs:\n  backend: engine\n  template: {template}\n")
    assert [k for k, _ in parse_judges(str(entry))] == ["judge"]
    inline = parse_judges(
        f"{{backend: endpoint, base_url: 'http://127.0.0.1:1/v1', model: j, template: {template}}}"
    )
    assert inline[0][1].base_url == "http://127.0.0.1:1/v1"

    no_judge = tmp_path / "rules.yaml"
    no_judge.write_text("rewards:\n  - name: exact_match\n")
    for spec, message in [
        (str(no_judge), "has no `judge` reward"),
        ("just-words", "neither a file nor a mapping"),
        ("{backend: engine, template: t, tempature: 1}", r"unknown judge key\(s\) \['tempature'\]"),
        ("{backend: engine, template: missing.txt}", "cannot be read"),
        ("{backend: engine", "cannot be read"),
    ]:
        with pytest.raises(InputError, match=message):
            parse_judges(spec)
    with pytest.raises(InputError, match="backend engine judges with the evaluated model's own local engine"):
        check_judges_for(judges, local=False)
    check_judges_for(judges, local=True)


def _records() -> tuple[list[dict[str, Any]], list[PromptItem]]:
    red = Image.new("RGB", (8, 8), "red")
    prompts = [PromptItem("t", [red], "red", {"prompt": "What colour?"}, f"s{i}") for i in range(4)]
    answers = ["red", "blue", None, "slow"]  # the third failed to generate
    records = [
        {"id": p.sample_id, "answer": "red", "completion": a, "reward": None if a is None else float(a == "red"),
         "correct": a == "red", "error": None if a is not None else "rejected"}
        for p, a in zip(prompts, answers, strict=True)
    ]  # fmt: skip
    return records, prompts


def test_judge_records_scores_the_answered_samples_and_counts_failures(template: Path) -> None:
    ((key, spec),) = parse_judges(f"{{backend: engine, template: {template}, on_error: -1}}")
    seen: list[JudgeRequest] = []

    def backend(requests: list[JudgeRequest]) -> list[float | JudgeFailure]:
        seen.extend(requests)
        return [JudgeFailure("late", timeout=True) if "slow" in r.text else (0.8 if "red" in r.completion else 0.2)
                for r in requests]  # fmt: skip

    records, prompts = _records()
    summary = judge_records(records, prompts, key, spec, backend, "prompt")
    assert [r.completion for r in seen] == ["red", "blue", "slow"]  # the failed generation is not judged
    assert [r["judge"]["judge"] for r in records] == [0.8, 0.2, None, None]  # a failure is None, not on_error
    assert [r["judge_verdict"]["judge"] for r in records] == ["yes 0.80", "yes 0.20", None, "timeout"]
    assert (
        summary["mean"] == pytest.approx(0.5) and summary["accepted"] == 0.5
    )  # (0.8 + 0.2) / 2; 1 of 2 >= 0.5
    assert (summary["num_judged"], summary["errors"], summary["timeouts"]) == (2, 0, 1)
    assert failed_judges({"judges": {key: summary}}) == []

    report = {"samples": records, "judges": {key: summary}, "accuracy": 0.25}
    md = render_markdown(report)
    assert "| judge judge (engine) | mean 0.500, accepted 0.500 of 2, 0 failed, 1 timed out |" in md
    assert "| id | answer | completion | reward | correct | judge judge | error |" in md
    assert "| s0 | red | red | 1.000 | True | 0.800 | - |" in md


def test_a_judge_that_failed_on_every_sample_is_named(template: Path) -> None:
    ((key, spec),) = parse_judges(f"{{backend: engine, template: {template}}}")
    records, prompts = _records()
    summary = judge_records(
        records, prompts, key, spec, lambda rs: [JudgeFailure("no route")] * len(rs), "prompt"
    )
    assert summary["mean"] is None and summary["errors"] == 3
    assert failed_judges({"judges": {key: summary}}) == ["judge: no route"]
