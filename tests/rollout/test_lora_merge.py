"""An adapter merged into the base weights (`visionrl.rollout.lora_merge`): the scale peft uses, the fused layers vLLM
reloads whole, every merge from the checkpoint's W0 (never from the last merge), the base model back, the errors
that name the setting to use instead; and the merged weights equal peft's own merge of the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from visionrl.rollout.lora_merge import (
    MergedWeights,
    MergeError,
    checkpoint_keys,
    fused_modules,
    read_adapter,
)
from visionrl.types import ADAPTER_CONFIG, ADAPTER_WEIGHTS

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
ATTN = "model.layers.0.self_attn"


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """A two-file checkpoint with an index: one attention block (q, k, v with biases; o without) and an MLP."""
    gen = torch.Generator().manual_seed(0)
    tensors = {f"{ATTN}.{p}.weight": torch.randn(4, 3, generator=gen) for p in ("q_proj", "k_proj", "v_proj")}
    tensors |= {f"{ATTN}.{p}.bias": torch.randn(4, generator=gen) for p in ("q_proj", "k_proj", "v_proj")}
    tensors[f"{ATTN}.o_proj.weight"] = torch.randn(3, 4, generator=gen)
    mlp = {
        f"model.layers.0.mlp.{p}.weight": torch.randn(5, 3, generator=gen) for p in ("gate_proj", "up_proj")
    }
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model-00001-of-00002.safetensors"))
    save_file(mlp, str(folder / "model-00002-of-00002.safetensors"))
    index = {n: "model-00001-of-00002.safetensors" for n in tensors} | {
        n: "model-00002-of-00002.safetensors" for n in mlp
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return tensors | mlp


def adapter(folder: Path, deltas: dict[str, tuple[torch.Tensor, torch.Tensor]], **config: object) -> Path:
    """A peft adapter folder: {module: (A [r, in], B [out, r])}."""
    folder.mkdir(parents=True)
    tensors = {}
    for module, (a, b) in deltas.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    (folder / ADAPTER_CONFIG).write_text(json.dumps({"r": 2, "lora_alpha": 4, **config}))
    return folder


def ones(rows: int, cols: int) -> torch.Tensor:
    return torch.ones(rows, cols)


def test_scale_is_alpha_over_rank_or_over_its_root_with_rslora(tmp_path: Path) -> None:
    a, b = ones(2, 3), ones(4, 2)
    plain = read_adapter(adapter(tmp_path / "plain", {f"{ATTN}.q_proj": (a, b)}))
    rs = read_adapter(adapter(tmp_path / "rs", {f"{ATTN}.q_proj": (a, b)}, use_rslora=True))
    assert plain[f"{ATTN}.q_proj"].scale == 2.0  # 4 / 2
    assert rs[f"{ATTN}.q_proj"].scale == pytest.approx(4 / 2**0.5)
    # scale * B @ A: every entry 2 * (1 * 1 + 1 * 1) = 4
    assert torch.equal(plain[f"{ATTN}.q_proj"].full("cpu"), torch.full((4, 3), 4.0))


def test_fused_modules_bring_the_projections_vllm_fuses_with_each() -> None:
    groups = fused_modules([f"{ATTN}.q_proj", f"{ATTN}.o_proj", "model.layers.0.mlp.up_proj"], PACKED)
    assert groups == [
        ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
        [f"{ATTN}.o_proj"],
        [f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj"],
    ]


def test_a_merge_sends_each_fused_layer_whole_and_merges_from_w0(tmp_path: Path) -> None:
    base = checkpoint(tmp_path / "model")
    assert set(checkpoint_keys(tmp_path / "model")) == set(base)
    merged = MergedWeights(tmp_path / "model", PACKED)
    a, b = torch.eye(2, 3), 0.5 * ones(4, 2)  # scale 2: delta = B @ A, rows [1, 1, 0]
    first = dict(merged.tensors_for(read_adapter(adapter(tmp_path / "v1", {f"{ATTN}.q_proj": (a, b)})), "cpu",
                                    torch.float32))  # fmt: skip
    # q is adapted; k and v (and the three biases) come along unchanged, as vLLM's qkv_proj is one layer
    assert sorted(first) == sorted(
        f"{ATTN}.{p}.{s}" for p in ("q_proj", "k_proj", "v_proj") for s in ("weight", "bias")
    )
    expected_q = base[f"{ATTN}.q_proj.weight"] + torch.tensor([[1.0, 1.0, 0.0]] * 4)
    assert torch.allclose(first[f"{ATTN}.q_proj.weight"], expected_q, atol=1e-6)
    assert torch.equal(first[f"{ATTN}.k_proj.weight"], base[f"{ATTN}.k_proj.weight"])
    assert torch.equal(first[f"{ATTN}.v_proj.bias"], base[f"{ATTN}.v_proj.bias"])

    # v2 adapts the MLP's up only: q's layer is sent again at W0 (the merge of v1 undone), gate and up come whole
    v2 = read_adapter(adapter(tmp_path / "v2", {"model.layers.0.mlp.up_proj": (a, 0.5 * ones(5, 2))}))
    second = dict(merged.tensors_for(v2, "cpu", torch.float32))
    assert torch.equal(second[f"{ATTN}.q_proj.weight"], base[f"{ATTN}.q_proj.weight"])
    assert torch.equal(
        second["model.layers.0.mlp.gate_proj.weight"], base["model.layers.0.mlp.gate_proj.weight"]
    )
    up = base["model.layers.0.mlp.up_proj.weight"] + torch.tensor([[1.0, 1.0, 0.0]] * 5)
    assert torch.allclose(second["model.layers.0.mlp.up_proj.weight"], up, atol=1e-6)
    # the kept W0 is untouched by the merges (a merge computed in its own tensor)
    again = dict(merged.tensors_for({}, "cpu", torch.float32))
    assert all(torch.equal(t, base[n]) for n, t in again.items()) and len(again) == 8


def test_merged_weights_are_cast_to_the_engine_dtype(tmp_path: Path) -> None:
    checkpoint(tmp_path / "model")
    merged = MergedWeights(tmp_path / "model", PACKED)
    delta = read_adapter(adapter(tmp_path / "v1", {f"{ATTN}.o_proj": (ones(2, 4), ones(3, 2))}))
    out = dict(merged.tensors_for(delta, "cpu", torch.bfloat16))
    assert {t.dtype for t in out.values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("config", "match"),
    [({"rank_pattern": {"q_proj": 8}}, "rank_pattern"), ({"use_dora": True}, "use_dora")],
)
def test_settings_a_merge_cannot_reproduce_are_refused(tmp_path: Path, config: dict, match: str) -> None:
    folder = adapter(tmp_path / "a", {f"{ATTN}.q_proj": (ones(2, 3), ones(4, 2))}, **config)
    with pytest.raises(MergeError, match=rf"{match}.*rollout\.lora_serving: adapter"):
        read_adapter(folder)


def test_an_adapter_of_weights_the_checkpoint_lacks_is_refused(tmp_path: Path) -> None:
    checkpoint(tmp_path / "model")
    merged = MergedWeights(tmp_path / "model", PACKED)
    delta = read_adapter(
        adapter(tmp_path / "a", {"lm_head": (ones(2, 3), ones(7, 2))})
    )  # tied: not in the file
    with pytest.raises(MergeError, match=r"\['lm_head'\].*does not hold.*lora_serving: adapter"):
        next(merged.tensors_for(delta, "cpu", torch.float32))


def test_an_adapter_of_another_model_is_refused(tmp_path: Path) -> None:
    checkpoint(tmp_path / "model")
    merged = MergedWeights(tmp_path / "model", PACKED)
    delta = read_adapter(adapter(tmp_path / "a", {f"{ATTN}.o_proj": (ones(2, 8), ones(3, 2))}))
    with pytest.raises(MergeError, match=r"update of .*o_proj is \[3, 8\], the checkpoint's weight \[3, 4\]"):
        list(merged.tensors_for(delta, "cpu", torch.float32))


def test_tensors_other_than_lora_a_and_b_are_refused(tmp_path: Path) -> None:
    folder = adapter(tmp_path / "a", {f"{ATTN}.q_proj": (ones(2, 3), ones(4, 2))})
    save_file({"base_model.model.lm_head.weight": ones(7, 3)}, str(folder / ADAPTER_WEIGHTS))
    with pytest.raises(MergeError, match="other than LoRA's A and B"):
        read_adapter(folder)


def test_the_merge_equals_peft_merging_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    """Against peft's own merge (merge_and_unload) of an adapter with every B non-zero, merger included."""
    from visionrl.config import LoraConfig
    from visionrl.models.loader import apply_lora, load_base_model

    model = apply_lora(load_base_model(tiny_model), LoraConfig(rank=8, alpha=16, train_merger=True), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(tmp_path / "adapter"))
    delta = read_adapter(tmp_path / "adapter")
    assert len(delta) == 2 * 7 + 4  # 2 layers x 7 projections, 4 merger linears
    reference = model.merge_and_unload().state_dict()
    merged = dict(MergedWeights(tiny_model, PACKED).tensors_for(delta, "cpu", torch.float32))
    for module in delta:
        assert torch.allclose(merged[f"{module}.weight"], reference[f"{module}.weight"], atol=1e-5), module
    changed = [m for m in delta if not torch.allclose(merged[f"{m}.weight"], load_base_weight(tiny_model, m))]
    assert sorted(changed) == sorted(delta)  # the comparison can fail: every adapted weight moved


def load_base_weight(model_path: Path, module: str) -> torch.Tensor:
    from safetensors import safe_open

    keys = checkpoint_keys(model_path)
    with safe_open(keys[f"{module}.weight"], framework="pt") as f:
        return f.get_tensor(f"{module}.weight").float()
