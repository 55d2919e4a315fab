"""A judge model of its own (backend `vllm`): its vLLM engine without LoRA, its processor, its yes and no tokens.

Runs inside a Ray judge actor during training, or in the process of `visionrl eval --judge`. The rollout engines'
own base model (backend `engine`) needs none of this: the engines judge with their adapter switched off.
"""

from __future__ import annotations

from visionrl.data.images import ImageBudget
from visionrl.data.prompts import user_prompt
from visionrl.models.loader import load_processor, vision_token_ids
from visionrl.rewards.judge import JudgeRequest, JudgeSpec, judge_ask


class ModelJudge:
    """`judge(requests)`: the judge model's raw verdicts (yes shares or texts; None for a prompt it refused)."""

    def __init__(self, spec: JudgeSpec, *, seed: int = 0, kv_cache_gib: float = 1.0) -> None:
        from transformers import AutoConfig

        from visionrl.rollout.vllm_engine import VLLMEngine

        assert spec.model is not None  # JudgeSpec.check: the vllm backend names its model
        budget = ImageBudget()
        self.processor = load_processor(spec.model, budget)
        self.ask = judge_ask(spec, self.processor.tokenizer)
        forbidden = vision_token_ids(AutoConfig.from_pretrained(spec.model), self.processor)
        self.engine = VLLMEngine(
            spec.model,
            lora_rank=0,
            tower_lora=False,
            forbidden_token_ids=forbidden,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            kv_cache_gib=kv_cache_gib,
            seed=seed,
            budget=budget,
        )

    def judge(self, requests: list[JudgeRequest]) -> list[float | str | None]:
        prompts = [user_prompt(self.processor, r.text, r.images) for r in requests]
        return self.engine.judge(prompts, self.ask)

    def close(self) -> None:
        self.engine.close()
