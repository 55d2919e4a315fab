"""Build a tiny, randomly initialised Qwen3-VL (default) or Qwen2.5-VL checkpoint that loads like a real one.

No model hub is reachable on the development machines, so tests and the demo make their own base model:
a Qwen3-VL or Qwen2.5-VL with the real architecture (vision tower, merger, deepstack for Qwen3-VL, windowed
vision attention for Qwen2.5-VL, M-RoPE text model) scaled down to ~250K parameters, a word-level tokenizer
trained here with `tokenizers`, and the processor, chat template and generation config of a normal checkpoint.
Stock `AutoModelForImageTextToText.from_pretrained(DIR)`, `AutoProcessor.from_pretrained(DIR)` and vLLM load
the directory.

The shapes follow docs/ENGINE_NOTES.md: they satisfy both transformers' and vLLM's CPU kernels (head_dim 32,
mrope_section summing to head_dim/2, out_hidden_size == text hidden size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Special tokens of the Qwen chat format. Their names are the ones Qwen3VLProcessor and vLLM look for.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
]
# Words besides the synthetic tasks' vocabulary, so prompts of other kinds tokenise to something.
BASE_WORDS = (
    "the a an is are what which where how many color colour shape image picture object objects in of on "
    "answer question yes no one two three four five six seven eight nine ten zero left right top bottom "
    "center middle red green blue yellow black white gray orange purple circle square rectangle ellipse "
    "triangle pentagon hexagon polygon sides side think user assistant system you are helpful . , ? ! : ; "
    "( ) [ ] < > / - + = 0 1 2 3 4 5 6 7 8 9"
).split()

# Qwen-style chat template: images become <|vision_start|><|image_pad|><|vision_end|> (the processor
# expands <|image_pad|> to one token per merged patch).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}\n</tool_response>{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A tool's answer comes back as Qwen's templates send it: a user turn wrapping it in <tool_response> (the model's
# calls are its own text, <tool_call>{json}</tool_call>). The tiny tokenizer has these four as tokens of their own
# only in a base made for tools (the `zoom` recipe): the other bases' vocabularies stay as they were.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

VOCAB_MULTIPLE = 64  # the model's vocab equals the tokenizer's, padded with unused tokens to this multiple

# The tiny architectures (model_type values): transformers' config, model and processor classes, the vision
# patch size. Qwen3-VL is the default everywhere.
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_vl": {
        "config": "Qwen3VLConfig",
        "model": "Qwen3VLForConditionalGeneration",
        "processor": "Qwen3VLProcessor",
        "video_processor": "Qwen3VLVideoProcessor",
        "patch": 16,
    },
    "qwen2_5_vl": {
        "config": "Qwen2_5_VLConfig",
        "model": "Qwen2_5_VLForConditionalGeneration",
        "processor": "Qwen2_5_VLProcessor",
        "video_processor": "Qwen2VLVideoProcessor",
        "patch": 14,
    },
}
DEFAULT_ARCH = "qwen3_vl"


def qwen3_rope(mrope_section: list[int]) -> dict[str, Any]:
    """Qwen3-VL's M-RoPE parameters (theta 5e6, interleaved); `mrope_section` sums to head_dim / 2."""
    return {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": mrope_section,
        "mrope_interleaved": True,
    }


