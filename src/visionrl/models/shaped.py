"""A checkpoint with the real Qwen3-VL-8B shapes and random weights, for GPU benchmarks and tests.

No hub is reachable where benchmarks run, and speed and memory depend on shapes, not on weight values. This
writes what `from_pretrained` and vLLM expect of Qwen3-VL-8B-Instruct: the 8B config values (which differ from
transformers' `Qwen3VLConfig` defaults), random bf16 weights, and a tokenizer built offline whose special tokens
sit at the real Qwen ids (151643 ...) in a 151,936-token vocabulary, so engines, processors and end-of-sequence
handling see the ids a real checkpoint has (docs/ENGINE_NOTES.md, "Qwen3-VL-8B shape").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from visionrl.models.tiny import (
    BASE_WORDS,
    QWEN3_TINY_TEXT,
    QWEN3_TINY_VISION,
    qwen3_rope,
    save_qwen_processor,
    save_qwen_tokenizer,
    text_token_fields,
    vision_token_fields,
)

# Qwen3-VL-8B-Instruct's shapes: text 36 layers x 4096, vision 27 blocks x 1152, deepstack at 8/16/24.
TEXT_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": qwen3_rope([24, 20, 20]),
}
VISION_8B: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 4096,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
# Small shapes with the same structure (and the real vocabulary and token ids), for CPU smoke runs and tests:
# they satisfy transformers' and vLLM's CPU rules (docs/ENGINE_NOTES.md, "Tiny model rules").
SMALL_TEXT: dict[str, Any] = dict(QWEN3_TINY_TEXT)
SMALL_VISION: dict[str, Any] = dict(QWEN3_TINY_VISION)
# The special tokens of Qwen's tokenizer at their real ids.
QWEN_SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
QWEN_EOS_IDS = [151645, 151643]  # generation_config of the real checkpoints: <|im_end|>, <|endoftext|>


def build_qwen_tokenizer(out_dir: Path, words: list[str], vocab_size: int = 151936) -> dict[str, int]:
    """A word-level fast tokenizer of `vocab_size` ids: `words` first, Qwen's special tokens at their real ids,
    unused filler tokens everywhere else (so every id an engine samples decodes)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    special_at = {i: t for t, i in QWEN_SPECIAL_IDS.items()}
    if vocab_size <= max(special_at):
        raise ValueError(f"vocab_size {vocab_size} cannot hold Qwen's special ids (up to {max(special_at)})")
    vocab: dict[str, int] = {"<unk>": 0}
    for w in sorted(set(words)):
        vocab[w] = len(vocab)
    if len(vocab) >= min(special_at):
        raise ValueError(f"{len(vocab)} words do not fit below the first special id {min(special_at)}")
    for i in range(len(vocab), vocab_size):
        vocab[special_at.get(i, f"<unused_{i}>")] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_IDS])
    save_qwen_tokenizer(tok, out_dir, model_max_length=TEXT_8B["max_position_embeddings"])
    return vocab


def build_shaped_checkpoint(
    out_dir: str | Path,
    *,
    device: str = "cuda",
    dtype: str = "bfloat16",
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
) -> Path:
    """Write a Qwen3-VL checkpoint with the 8B shapes (or `text`/`vision` overrides of them) and random weights.

    The weights are initialised directly on `device` (about 1 s for 8B on a GPU) and saved as safetensors shards.
    """
    import torch
    from transformers import (
        GenerationConfig,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    from visionrl.data.synthetic import task_vocabulary

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_cfg = {**TEXT_8B, **(text or {})}
    vision_cfg = {**VISION_8B, **(vision or {})}
    ids = build_qwen_tokenizer(out, BASE_WORDS + task_vocabulary(), vocab_size=text_cfg["vocab_size"])
    config = Qwen3VLConfig(
        text_config={**text_cfg, "model_type": "qwen3_vl_text", **text_token_fields(ids, dtype)},
        vision_config={**vision_cfg, "model_type": "qwen3_vl_vision"},
        **vision_token_fields(ids),
        dtype=dtype,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    patch, merge = vision_cfg["patch_size"], vision_cfg["spatial_merge_size"]
    save_qwen_processor(
        out, patch=patch, merge=merge, min_pixels=(patch * merge) ** 2, max_pixels=1024 * 1024
    )
    GenerationConfig(
        eos_token_id=QWEN_EOS_IDS, pad_token_id=ids["<|endoftext|>"], do_sample=True, temperature=1.0
    ).save_pretrained(out)
    (out / "visionrl_shaped.json").write_text(
        json.dumps({"kind": "qwen3-vl-8b-shaped", "seed": seed, "dtype": dtype}, indent=2) + "\n"
    )
    return out
