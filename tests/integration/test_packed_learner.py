"""`train.packing` on the tiny Qwen3-VL at float32: a packed row gives every sequence the log-probs and the
gradient the padded micro-batches give it (1e-5), with no, one or two images of different sizes per prompt and
with a multi-turn episode; and attention never crosses from one sequence of a row into another. Each on both
attention paths of a packed row (`train.packed_attention`): transformers' dense document mask, and the varlen
path (on the CPU its per-sequence reference) registered as the language model's attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from visionrl.config import config_from_dict
from visionrl.models.sequences import Sequence
from visionrl.train.learner import Learner, TrainBatch
from visionrl.types import PromptItem

ATOL = 1e-5


def _learner(tiny_model: Path, color_data: Path, **train: object) -> Learner:
    cfg = config_from_dict(
        {
            "output_dir": "unused",
            "model": {"path": str(tiny_model), "dtype": "float32"},
            "data": {"train": str(color_data / "train.jsonl")},
            "rewards": [{"name": "exact_match"}],
            "lora": {"rank": 8, "train_merger": True, "train_lm_head": True},
            "algorithm": {"group_size": 2},
            "rollout": {"prompts_per_step": 3, "max_new_tokens": 8, "temperature": 0.7},
            "train": {"lr": 1e-2, "lr_schedule": "constant", "max_grad_norm": 1e9, **train},
        }
    )
    out = Learner(cfg, device="cpu")
    out.cfg.train.packing = False  # the tests switch it on where they pack
    with torch.no_grad():  # a non-zero B: every LoRA weight gets a gradient and the adapter changes log-probs
        gen = torch.Generator().manual_seed(1)
        for n, p in out.model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=gen)
    return out


@pytest.fixture(scope="module")
def dense_learner(tiny_model: Path, color_data: Path) -> Learner:
    """Packing switched on after the start: packed rows on transformers' dense document mask (sdpa_mask)."""
    out = _learner(tiny_model, color_data)
    assert out.packed_kernel == "sdpa_mask"
    return out


@pytest.fixture(scope="module")
def varlen_learner(tiny_model: Path, color_data: Path) -> Learner:
    """train.packing with packed_attention=varlen: on the CPU the per-sequence reference, registered with
    transformers as the language model's attention (the vision tower keeps SDPA)."""
    out = _learner(tiny_model, color_data, packing=True, packed_attention="varlen")
    assert out.packed_kernel == "reference"
    config = out.model.get_base_model().config
    assert config.text_config._attn_implementation == "visionrl_packed_sdpa"
    assert config.vision_config._attn_implementation == "sdpa"
    return out


@pytest.fixture(params=["sdpa_mask", "varlen"])
def learner(request: pytest.FixtureRequest) -> Learner:
    """Each test below on both attention paths of a packed row."""
    return request.getfixturevalue("dense_learner" if request.param == "sdpa_mask" else "varlen_learner")


def _prompt(learner: Learner, sizes: list[tuple[int, int]]) -> PromptItem:
    content = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": "what color ?"}]
    text = learner.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [Image.new("RGB", s, (40 * i + 20, 200 - 50 * i, 90)) for i, s in enumerate(sizes)]
    return PromptItem(text=text, images=images)


# images per prompt: none; one, of two sizes (4 and 12 image tokens); two of different sizes; all kinds at once
LAYOUTS = {
    "no-image": [[], []],
    "one-image": [[(64, 64)], [(128, 96)]],
    "two-images": [[(64, 64), (96, 64)], [(128, 96), (64, 128)]],
    "mixed": [[], [(64, 64)], [(96, 64), (128, 96)]],
}


