"""The learner on the tiny model: log-probs, micro-batching that preserves the gradient, the update."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from visionrl.config import JobConfig, config_from_dict
from visionrl.config_yaml import ConfigError
from visionrl.data import load_dataset
from visionrl.data.prompts import build_prompt
from visionrl.models.sequences import Sequence
from visionrl.train.forward import compiled_graphs
from visionrl.train.learner import Learner, TrainBatch


def _cfg(model_dir: Path, data: Path, **over: dict) -> JobConfig:
    raw = {
        "output_dir": "unused",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": {"train": str(data / "train.jsonl")},
        "rewards": [{"name": "exact_match"}],
        "lora": {"rank": 8, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 2},
        "rollout": {"prompts_per_step": 3, "max_new_tokens": 4, "temperature": 0.7},
        "train": {"lr": 1e-2, "lr_schedule": "constant", "max_grad_norm": 1e9},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


def _batch(learner: Learner, data: Path) -> TrainBatch:
    ds = load_dataset(data / "train.jsonl")
    prompts = [build_prompt(ds[i], learner.processor) for i in range(3)]
    # Hand-made completions of different lengths (1 to 4 tokens), two per prompt, advantages +-1.
    vocab = learner.processor.tokenizer.get_vocab()
    words = [
        ["red", "<|im_end|>"],
        ["blue"],
        ["green", "shape", "?", "<|im_end|>"],
        ["yellow", "<|im_end|>"],
        ["left", "right", "top"],
        ["one", "<|im_end|>"],
    ]
    seqs = [
        Sequence(
            prompt=i // 2,
            completion_ids=[vocab[w] for w in ws],
            advantage=1.0 if i % 2 == 0 else -1.0,
            sampling_logprobs=[0.0] * len(ws),
        )
        for i, ws in enumerate(words)
    ]
    return TrainBatch(prompts, seqs)


def _grads(learner: Learner) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.clone()
        for n, p in learner.model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_micro_batches_give_the_gradient_of_one_batch(tiny_model: Path, color_data: Path) -> None:
    """A token budget small enough for one sequence per micro-batch must give the same gradient as one batch."""
    grads = {}
    for budget in (100_000, 64):
        learner = Learner(_cfg(tiny_model, color_data, train={"micro_batch_tokens": budget}), device="cpu")
        with torch.no_grad():  # a non-zero B so every LoRA weight gets a gradient
            for n, p in learner.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
        batch = _batch(learner, color_data)
        encoded = learner.encode_prompts(batch.prompts)
        mbs = learner._micro_batches(encoded, batch.sequences, range(len(batch.sequences)))
        assert (len(mbs) == 1) == (budget == 100_000)
        learner.optimizer.step = lambda: None  # keep the weights; inspect the accumulated gradient
        rows = list(range(len(batch.sequences)))
        learner._update(encoded, batch.sequences, rows, rows, None, None)
        grads[budget] = _grads(learner)
    assert grads[100_000].keys() == grads[64].keys() and len(grads[64]) > 0
    for name, g in grads[100_000].items():
        torch.testing.assert_close(grads[64][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_logprobs_do_not_depend_on_padding_or_batch_company(tiny_model: Path, color_data: Path) -> None:
    """Rows padded at the end and run without a mask (models.sequences): a sequence's log-probs are the same alone
    or batched with longer prompts and completions; M-RoPE positions of real tokens do not move."""
    learner = Learner(_cfg(tiny_model, color_data), device="cpu")
    batch = _batch(learner, color_data)
    # prompt 2 gets a 128x96 image (24 image tokens instead of 4): prompts of two lengths in one micro-batch
    big = dataclasses.replace(batch.prompts[2], images=[Image.new("RGB", (128, 96), (10, 200, 10))])
    batch = TrainBatch([*batch.prompts[:2], big], batch.sequences)
    assert len({len(e.input_ids) for e in learner.encode_prompts(batch.prompts)}) == 2
    together = learner.logprobs(batch)
    for i, seq in enumerate(batch.sequences):
        alone = learner.logprobs(TrainBatch(batch.prompts, [seq]))[0]
        assert len(alone) == len(seq.completion_ids)
        torch.testing.assert_close(torch.tensor(alone), torch.tensor(together[i]), rtol=0, atol=1e-5)
    # The policy is the sampling distribution (temperature, vision tokens removed): probabilities sum to < 1 per
    # token but each log-prob is finite and negative.
    assert all(-50 < lp < 0 for row in together for lp in row)


def test_update_raises_the_probability_of_positive_advantage_tokens(
    tiny_model: Path, color_data: Path
) -> None:
    learner = Learner(_cfg(tiny_model, color_data), device="cpu")
    batch = _batch(learner, color_data)
    before = learner.logprobs(batch)
    metrics = learner.train_step(batch)
    after = learner.logprobs(batch)
    assert learner.version == 1 and metrics["adapter_version"] == 1.0
    assert metrics["policy/grad_norm"] > 0
    for seq, b, a in zip(batch.sequences, before, after, strict=True):
        change = sum(a) - sum(b)
        assert change > 0 if seq.advantage > 0 else change < 0


def test_reference_logprobs_are_the_base_model(tiny_model: Path, color_data: Path) -> None:
    learner = Learner(_cfg(tiny_model, color_data), device="cpu")
    batch = _batch(learner, color_data)
    base_before = learner.logprobs(batch, adapter=False)
    learner.train_step(batch)
    flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
    assert flat(learner.logprobs(batch, adapter=False)) == pytest.approx(flat(base_before))
    assert flat(learner.logprobs(batch)) != pytest.approx(flat(base_before))


def test_adapter_holds_only_lora_weights(tiny_model: Path, color_data: Path) -> None:
    """With LoRA on lm_head the saved adapter must not carry the frozen base lm_head (huge for real models)."""
    from safetensors.torch import load

    learner = Learner(_cfg(tiny_model, color_data), device="cpu")
    names = sorted(load(learner.adapter_payload().file_bytes("adapter_model.safetensors")))
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names
    assert any("lm_head.lora_A" in n for n in names)


def test_engine_payload_uses_the_model_dtype_checkpoints_keep_float32(
    tiny_model: Path, color_data: Path
) -> None:
    from safetensors.torch import load

    learner = Learner(_cfg(tiny_model, color_data, model={"dtype": "bfloat16"}), device="cpu")
    engine_weights = load(learner.adapter_payload().file_bytes("adapter_model.safetensors"))
    full_weights = load(learner.adapter_payload(for_engine=False).file_bytes("adapter_model.safetensors"))
    assert engine_weights.keys() == full_weights.keys()
    assert {t.dtype for t in engine_weights.values()} == {torch.bfloat16}
    assert {t.dtype for t in full_weights.values()} == {torch.float32}
    # the engines' copy is the checkpoint's, rounded once to bfloat16
    for name, weight in full_weights.items():
        assert torch.equal(engine_weights[name], weight.to(torch.bfloat16)), name


def test_entropy_bonus_raises_entropy_when_advantages_are_zero(tiny_model: Path, color_data: Path) -> None:
    """With zero advantages the only force is the entropy bonus: one update must raise the policy entropy."""
    learner = Learner(_cfg(tiny_model, color_data, algorithm={"entropy_coef": 1.0}), device="cpu")
    batch = _batch(learner, color_data)
    for seq in batch.sequences:
        seq.advantage = 0.0
    before = learner.train_step(batch)["policy/entropy"]
    after = learner.train_step(batch)["policy/entropy"]
    assert after > before


def test_kl_penalty_pulls_the_policy_back_to_the_reference(tiny_model: Path, color_data: Path) -> None:
    """With zero advantages and kl_coef > 0, updates from a perturbed adapter shrink the KL to the base model."""
    cfg = _cfg(tiny_model, color_data, algorithm={"kl_coef": 1.0, "kl_kind": "k3"}, train={"lr": 1e-3})
    learner = Learner(cfg, device="cpu")
    with torch.no_grad():
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(2))
    batch = _batch(learner, color_data)
    for seq in batch.sequences:
        seq.advantage = 0.0
    kls = [learner.train_step(batch)["loss/kl"] for _ in range(5)]
    assert kls[0] > 0
    assert kls[-1] < kls[0] / 2, kls  # measured: 0.085 -> 0.015


def _accumulated_grads(learner: Learner, batch: TrainBatch) -> dict[str, torch.Tensor]:
    with torch.no_grad():  # a non-zero B so every LoRA weight gets a gradient
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    encoded = learner.encode_prompts(batch.prompts)
    learner.optimizer.step = lambda: None  # keep the weights; inspect the accumulated gradient
    rows = list(range(len(batch.sequences)))
    learner._update(encoded, batch.sequences, rows, rows, None, None)
    return _grads(learner)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize(
    "lean",
    [
        {"train": {"share_images": False}},  # each row encodes its own copy of the image
        {"train": {"logit_chunk_tokens": 0}},  # all logits of the micro-batch at once
        {"train": {"logit_chunk_tokens": 1}},  # one token per lm_head chunk
        {"model": {"gradient_checkpointing": True}},
        {"model": {"gradient_checkpointing": True, "checkpoint_layers": 1}},
    ],
    ids=["per-row-images", "unchunked", "chunk-1", "checkpointed", "checkpoint-1-layer"],
)
def test_lean_forward_options_leave_the_gradient_unchanged(
    tiny_model: Path, color_data: Path, lean: dict
) -> None:
    """Sharing a group's image, chunked logits and (partial) checkpointing change memory and time, not the math:
    the gradient (merger and lm_head LoRA included) equals the plain path's to float32 rounding."""
    default = Learner(_cfg(tiny_model, color_data), device="cpu")
    batch = _batch(default, color_data)
    mbs = default._micro_batches(default.encode_prompts(batch.prompts), batch.sequences, range(6))
    # 3 prompts x 2 completions in one micro-batch: the vision tower encodes 3 images, not 6
    assert len(mbs) == 1 and mbs[0].image_share is not None
    assert mbs[0].image_grid_thw.shape[0] == 6 and len(mbs[0].image_share.unique_grid_thw) == 3
    want = _accumulated_grads(default, batch)
    got = _accumulated_grads(Learner(_cfg(tiny_model, color_data, **lean), device="cpu"), batch)
    assert (
        want.keys() == got.keys() and any("merger" in n for n in want) and any("lm_head" in n for n in want)
    )
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_checkpoint_layers_beyond_the_model_is_an_error(tiny_model: Path, color_data: Path) -> None:
    cfg = _cfg(tiny_model, color_data, model={"gradient_checkpointing": True, "checkpoint_layers": 3})
    with pytest.raises(ValueError, match="checkpoint_layers=3 exceeds the model's 2 decoder layers"):
        Learner(cfg, device="cpu")


