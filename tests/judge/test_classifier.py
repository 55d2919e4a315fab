"""The classifier judge (a reward model with a score head, in transformers) on the tiny Qwen3-VL whose head is the
lm_head row of 'yes' minus that of 'no': its sigmoid must equal the generative judge's share of yes among yes and
no, computed here from the model's own next-token logits; what it reads (template or conversation) and its
refusals."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from visionrl.errors import InputError
from visionrl.rewards.judge import JudgeRequest, JudgeSpec

TEMPLATE = "Question: {question}\nProposed answer: {completion}\nIs it right? Answer yes or no."


def _spec(model: Path, tmp_path: Path, **kw: object) -> JudgeSpec:
    template = tmp_path / "t.txt"
    template.write_text(TEMPLATE)
    base = {"backend": "classifier", "model": str(model), "template": str(template), "score": "scalar"}
    return JudgeSpec.from_kwargs({**base, **kw})


def _requests() -> list[JudgeRequest]:
    red, blue = Image.new("RGB", (64, 64), (220, 30, 30)), Image.new("RGB", (64, 64), (30, 30, 220))
    out = []
    for image in (red, blue):
        for answer in ("red", "blue", "a green circle"):
            text = TEMPLATE.format(question="What color is the shape?", completion=answer)
            out.append(JudgeRequest(text, (image,), "What color is the shape?", answer))
    return out


def test_the_score_head_of_yes_minus_no_is_the_judges_yes_share(
    tiny_reward_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForImageTextToText

    from visionrl.data.prompts import user_prompt
    from visionrl.judge.classifier import ClassifierJudge

    judge = ClassifierJudge(_spec(tiny_reward_model, tmp_path, batch_size=4), device="cpu")
    requests = _requests()
    scores = judge.judge(requests)  # two batches: 4 + 2

    lm = AutoModelForImageTextToText.from_pretrained(str(tiny_reward_model), dtype=torch.float32).eval()
    tok = judge.processor.tokenizer
    yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    expected = []
    for r in requests:  # one at a time: no padding at all
        p = user_prompt(judge.processor, r.text, r.images)
        enc = judge.processor(text=[p.text], images=p.images, return_tensors="pt")
        with torch.no_grad():
            logits = lm(**enc).logits[0, -1, [yes, no]]
        expected.append(float(torch.softmax(logits, -1)[0]))
    assert scores == pytest.approx(expected, abs=1e-5)
    assert max(scores) - min(scores) > 1e-4  # the scores depend on the image and the answer

    # squash: none is the head's raw value, the logit of that share
    raw = ClassifierJudge(_spec(tiny_reward_model, tmp_path, squash="none"), device="cpu").judge(requests)
    assert raw == pytest.approx([math.log(p / (1 - p)) for p in expected], abs=1e-4)


def test_the_conversation_input_scores_the_answer_as_the_assistants_turn(
    tiny_reward_model: Path, tmp_path: Path
) -> None:
    from visionrl.data.prompts import conversation_prompt
    from visionrl.judge.classifier import ClassifierJudge

    spec = _spec(tiny_reward_model, tmp_path, input="conversation", template="")
    judge = ClassifierJudge(spec, device="cpu")
    requests = _requests()
    scores = judge.judge(requests)
    assert all(0.0 < s < 1.0 for s in scores) and len(set(scores)) == len(scores)
    # what it read: the question as the user's turn and the answer as the assistant's, closed
    text = conversation_prompt(judge.processor, "What color?", "red", [requests[0].images[0]]).text
    assert text.rstrip().endswith("red<|im_end|>") and "<|im_start|>assistant" in text
    assert "Proposed answer" not in text
    one = judge.judge([JudgeRequest("ignored", requests[0].images, "What color is the shape?", "red")])
    assert one == pytest.approx(scores[:1], abs=1e-5)  # the rendered text is not what it reads


def test_a_model_without_a_score_head_is_refused_with_what_to_do(
    tiny_model: Path, tiny_reward_model: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from visionrl.judge.classifier import ClassifierJudge

    with pytest.raises(InputError, match=r"no score head.*backend vllm"):
        ClassifierJudge(_spec(tiny_model, tmp_path), device="cpu")
    wide = tmp_path / "two-labels"
    shutil.copytree(tiny_reward_model, wide)
    weights = load_file(str(wide / "model.safetensors"))
    weights["score.weight"] = torch.cat([weights["score.weight"]] * 2)
    save_file(weights, str(wide / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"shape \[2, .*num_labels 1"):
        ClassifierJudge(_spec(wide, tmp_path), device="cpu")


def test_a_prompt_the_processor_refuses_scores_none_and_the_rest_are_scored(
    tiny_reward_model: Path, tmp_path: Path
) -> None:
    from visionrl.judge.classifier import ClassifierJudge

    judge = ClassifierJudge(_spec(tiny_reward_model, tmp_path), device="cpu")
    good = _requests()[:2]
    thin = Image.new("RGB", (4000, 4), (0, 0, 0))  # aspect ratio over 200: the processor refuses it
    bad = JudgeRequest(good[0].text, (thin,), "q", "red")
    got = judge.judge([good[0], bad, good[1]])
    assert got[1] is None and got[0] == pytest.approx(judge.judge(good[:1])[0], abs=1e-5)
    assert got[2] is not None
