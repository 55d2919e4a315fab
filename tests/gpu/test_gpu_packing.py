"""`train.packing` on the GPU at bf16: the tiny Qwen3-VL's packed rows give the padded rows' log-probs and LoRA
gradients within bf16 rounding (the float32 equality to 1e-5 is tests/integration/test_packed_learner.py's).

Tolerances, and why: the logits leave `lm_head` in bf16 and are rounded there before the float32 log-softmax.
Near |logit| 4-8 (the tiny model's range) one bf16 ulp is 2^-5 = 0.031, and a packed row orders its sums
differently from a padded one (other GEMM shapes, SDPA with a document mask instead of its causal kernel), so a
logit may land one ulp away and its log-prob moves by up to about that much. Allowed: 0.05 per token (1.5 ulp) and
0.01 on average (a third of an ulp; most logits round the same). Gradients: bf16 keeps 8 significant bits (0.4%
per rounding) and each LoRA gradient sums thousands of products in another order, so their relative L2 difference
is allowed 5%; a layout bug (a token reading another sequence, an image at the wrong placeholders) moves log-probs
by tenths of a nat and gradients by their own size. The same tolerances hold packed rows on the varlen kernels
(`train.packed_attention`: torch's varlen_attn, FlexAttention), which also order their sums their own way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from visionrl.config import config_from_dict
from visionrl.models import packed_attention as pa
from visionrl.models.sequences import Sequence
from visionrl.train.learner import Learner, TrainBatch
from visionrl.types import PromptItem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _learner(model: Path, data: Path, device: str = "cuda", **train: object) -> Learner:
    raw = {
        "output_dir": "unused",
        "model": {"path": str(model), "dtype": "bfloat16"},
        "data": {"train": str(data / "train.jsonl")},
        "rewards": [{"name": "exact_match"}],
        "lora": {"rank": 8, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 4},
        "rollout": {"prompts_per_step": 3, "max_new_tokens": 48},
        "train": {"lr": 1e-3, "lr_schedule": "constant", "max_grad_norm": 1e9, **train},
    }
    learner = Learner(config_from_dict(raw), device=device)
    learner.cfg.train.packing = False  # switched on where a test packs
    with torch.no_grad():  # a non-zero B: every LoRA weight gets a gradient
        gen = torch.Generator(device=device).manual_seed(1)
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=gen)
    return learner


def _batch(learner: Learner) -> TrainBatch:
    """3 prompts (no image, one 64x64, two of 96x64 and 128x96) x 4 completions of 6 to 48 random tokens."""
    prompts = []
    for sizes in ([], [(64, 64)], [(96, 64), (128, 96)]):
        content = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": "what color ?"}]
        text = learner.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(PromptItem(text=text, images=[Image.new("RGB", s, (30, 160, 90)) for s in sizes]))
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(12):
        k = int(torch.randint(6, 49, (1,), generator=gen))
        ids = torch.randint(8, 128, (k,), generator=gen).tolist()  # text tokens of the tiny vocab
        seqs.append(Sequence(i // 4, ids, float(torch.randn((), generator=gen)), [-6.0] * k))
    return TrainBatch(prompts, seqs)


def _grads(learner: Learner, batch: TrainBatch) -> dict[str, torch.Tensor]:
    step, learner.optimizer.step = (
        learner.optimizer.step,
        lambda: None,
    )  # inspect the gradient, keep the weights
    try:
        encoded = learner.encode_prompts(batch.prompts)
        rows = list(range(len(batch.sequences)))
        learner._update(encoded, batch.sequences, rows, rows, None, None)
    finally:
        learner.optimizer.step = step
    return {n: p.grad.float().clone() for n, p in learner.model.named_parameters() if p.grad is not None}


def _compare(learner: Learner, batch: TrainBatch) -> tuple[float, float, float]:
    """Padded, then packed (one row): the log-probs' largest and mean difference, the largest relative
    difference of a LoRA gradient; each within its bf16 tolerance (module docstring)."""
    padded, want = learner.logprobs(batch), _grads(learner, batch)
    learner.cfg.train.packing = True
    encoded = learner.encode_prompts(batch.prompts)
    assert len(learner._micro_batches(encoded, batch.sequences, range(12))) == 1  # one packed row
    try:
        packed, got = learner.logprobs(batch), _grads(learner, batch)
    finally:
        learner.cfg.train.packing = False
    diffs = torch.tensor(
        [abs(a - b) for p, q in zip(packed, padded, strict=True) for a, b in zip(p, q, strict=True)]
    )
    assert len(diffs) == sum(len(s.completion_ids) for s in batch.sequences)
    assert diffs.max() <= 0.05 and diffs.mean() <= 0.01, (float(diffs.max()), float(diffs.mean()))
    assert want.keys() == got.keys() and any("merger" in n for n in want)
    worst = 0.0
    for name, g in want.items():
        rel = float((got[name] - g).norm() / g.norm())
        assert rel <= 0.05, f"{name}: relative difference {rel:.3f}"
        worst = max(worst, rel)
    return float(diffs.max()), float(diffs.mean()), worst


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_packed_rows_match_padded_rows_in_bf16(tiny_model: Path, color_data: Path) -> None:
    """Packed rows on transformers' dense document mask (packing switched on after the start: sdpa_mask)."""
    learner = _learner(tiny_model, color_data)
    assert learner.packed_kernel == "sdpa_mask"
    _compare(learner, _batch(learner))


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("requested", ["varlen", "flex"])
def test_varlen_packed_rows_match_padded_rows_in_bf16(
    tiny_model: Path, color_data: Path, requested: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.packed_attention=varlen (torch's varlen_attn) and flex (FlexAttention, document block mask): the
    same tolerances; prints the kernel that ran and how often (run with -s), and fails if the one asked for
    could run here but another did."""
    learner = _learner(tiny_model, color_data, packing=True, packed_attention=requested)
    kernel = learner.packed_kernel
    ran: dict[str, int] = {}
    for name in ("_varlen", "_flex", "_reference"):
        real = getattr(pa, name)

        def counted(*args: object, _real: Any = real, _name: str = name) -> object:
            ran[_name] = ran.get(_name, 0) + 1
            return _real(*args)

        monkeypatch.setattr(pa, name, counted)
    worst = _compare(learner, _batch(learner))
    print(
        f"\npacked_attention={requested}: kernel {kernel}, calls {ran}, torch {torch.__version__}, "
        f"log-prob diff max {worst[0]:.4f} mean {worst[1]:.5f}, gradient rel diff max {worst[2]:.4f}"
    )
    missing = pa.varlen_missing(torch.bfloat16) if requested == "varlen" else pa.flex_missing()
    if missing is None:
        assert kernel == requested and ran.get(f"_{requested}", 0) > 0, (kernel, ran)
    else:
        assert kernel != requested, (kernel, missing)
