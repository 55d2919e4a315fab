"""What a step writes besides its checkpoint (the rollouts chosen for the TensorBoard pictures), and the merging
of reward results over reward workers and sampling rounds."""

from __future__ import annotations

from PIL import Image

from visionrl.orchestrate.step_log import rollout_samples
from visionrl.rewards import RewardResult
from visionrl.rewards.merge import merge_results
from visionrl.types import Completion, PromptItem


def _group(prompt: int, texts: list[str]) -> list[Completion]:
    return [Completion(prompt, [1], t, [-0.1], "stop") for t in texts]


def test_rollout_samples_show_the_first_completion_of_the_first_groups_with_an_image() -> None:
    image = Image.new("RGB", (4, 4), "red")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    prompts = [
        PromptItem(text="t0", images=[image], answer="red", record={"prompt": "Name the colour."}),
        PromptItem(text="t1", images=[], answer="blue"),  # text only: no picture
        PromptItem(text="t2", images=[image], answer=[1, 2], record={"messages": messages}),
        PromptItem(text="t3", images=[image], answer="green"),  # beyond n
    ]
    groups = [_group(i, [f"a{i}", f"b{i}"]) for i in range(4)]
    totals = [1.0, 0.0, 0.5, 0.5, 0.25, 0.75, 0.0, 0.0]
    samples = rollout_samples(prompts, groups, totals, n=3)
    assert [(s.question, s.completion, s.answer, s.reward) for s in samples] == [
        ("Name the colour.", "a0", "red", 1.0),
        ("What colour?", "a2", "[1, 2]", 0.25),  # a non-string answer as JSON; the group's first reward
    ]
    assert samples[0].image is image


def test_the_question_of_a_picture_comes_from_the_layouts_prompt_key() -> None:
    """Geometry3K / EasyR1 records hold the question in `problem` (data.prompt_key); it was left empty."""
    image = Image.new("RGB", (4, 4), "red")
    record = {"problem": "<image>Find the angle x.", "answer": "30"}
    prompts = [PromptItem(text="t0", images=[image], answer="30", record=record)]
    (sample,) = rollout_samples(prompts, [_group(0, ["x = 30"])], [1.0], n=1, prompt_key="problem")
    assert sample.question == "Find the angle x."  # the image marker is not part of the question
    (default,) = rollout_samples(prompts, [_group(0, ["x = 30"])], [1.0], n=1)
    assert default.question == ""  # without the key the record has no `prompt` and no `messages`


def test_merged_reward_results_concatenate_scores_and_sum_counts_in_order() -> None:
    first = RewardResult([1.0, 0.0], {"em": [1.0, 0.0]}, {"em": 1}, {"em": 0}, {"em": "bad"})
    second = RewardResult([0.5], {"em": [0.5]}, {"em": 2}, {"em": 1}, {"em": "worse"})
    merged = merge_results([first, second])
    assert (merged.total, merged.per_reward, merged.num_errors, merged.num_timeouts) == (
        [1.0, 0.0, 0.5],
        {"em": [1.0, 0.0, 0.5]},
        {"em": 3},
        {"em": 1},
    )
    assert merged.error_examples == {"em": "bad"}  # the earliest part's message
    assert merge_results([second]) is second
