"""The one engine factory: training (each rollout actor) and local evaluation build their engine here.

Heavy imports (vLLM, transformers) happen inside, so importing this module costs nothing.
"""

from __future__ import annotations

from visionrl.config import LoraConfig, RolloutConfig
from visionrl.data.images import ImageBudget
from visionrl.types import RolloutEngine

ENGINES = ("vllm", "hf")


def make_engine(
    model_path: str,
    *,
    lora: LoraConfig,
    rollout: RolloutConfig,
    forbidden_token_ids: list[int],
    dtype: str,
    seed: int,
    budget: ImageBudget,
) -> RolloutEngine:
    """The rollout engine `rollout.engine` ("vllm" or "hf") for `model_path` with a LoRA layout from `lora`.

    vLLM reads the adapter's targets from the adapter files themselves; it needs the rank to size its LoRA
    slots and `lora.train_merger` to apply LoRA on the vision merger. The HF engine builds the peft layout
    from `lora`, so the adapters it loads must match it. Both resize images into `budget` and take at most
    `budget.max_images` images per prompt.
    """
    if rollout.engine == "vllm":
        from visionrl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_path,
            lora_rank=lora.rank,
            tower_lora=lora.train_merger,
            forbidden_token_ids=forbidden_token_ids,
            dtype=dtype,
            max_model_len=rollout.max_model_len,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            enforce_eager=rollout.enforce_eager,
            kv_cache_gib=rollout.kv_cache_gib,
            seed=seed,
            budget=budget,
            sleep_mode=rollout.sleep_during_update,
            engine_args=rollout.vllm_engine_args,
            lora_serving=rollout.lora_serving,
        )
    if rollout.engine == "hf":
        from visionrl.rollout.hf_engine import HFEngine

        return HFEngine(
            model_path,
            lora=lora,
            forbidden_token_ids=forbidden_token_ids,
            dtype=dtype,
            seed=seed,
            budget=budget,
        )
    raise ValueError(f"unknown rollout engine {rollout.engine!r}; use one of {', '.join(ENGINES)}")


def preload_engine(engine: str) -> None:
    """Import what `make_engine` will build on (vLLM's import alone takes 15-18 s on a GPU machine), so that an
    engine waiting for its turn to load the model spends the wait on it. `import vllm` alone is lazy: on the CPU
    build it takes 1.8 s and the engine class 4.2 s more (docs/ENGINE_NOTES.md)."""
    if engine == "vllm":
        from vllm import LLM  # noqa: F401

        from visionrl.rollout import vllm_engine  # noqa: F401
