"""Would `vllm serve --enable-lora` apply a peft LoRA adapter exactly as it was trained?

A pure check of an adapter's `adapter_config.json` (and, when at hand, the names and dtypes of the
tensors in its `adapter_model.safetensors`) against what vLLM loads and applies for Qwen3-VL and Qwen2.5-VL: the allowed
`max_lora_rank` values, the modules vLLM puts LoRA on (language-model projections, `lm_head`, and the
vision merger behind `--enable-tower-connector-lora`; never the vision tower blocks), and peft features
vLLM refuses. Export runs it before every export and serving before every adapter; no I/O happens here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from visionrl.adapter.files import target_regex

# The `max_lora_rank` values vLLM accepts; its LoRA slots are sized to one of them.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


# Module-name patterns (peft names, e.g. `model.language_model.layers.0.self_attn.q_proj`) by what vLLM
# does with LoRA on them, first match wins. Only the merger needs `--enable-tower-connector-lora`
# (docs/ENGINE_NOTES.md); the rest of the vision tower ("vision_tower") and anything else ("other") is not applied.
_MODULE_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("language_model", re.compile(r"(^|\.)language_model\.(.+\.)?(q|k|v|o|gate|up|down)_proj$")),
    ("lm_head", re.compile(r"(^|\.)lm_head$")),
    (
        "connector",
        re.compile(r"(^|\.)visual\.((merger|deepstack_merger_list\.\d+)\.linear_fc[12]|merger\.mlp\.[02])$"),
    ),
    ("vision_tower", re.compile(r"(^|\.)visual\.")),
)

# Representative module names of a Qwen3-VL (and Qwen2.5-VL's merger, its only names outside Qwen3-VL's that vLLM
# applies LoRA to), used to decide what a target regex matches when the adapter's weights (the exact source of
# truth) are not at hand.
QWEN_VL_MODULE_NAMES = (
    *(f"model.language_model.layers.0.self_attn.{p}_proj" for p in "qkvo"),
    *(f"model.language_model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")),
    *("model.language_model.embed_tokens", "lm_head", "model.visual.patch_embed.proj"),
    *(f"model.visual.blocks.0.{p}" for p in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")),
    *(f"model.visual.{m}.linear_fc{i}" for m in ("merger", "deepstack_merger_list.0") for i in (1, 2)),
    *(f"model.visual.merger.mlp.{i}" for i in (0, 2)),
)

# peft adapter_config fields that vLLM refuses (or would serve with a different meaning), with the fix.
_UNSUPPORTED_FEATURES: tuple[tuple[str, str], ...] = (
    ("use_dora", "DoRA (use_dora=true): vLLM does not support DoRA; retrain as plain LoRA"),
    ("lora_bias", "LoRA bias (lora_bias=true): vLLM does not load adapter biases; retrain without it"),
    ("layer_replication", "layer_replication is set: vLLM does not support it; retrain without it"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens): vLLM does not support it"),
    ("use_qalora", "QA-LoRA (use_qalora=true): vLLM does not support it; retrain as plain LoRA"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora): vLLM does not support it; retrain as plain LoRA"),
)
# Inits that rewrite the base weights when peft loads the adapter; vLLM serves the unmodified base.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq")
# Base architectures (config.json model_type) whose lm_head vLLM 0.32 takes no LoRA on: Qwen2.5-VL's language model
# (vLLM's Qwen2ForCausalLM) declares no LoRA embedding modules, and an adapter with lm_head LoRA fails to load
# ("expected target modules in ...", docs/ENGINE_NOTES.md).
NO_LM_HEAD_LORA = frozenset({"qwen2_5_vl"})
_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(lora_A|lora_B)(\.[^.]+)?\.weight$|^(?P<emb>.+)\.lora_embedding_[AB]$"
)
_PEFT_PREFIX = "base_model.model."


def adapter_module_names(tensor_names: Iterable[str]) -> list[str]:
    """Module names that carry LoRA weights, from safetensors keys of a peft adapter (sorted, unique).

    `base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight` ->
    `model.language_model.layers.0.self_attn.q_proj`. Keys that are not LoRA matrices (peft's full copy of
    an embedding layer, `...lm_head.base_layer.weight`) are not targets and are left out.
    """
    names = set()
    for key in tensor_names:
        match = _LORA_KEY.match(key)
        if match:
            names.add((match.group("module") or match.group("emb")).removeprefix(_PEFT_PREFIX))
    return sorted(names)


def _targeted_modules(target_modules: str | Sequence[str] | None, candidates: Iterable[str]) -> list[str]:
    """The candidates peft would target (`visionrl.adapter.files.target_regex`)."""
    if not target_modules:
        return []
    pattern = re.compile(target_regex(target_modules))
    return [n for n in candidates if pattern.fullmatch(n)]


def _classify_modules(modules: list[str]) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {kind: [] for kind, _ in _MODULE_KINDS}
    kinds["other"] = []
    for name in modules:
        kind = next((k for k, pattern in _MODULE_KINDS if pattern.search(name)), "other")
        kinds[kind].append(name)
    return kinds


def _shown(names: list[str], limit: int = 4) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _feature_problems(adapter_config: Mapping[str, Any]) -> list[str]:
    problems = [msg for key, msg in _UNSUPPORTED_FEATURES if adapter_config.get(key)]
    if adapter_config.get("bias", "none") != "none":
        problems.append(
            f"bias={adapter_config['bias']!r}: vLLM does not load adapter biases; retrain with bias='none'"
        )
    init = adapter_config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        problems.append(
            f"init_lora_weights={init!r} changes the base weights when peft loads the adapter, but vLLM serves the "
            "unchanged base model; convert the adapter to plain LoRA (peft path_initial_model_for_weight_conversion)"
        )
    if adapter_config.get("modules_to_save"):
        problems.append(
            f"modules_to_save={adapter_config['modules_to_save']!r}: vLLM does not load fully trained modules from "
            "an adapter, only LoRA weights; retrain with those modules as LoRA targets (lora.train_lm_head, "
            "lora.train_merger) instead"
        )
    return problems


def check_servable(
    adapter_config: Mapping[str, Any],
    tensors: Mapping[str, str] | None = None,
    model_type: str | None = None,
) -> dict[str, Any]:
    """Whether vLLM serves this peft adapter as trained, and with which server flags.

    `tensors` maps the adapter's safetensors keys to their dtypes (`visionrl.adapter.files.read_safetensors_header`):
    with it the targeted modules are read exactly from the weights; without it the target_modules setting is
    matched against representative Qwen-VL module names. Returns {"ok", "problems", "notes",
    "max_lora_rank" (0 when no vLLM value fits), "tower_connector_lora", "targets" (module kind -> count)}.
    `model_type` (the base model's, when known) adds the rules of one architecture (NO_LM_HEAD_LORA).
    """
    problems = _feature_problems(adapter_config)
    notes: list[str] = []
    # vLLM sizes its LoRA slots by the largest rank, rank_pattern's per-module ranks included.
    rank = max([int(adapter_config.get("r") or 0), *(adapter_config.get("rank_pattern") or {}).values()])
    max_lora_rank = 0
    if rank < 1:
        problems.append(
            f"adapter_config.json has no valid rank r ({adapter_config.get('r')!r}); re-save the adapter"
        )
    elif rank > VLLM_LORA_RANKS[-1]:
        problems.append(
            f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; retrain with lora.rank <= "
            f"{VLLM_LORA_RANKS[-1]}"
        )
    else:
        max_lora_rank = vllm_max_lora_rank(rank)
        notes.append(
            f"serve with --enable-lora --max-lora-rank {max_lora_rank} (the smallest vLLM value >= {rank})"
        )

    if tensors is not None:
        modules = adapter_module_names(tensors)
    else:
        modules = _targeted_modules(adapter_config.get("target_modules"), QWEN_VL_MODULE_NAMES)
    kinds = _classify_modules(modules)
    if not modules:
        problems.append(
            f"target_modules={adapter_config.get('target_modules')!r} puts LoRA on no module vLLM applies; "
            "retrain with the language model projections as targets (the default lora.target_modules)"
        )
    if kinds["vision_tower"]:
        problems.append(
            f"vLLM ignores LoRA on the vision tower blocks; retrain without them ({_shown(kinds['vision_tower'])})"
        )
    if kinds["other"]:
        problems.append(
            f"vLLM does not apply LoRA to {_shown(kinds['other'])}; retrain without them (LoRA targets vLLM applies: "
            "language-model projections, lm_head, the vision merger)"
        )
    if kinds["lm_head"] and model_type in NO_LM_HEAD_LORA:
        problems.append(
            f"vLLM does not load LoRA on the lm_head of a {model_type} base (its language model takes no LoRA "
            "there); retrain with lora.train_lm_head: false"
        )
    tower = bool(kinds["connector"])
    if tower:
        notes.append(
            "the adapter trains the vision merger: serve with --enable-tower-connector-lora (without it vLLM "
            "silently skips the merger LoRA and the served model differs from the trained one)"
        )
    if tensors is not None and any(k.endswith(".base_layer.weight") for k in tensors):
        notes.append("the file carries peft's full copy of an embedding layer (lm_head); vLLM ignores it")
    dtypes = sorted({d for d in (tensors or {}).values()})
    stored = f"stored as {'/'.join(dtypes)}; " if dtypes else ""
    notes.append(f"adapter weights are {stored}vLLM casts them to the served model's dtype (--dtype)")
    return {
        "ok": not problems,
        "problems": problems,
        "notes": notes,
        "max_lora_rank": max_lora_rank,
        "tower_connector_lora": tower,
        "targets": {kind: len(names) for kind, names in kinds.items() if names},
    }
