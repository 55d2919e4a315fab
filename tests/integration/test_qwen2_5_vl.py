"""Qwen2.5-VL end to end on its tiny checkpoint (slow): the factory writes what stock transformers loads, the
loader puts LoRA on its merger (`visual.merger.mlp.0/2`) and never on its vision blocks, learner and vLLM
log-probs agree with LoRA on the language model and the merger, the CPU loop trains it through Ray, and the
exported adapter is served by the vLLM server with the same answers as local vLLM and transformers evaluation.
Qwen3-VL stays the default; its tests are in test_tiny_model.py, test_loop.py and test_serving.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from visionrl.config import JobConfig, LoraConfig, config_from_dict
from visionrl.errors import InputError
from visionrl.models.loader import apply_lora, check_model_dir, load_base_model, lora_param_groups

pytestmark = pytest.mark.slow

QUESTION = "What color is the shape?"


def _encode(processor: Any) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = Image.new("RGB", (64, 64), (255, 255, 255))
    image.paste((220, 40, 40), (8, 8, 48, 40))
    return dict(processor(text=[text], images=[image], return_tensors="pt"))


def _trainable(model: Any) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _cfg(model: Path, data: Path, out: Path, **over: dict) -> JobConfig:
    raw = {
        "output_dir": str(out),
        "model": {"path": str(model), "dtype": "float32"},
        "data": {
            "train": str(data / "train.jsonl"),
            "eval": str(data / "eval.jsonl"),
            "max_eval_samples": 16,
        },
        "rewards": [{"name": "exact_match", "kwargs": {"first_word": True}}],
        # No lm_head LoRA: vLLM takes none on Qwen2.5-VL (docs/ENGINE_NOTES.md).
        "lora": {"rank": 16, "alpha": 16, "train_merger": True},
        "algorithm": {"group_size": 4},
        "rollout": {"prompts_per_step": 8, "max_new_tokens": 4, "max_model_len": 256, "temperature": 1.0},
        "train": {"lr": 2e-2, "lr_schedule": "constant", "torch_threads": 1, "steps": 2},
        "logging": {"eval_every": 2, "save_every": 2, "images_every": 100},
        "ray": {"num_cpus": 2},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


# --------------------------------------------------------------------------- factory and loader


def test_factory_writes_a_qwen2_5_vl_that_stock_transformers_loads(tiny_qwen25_model: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    config = check_model_dir(tiny_qwen25_model)
    text, vision = config["text_config"], config["vision_config"]
    assert config["model_type"] == "qwen2_5_vl"
    # Qwen2's text model derives head_dim = hidden / heads; vLLM's CPU attention needs 32 (docs/ENGINE_NOTES.md).
    assert "head_dim" not in text and text["hidden_size"] // text["num_attention_heads"] == 32
    assert sum(text["rope_parameters"]["mrope_section"]) == 32 // 2
    assert vision["out_hidden_size"] == text["hidden_size"] and "deepstack_visual_indexes" not in vision
    assert all(0 <= i < vision["depth"] for i in vision["fullatt_block_indexes"])

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen25_model, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tiny_qwen25_model)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    inputs = _encode(processor)
    # 64x64 -> 56x56 (a multiple of patch 14 x merge 2) -> a [1, 4, 4] patch grid -> 2x2 = 4 image tokens.
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 4
    n = inputs["input_ids"].shape[1]
    greedy = [model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, n:].tolist() for _ in range(2)]
    assert greedy[0] == greedy[1] and 1 <= len(greedy[0]) <= 4
    assert all(0 <= t < len(processor.tokenizer) == text["vocab_size"] for t in greedy[0])


def test_m_rope_positions_come_from_mm_token_type_ids(tiny_qwen25_model: Path) -> None:
    """Without `mm_token_type_ids` Qwen2.5-VL raises nothing and silently uses 1-D positions (the learner always
    passes them); with them, the logits are those of the explicit 3-D positions of `get_rope_index`."""
    from visionrl.models.loader import load_processor

    model = load_base_model(tiny_qwen25_model)
    inputs = _encode(load_processor(tiny_qwen25_model))
    with torch.no_grad():
        with_types = model(**inputs).logits
        positions, _ = model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
        explicit = model(**inputs, position_ids=positions).logits
        without = model(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"}).logits
    # The 4 image tokens share one temporal position and span a 2x2 grid: 3-D and 1-D positions differ.
    assert positions.shape == (3, 1, inputs["input_ids"].shape[1])
    assert not torch.equal(positions[0], positions[1])
    assert torch.allclose(with_types, explicit, atol=1e-6)
    assert (with_types - without).abs().max() > 1e-4


def test_lora_on_the_merger_never_reaches_the_vision_blocks(tiny_qwen25_model: Path) -> None:
    """The blocks of Qwen2.5-VL's vision tower have gate/up/down_proj like the language model, and its merger is
    `merger.mlp.0/2` (mlp.1 is the GELU): LoRA lands on the 2 merger linears and the 14 LM projections only."""
    model = apply_lora(load_base_model(tiny_qwen25_model), LoraConfig(rank=4, train_merger=True))
    names = _trainable(model)
    visual = sorted({n.split(".lora_")[0] for n in names if "visual" in n})
    assert visual == [f"base_model.model.model.visual.merger.mlp.{i}" for i in (0, 2)]
    assert len(names) == 2 * (2 * 7 + 2)  # A and B of 2 layers x 7 projections + 2 merger linears
    groups = {g["name"]: len(g["params"]) for g in lora_param_groups(model, 1e-3, 5e-4, None)}
    assert groups == {"lm": 28, "merger": 4}
    # A list of suffixes stays on the language model although the vision blocks have the same names.
    suffixes = _trainable(
        apply_lora(load_base_model(tiny_qwen25_model), LoraConfig(target_modules=["gate_proj"]))
    )
    assert len(suffixes) == 4 and all("language_model" in n for n in suffixes)


def test_lm_head_lora_is_refused_with_what_to_set(tiny_qwen25_model: Path) -> None:
    with pytest.raises(
        InputError, match=r"lora\.train_lm_head=true on a qwen2_5_vl base.*train_lm_head: false"
    ):
        apply_lora(load_base_model(tiny_qwen25_model), LoraConfig(rank=4, train_lm_head=True))


# --------------------------------------------------------------------------- learner vs vLLM (the key test)


def _set_lora_b(model: Any, seed: int, where: str = "") -> None:
    """Random non-zero LoRA B (so the adapter is not a no-op) where the name contains `where`, zero elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 if where in name else torch.zeros_like(p))