def test_old_logprobs_only_for_minibatches_after_the_first(tiny_model: Path, color_data: Path) -> None:
    """updates_per_batch=2: mini-batch 1 (groups 0 and 2) trains on-policy, so the no-grad old-log-prob pass
    covers only mini-batch 2 (group 1 = rows 2, 3), and mini-batch 1's ratios are exactly 1 (nothing clipped)."""
    cfg = _cfg(tiny_model, color_data, algorithm={"updates_per_batch": 3}, rollout={"prompts_per_step": 3})
    learner = Learner(cfg, device="cpu")
    batch = _batch(learner, color_data)
    seen: list[list[int]] = []
    real = learner._precompute

    def spy(encoded, seqs, rows, adapter):
        seen.append(sorted(rows))
        return real(encoded, seqs, rows, adapter)

    learner._precompute = spy
    clip = []
    real_update = learner._update

    def spy_update(*args):
        out = real_update(*args)
        clip.append(out["policy/clip_fraction"])
        return out

    learner._update = spy_update
    metrics = learner.train_step(batch)
    # 3 updates over 3 groups: mini-batches [0, 1], [2, 3], [4, 5]; old log-probs for the last two only
    assert seen == [[2, 3, 4, 5]]
    assert clip[0] == 0.0
    assert metrics["learner/tokens"] == sum(len(s.completion_ids) for s in batch.sequences)


