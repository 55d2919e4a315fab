"""A short supervised pre-training that turns the random tiny Qwen3-VL into a plausible *base* model.

Real bases (Qwen3-VL-8B) arrive pre-trained: they read images and answer in the expected format. A random
tiny model does neither, and GRPO from scratch with a pure LoRA adapter stalls (docs/ENGINE_NOTES.md). So the tiny base
is taught, in about half a minute on a CPU, to answer the synthetic `position`, `count` and `sides`
questions from the image, and to answer the `color` question with a colour word drawn at RANDOM,
independent of the image. The base thus knows the answer format of the colour task but not the mapping:
its colour accuracy is chance (0.25), which is what the demo's GRPO run then has to learn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from visionrl.data.synthetic import TASKS, balanced_answers
from visionrl.models.sequences import EncodedPrompt, Sequence, collate

TRUE_LABEL_TASKS = ("position", "count", "sides")
RANDOM_LABEL_TASK = "color"
EASY_VQA = "easy-vqa"
JUDGE_COLOR = "judge-color"
# The tiny judge's question (a `judge` reward template); configs/judges/color_match.txt holds the same text.
COLOR_MATCH_TEMPLATE = (
    "Question: {question}\nProposed answer: {completion}\n"
    "Is the proposed answer the color of the shape in the image? Answer yes or no."
)
# The judge's lesson gets twice a task's examples, and 600 steps: the judge must be right, not only in format
# (measured on 128 held-out questions x 2 proposed answers: agreement with the true labels 1.0 after 600 steps,
# 0.88 after 300; with six times a task's examples the colour lesson drowned, and the judge told red from yellow
# no better than chance: agreement 0.86).
JUDGE_EXAMPLES_PER_TASK = 2
RECIPE_STEPS = {JUDGE_COLOR: 600}
# Which tasks a base learns with true labels and which only in format (random labels), per task a GRPO run
# then has to learn. "color" is the demo's base. For the two-image `same_color` task the base reads colours
# (real bases do) and knows the yes/no format, but not the comparison of two images, which GRPO must learn.
RECIPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "color": (TRUE_LABEL_TASKS, (RANDOM_LABEL_TASK,)),
    "same_color": ((*TRUE_LABEL_TASKS, "color"), ("same_color",)),
    # easy-VQA: the base reads colours on the synthetic images (4 of easy-VQA's 8 colour words), and answers
    # easy-VQA's own questions in format only, with random answers of each question's type (yes/no, a shape, a
    # colour); which colour word fits which easy-VQA image is left to GRPO. Without the synthetic colours the
    # tower has no colour features, and colour questions stay at chance (README, easy-VQA).
    EASY_VQA: ((*TRUE_LABEL_TASKS, "color"), (EASY_VQA,)),
    # A tiny judge (the `judge` reward's model): it reads colours, and answers yes or no to "is this answer the colour
    # of the shape?" asked through COLOR_MATCH_TEMPLATE, with true labels.
    JUDGE_COLOR: ((*TRUE_LABEL_TASKS, "color", JUDGE_COLOR), ()),
}


@dataclass
class PretrainReport:
    steps: int
    final_loss: float
    seconds: float


def _examples(
    rng: random.Random, num_per_task: int, image_size: int, recipe: str
) -> list[tuple[str, list[Image.Image], str]]:
    """(question, images, target answer) triples; the recipe's format-only tasks get random labels."""
    true_tasks, random_tasks = RECIPES[recipe]
    out: list[tuple[str, list[Image.Image], str]] = []
    for name in (*true_tasks, *random_tasks):
        if name == EASY_VQA:
            out.extend(_easy_vqa_examples(rng, 4 * num_per_task))
            continue
        if name == JUDGE_COLOR:
            out.extend(_judge_examples(rng, JUDGE_EXAMPLES_PER_TASK * num_per_task, image_size))
            continue
        task = TASKS[name]
        for answer in balanced_answers(rng, task.answers, num_per_task):
            item = task.render(rng, answer, image_size)
            target = rng.choice(task.answers) if name in random_tasks else item.answer
            out.append((task.question, item.images, target))
    rng.shuffle(out)
    return out