# The tiny sizes both architectures share (docs/ENGINE_NOTES.md, "Tiny model rules", says why each number).
_TINY_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
_TINY_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,
}
#: The tiny Qwen3-VL's text and vision shapes (`models.shaped` builds its small smoke checkpoint from them).
QWEN3_TINY_TEXT: dict[str, Any] = {**_TINY_TEXT, "head_dim": 32, "rope_parameters": qwen3_rope([6, 5, 5])}
QWEN3_TINY_VISION: dict[str, Any] = {
    **_TINY_VISION,
    "patch_size": ARCHS["qwen3_vl"]["patch"],
    "num_position_embeddings": 256,
    "deepstack_visual_indexes": [0],
}
# Qwen2.5-VL scaled down like the Qwen3-VL. Its text model has no head_dim key (hidden / heads = 32) and
# plain (not interleaved) M-RoPE: [4, 6, 6] is the real [16, 24, 24] over head_dim 32. Its vision tower has
# no deepstack; window attention (112-pixel windows, full attention in the last block), patch 14.
_QWEN2_5_TINY_TEXT: dict[str, Any] = {
    **_TINY_TEXT,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]},
}
_QWEN2_5_TINY_VISION: dict[str, Any] = {
    **_TINY_VISION,
    "patch_size": ARCHS["qwen2_5_vl"]["patch"],
    "window_size": 112,
    "fullatt_block_indexes": [1],
    "tokens_per_second": 2,
}
_TINY_SHAPES = {
    "qwen3_vl": (QWEN3_TINY_TEXT, QWEN3_TINY_VISION),
    "qwen2_5_vl": (_QWEN2_5_TINY_TEXT, _QWEN2_5_TINY_VISION),
}


