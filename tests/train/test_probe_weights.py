"""The probe adapters of the learner (train.probe): one part at a time, the same weights for payload and scoring."""

from __future__ import annotations

import pytest
import torch

from visionrl.train.probe import (
    LANGUAGE,
    MERGER,
    PROBE_STD,
    PROBE_VERSION,
    part_of,
    probe_parts,
    probe_weights,
)

NAMES = [
    "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight",
    "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.default.weight",
    "base_model.model.model.visual.merger.linear_fc1.lora_A.default.weight",
    "base_model.model.model.visual.merger.linear_fc1.lora_B.default.weight",
    "base_model.model.lm_head.lora_B.default.weight",
]


def _named() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(n, torch.randn(64, 8, generator=gen)) for n in NAMES]


def test_parts_are_the_vision_tower_and_the_rest() -> None:
    assert [part_of(n) for n in NAMES] == [LANGUAGE, LANGUAGE, MERGER, MERGER, LANGUAGE]
    assert probe_parts(_named()) == [LANGUAGE, MERGER]
    assert probe_parts(_named()[:2]) == [LANGUAGE]  # no merger LoRA: one probe


def test_a_part_gets_random_b_the_other_part_zero_b_and_a_stays() -> None:
    named = _named()
    snap = probe_weights(named, MERGER, seed=7)
    assert snap.version == PROBE_VERSION
    a_lm, b_lm, a_merger, b_merger, b_head = snap.weights
    assert torch.equal(a_lm, named[0][1]) and torch.equal(a_merger, named[2][1])  # A as trained
    assert not b_lm.any() and not b_head.any()  # the language model's B: zero
    assert b_merger.std().item() == pytest.approx(PROBE_STD, rel=0.2)
    again = probe_weights(named, MERGER, seed=7).weights[3]
    assert torch.equal(b_merger, again)  # the payload and the learner's scoring see the same weights
    lm = probe_weights(named, LANGUAGE, seed=7).weights
    assert lm[1].any() and lm[4].any() and not lm[3].any()
    assert not torch.equal(lm[1][:8], b_merger[:8])  # each part its own draw
    with pytest.raises(ValueError, match="unknown adapter part"):
        probe_weights(named, "vision", seed=7)
