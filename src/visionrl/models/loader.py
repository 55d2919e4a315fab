"""Load a Qwen3-VL or Qwen2.5-VL base model and processor from a checkpoint directory, and put LoRA on it.

The same code takes the tiny test models and real checkpoints (Qwen3-VL-8B-Instruct): all are plain
checkpoint directories (hub-format configs, old `rope_scaling`/`torch_dtype` spellings included, are read by
transformers). Both architectures share what the learner relies on: `model.visual` (vision tower + merger),
`model.language_model`, `lm_head`, and M-RoPE positions computed from `mm_token_type_ids` (docs/ENGINE_NOTES.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from visionrl.adapter.files import target_regex
from visionrl.adapter.servable import NO_LM_HEAD_LORA
from visionrl.config import LM_PROJECTIONS, MERGER_PROJECTIONS, LoraConfig
from visionrl.data.images import ImageBudget
from visionrl.errors import InputError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, ProcessorMixin

SUPPORTED_MODEL_TYPES = ("qwen3_vl", "qwen2_5_vl")
LM_HEAD = "lm_head"


class ModelLoadError(InputError):
    """The base model directory is missing, incomplete or of an unsupported architecture."""


def check_model_dir(path: str | Path) -> dict[str, Any]:
    """Read and check `config.json`; returns it. Raises ModelLoadError with what to do."""
    p = Path(path)
    cfg_path = p / "config.json"
    if not p.is_dir():
        raise ModelLoadError(
            f"base model '{p}' is not a directory; pass a checkpoint directory "
            "(e.g. one written by `visionrl init-tiny-model DIR`, or a downloaded Qwen3-VL-8B-Instruct)"
        )
    if not cfg_path.is_file():
        raise ModelLoadError(f"base model '{p}' has no config.json; is it a complete checkpoint directory?")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(
            f"{cfg_path} is not valid JSON ({err}); re-download or re-create the checkpoint"
        ) from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"base model '{p}' has model_type '{model_type}'; visionrl supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_processor(path: str | Path, budget: ImageBudget | None = None) -> ProcessorMixin:
    """The checkpoint's processor; with `budget`, its image processor resizes into the budget's pixel bounds
    (the same bounds the engines and the server get: `visionrl.data.images`)."""
    from transformers import AutoProcessor
    from transformers.image_utils import SizeDict

    check_model_dir(path)
    processor = AutoProcessor.from_pretrained(str(path))
    if budget is not None:
        # Only the image processor: passing `size` to from_pretrained would also set the video processor's,
        # whose bounds mean pixels x frames.
        processor.image_processor.size = SizeDict(**budget.processor_size())
    return processor


def load_base_model(
    path: str | Path,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """The base VLM, in eval mode, with frozen weights."""
    import torch
    from transformers import AutoModelForImageTextToText

    from visionrl.models.patch_embed import patch_embed_as_matmul

    check_model_dir(path)
    # Straight onto the accelerator: an 8B model staged in host memory first costs 17 GB and a copy.
    on_gpu = torch.device(device).type == "cuda"
    model = AutoModelForImageTextToText.from_pretrained(
        str(path),
        dtype=torch_dtype(dtype),
        attn_implementation=attn_implementation,
        device_map=str(device) if on_gpu else None,
    )
    model.to(device)
    model.requires_grad_(False)
    patch_embed_as_matmul(model)  # the Conv3d of the vision tower, 34x slower than the same matmul on an H200
    return model.eval()


def lora_target_regex(cfg: LoraConfig) -> str:
    """One regex (peft full-match) covering the configured LoRA targets."""
    # Suffixes like ["q_proj", "v_proj"] stay on the language model (never the vision blocks).
    parts = [target_regex(cfg.target_modules, within=".*language_model")]
    if cfg.train_merger:
        parts.append(MERGER_PROJECTIONS)
    if cfg.train_lm_head:
        parts.append(LM_HEAD)
    return "|".join(f"(?:{p})" for p in parts)


def check_lora_for_model(model_type: str, cfg: LoraConfig) -> None:
    """Refuse LoRA settings whose adapter vLLM could not take on this architecture (rollouts and serving would
    not follow the trained policy): lm_head LoRA on Qwen2.5-VL (`visionrl.adapter.servable.NO_LM_HEAD_LORA`)."""
    if cfg.train_lm_head and model_type in NO_LM_HEAD_LORA:
        raise InputError(
            f"lora.train_lm_head=true on a {model_type} base: vLLM does not load LoRA on its lm_head (the adapter "
            "would fail in the rollout engine and the server); set lora.train_lm_head: false "
            "(docs/ENGINE_NOTES.md, Qwen2.5-VL)"
        )


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, seed: int = 0) -> Any:
    """Wrap `model` in a peft LoRA model (only the adapter is trainable). Deterministic for a seed."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_lora_for_model(model.config.model_type, cfg)
    targets = lora_target_regex(cfg)
    # Checked here (peft full-matches the same regex) so that the user gets an InputError naming the config
    # key, not peft's own error.
    if not any(re.fullmatch(targets, name) for name, _ in model.named_modules()):
        raise InputError(
            f"lora.target_modules={cfg.target_modules!r} matched no module of the model; "
            f"the default {LM_PROJECTIONS!r} targets the language model's projections"
        )
    torch.manual_seed(seed)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        init_lora_weights=True if cfg.init_lora_weights == "default" else "gaussian",
        bias="none",
    )
    return get_peft_model(model, peft_cfg)


