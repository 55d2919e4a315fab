"""The run's judging (visionrl.orchestrate.judging) around a backend: the cache and in-batch dedupe, failures and
timeouts scored `on_error` and counted, the run stopped when the judge fails on every sample step after step, and
a judge's scores in the step's metrics and pictures."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from visionrl.errors import RunError
from visionrl.judge.scoring import Judging
from visionrl.rewards.judge import JudgeFailure, JudgeRequest, JudgeSpec
from visionrl.types import Completion, PromptItem


def _prompts() -> list[PromptItem]:
    red, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    return [
        PromptItem("t", [red], answer="red", record={"prompt": "<image>What colour is the shape?"}),
        PromptItem("t", [blue], answer="blue", record={"prompt": "<image>What colour is the shape?"}),
    ]


def _groups(*texts: list[str]) -> list[list[Completion]]:
    return [[Completion(i, [1], t, [0.0], "stop") for t in group] for i, group in enumerate(texts)]


class _ColourJudge:
    """Says yes (0.9) when the completion names the colour of the image's centre pixel, else 0.1; records calls."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[list[JudgeRequest]] = []
        self.fail_on = fail_on

    def __call__(self, requests: list[JudgeRequest]) -> list[float | JudgeFailure]:
        self.calls.append(requests)
        out: list[float | JudgeFailure] = []
        for r in requests:
            colour = {(255, 0, 0): "red", (0, 0, 255): "blue"}[r.images[0].getpixel((4, 4))]
            answer = r.text.split("<completion>\n")[1].split("\n</completion>")[0]
            if self.fail_on is not None and self.fail_on in answer:
                out.append(JudgeFailure("took too long", timeout=self.fail_on == "slow"))
            else:
                out.append(0.9 if answer == colour else 0.1)
        return out


def _judging(tmp_path: Path, backend, **kw: object) -> Judging:
    template = tmp_path / "judge.txt"
    template.write_text("{question}\n{completion}\nIs that the colour of the shape? yes or no")
    spec = JudgeSpec.from_kwargs({"backend": "engine", "template": str(template), "on_error": -1.0, **kw})
    return Judging("judge", spec, backend, "prompt", [])


def test_verdicts_cache_and_in_batch_duplicates(tmp_path: Path) -> None:
    backend = _ColourJudge()
    judging = _judging(tmp_path, backend)
    first = judging.score(_prompts(), _groups(["red", "blue", "red"], ["blue", "green", "blue"]))
    assert first.scores == [0.9, 0.1, 0.9, 0.9, 0.1, 0.9]
    assert first.verdicts[:2] == ["yes 0.90", "yes 0.10"]
    # "red" on the red image and "blue" on the blue one were each asked once: 4 distinct pairs of 6
    assert len(backend.calls) == 1 and len(backend.calls[0]) == 4 and first.cached == 0
    assert (
        "What colour is the shape?" in backend.calls[0][0].text and "<image>" not in backend.calls[0][0].text
    )
    # the same pair on another step comes from the cache; a new pair is judged
    second = judging.score(_prompts(), _groups(["red", "yellow"], ["blue", "blue"]))
    assert second.scores == [0.9, 0.1, 0.9, 0.9] and second.cached == 3
    assert [len(c) for c in backend.calls] == [4, 1]
    # the same words on the other image are another pair: the judge sees the images
    third = judging.score(_prompts()[::-1], _groups(["red"], ["blue"]))
    assert third.scores == [0.1, 0.1] and third.cached == 1  # (red image, "blue") was judged in step 1


def test_failures_score_on_error_and_are_counted(tmp_path: Path) -> None:
    judging = _judging(tmp_path, _ColourJudge(fail_on="slow"))
    out = judging.score(_prompts(), _groups(["red", "slow"], ["slow", "blue"]))
    assert out.scores == [0.9, -1.0, -1.0, 0.9] and (out.errors, out.timeouts) == (0, 2)
    assert (
        out.verdicts == ["yes 0.90", "timeout", "timeout", "yes 0.90"] and out.first_error == "took too long"
    )
    assert [s for s, v in zip(out.scores, out.verdicts, strict=True) if v.startswith("yes")] == [0.9, 0.9]
    # a failed pair is not cached: the next step asks again
    again = judging.score(_prompts(), _groups(["slow"], ["blue"]))
    assert again.timeouts == 1 and again.cached == 1


def test_a_judge_failing_on_every_sample_stops_the_run_after_max_failed_steps(tmp_path: Path) -> None:
    judging = _judging(tmp_path, _ColourJudge(fail_on="bad"), max_failed_steps=2)
    judging.score(_prompts(), _groups(["bad"], ["bad"]))  # one step: counted, the run goes on
    judging.score(_prompts(), _groups(["red"], ["bad"]))  # a step with a verdict: the count starts again
    judging.score(_prompts(), _groups(["bad"], ["bad x"]))
    with pytest.raises(RunError, match=r"failed on every sample of 2 step\(s\) in a row.*took too long"):
        judging.score(_prompts(), _groups(["bad y"], ["bad z"]))
    never = _judging(tmp_path, _ColourJudge(fail_on="bad"), max_failed_steps=0)
    for _ in range(3):
        assert never.score(_prompts(), _groups(["bad"], ["bad"])).errors == 2


def test_the_judges_metrics_histogram_and_verdicts_in_the_pictures(tmp_path: Path) -> None:
    import torch

    from visionrl import metrics as tags
    from visionrl.orchestrate.judging import join_scores
    from visionrl.orchestrate.step_log import rollout_samples, step_metrics
    from visionrl.pictures import samples_markdown
    from visionrl.rewards import RewardSpec

    judging = _judging(tmp_path, _ColourJudge(fail_on="slow"))
    groups = _groups(["red", "slow"], ["blue", "green"])
    judged = judging.score(_prompts(), groups)
    spec = RewardSpec("judge", 1.0, {"backend": "engine", "template": "t"})
    scores = join_scores([spec], None, [judged], 4)
    rewards = torch.tensor(scores.total)
    m = step_metrics(rewards, groups, scores, {}, 2, 2)
    assert m[tags.JUDGE_MEAN] == pytest.approx((0.9 - 1.0 + 0.9 + 0.1) / 4)
    assert (m[tags.JUDGE_TIMEOUTS], m[tags.JUDGE_ERRORS]) == (1.0, 0.0)
    assert (
        m[tags.TIMING_JUDGE] == pytest.approx(judged.seconds)
        and m["reward/component/judge"] == m[tags.JUDGE_MEAN]
    )
    samples = rollout_samples(_prompts(), groups, scores.total, 2, "prompt", scores.verdicts)
    assert [s.verdict for s in samples] == ["yes 0.90", "yes 0.90"]
    assert samples_markdown(samples).splitlines()[0].endswith("| judge |")
