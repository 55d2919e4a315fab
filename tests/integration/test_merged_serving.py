"""`rollout.lora_serving: merged` on vLLM's CPU build: an engine without LoRA, each adapter version merged into its
base weights, serves what the LoRA engine serves (the same greedy tokens, log-probs within float32 noise); a probe
or the judge's base model is merged in and the served version merged back; an adapter a merge cannot reproduce is refused and the version before stays served;
a rebuilt engine gets the served version again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from tests.integration.test_tiny_model import IMAGE_COLORS, adapter_payload, perturb_lora_b, prompt_text

from visionrl.config import LoraConfig
from visionrl.models.loader import apply_lora, load_base_model, load_processor, vision_token_ids
from visionrl.rollout.lora_merge import MergeError
from visionrl.types import ADAPTER_CONFIG, AdapterPayload, JudgeAsk, PromptItem, SamplingSpec

SPEC = SamplingSpec(n=1, greedy=True, max_tokens=8)


def engine(model: Path, forbidden: list[int], serving: str) -> Any:
    from visionrl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(str(model), lora_rank=8, tower_lora=True, forbidden_token_ids=forbidden, dtype="float32",
                      max_model_len=512, lora_serving=serving)  # fmt: skip


def tokens(groups: list[list[Any]]) -> list[list[int]]:
    return [g[0].token_ids for g in groups]


@pytest.mark.slow
def test_merged_serving_serves_what_the_lora_engine_serves(tiny_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    processor = load_processor(tiny_model)
    forbidden = vision_token_ids(load_base_model(tiny_model).config, processor)
    payloads = []
    # v1, v2: LoRA on the language model and the merger, every B non-zero; v3: the merger's B only
    for version, only in ((1, ""), (2, ""), (3, "visual")):
        layout = LoraConfig(rank=8, alpha=16, train_merger=True)
        model = apply_lora(load_base_model(tiny_model), layout, seed=0)
        perturb_lora_b(model, seed=version, only=only)
        payloads.append(adapter_payload(model, tmp_path / f"v{version}", version))
    prompts = []
    for rgb in IMAGE_COLORS:
        image = Image.new("RGB", (64, 64), (255, 255, 255))
        image.paste(rgb, (8, 8, 48, 40))
        prompts.append(PromptItem(text=prompt_text(processor), images=[image]))

    lora = engine(tiny_model, forbidden, "adapter")
    try:
        lora.load_adapter(payloads[0])
        expected = lora.generate(prompts, SPEC)
    finally:
        lora.close()

    merged = engine(tiny_model, forbidden, "merged")
    try:
        assert "enable_lora" not in merged._llm_kwargs  # no LoRA slots, no LoRA kernels
        # and eager on the CPU build, which would compile it (not the LoRA engine)
        assert merged._llm_kwargs["enforce_eager"] and not lora._llm_kwargs["enforce_eager"]
        base = merged.generate(prompts, SPEC)
        # the start-up probe of the merger alone moves the completions: no image embedding cached before a merge
        # is reused after it
        merger_only = merged.probe(payloads[2], prompts)
        assert merger_only.tokens_changed > 0 or merger_only.largest_change > 1e-3
        assert tokens(merged.generate(prompts, SPEC)) == tokens(base)  # and the base model is served again
        assert merged.load_adapter(payloads[0]) == 1
        assert {"write", "add", "remove", "reset"} <= set(merged.load_parts)
        served = merged.generate(prompts, SPEC)
        assert tokens(served) == tokens(expected) != tokens(base)
        for got, want in zip(served, expected, strict=True):
            assert got[0].logprobs == pytest.approx(want[0].logprobs, abs=1e-4)

        # a probe of v2 moves the completions; afterwards v1 is served again
        assert merged.probe(payloads[1], prompts).tokens_changed > 0
        assert tokens(merged.generate(prompts, SPEC)) == tokens(expected)
        # the judge answers as the base model (the checkpoint's weights merged back, no zero adapter built);
        # afterwards v1 is served again
        assert merged.judge(prompts, JudgeAsk(max_tokens=8)) == [g[0].text for g in base]
        assert merged._adapters._zero is None
        assert tokens(merged.generate(prompts, SPEC)) == tokens(expected)
        # an adapter a merge cannot reproduce is refused with the setting to use, and v1 stays served
        config = json.loads(payloads[1].files[ADAPTER_CONFIG]) | {"rank_pattern": {"q_proj": 4}}
        bad = AdapterPayload(3, {**payloads[1].files, ADAPTER_CONFIG: json.dumps(config).encode()})
        with pytest.raises(MergeError, match=r"rank_pattern.*rollout\.lora_serving: adapter"):
            merged.load_adapter(bad)
        assert merged.adapter_version() == 1 and len(list(merged._adapters.dir.iterdir())) == 1
        assert tokens(merged.generate(prompts, SPEC)) == tokens(expected)
        # a rebuilt engine loads the checkpoint again and gets v1 merged back in
        merged.rebuild()
        assert tokens(merged.generate(prompts, SPEC)) == tokens(expected)
    finally:
        merged.close()
