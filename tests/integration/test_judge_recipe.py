"""The tiny judge that `make demo-judge` builds (`init-tiny-model --recipe judge-color`), built fresh as a new user's
machine builds it: it must be right on every colour of its own validation pictures, agree with the true labels on
held-out pictures and fall to chance with the images permuted. A judge that says yes to a wrong colour is a reward
the policy learns to collect: the recipe's earlier judge did so on a quarter of the pictures and sent the demo to
one colour (benchmarks/NOTES-demo-judge.md, round 2). About 2 minutes on 2 cores; the demo's learning run itself
(7 minutes: 0.953 held-out with seed 2) is measured there, the judge's part of the loop is smoke-tested in
test_judge_rewards.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_the_judge_recipe_builds_a_judge_right_on_every_colour(tmp_path: Path, color_data: Path) -> None:
    import torch

    from visionrl.demo import REPO, judge_agreement
    from visionrl.models.tiny import build_tiny_model

    torch.set_num_threads(1)  # as the demo builds it: the judge is chosen on its arithmetic
    judge = build_tiny_model(tmp_path / "judge", seed=0, pretrain=True, recipe="judge-color")
    info = json.loads((judge / "visionrl_tiny.json").read_text())
    assert (
        info["selected_score"] == 1.0 and 450 <= info["selected_step"] <= 900
    )  # all four colours, every picture
    report = judge_agreement(
        judge, color_data / "eval.jsonl", REPO / "configs" / "judges" / "color_match.txt"
    )
    assert report["agreement"] >= 0.98, report
    assert 0.35 <= report["agreement, images permuted"] <= 0.65, report  # it reads the image, not the words
