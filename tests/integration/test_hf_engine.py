"""The HF rollout engine: merged-adapter generation with exact restore of the base weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from visionrl.config import LoraConfig
from visionrl.models.loader import apply_lora, load_base_model
from visionrl.rollout.hf_engine import HFEngine
from visionrl.types import AdapterPayload


def _payload(model_dir: Path, tmp: Path, seed: int, version: int) -> AdapterPayload:
    peft_model = apply_lora(load_base_model(model_dir), LoraConfig(rank=8, train_merger=True), seed=seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(seed))
    out = tmp / f"a{seed}"
    peft_model.save_pretrained(out)
    return AdapterPayload(
        version, {n: (out / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    )


def test_syncs_do_not_drift_the_weights_in_bf16(tiny_model: Path, tmp_path: Path) -> None:
    """Many merge/unmerge cycles in bf16 would drift the base weights; after 5 syncs the engine's weights are bit
    for bit those of a fresh engine that loaded only the last adapter."""

    def engine() -> HFEngine:
        return HFEngine(
            str(tiny_model),
            lora=LoraConfig(rank=8, train_merger=True),
            forbidden_token_ids=[],
            dtype="bfloat16",
            device="cpu",
        )

    synced = engine()
    for v in range(1, 6):
        synced.load_adapter(_payload(tiny_model, tmp_path, seed=v, version=v))
    fresh = engine()
    fresh.load_adapter(_payload(tiny_model, tmp_path, seed=5, version=5))
    assert synced.adapter_version() == 5 and synced._pristine
    a, b = dict(synced.model.named_modules()), dict(fresh.model.named_modules())
    for name in synced._pristine:
        assert torch.equal(a[name].base_layer.weight, b[name].base_layer.weight), name


def test_merged_generation_equals_the_unmerged_adapter(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    from visionrl.data import load_dataset
    from visionrl.data.prompts import build_prompt
    from visionrl.types import SamplingSpec

    engine = HFEngine(
        str(tiny_model), lora=LoraConfig(rank=8, train_merger=True), forbidden_token_ids=[5], device="cpu"
    )
    engine.load_adapter(_payload(tiny_model, tmp_path, seed=3, version=1))
    ds = load_dataset(color_data / "eval.jsonl")
    prompts = [build_prompt(ds[i], engine.processor) for i in range(4)]
    spec = SamplingSpec(n=1, greedy=True, max_tokens=4)
    merged = [g[0] for g in engine.generate(prompts, spec)]
    engine.model.unmerge_adapter()  # the LoRA layers compute the same function unmerged
    unmerged = [g[0] for g in engine.generate(prompts, spec)]
    assert [c.token_ids for c in merged] == [c.token_ids for c in unmerged]
    for a, b in zip(merged, unmerged, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_the_judge_is_the_base_model_and_the_served_adapter_stays(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    """`judge` (backend engine) answers with the base model while an adapter is served, and leaves it served."""
    from visionrl.data import load_dataset
    from visionrl.data.prompts import build_prompt
    from visionrl.types import JudgeAsk, SamplingSpec

    def engine() -> HFEngine:
        return HFEngine(
            str(tiny_model), lora=LoraConfig(rank=8, train_merger=True), forbidden_token_ids=[], device="cpu"
        )

    served, base = engine(), engine()
    served.load_adapter(_payload(tiny_model, tmp_path, seed=3, version=1))
    ds = load_dataset(color_data / "eval.jsonl")
    prompts = [build_prompt(ds[i], served.processor) for i in range(4)]
    spec = SamplingSpec(n=1, greedy=True, max_tokens=4)
    before = [g[0].token_ids for g in served.generate(prompts, spec)]
    tok = served.processor.tokenizer
    ask = JudgeAsk(yes_ids=(tok.convert_tokens_to_ids("yes"),), no_ids=(tok.convert_tokens_to_ids("no"),))
    shares, texts = served.judge(prompts, ask), served.judge(prompts, JudgeAsk(max_tokens=4))
    assert [g[0].token_ids for g in served.generate(prompts, spec)] == before
    assert before != [g[0].token_ids for g in base.generate(prompts, spec)]  # the adapter matters here
    assert texts == [g[0].text for g in base.generate(prompts, spec)]
    for prompt, share in zip(prompts, shares, strict=True):
        enc = base.processor(text=[prompt.text], images=prompt.images, return_tensors="pt")
        with torch.no_grad():
            logits = base.model(**enc).logits[0, -1, [*ask.yes_ids, *ask.no_ids]]
        assert share == pytest.approx(float(torch.softmax(logits, -1)[0]), abs=1e-5)


def test_a_teacher_forced_fingerprint_is_what_the_learner_scores_raw(
    tiny_model: Path, color_data: Path
) -> None:
    """The fingerprint's fixed continuation: the engine teacher-forces a greedy completion in one forward and gives
    its raw log-probs (over the whole vocabulary), which the learner's `raw` log-probs equal in float32 under the
    same adapter. The greedy completion's own log-probs leave the vision tokens out, so each is the raw one plus
    -log(1 - their share), above it at every token."""
    from visionrl.config import config_from_dict
    from visionrl.data import load_dataset
    from visionrl.data.prompts import build_prompt
    from visionrl.models.sequences import Sequence
    from visionrl.train.learner import Learner, TrainBatch

    cfg = config_from_dict(
        {
            "output_dir": "unused",
            "model": {"path": str(tiny_model), "dtype": "float32"},
            "data": {"train": str(color_data / "train.jsonl")},
            "rewards": [{"name": "exact_match"}],
            "lora": {"rank": 8, "train_merger": True},
        }
    )
    learner = Learner(cfg, device="cpu")
    with torch.no_grad():  # an adapter that moves the model, sent to the engine as each sync sends it
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(4))
    engine = HFEngine(
        str(tiny_model),
        lora=LoraConfig(rank=8, train_merger=True),
        forbidden_token_ids=learner.forbidden.tolist(),
        device="cpu",
    )
    engine.load_adapter(learner.adapter_payload())
    ds = load_dataset(color_data / "eval.jsonl")
    for i in range(2):
        prompt = build_prompt(ds[i], engine.processor)
        greedy = engine.fingerprint(prompt, 6)
        assert greedy is not None and len(greedy.token_ids) >= 2
        forced = engine.fingerprint(prompt, 6, greedy.token_ids)
        assert forced is not None and forced.token_ids == greedy.token_ids
        seq = Sequence(prompt=0, completion_ids=greedy.token_ids, advantage=0.0, sampling_logprobs=[0.0] * 6)
        raw = learner.logprobs(TrainBatch([prompt], [seq]), temperature=1.0, raw=True)[0]
        kept = learner.logprobs(TrainBatch([prompt], [seq]), temperature=1.0)[0]
        torch.testing.assert_close(torch.tensor(forced.logprobs), torch.tensor(raw), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(greedy.logprobs), torch.tensor(kept), rtol=0, atol=1e-5)
        assert all(k > r for k, r in zip(kept, raw, strict=True)), (kept, raw)