def in_vision_tower(name: str) -> bool:
    """Whether a parameter name lies in the vision tower module (`model.visual`: the merger's LoRA)."""
    return ".visual." in name or name.startswith("visual.") or "model.visual" in name


def checkpoint_layers(model: Any, count: int | None) -> None:
    """Recompute activations in backward for the first `count` decoder layers of a peft model (all when None):
    each one checkpointed saves its activations' memory and costs one more forward of that layer."""
    # Non-reentrant checkpointing needs no `enable_input_require_grads` (that would also make backward
    # compute gradients of the input embeddings, which nothing trains).
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.get_base_model().model.language_model.layers
    if count is None:
        return
    if count > len(layers):
        raise ValueError(
            f"model.checkpoint_layers={count} exceeds the model's {len(layers)} decoder layers; "
            f"set at most {len(layers)}, or null for all"
        )
    for layer in layers[count:]:
        layer.gradient_checkpointing = False


def lora_param_groups(model: Any, lr: float, merger_lr: float | None, lm_head_lr: float | None) -> list[dict]:
    """Optimizer parameter groups: language model LoRA, merger LoRA and lm_head LoRA may use their own rates."""
    groups: dict[str, list] = {"lm": [], "merger": [], "lm_head": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if in_vision_tower(name):
            groups["merger"].append(p)
        elif f"{LM_HEAD}." in name:
            groups["lm_head"].append(p)
        else:
            groups["lm"].append(p)
    rates = {"lm": lr, "merger": merger_lr or lr, "lm_head": lm_head_lr or lr}
    return [{"params": ps, "lr": rates[k], "name": k} for k, ps in groups.items() if ps]


def checkpoint_vision_token_ids(path: str | Path) -> list[int]:
    """`vision_token_ids` read from the checkpoint's config alone (no weights): what the engines must never
    sample, known before any learner has loaded the model."""
    from transformers import AutoConfig

    return vision_token_ids(AutoConfig.from_pretrained(str(path)), None)


def vision_token_ids(model_config: Any, processor: Any) -> list[int]:
    """Token ids that must never be sampled: image/video pads and vision delimiters (docs/ENGINE_NOTES.md)."""
    ids = {
        getattr(model_config, "image_token_id", None),
        getattr(model_config, "video_token_id", None),
        getattr(model_config, "vision_start_token_id", None),
        getattr(model_config, "vision_end_token_id", None),
    }
    return sorted(i for i in ids if i is not None)
