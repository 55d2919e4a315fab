"""Multi-image prompts end to end: GRPO teaches the tiny model the two-image `same_color` task, and the model
really compares the two images (held-out accuracy well above chance, back at chance with images permuted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from visionrl.config import load_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def same_color_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny base made for the task: reads colours, answers yes/no at chance (about 40 s)."""
    from visionrl.models.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("pair") / "model", seed=0, pretrain=True, recipe="same_color"
    )


def test_grpo_learns_to_compare_two_images(same_color_base: Path, tmp_path: Path) -> None:
    from visionrl.data.synthetic import make_dataset
    from visionrl.eval.local import evaluate_local
    from visionrl.orchestrate.loop import train

    data = tmp_path / "data"
    make_dataset(data, "same_color", num_train=512, num_eval=128, seed=0)
    cfg = load_config(
        REPO / "configs" / "same_color.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.path={same_color_base}",
            f"data.train={data / 'train.jsonl'}",
            f"data.eval={data / 'eval.jsonl'}",
            "train.steps=80",
            "train.target_accuracy=0.8",
            "logging.save_every=1000",
        ],
    )
    result = train(cfg)
    # the HF engine: the same greedy answers as vLLM (tests/integration/test_evaluate.py), without its start-up
    common = {"base": str(same_color_base), "data": str(data / "eval.jsonl"), "max_tokens": 2, "engine": "hf"}
    base = evaluate_local(adapter=None, out=str(tmp_path / "base.json"), **common)
    final = evaluate_local(adapter=str(result.adapter_dir), out=str(tmp_path / "final.json"), **common)
    permuted = evaluate_local(
        adapter=str(result.adapter_dir), out=str(tmp_path / "permuted.json"), ablate_images=True, **common
    )
    # 128 balanced yes/no questions: chance is 0.5 with a standard deviation of sqrt(0.25 / 128) = 0.044, so
    # 0.62 is 2.7 deviations above it; a model that compares the colours gets far more.
    assert 0.38 <= base["accuracy"] <= 0.62, f"the base should be at chance, got {base['accuracy']:.3f}"
    assert final["accuracy"] >= 0.7, (
        f"trained {result.steps} steps, held-out accuracy {final['accuracy']:.3f}"
    )
    # Permuted images pair each question with the images of another: the colours no longer decide it.
    assert permuted["accuracy"] <= 0.62, f"with images permuted {permuted['accuracy']:.3f}: not reading them"