def _batch(learner: Learner, layout: list[list[tuple[int, int]]]) -> TrainBatch:
    """Two completions per prompt, of 1 to 7 tokens, advantages +-1."""
    vocab = learner.processor.tokenizer.get_vocab()
    words = ["red", "blue", "green", "yellow", "left", "right", "top", "one", "?"]
    seqs = []
    for i in range(2 * len(layout)):
        k = 1 + (3 * i + 2) % 7
        ids = [vocab[words[(i + t) % len(words)]] for t in range(k - 1)] + [vocab["<|im_end|>"]]
        seqs.append(Sequence(i // 2, ids, 1.0 if i % 2 else -1.0, [-1.0] * k))
    return TrainBatch([_prompt(learner, sizes) for sizes in layout], seqs)


def _logprobs(
    learner: Learner, batch: TrainBatch, packing: bool, budget: int | None = None
) -> list[list[float]]:
    learner.cfg.train.packing = packing
    learner.cfg.train.logprob_batch_tokens = budget
    try:
        return learner.logprobs(batch)
    finally:
        learner.cfg.train.packing, learner.cfg.train.logprob_batch_tokens = False, None


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_logprobs_equal_the_padded_ones(learner: Learner, layout: str) -> None:
    batch = _batch(learner, LAYOUTS[layout])
    encoded = learner.encode_prompts(batch.prompts)
    learner.cfg.train.packing = True
    mbs = learner._micro_batches(encoded, batch.sequences, range(len(batch.sequences)), 16384)
    learner.cfg.train.packing = False
    # all sequences end to end in one row, each completion after its own prompt
    assert len(mbs) == 1 and mbs[0].input_ids.shape[0] == 1 and mbs[0].segments is not None
    assert len(mbs[0].segments.bounds) - 1 >= len(batch.sequences)
    padded = _logprobs(learner, batch, packing=False)
    packed = _logprobs(learner, batch, packing=True)
    assert _max_diff(packed, padded) <= ATOL
    # rows of at most 64 tokens: several packed rows, the same numbers
    assert _max_diff(_logprobs(learner, batch, packing=True, budget=64), padded) <= ATOL
    assert all(-50 < x < 0 for row in packed for x in row)


def _grads(learner: Learner, batch: TrainBatch, packing: bool) -> dict[str, torch.Tensor]:
    learner.cfg.train.packing = packing
    step = learner.optimizer.step
    learner.optimizer.step = lambda: None  # keep the weights; inspect the accumulated gradient
    try:
        encoded = learner.encode_prompts(batch.prompts)
        rows = list(range(len(batch.sequences)))
        learner._update(encoded, batch.sequences, rows, rows, None, None)
    finally:
        learner.optimizer.step = step
        learner.cfg.train.packing = False
    return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("layout", ["one-image", "mixed"])
def test_packed_gradient_equals_the_padded_one(learner: Learner, layout: str) -> None:
    batch = _batch(learner, LAYOUTS[layout])
    want, got = _grads(learner, batch, packing=False), _grads(learner, batch, packing=True)
    assert want.keys() == got.keys()
    assert any("merger" in n for n in want) and any("lm_head" in n for n in want)
    assert any("language_model" in n for n in want)
    for name, g in want.items():
        assert g.abs().max() > 0, name
        rel = float((got[name] - g).norm() / g.norm())
        assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"


def test_attention_does_not_cross_sequences_in_a_packed_row(learner: Learner) -> None:
    """Changing the first sequence of a row changes its own log-probs and leaves every later one's unchanged;
    the same row read as one sequence (text positions not restarting) does let the change through."""
    batch = _batch(learner, LAYOUTS["mixed"])
    encoded = learner.encode_prompts(batch.prompts)
    learner.cfg.train.packing = True
    try:
        (mb,) = learner._micro_batches(encoded, batch.sequences, range(len(batch.sequences)), 16384)
        first = mb.rows[0]
        vocab = learner.processor.tokenizer.get_vocab()
        changed = list(batch.sequences)
        old = changed[first]
        changed[first] = Sequence(
            old.prompt, [vocab["left"]] * len(old.completion_ids), 1.0, old.sampling_logprobs
        )
        (mb2,) = learner._micro_batches(encoded, changed, range(len(changed)), 16384)
        assert mb2.rows == mb.rows and mb2.segments == mb.segments  # the same places in the row
        with torch.no_grad():
            a, b = learner._stats(mb)[0], learner._stats(mb2)[0]
            assert (a[0] - b[0]).abs().max() > 1e-2  # the first sequence's own log-probs moved
            assert (a[1:] - b[1:]).abs().max() <= 1e-6  # no other sequence saw it
            # control: one segment over the whole row, attention crossing from the first sequence into the rest
            assert mb.segments is not None and mb2.segments is not None
            for m in (mb, mb2):
                m.segments.bounds, m.segments.images = [0, m.input_ids.shape[1]], [len(m.image_grid_thw)]
            crossed = (learner._stats(mb)[0][1:] - learner._stats(mb2)[0][1:]).abs().max()
        assert crossed > 1e-3
    finally:
        learner.cfg.train.packing = False


def test_varlen_path_attends_per_sequence_with_no_dense_mask(
    varlen_learner: Learner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every SDPA call of a packed forward: the vision tower's per image (its own attention, unmasked), then per
    text layer one causal call per segment of the row, the padding's included; never an [L, L] mask."""
    learner = varlen_learner
    batch = _batch(learner, LAYOUTS["mixed"])
    encoded = learner.encode_prompts(batch.prompts)
    learner.cfg.train.packing = True
    try:
        (mb,) = learner._micro_batches(encoded, batch.sequences, range(len(batch.sequences)), 16384)
    finally:
        learner.cfg.train.packing = False
    calls: list[tuple[int, bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append((q.shape[-2], kwargs.get("attn_mask") is None, bool(kwargs.get("is_causal"))))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        learner._stats(mb)
    assert mb.segments is not None and mb.image_grid_thw is not None
    bounds = mb.segments.bounds
    segments = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert bounds[-1] == mb.input_ids.shape[1] and len(segments) == len(batch.sequences) + 1  # + the padding
    layers = len(learner.model.get_base_model().model.language_model.layers)
    assert all(unmasked for _, unmasked, _ in calls)
    assert [n for n, _, causal in calls if causal] == segments * layers
    # the vision tower: one unmasked call per distinct image (a group's completions share theirs) and vision layer
    grids = mb.image_grid_thw if mb.image_share is None else mb.image_share.unique_grid_thw
    depth = learner.model.get_base_model().config.vision_config.depth
    assert sorted(n for n, _, causal in calls if not causal) == sorted(grids.prod(-1).tolist() * depth)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_gives_the_padded_logprobs(varlen_learner: Learner) -> None:
    """The FlexAttention kernel with its document block mask, run eagerly on the CPU (no backward there, so
    log-probs only): every layout's packed log-probs equal the padded ones."""
    varlen_learner.packed_kernel = "flex"
    try:
        for layout in LAYOUTS.values():
            batch = _batch(varlen_learner, layout)
            padded = _logprobs(varlen_learner, batch, packing=False)
            assert _max_diff(_logprobs(varlen_learner, batch, packing=True), padded) <= ATOL
    finally:
        varlen_learner.packed_kernel = "reference"


def test_the_kernel_switches_back_and_forth(varlen_learner: Learner) -> None:
    """`setup_packed_attention` between steps (the benchmark's levers): back to sdpa_mask the text attention is
    SDPA again, which builds the document mask itself; then varlen again; the padded log-probs throughout."""
    from visionrl.models.packed_attention import setup_packed_attention

    base = varlen_learner.model.get_base_model()
    batch = _batch(varlen_learner, LAYOUTS["mixed"])
    padded = _logprobs(varlen_learner, batch, packing=False)
    try:
        for requested, kernel, text in [("sdpa_mask", "sdpa_mask", "sdpa"), ("varlen", "reference", None)]:
            varlen_learner.packed_kernel = setup_packed_attention(base, requested, "sdpa")
            assert varlen_learner.packed_kernel == kernel
            assert base.config.text_config._attn_implementation == (text or "visionrl_packed_sdpa")
            assert base.config.vision_config._attn_implementation == "sdpa"
            assert _max_diff(_logprobs(varlen_learner, batch, packing=True), padded) <= ATOL
    finally:
        varlen_learner.packed_kernel = setup_packed_attention(base, "varlen", "sdpa")
