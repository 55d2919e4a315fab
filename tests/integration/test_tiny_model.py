"""The tiny Qwen3-VL checkpoint: stock transformers loads it and generates from an image; the build is
deterministic for a seed; its tokenizer and config follow docs/ENGINE_NOTES.md; `visionrl.models.loader` loads it (also in
the older hub config format of Qwen3-VL-8B-Instruct) and puts LoRA exactly where the config says; and (slow)
vLLM serves it with a LoRA adapter on the language model and the merger."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from visionrl.config import LoraConfig
from visionrl.data.synthetic import COLORS, TASKS, split_words
from visionrl.errors import InputError
from visionrl.models.loader import (
    ModelLoadError,
    apply_lora,
    check_model_dir,
    load_base_model,
    load_processor,
    lora_param_groups,
    vision_token_ids,
)
from visionrl.models.tiny import SPECIAL_TOKENS, build_tiny_model

QUESTION = "What color is the shape?"
# One colour per prompt: a 64x64 image is a [1, 4, 4] patch grid, merged 2x2 into 4 image tokens (docs/ENGINE_NOTES.md).
IMAGE_COLORS = [(220, 40, 40), (40, 170, 60), (40, 70, 220), (235, 205, 40)]


def prompt_text(processor: Any, question: str = QUESTION) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode(
    processor: Any, rgb: tuple[int, int, int] = IMAGE_COLORS[0], text: str | None = None
) -> dict[str, torch.Tensor]:
    """One image prompt, encoded as the model's forward wants it (mm_token_type_ids included)."""
    image = Image.new("RGB", (64, 64), (255, 255, 255))
    image.paste(rgb, (8, 8, 48, 40))
    return dict(processor(text=[text or prompt_text(processor)], images=[image], return_tensors="pt"))


