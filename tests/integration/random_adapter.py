"""A LoRA adapter that changes the tiny model's answers: random non-zero B (a fresh adapter's B is zero, a no-op)."""

from __future__ import annotations

from pathlib import Path


def random_adapter(base: Path, out: Path, seed: int) -> Path:
    """A peft adapter on the LM projections and the merger (rank 8) with random non-zero lora_B."""
    import torch

    from visionrl.config import LoraConfig
    from visionrl.models.loader import apply_lora, load_base_model

    model = apply_lora(load_base_model(base), LoraConfig(rank=8, alpha=16.0, train_merger=True), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B = 0 would make the adapter a no-op
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    model.save_pretrained(str(out))
    return out
