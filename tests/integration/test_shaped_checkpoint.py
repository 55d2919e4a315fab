"""The 8B-shaped checkpoint builder (used by the GPU benchmarks), here with small shapes on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def test_shaped_checkpoint_has_the_real_qwen_token_ids(tmp_path: Path) -> None:
    from PIL import Image

    from visionrl.models.loader import load_base_model, load_processor
    from visionrl.models.shaped import SMALL_TEXT, SMALL_VISION, build_shaped_checkpoint
    from visionrl.rollout.hf_engine import end_of_sequence_ids

    out = build_shaped_checkpoint(
        tmp_path / "m", device="cpu", dtype="float32", text=SMALL_TEXT, vision=SMALL_VISION
    )
    proc = load_processor(out)
    tok = proc.tokenizer
    assert len(tok) == 151936
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        151643,
        151644,
        151645,
    ]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many shapes?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=[Image.new("RGB", (448, 448), (10, 20, 30))], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    # 448 x 448 at patch 16, merge 2: 28 x 28 patches -> 14 x 14 = 196 image tokens between vision start/end
    assert ids.count(151655) == 196 and ids.count(151652) == 1 and ids.count(151653) == 1
    assert ids[0] == 151644 and tok.convert_ids_to_tokens(ids[-2:]) == ["<|im_start|>", "assistant"]
    model = load_base_model(out, "float32")
    assert model.config.text_config.vocab_size == 151936
    assert end_of_sequence_ids(model.generation_config.eos_token_id, tok.eos_token_id) == [151645, 151643]
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, len(ids), 151936) and torch.isfinite(logits).all()