def logits(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def perturb_lora_b(model: Any, seed: int, only: str = "") -> int:
    """Give LoRA B matrices (whose names contain `only`) random values, so the adapter is not a no-op."""
    gen = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and only in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
                changed += 1
    return changed


def lora_names(model: Any) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def processor(tiny_model: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def inputs(processor: Any) -> dict[str, torch.Tensor]:
    return encode(processor)


# --------------------------------------------------------------------------- stock transformers


def test_stock_transformers_loads_and_generates_from_an_image(
    tiny_model: Path, processor: Any, inputs: dict[str, torch.Tensor]
) -> None:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    image_token = model.config.image_token_id
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((inputs["input_ids"] == image_token).sum()) == 4

    prompt_len = inputs["input_ids"].shape[1]
    eos = model.config.text_config.eos_token_id
    torch.manual_seed(0)
    sampled = model.generate(**inputs, max_new_tokens=6, do_sample=True)[0, prompt_len:].tolist()
    greedy = [
        model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, prompt_len:].tolist() for _ in range(2)
    ]
    assert greedy[0] == greedy[1]
    for new in (sampled, greedy[0]):
        assert 1 <= len(new) <= 6
        assert all(0 <= t < model.config.text_config.vocab_size == len(processor.tokenizer) for t in new)
        # Either it ran to max_new_tokens, or it stopped right after the first end-of-turn token.
        assert len(new) == 6 or (new[-1] == eos and eos not in new[:-1])


# --------------------------------------------------------------------------- build determinism


def test_build_is_deterministic_for_a_seed(tiny_model: Path, tmp_path: Path) -> None:
    same = build_tiny_model(tmp_path / "same", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    weights = "model.safetensors"
    assert (same / weights).read_bytes() == (tiny_model / weights).read_bytes()
    assert (other / weights).read_bytes() != (tiny_model / weights).read_bytes()
    # The seed changes the weights only: architecture, tokenizer and processor are the same.
    for name in ("config.json", "tokenizer.json", "processor_config.json"):
        assert (other / name).read_text() == (tiny_model / name).read_text() == (same / name).read_text()


# --------------------------------------------------------------------------- tokenizer and config


def test_every_colour_and_task_answer_is_one_token(processor: Any) -> None:
    tok = processor.tokenizer
    words = set(COLORS) | {answer for task in TASKS.values() for answer in task.answers}
    assert {"red", "blue", "3", "left"} <= words
    for word in sorted(words):
        ids = tok.encode(word, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, (word, ids)
        assert tok.decode(ids) == word
        # The same single token inside a sentence (the model's answer may follow a space).
        assert tok.encode(f"the answer is {word}", add_special_tokens=False)[-1] == ids[0]


def test_every_task_question_tokenises_without_unknown_words(processor: Any) -> None:
    tok = processor.tokenizer
    for task in TASKS.values():
        ids = tok.encode(task.question, add_special_tokens=False)
        assert tok.unk_token_id not in ids
        assert len(ids) == len(split_words(task.question))  # one token per word or punctuation mark


def test_special_tokens_are_single_tokens_matching_the_config(tiny_model: Path, processor: Any) -> None:
    tok = processor.tokenizer
    config = json.loads((tiny_model / "config.json").read_text())
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert config["vision_end_token_id"] == ids["<|vision_end|>"]
    assert config["text_config"]["eos_token_id"] == tok.eos_token_id == ids["<|im_end|>"]


def test_config_follows_the_facts(tiny_model: Path, processor: Any) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert config["model_type"] == "qwen3_vl"
    assert text["head_dim"] == 32  # vLLM's CPU attention needs head_dim in {32, 64, 80, ...}
    mrope = text["rope_parameters"]["mrope_section"]
    assert mrope == [6, 5, 5] and sum(mrope) == text["head_dim"] // 2
    assert vision["out_hidden_size"] == text["hidden_size"]
    assert text["vocab_size"] == len(processor.tokenizer)
    assert all(0 <= i < vision["depth"] for i in vision["deepstack_visual_indexes"])
    assert (vision["hidden_size"] // vision["num_heads"]) % 4 == 0


# --------------------------------------------------------------------------- loader


def test_loader_loads_the_tiny_model(tiny_model: Path, inputs: dict[str, torch.Tensor]) -> None:
    assert check_model_dir(tiny_model)["model_type"] == "qwen3_vl"
    model = load_base_model(tiny_model, dtype="float32")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    processor = load_processor(tiny_model)
    assert processor.image_processor.patch_size == 16 and processor.image_processor.merge_size == 2
    out = logits(model, inputs)
    assert out.shape == (1, inputs["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(out).all()


def write_old_hub_format(src: Path, dst: Path) -> dict[str, Any]:
    """Copy a checkpoint and rewrite its config.json as transformers 4.57 wrote Qwen3-VL-8B-Instruct's."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = {k: rope[k] for k in ("rope_type", "mrope_section", "mrope_interleaved")}
    text["torch_dtype"] = text.pop("dtype")
    config["torch_dtype"] = config.pop("dtype")
    config["vision_config"].pop("rope_parameters", None)  # the old format had no vision rope entry
    config["transformers_version"] = "4.57.0"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return config


def test_loader_reads_the_older_hub_config_format(
    tiny_model: Path, tmp_path: Path, inputs: dict[str, torch.Tensor]
) -> None:
    old_dir = tmp_path / "old"
    old = write_old_hub_format(tiny_model, old_dir)
    assert "rope_parameters" not in old["text_config"] and "dtype" not in old
    assert old["text_config"]["rope_scaling"]["mrope_section"] == [6, 5, 5]

    model = load_base_model(old_dir, dtype="float32")
    rope = model.config.text_config.rope_parameters
    # Losing mrope_section would silently fall back to [24, 20, 20] (docs/ENGINE_NOTES.md) and change every logit.
    assert rope["mrope_section"] == [6, 5, 5] and rope["mrope_interleaved"] is True
    assert rope["rope_theta"] == 5_000_000.0
    reference = logits(load_base_model(tiny_model, dtype="float32"), inputs)
    assert torch.allclose(logits(model, inputs), reference, atol=1e-6)
    assert load_processor(old_dir).tokenizer.get_vocab() == load_processor(tiny_model).tokenizer.get_vocab()


def test_check_model_dir_errors_say_what_to_do(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError, match="is not a directory; pass a checkpoint directory.*init-tiny-model"
    ):
        check_model_dir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json; is it a complete checkpoint directory"):
        load_base_model(tmp_path / "empty")
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ModelLoadError, match="model_type 'llava'; visionrl supports qwen3_vl"):
        load_processor(other)
    (other / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="is not valid JSON"):
        check_model_dir(other)
    assert issubclass(ModelLoadError, InputError)  # the CLI prints it without a traceback


# --------------------------------------------------------------------------- LoRA


def test_default_lora_is_on_language_model_projections_only(tiny_model: Path) -> None:
    model = apply_lora(load_base_model(tiny_model), LoraConfig(rank=4))
    names = lora_names(model)
    assert names and all("lora_" in n for n in names)
    assert not any("visual" in n or "lm_head" in n for n in names)
    # Every projection of both layers, A and B.
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for layer in (0, 1):
        for proj in projections:
            hits = [n for n in names if f"language_model.layers.{layer}." in n and f".{proj}.lora_" in n]
            assert len(hits) == 2, (layer, proj, hits)
    assert len(names) == 2 * 2 * len(projections)
    assert [g["name"] for g in lora_param_groups(model, 1e-3, 5e-4, 2e-4)] == ["lm"]


def test_lora_with_merger_and_lm_head(tiny_model: Path) -> None:
    model = apply_lora(load_base_model(tiny_model), LoraConfig(rank=4, train_merger=True, train_lm_head=True))
    names = lora_names(model)
    visual = [n for n in names if "visual" in n]
    assert visual and not any("visual.blocks" in n for n in visual)
    for module in (
        "merger.linear_fc1",
        "merger.linear_fc2",
        "deepstack_merger_list.0.linear_fc1",
        "deepstack_merger_list.0.linear_fc2",
    ):
        assert sum(f"visual.{module}.lora_" in n for n in names) == 2, module
    assert sum("lm_head.lora_" in n for n in names) == 2
    groups = {g["name"]: g for g in lora_param_groups(model, 1e-3, 5e-4, 2e-4)}
    assert {k: (g["lr"], len(g["params"])) for k, g in groups.items()} == {
        "lm": (1e-3, 28),
        "merger": (5e-4, 8),
        "lm_head": (2e-4, 2),
    }


def test_lora_with_a_list_of_suffixes_stays_on_the_language_model(tiny_model: Path) -> None:
    # The vision blocks have mlp.linear_fc1/fc2 too; a suffix list must still not reach them.
    model = apply_lora(
        load_base_model(tiny_model), LoraConfig(rank=4, target_modules=["q_proj", "linear_fc1"])
    )
    names = lora_names(model)
    assert names and all("language_model" in n and ".q_proj." in n for n in names)


def test_lora_that_matches_nothing_is_an_input_error(tiny_model: Path) -> None:
    with pytest.raises(InputError, match=r"lora\.target_modules='.*nothing_here.*' matched no module"):
        apply_lora(load_base_model(tiny_model), LoraConfig(target_modules=r".*nothing_here"))


def test_lora_at_init_equals_the_base_model(tiny_model: Path, inputs: dict[str, torch.Tensor]) -> None:
    reference = logits(load_base_model(tiny_model), inputs)
    model = apply_lora(load_base_model(tiny_model), LoraConfig(rank=8, train_merger=True, train_lm_head=True))
    assert torch.equal(logits(model, inputs), reference)  # B = 0: the adapter adds exactly zero
    # The comparison can fail: a non-zero B (merger only) changes the logits.
    assert perturb_lora_b(model, seed=0, only="visual") == 4
    assert not torch.allclose(logits(model, inputs), reference, atol=1e-4)


def test_lora_init_is_deterministic_for_a_seed(tiny_model: Path) -> None:
    def lora_a(seed: int) -> list[torch.Tensor]:
        model = apply_lora(load_base_model(tiny_model), LoraConfig(rank=4), seed=seed)
        return [p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n]

    first, again, other = lora_a(0), lora_a(0), lora_a(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


# --------------------------------------------------------------------------- vLLM (slow)


def adapter_payload(model: Any, out: Path, version: int) -> Any:
    from visionrl.types import AdapterPayload

    model.save_pretrained(str(out))
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files)
    return AdapterPayload(version=version, files=files)


def hf_raw_logprobs(
    model: Any, processor: Any, rgb: tuple[int, int, int], continuation: list[int]
) -> list[float]:
    """Log-softmax over the whole vocabulary of each `continuation` token after the image prompt (transformers)."""
    enc = encode(processor, rgb)
    tail = torch.tensor([continuation])
    enc["input_ids"] = torch.cat([enc["input_ids"], tail], 1)
    enc["attention_mask"] = torch.cat([enc["attention_mask"], torch.ones_like(tail)], 1)
    enc["mm_token_type_ids"] = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(tail)], 1)
    n = len(continuation)
    lps = torch.log_softmax(logits(model, enc)[0, -n - 1 : -1].float(), -1)
    return lps.gather(1, tail.T).squeeze(1).tolist()


def hf_greedy(model: Any, processor: Any, forbidden: list[int], max_tokens: int) -> list[list[int]]:
    out = []
    for rgb in IMAGE_COLORS:
        enc = encode(processor, rgb)
        ids = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, suppress_tokens=forbidden)
        out.append(ids[0, enc["input_ids"].shape[1] :].tolist())
    return out


@pytest.mark.slow
def test_vllm_serves_the_tiny_model_with_lm_and_merger_lora(tiny_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from dataclasses import replace

    from visionrl.rollout.vllm_engine import VLLMEngine
    from visionrl.types import JudgeAsk, PromptItem, SamplingSpec

    processor = load_processor(tiny_model)
    base = load_base_model(tiny_model)
    forbidden = vision_token_ids(base.config, processor)
    assert forbidden == sorted(
        {
            base.config.image_token_id,
            base.config.video_token_id,
            base.config.vision_start_token_id,
            base.config.vision_end_token_id,
        }
    )
    rank = 8
    # v1: LoRA on the language model and the merger, every B non-zero.
    both = apply_lora(load_base_model(tiny_model), LoraConfig(rank=rank, alpha=16, train_merger=True), seed=0)
    assert perturb_lora_b(both, seed=1) == 2 * 7 + 4  # 2 layers x 7 projections + 4 merger linears
    # v2: the same shapes, but only the merger's B non-zero: shows vLLM applies tower/connector LoRA.
    merger = apply_lora(
        load_base_model(tiny_model), LoraConfig(rank=rank, alpha=16, train_merger=True), seed=0
    )
    assert perturb_lora_b(merger, seed=2, only="visual") == 4
    payloads = [adapter_payload(both, tmp_path / "v1", 1), adapter_payload(merger, tmp_path / "v2", 2)]

    text = prompt_text(processor)
    judge_text = prompt_text(processor, "is the shape red ? answer yes or no")
    prompts = []
    for rgb in IMAGE_COLORS:
        image = Image.new("RGB", (64, 64), (255, 255, 255))
        image.paste(rgb, (8, 8, 48, 40))
        prompts.append(PromptItem(text=text, images=[image]))
    spec = SamplingSpec(n=1, greedy=True, max_tokens=8)
    engine = VLLMEngine(
        str(tiny_model),
        lora_rank=rank,
        tower_lora=True,
        forbidden_token_ids=forbidden,
        dtype="float32",
        max_model_len=512,
        engine_args={
            "max_num_seqs": 3
        },  # rollout.vllm_engine_args: fewer sequences than prompts still answers all
    )
    try:
        assert engine._llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == 3
        outputs = {"base": engine.generate(prompts, spec)}
        assert engine.adapter_version() == 0
        for payload in payloads:
            assert engine.load_adapter(payload) == payload.version
            outputs[f"v{payload.version}"] = engine.generate(prompts, spec)
        # The judge (backend engine): the base model answers under a zero adapter while v2 is served; the served
        # adapter is untouched afterwards.
        yes, no = (processor.tokenizer.convert_tokens_to_ids(w) for w in ("yes", "no"))
        judge_prompts = [replace(p, text=judge_text) for p in prompts]
        shares = engine.judge(judge_prompts, JudgeAsk(yes_ids=(yes,), no_ids=(no,)))
        judge_texts = engine.judge(prompts, JudgeAsk(max_tokens=8))
        assert [g[0].token_ids for g in engine.generate(prompts, spec)] == [
            g[0].token_ids for g in outputs["v2"]
        ]
        # The fingerprint under v2: greedy, then its tokens teacher-forced in one prefill (raw log-probs)
        greedy = [engine.fingerprint(p, 8) for p in prompts]
        forced = [engine.fingerprint(p, 8, c.token_ids) for p, c in zip(prompts, greedy, strict=True) if c]
        # An internal error in a batch: the old engine is shut down first, a new one built with the adapter it
        # served, and the batch retried once; the rebuild is counted (the loop probes a rebuilt engine again).
        old, shut = engine._llm, []
        core = old.llm_engine.engine_core
        stop = core.shutdown
        core.shutdown = lambda *args, **kwargs: (shut.append(True), stop(*args, **kwargs))

        def failing(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("injected: the engine core died")

        old.generate = failing
        assert engine.rebuilds() == 0
        outputs["rebuilt"] = engine.generate(prompts, spec)
        assert shut == [True] and engine.rebuilds() == 1 and engine._llm is not old
    finally:
        engine.close()

    tokens = {k: [group[0].token_ids for group in v] for k, v in outputs.items()}
    for key, groups in outputs.items():
        assert len(groups) == len(prompts) and all(len(g) == 1 for g in groups)
        for group in groups:
            completion = group[0]
            assert 1 <= len(completion.token_ids) <= 8
            assert not set(completion.token_ids) & set(forbidden)  # vision tokens are never sampled
            assert completion.adapter_version == {"base": 0, "v1": 1, "v2": 2, "rebuilt": 2}[key]
    assert tokens["v1"] != tokens["base"]
    assert tokens["v2"] != tokens["base"] and tokens["v2"] != tokens["v1"]
    assert tokens["rebuilt"] == tokens["v2"]  # the rebuilt engine serves the adapter it served before
    # Greedy tokens equal transformers + peft for the base and for the merger-only adapter (fp32).
    assert tokens["base"] == hf_greedy(base, processor, forbidden, 8)
    assert tokens["v2"] == hf_greedy(merger, processor, forbidden, 8)
    # The teacher-forced fingerprint: vLLM's prompt log-probs of the greedy tokens are transformers' over the whole
    # vocabulary (fp32); the greedy ones leave the vision tokens out, so they are never below them.
    assert [c.token_ids for c in greedy if c] == tokens["v2"] == [c.token_ids for c in forced if c]
    for rgb, g, f in zip(IMAGE_COLORS, greedy, forced, strict=True):
        assert g is not None and f is not None
        assert f.logprobs == pytest.approx(hf_raw_logprobs(merger, processor, rgb, g.token_ids), abs=1e-4)
        assert all(x <= y + 1e-5 for x, y in zip(f.logprobs, g.logprobs, strict=True))
    # The judge's verdicts are the base model's: its text, and its share of yes among yes and no (transformers).
    decode = processor.tokenizer.decode
    # (vLLM's incremental detokenizer puts a space before the first word that the tokenizer's decode leaves out)
    assert [t.strip() for t in judge_texts] == [decode(t, skip_special_tokens=True) for t in tokens["base"]]
    expected = []
    for rgb in IMAGE_COLORS:
        with torch.no_grad():
            logits = base(**encode(processor, rgb, judge_text)).logits[0, -1, [yes, no]].float()
        expected.append(float(torch.softmax(logits, -1)[0]))
    assert shares == pytest.approx(expected, abs=1e-4)
    assert max(shares) - min(shares) > 1e-4  # the images change the verdict: the judge sees them