def _diffs(learner: Any, prompts: list, groups: list, adapter: bool = True) -> list[float]:
    from visionrl.models.sequences import Sequence
    from visionrl.train.learner import TrainBatch

    seqs = [
        Sequence(prompt=i, completion_ids=c.token_ids, advantage=0.0, sampling_logprobs=c.logprobs)
        for i, g in enumerate(groups)
        for c in g
    ]
    ours = learner.logprobs(TrainBatch(prompts, seqs), adapter=adapter)
    return [
        abs(a - b)
        for s, row in zip(seqs, ours, strict=True)
        for a, b in zip(row, s.sampling_logprobs, strict=True)
    ]


def test_learner_logprobs_match_vllm_with_lm_and_merger_lora(
    tiny_qwen25_model: Path, color_data: Path, tmp_path: Path
) -> None:
    """vLLM-sampled completions (temperature 1, 8 prompts x 4) scored by the learner (M-RoPE from
    mm_token_type_ids, each group's image encoded once): the same log-probs, measured to 1e-6 in float32, with LoRA
    on the language model and the merger and with the merger alone; the merger-only adapter is really applied
    (far from the base model)."""
    from visionrl.data import load_dataset
    from visionrl.data.prompts import build_prompt
    from visionrl.rollout.vllm_engine import VLLMEngine
    from visionrl.train.learner import Learner
    from visionrl.types import SamplingSpec

    learner = Learner(_cfg(tiny_qwen25_model, color_data, tmp_path), device="cpu")
    ds = load_dataset(color_data / "eval.jsonl")
    prompts = [build_prompt(ds[i], learner.processor) for i in range(8)]
    spec = SamplingSpec(n=4, temperature=1.0, max_tokens=4)
    engine = VLLMEngine(str(tiny_qwen25_model), lora_rank=16, tower_lora=True,
                        forbidden_token_ids=learner.forbidden.tolist(), dtype="float32", max_model_len=256)  # fmt: skip
    try:
        diffs = {}
        for version, where in ((1, ""), (2, "visual")):  # LM + merger, then the merger alone
            _set_lora_b(learner.model, seed=version, where=where)
            learner.version = version
            assert engine.load_adapter(learner.adapter_payload()) == version
            groups = engine.generate(prompts, spec)
            diffs[version] = _diffs(learner, prompts, groups)
        base = _diffs(learner, prompts, groups, adapter=False)
    finally:
        engine.close()
    for version, d in diffs.items():
        assert len(d) >= 32
        assert max(d) < 1e-4, f"v{version}: max |learner - vLLM| log-prob difference {max(d):.2e}"
    assert max(base) > 1e-2  # vLLM's merger-only samples are not the base model's: the merger LoRA is applied