def _judge_examples(
    rng: random.Random, num: int, image_size: int
) -> list[tuple[str, list[Image.Image], str]]:
    """The judge's lesson: a colour picture, the colour question with a proposed answer in COLOR_MATCH_TEMPLATE, and
    "yes" exactly when the answer is the shape's colour and nothing else (half the time). The other half: another
    colour, or what a drifting policy writes (a word or number that is no colour, the colour with a word before or
    after it), so that the judge pays only for the answer exact match would accept."""
    from visionrl.data.synthetic import task_vocabulary
    from visionrl.rewards.judge import render

    task = TASKS["color"]
    junk = [w for w in task_vocabulary() if w not in task.answers]
    out = []
    for answer in balanced_answers(rng, task.answers, num):
        item = task.render(rng, answer, image_size)
        right, kind = rng.random() < 0.5, rng.random()
        if right:
            candidate = item.answer
        elif kind < 0.5:
            candidate = rng.choice([a for a in task.answers if a != item.answer])
        elif kind < 0.7:
            candidate = rng.choice(junk)
        elif kind < 0.85:
            candidate = f"{item.answer} {rng.choice(junk + list(task.answers))}"
        else:
            candidate = f"{rng.choice(junk)} {item.answer}"
        text = render(COLOR_MATCH_TEMPLATE, task.question, None, candidate)
        out.append((text, item.images, "yes" if right else "no"))
    return out


def _easy_vqa_examples(rng: random.Random, num: int) -> list[tuple[str, list[Image.Image], str]]:
    from visionrl.data.easy_vqa import format_examples

    out = []
    for question, path, answer in format_examples(rng, num):
        with Image.open(path) as image:
            out.append((question, [image.convert("RGB")], answer))
    return out


def pretrain_tiny(
    model: torch.nn.Module,
    processor: Any,
    *,
    seed: int = 0,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 2e-3,
    num_per_task: int = 512,
    image_size: int = 64,
    recipe: str = "color",
) -> PretrainReport:
    """Full-parameter supervised training on answer tokens (+ end of turn). Deterministic for a seed.
    `recipe`: which tasks are taught with true labels and which in format only (RECIPES)."""
    import time

    t0 = time.perf_counter()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    data = _examples(rng, num_per_task, image_size, recipe)
    tok = processor.tokenizer
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    encoded: list[EncodedPrompt] = []
    targets: list[list[int]] = []
    for question, images, answer in data:
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], images=images, return_tensors="pt")
        encoded.append(
            EncodedPrompt(
                enc["input_ids"][0], enc["mm_token_type_ids"][0], enc["pixel_values"], enc["image_grid_thw"]
            )
        )
        targets.append([*tok.encode(answer, add_special_tokens=False), end_id])
    model.train()
    model.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps)
    )
    loss_value = float("nan")
    pad = tok.pad_token_id or 0
    for _ in range(steps):
        rows = [rng.randrange(len(data)) for _ in range(batch_size)]
        seqs = [
            Sequence(
                prompt=r, completion_ids=targets[r], advantage=0.0, sampling_logprobs=[0.0] * len(targets[r])
            )
            for r in rows
        ]
        mb = collate(encoded, seqs, list(range(len(seqs))), pad)
        T = mb.completion_ids.shape[1]
        logits = model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            mm_token_type_ids=mb.mm_token_type_ids,
            pixel_values=mb.pixel_values,
            image_grid_thw=mb.image_grid_thw,
            use_cache=False,
        ).logits.float()
        at = (mb.starts.unsqueeze(1) - 1 + torch.arange(T)).clamp(0, logits.shape[1] - 1)  # [B, T]
        logits = logits.gather(1, at.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), mb.completion_ids.reshape(-1), reduction="none"
        ).reshape(mb.completion_ids.shape)
        loss = (nll * mb.completion_mask).sum() / mb.completion_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss)
    model.eval()
    model.requires_grad_(False)
    return PretrainReport(steps=steps, final_loss=loss_value, seconds=time.perf_counter() - t0)