def vision_token_fields(token_ids: dict[str, int]) -> dict[str, Any]:
    """The top-level config fields of every checkpoint built here: the ids of the vision tokens, and an
    lm_head not tied to the embeddings (LoRA can target it)."""
    return {
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


def text_token_fields(token_ids: dict[str, int], dtype: str) -> dict[str, Any]:
    """The text config's special tokens (no BOS, <|im_end|> ends a turn, <|endoftext|> pads) and dtype."""
    return {
        "bos_token_id": None,
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "dtype": dtype,
    }


def tiny_config_dict(vocab_size: int, token_ids: dict[str, int], arch: str = DEFAULT_ARCH) -> dict:
    """The config of the tiny model of `arch`, float32 (see docs/ENGINE_NOTES.md for why each number)."""
    text, vision = _TINY_SHAPES[arch]
    return {
        "architectures": [ARCHS[arch]["model"]],
        "model_type": arch,
        **vision_token_fields(token_ids),
        "text_config": {
            **text,
            "model_type": f"{arch}_text",
            "vocab_size": vocab_size,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            **text_token_fields(token_ids, "float32"),
        },
        "vision_config": {**vision, "model_type": f"{arch}_vision"},
        "dtype": "float32",
    }


def save_qwen_tokenizer(tok: Any, out_dir: Path, model_max_length: int) -> None:
    """Save a `tokenizers.Tokenizer` as the fast tokenizer Qwen3VLProcessor and vLLM expect: Qwen's special-token
    names, left padding, the chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        },
        model_max_length=model_max_length,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def save_qwen_processor(
    out_dir: Path, *, patch: int, merge: int, min_pixels: int, max_pixels: int, arch: str = DEFAULT_ARCH
) -> Any:
    """Write the processor of `arch` (image and video processors, mean = std = 0.5, the chat template) next to
    the tokenizer already saved in `out_dir`."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    processor_cls = getattr(transformers, ARCHS[arch]["processor"])
    video_cls = getattr(transformers, ARCHS[arch]["video_processor"])
    common = {"patch_size": patch, "merge_size": merge, "temporal_patch_size": 2}
    norm = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    processor = processor_cls(
        image_processor=Qwen2VLImageProcessor(
            **common,
            **norm,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        ),
        tokenizer=AutoTokenizer.from_pretrained(out_dir),
        video_processor=video_cls(**common, **norm),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return processor


def train_tokenizer(words: list[str], out_dir: Path, tools: bool = False) -> dict[str, int]:
    """Train a word-level tokenizer on `words` (plus BASE_WORDS) and save it as a fast tokenizer; `tools`: with
    TOOL_TOKENS as tokens of their own (matched before words are split, kept when decoding)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    vocab_words = sorted(set(BASE_WORDS) | {w for w in words if w})
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    # Split on whitespace and punctuation, so "shape?" is "shape" + "?".
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces, tidies punctuation
    # Pad the vocabulary to a multiple of VOCAB_MULTIPLE with unused tokens, so the model's vocab equals
    # the tokenizer's and every id an engine can sample decodes.
    tools_added = TOOL_TOKENS if tools else []
    n = len(SPECIAL_TOKENS) + len(vocab_words) + len(tools_added)
    pad = (-n) % VOCAB_MULTIPLE
    filler = [f"<unused_{i}>" for i in range(pad)]
    trainer = trainers.WordLevelTrainer(
        special_tokens=SPECIAL_TOKENS, min_frequency=1, vocab_size=n - len(tools_added) + pad
    )
    tok.train_from_iterator([" ".join(vocab_words)], trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tools_added])
    tok.add_special_tokens(filler)
    save_qwen_tokenizer(tok, out_dir, model_max_length=4096)
    vocab = tok.get_vocab()
    assert len(vocab) % VOCAB_MULTIPLE == 0, len(vocab)
    return vocab


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    extra_words: list[str] | None = None,
    pretrain: bool = False,
    arch: str = DEFAULT_ARCH,
    recipe: str = "color",
) -> Path:
    """Write a tiny checkpoint directory of `arch` (a key of ARCHS): config, safetensors, tokenizer, processor,
    template.

    `pretrain=True` adds the short supervised pre-training of `models/pretrain.py` (about half a minute),
    giving a base that reads images and answers in format, as real bases do; `recipe` names the task the
    base is made for (`models.pretrain.RECIPES`: it knows that task's answer format, not its answers).
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    from visionrl.data.synthetic import task_vocabulary

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny-model architecture {arch!r}; use one of {', '.join(ARCHS)}")
    classes = ARCHS[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    words = task_vocabulary() + list(extra_words or [])
    if recipe == "easy-vqa":  # a third-party data set: its questions' words become tokens too
        from visionrl.data.easy_vqa import vocabulary

        words += vocabulary()
    if recipe == "judge-color":  # a judge: the words of its template and of the completion's delimiters
        from visionrl.data.synthetic import split_words
        from visionrl.models.pretrain import COLOR_MATCH_TEMPLATE
        from visionrl.rewards.judge import CLOSE, OPEN

        words += split_words(COLOR_MATCH_TEMPLATE.format(question="", completion=OPEN + CLOSE))
    if recipe == "zoom":  # the zoom task's question and the crop tool's call in Qwen's JSON format
        from visionrl.data.zoom import ZOOM_WORDS

        words += ZOOM_WORDS
    vocab = train_tokenizer(words, out, tools=recipe == "zoom")
    config = getattr(transformers, classes["config"])(**tiny_config_dict(len(vocab), vocab, arch))

    torch.manual_seed(seed)
    model = getattr(transformers, classes["model"])(config).to(torch.float32).eval()

    # The smallest image keeps one merged token per side (patch x merge pixels); 448 is a multiple of 16*2 and 14*2.
    patch = classes["patch"]
    processor = save_qwen_processor(
        out, patch=patch, merge=2, min_pixels=(2 * patch) ** 2, max_pixels=448 * 448, arch=arch
    )
    info: dict = {"seed": seed, "kind": f"tiny-{arch.replace('_', '-')}", "pretrained": pretrain}
    if pretrain:
        from visionrl.models.pretrain import RECIPE_LR, RECIPE_STEPS, pretrain_tiny

        steps, lr = RECIPE_STEPS.get(recipe, 300), RECIPE_LR.get(recipe, 2e-3)
        report = pretrain_tiny(model, processor, seed=seed, recipe=recipe, steps=steps, lr=lr)
        info.update(pretrain_steps=report.steps, pretrain_final_loss=round(report.final_loss, 4))
        if report.selected_step is not None:  # the judge recipe: the weights that judged best
            info.update(selected_step=report.selected_step, selected_score=report.selected_score)
        if recipe != "color":  # the demo base's file stays byte-identical
            info["pretrain_recipe"] = recipe
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
        do_sample=True,
        temperature=1.0,
    ).save_pretrained(out)
    (out / "visionrl_tiny.json").write_text(json.dumps(info, indent=2) + "\n")
    return out
