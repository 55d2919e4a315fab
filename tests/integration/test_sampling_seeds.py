"""Sampling noise: distinct for every sample (no two prompts share it), reproducible from the step's seed."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from visionrl.types import PromptItem, SamplingSpec

pytestmark = pytest.mark.slow


def _engine(kind: str, model: Path):
    if kind == "vllm":
        from visionrl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(str(model), lora_rank=8, tower_lora=True, forbidden_token_ids=[], dtype="float32")
    from visionrl.config import LoraConfig
    from visionrl.rollout.hf_engine import HFEngine

    return HFEngine(str(model), lora=LoraConfig(rank=8), forbidden_token_ids=[], dtype="float32")


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_samples_do_not_share_noise_and_a_step_seed_reproduces_them(tiny_model: Path, kind: str) -> None:
    from visionrl.models.loader import load_processor

    proc = load_processor(tiny_model)
    msgs = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color is the shape?"}]}
    ]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = PromptItem(text=text, images=[Image.new("RGB", (64, 64), (200, 10, 10))])
    engine = _engine(kind, tiny_model)
    spec = SamplingSpec(n=4, temperature=1.0, max_tokens=8, seed=123)
    ids = lambda groups: [[c.token_ids for c in g] for g in groups]  # noqa: E731
    # The same prompt twice in one batch: with shared noise (per-request seeds: sample j of every prompt gets
    # seed + j) both rows would be equal sample for sample. 4 samples x 8 tokens from a random 512-word model:
    # equal rows by chance have probability far below 1e-9.
    first = ids(engine.generate([prompt, prompt], spec))
    assert first[0] != first[1]
    assert len({tuple(s) for s in first[0] + first[1]}) > 4
    # the step's seed reproduces the step exactly; another step's seed gives other samples
    assert ids(engine.generate([prompt, prompt], spec)) == first
    other = ids(engine.generate([prompt, prompt], SamplingSpec(n=4, temperature=1.0, max_tokens=8, seed=124)))
    assert other != first
    engine.close()


def test_engines_and_rounds_draw_from_different_seeds() -> None:
    from visionrl.orchestrate.engine_lanes import ENGINE_SEED_STRIDE
    from visionrl.orchestrate.engine_lanes import engine_spec as _engine_spec

    spec = SamplingSpec(n=2, seed=7)
    assert [_engine_spec(spec, i).seed for i in range(3)] == [
        7,
        7 + ENGINE_SEED_STRIDE,
        7 + 2 * ENGINE_SEED_STRIDE,
    ]
    assert _engine_spec(SamplingSpec(n=2), 5).seed is None