# --------------------------------------------------------------------------- loop, export, serving, evaluation


@pytest.fixture(scope="module")
def trained(
    tiny_qwen25_model: Path, color_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Two GRPO steps through Ray (vLLM rollout actor, learner actor), then `visionrl export` of the adapter."""
    from visionrl.cli import main
    from visionrl.orchestrate.loop import train

    root = tmp_path_factory.mktemp("q25-run")
    # The random base never names a colour (every reward 0, every advantage 0): the entropy bonus gives the
    # updates a gradient, so the synced and exported adapter differs from the base model.
    result = train(_cfg(tiny_qwen25_model, color_data, root / "run", algorithm={"entropy_coef": 0.1}))
    assert main(["export", str(root / "run"), str(root / "export")]) == 0
    return {"result": result, "export": root / "export", "root": root}


def test_the_cpu_loop_trains_it_and_the_manifest_records_the_arch(trained: dict[str, Any]) -> None:
    history = trained["result"].history
    assert [h["step"] for h in history] == [1, 2]
    # step 2 sampled the synced version 1
    assert [h["rollout/adapter_version"] for h in history] == [0.0, 1.0]
    assert all(h["rollout/logprob_diff"] < 1e-3 for h in history)  # engine and learner score the same policy
    assert all(h["policy/grad_norm"] > 0 for h in history)
    manifest = json.loads((trained["export"] / "visionrl_manifest.json").read_text())
    assert manifest["base_model"]["model_type"] == "qwen2_5_vl"
    assert manifest["processor"]["patch_size"] == 14
    assert manifest["serving"]["ok"] and manifest["serving"]["tower_connector_lora"]
    assert manifest["serving"]["targets"] == {"language_model": 14, "connector": 2}


@pytest.fixture(scope="module")
def server(trained: dict[str, Any], tiny_qwen25_model: Path) -> Iterator[Any]:
    from visionrl.serve.server import start_server

    root = trained["root"]
    with start_server(str(tiny_qwen25_model), {"q25": str(trained["export"])}, cache_dir=root / "cache",
                      log_path=root / "server.log") as handle:  # fmt: skip
        yield handle


def test_served_answers_equal_local_vllm_and_transformers_answers(
    server: Any, trained: dict[str, Any], tiny_qwen25_model: Path, color_data: Path, tmp_path: Path
) -> None:
    from visionrl.eval.endpoint import evaluate_endpoint
    from visionrl.eval.local import evaluate_local

    assert "--enable-tower-connector-lora" in server.command
    common = {"data": str(color_data / "eval.jsonl"), "max_samples": 16, "max_tokens": 4}
    served = evaluate_endpoint(server.base_url, "q25", out=str(tmp_path / "served.json"), concurrency=4,
                               base=str(tiny_qwen25_model), **common)  # fmt: skip
    local = {
        engine: evaluate_local(
            base=str(tiny_qwen25_model),
            adapter=str(trained["export"]),
            engine=engine,
            out=str(tmp_path / f"{engine}.json"),
            **common,
        )  # fmt: skip
        for engine in ("vllm", "hf")
    }
    base = evaluate_local(base=str(tiny_qwen25_model), adapter=None, engine="vllm", out=str(tmp_path / "b.json"),
                          **common)  # fmt: skip
    # Whitespace compared loosely: vLLM's detokenizer puts a space before the first word (rewards normalise it).
    answers = {k: [(s["id"], (s["completion"] or "").split()) for s in r["samples"]]
               for k, r in {"served": served, **local, "base": base}.items()}  # fmt: skip
    assert served["num_samples"] == 16 and served["num_failed"] == 0
    assert answers["served"] == answers["vllm"] == answers["hf"]
    assert served["accuracy"] == local["vllm"]["accuracy"] == local["hf"]["accuracy"]
    assert answers["vllm"] != answers["base"]  # the trained adapter changes the answers