def test_engine_mismatch_is_measured_before_the_update(tiny_model: Path, color_data: Path) -> None:
    """With sampling log-probs equal to the learner's own, the reported mismatch is 0 even with three updates per
    batch at a large learning rate: later mini-batches are compared through the old log-probs (taken before
    any update), not their post-update training forward."""
    cfg = _cfg(tiny_model, color_data, algorithm={"updates_per_batch": 3}, train={"lr": 5e-2})
    learner = Learner(cfg, device="cpu")
    batch = _batch(learner, color_data)
    for seq, lps in zip(batch.sequences, learner.logprobs(batch), strict=True):
        seq.sampling_logprobs = lps
    assert learner.train_step(batch)["rollout/logprob_diff"] < 1e-6
    # and the update did move the policy: the same measure now shows the drift
    assert learner.train_step(batch)["rollout/logprob_diff"] > 1e-3


@pytest.mark.slow
def test_a_non_finite_update_is_not_applied(tiny_model: Path, color_data: Path) -> None:
    """One NaN advantage makes the loss NaN: with on_nonfinite=skip the weights, optimizer state, learning-rate
    schedule and version stay as they were and the step reports one skipped update; the next finite batch is
    applied. With on_nonfinite=stop the same batch raises NonFiniteError and changes nothing either."""
    from dataclasses import replace

    from visionrl.errors import NonFiniteError
    from visionrl.metrics import SKIPPED_UPDATES

    learner = Learner(_cfg(tiny_model, color_data), device="cpu")
    batch = _batch(learner, color_data)
    poisoned = TrainBatch(
        batch.prompts, [replace(batch.sequences[0], advantage=float("nan")), *batch.sequences[1:]]
    )
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}
    stats = learner.train_step(poisoned)
    assert stats[SKIPPED_UPDATES] == 1.0 and stats["updates"] == 1.0 and learner.version == 0
    assert stats["policy/grad_norm"] != stats["policy/grad_norm"]  # NaN
    after = dict(learner.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not learner.optimizer.state  # AdamW never saw the NaN gradient
    assert learner.scheduler.last_epoch == 0
    stats = learner.train_step(batch)
    assert stats[SKIPPED_UPDATES] == 0.0 and learner.version == 1
    assert any(not torch.equal(before[n], after[n]) for n in before)

    strict = Learner(_cfg(tiny_model, color_data, train={"on_nonfinite": "stop"}), device="cpu")
    with pytest.raises(NonFiniteError, match=r"non-finite loss \(nan\).*train\.on_nonfinite=stop"):
        strict.train_step(poisoned)
    assert strict.version == 0 and not strict.optimizer.state


def test_engine_old_logprobs_skip_the_old_pass_and_set_the_ratio(tiny_model: Path, color_data: Path) -> None:
    """algorithm.old_logprobs=engine: no no-grad pass at all, and every mini-batch's ratio is against the
    engine's sampling log-probs. Here they are the learner's own minus log 2, so mini-batch 1 (rows 0 and 1,
    before any update) has ratio r = 2 on every token. Per token the loss is -min(r A, clip(r, 0.8, 1.2) A):
    row 0 (A = +1, 2 tokens) takes the clipped -1.2 each (clipped); row 1 (A = -1, 1 token) the unclipped
    -(-2) = 2. Token mean over the 3 tokens: (-2.4 + 2) / 3 = -0.1333; clip fraction 2/3."""
    algo = {"updates_per_batch": 3, "old_logprobs": "engine", "rollout_correction": "off"}
    algo |= {"clip_low": 0.2, "clip_high": 0.2}
    learner = Learner(_cfg(tiny_model, color_data, algorithm=algo), device="cpu")
    batch = _batch(learner, color_data)
    for seq, lps in zip(batch.sequences, learner.logprobs(batch), strict=True):
        seq.sampling_logprobs = [lp - math.log(2.0) for lp in lps]
    passes: list[list[int]] = []
    real = learner._precompute

    def spy(encoded, seqs, rows, adapter):  # type: ignore[no-untyped-def]
        passes.append(sorted(rows))
        return real(encoded, seqs, rows, adapter)

    learner._precompute = spy  # type: ignore[method-assign]
    firsts: list[dict[str, float]] = []
    real_update = learner._update

    def spy_update(*args):  # type: ignore[no-untyped-def]
        out = real_update(*args)
        firsts.append(out)
        return out

    learner._update = spy_update  # type: ignore[method-assign]
    metrics = learner.train_step(batch)
    assert passes == []  # no old-log-prob pass (and no reference pass: kl_coef 0)
    assert len(firsts) == 3
    assert firsts[0]["loss/policy"] == pytest.approx(-0.4 / 3, abs=1e-5)
    assert firsts[0]["policy/clip_fraction"] == pytest.approx(2 / 3, abs=1e-6)
    # both clipped tokens have A > 0 and r = 2 above 1.2: the high side; every ratio of mini-batch 1 is 2
    assert firsts[0]["policy/clip_fraction_high"] == pytest.approx(2 / 3, abs=1e-6)
    assert firsts[0]["policy/clip_fraction_low"] == 0.0
    assert firsts[0]["policy/ratio_max"] == pytest.approx(2.0, rel=1e-4)
    assert firsts[0]["policy/ratio_min"] == pytest.approx(2.0, rel=1e-4)
    # the step's extremes span its mini-batches (the later ones see the updated policy)
    assert metrics["policy/ratio_max"] == max(f["policy/ratio_max"] for f in firsts)
    assert metrics["policy/ratio_min"] == min(f["policy/ratio_min"] for f in firsts)
    # the mismatch measure still compares learner and engine before the first update: log 2 per token
    assert metrics["rollout/logprob_diff"] == pytest.approx(math.log(2.0), abs=1e-4)


def test_engine_old_logprobs_with_rollout_correction_are_refused(tiny_model: Path, color_data: Path) -> None:
    with pytest.raises(ConfigError, match=r"set algorithm.rollout_correction=off \(it is 'token'\)"):
        _cfg(tiny_model, color_data, algorithm={"old_logprobs": "engine"})


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_compiled_decoder_layers_give_the_eager_gradient(tiny_model: Path, color_data: Path) -> None:
    """train.compile: every decoder layer runs through torch.compile (inductor on the CPU here), and the
    gradient of a batch of completions of different lengths (one graph for all lengths) is the eager one."""
    eager = Learner(_cfg(tiny_model, color_data), device="cpu")
    compiled = Learner(_cfg(tiny_model, color_data, train={"compile": True}), device="cpu")
    layers = compiled.model.get_base_model().model.language_model.layers
    assert len(layers) > 0 and all(layer._compiled_call_impl is not None for layer in layers)
    # the warm-up (run beside the engines' start) compiles the layers for training and changes nothing else
    weights = {n: p.detach().clone() for n, p in compiled.model.named_parameters()}
    assert compiled.warm_up() > 0 and eager.warm_up() == 0.0  # nothing to warm up without train.compile
    warmed = compiled_graphs()
    assert all(torch.equal(p, weights[n]) and p.grad is None for n, p in compiled.model.named_parameters())
    assert compiled.version == 0 and not compiled.optimizer.state
    batch = _batch(eager, color_data)
    want, got = _accumulated_grads(eager, batch), _accumulated_grads(compiled, batch)
    assert compiled_graphs() == warmed  # the first real update (images, other lengths) compiled nothing new
    assert want.keys() == got.keys() and len(want) > 0
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3  # real gradients: the comparison can fail
    # the shared layer code gets room for its guard variants, and a step reports the graphs compiled so far
    assert torch._dynamo.config.recompile_limit >= 64
    graphs = compiled.train_step(batch)["learner/compiled_graphs"]
    assert graphs >= 1 and compiled.train_step(batch)["learner/compiled_graphs"] == graphs  # no recompilation


@pytest.mark.slow
def test_a_completion_that_sampled_a_vision_token_is_left_out_not_the_step(
    tiny_model: Path, color_data: Path
) -> None:
    learner = Learner(_cfg(tiny_model, color_data))
    batch = _batch(learner, color_data)
    pad = learner.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    bad = dataclasses.replace(batch.sequences[1], completion_ids=[pad, *batch.sequences[1].completion_ids])
    clean = TrainBatch(batch.prompts, [s for i, s in enumerate(batch.sequences) if i != 1])
    twin = Learner(_cfg(tiny_model, color_data))
    # In the forward an <|image_pad|> reads as a placeholder for image features that do not exist: it failed
    # the whole step ("Image features and image tokens do not match"). Left out, the step trains on the other
    # five completions exactly as a batch without it does.
    m = learner.train_step(TrainBatch(batch.prompts, [*batch.sequences[:1], bad, *batch.sequences[2:]]))
    m_clean = twin.train_step(clean)
    assert m["rollout/vision_tokens_sampled"] == 1 and m_clean["rollout/vision_tokens_sampled"] == 0
    assert m["learner/tokens"] == m_clean["learner/tokens"] == 13  # 2 + 4 + 2 + 3 + 2 tokens
    assert m["loss/policy"] == pytest.approx(m_clean["loss/policy"], abs=1e-7)
    # a batch of nothing but such completions: no update, the adapter keeps its version
    only_bad = learner.train_step(TrainBatch(batch.prompts, [bad]))
    assert only_bad["rollout/vision_tokens_sampled"] == 1 and only_bad["updates"] == 0
    assert learner.version == 1


@pytest.mark.slow
def test_a_token_without_a_sampling_logprob_leaves_the_loss_not_the_update(
    tiny_model: Path, color_data: Path
) -> None:
    """The engine's log-probs as the old policy, equal to the learner's (ratio 1), except one token the engine
    returned none for (NaN). Before, that NaN made the whole update non-finite and it was skipped. Now the token
    stays in the context and leaves the loss: 13 of the 14 tokens are scored, and the on-policy loss is
    -sum(A) / 13 over them: A = +1 on rows 0, 2, 4 (2 + 3 + 3 tokens, row 2 without its NaN token), -1 on rows
    1, 3, 5 (1 + 2 + 2): -(8 - 5) / 13."""
    algo = {"old_logprobs": "engine", "rollout_correction": "off"}
    learner = Learner(_cfg(tiny_model, color_data, algorithm=algo), device="cpu")
    batch = _batch(learner, color_data)
    for seq, lps in zip(batch.sequences, learner.logprobs(batch), strict=True):
        seq.sampling_logprobs = list(lps)
    batch.sequences[2].sampling_logprobs[1] = float("nan")
    metrics = learner.train_step(batch)
    assert metrics["faults/skipped_updates"] == 0 and learner.version == 1
    assert metrics["learner/tokens"] == 13
    assert metrics["loss/policy"] == pytest.approx(-3 / 13, abs=1e-5)
    assert metrics["rollout/logprob_diff"] == pytest.approx(0.0, abs=1e-5)  # the NaN is not compared


@pytest.mark.slow
def test_tokens_the_correction_masks_leave_the_token_mean_denominator(
    tiny_model: Path, color_data: Path
) -> None:
    """correction_mode mask with the learner's old policy: the engine agrees with the learner (weight 1) except
    on two tokens, one at weight e^-3 (under correction_lower 0.5) and one at e (over the threshold 2). Both
    leave the loss and its normaliser: 12 of 14 tokens, on-policy loss -sum(A) / 12 over them, A = +1 on rows
    0, 2, 4 (2 + 3 + 2 tokens), -1 on rows 1, 3, 5 (1 + 2 + 2): -2 / 12. Before, the masked tokens had weight
    0 but stayed in the denominator: -2 / 14."""
    algo = {"old_logprobs": "learner", "rollout_correction": "token", "correction_mode": "mask"}
    learner = Learner(_cfg(tiny_model, color_data, algorithm=algo), device="cpu")
    batch = _batch(learner, color_data)
    for seq, lps in zip(batch.sequences, learner.logprobs(batch), strict=True):
        seq.sampling_logprobs = list(lps)
    batch.sequences[2].sampling_logprobs[1] += 3.0  # weight learner / engine = e^-3
    batch.sequences[4].sampling_logprobs[0] -= 1.0  # weight e
    metrics = learner.train_step(batch)
    assert metrics["learner/tokens"] == 12
    assert metrics["loss/policy"] == pytest.approx(-2 / 12, abs=1e-5)
    assert metrics["rollout/correction_clipped_fraction"] == pytest.approx(2 / 14)


@pytest.mark.slow
def test_a_checkpoint_of_another_lora_layout_is_refused_and_rng_restored(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    import random

    from visionrl.errors import InputError

    lm_only = Learner(_cfg(tiny_model, color_data, lora={"train_merger": False}))
    payload, state = lm_only.adapter_payload(for_engine=False), lm_only.state_dict()["trainer_state"]
    for name, data in payload.files.items():
        (tmp_path / name).write_bytes(data)
    # the merger's LoRA weights are not in the checkpoint: before, peft loaded the rest and kept the merger's
    # fresh, silently
    with_merger = Learner(_cfg(tiny_model, color_data))
    with pytest.raises(InputError, match="does not fit this job's LoRA layout") as err:
        with_merger.load_state(tmp_path, state)
    assert "merger" in str(err.value) and "train_merger" in str(err.value)
    # the same layout loads, and the Python RNG comes back with the torch one
    random.seed(7)
    expected = random.random()
    random.seed(7)
    state = lm_only.state_dict()["trainer_state"]
    random.random()
    Learner(_cfg(tiny_model, color_data, lora={"train_merger": False})).load_state(tmp_path, state)
    assert random.random() == expected


@pytest.mark.slow
def test_the_schedule_runs_on_steps_not_on_the_updates_applied(tiny_model: Path, color_data: Path) -> None:
    """Cosine to 0 over 4 steps x 2 updates = 8 slots, no warm-up: lr(slot) = 1e-2 * (1 + cos(pi slot / 8)) / 2.
    A batch of one group has one update a step (not 2); before, each such step moved the schedule one slot, so
    after 4 steps it stood at slot 3 instead of 6. Now step k's update takes slot 2k: 1e-2, 0.8536e-2,
    0.5e-2, 0.1464e-2."""
    train = {"steps": 4, "lr_schedule": "cosine", "min_lr_ratio": 0.0, "lr": 1e-2}
    over = {"algorithm": {"updates_per_batch": 2}, "rollout": {"prompts_per_step": 2}}
    learner = Learner(_cfg(tiny_model, color_data, train=train, **over))
    batch = _batch(learner, color_data)
    one_group = TrainBatch(batch.prompts, batch.sequences[:2])  # prompt 0's two completions
    lrs = [learner.train_step(one_group)["policy/lr"] for _ in range(4)]
    expected = [1e-2 * (1 + math.cos(math.pi * slot / 8)) / 2 for slot in (0, 2, 4, 6)]
    assert lrs == pytest.approx(expected, rel=1e-9)
    assert lrs[1] == pytest.approx(0.8536e-2, abs=1e-6)


@pytest.mark.slow
def test_a_processor_without_modality_ids_gets_them_from_the_vision_tokens(
    tiny_model: Path, color_data: Path
) -> None:
    """M-RoPE places image tokens by `mm_token_type_ids`; a processor that returns none used to get zeros (every
    token text, wrong positions, no error). Derived from the image token ids, they equal the processor's own."""
    learner = Learner(_cfg(tiny_model, color_data))
    prompts = _batch(learner, color_data).prompts[:1]
    expected = learner.encode_prompts(prompts)[0].mm_token_type_ids
    real = learner.processor.__call__

    def without_types(*args, **kwargs):  # type: ignore[no-untyped-def]
        enc = real(*args, **kwargs)
        del enc["mm_token_type_ids"]
        return enc

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(learner.processor), "__call__", lambda self, *a, **k: without_types(*a, **k))
        derived = learner.encode_prompts(prompts)[0].mm_token_type_ids
    assert int(expected.sum()) == 4  # the 64 x 64 image's 4 tokens
    assert torch.equal(derived, expected)
