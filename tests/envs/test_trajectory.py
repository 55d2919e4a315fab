"""Token-exact episodes on the tiny Qwen3-VL: the observation glue is exactly what the chat template renders, an
episode's tokens equal the whole conversation rendered in one piece (and the replay check fails on drift), the
learner scores an episode's turns exactly as it scores the same conversation rendered as one prompt (observation
images expanded, placed and positioned as the processor does), and the HF engine reads token prompts as it reads
text ones."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from visionrl.config import config_from_dict
from visionrl.data.images import fit_to_processor
from visionrl.envs import Observation
from visionrl.envs.trajectory import ChatGlue, Episode, message, replay_mismatch
from visionrl.models.loader import load_processor
from visionrl.models.sequences import Sequence
from visionrl.models.token_prompts import encode_images, expand_episode, expand_placeholders
from visionrl.types import Completion, PromptItem


@pytest.fixture(scope="module")
def processor(tiny_model: Path):
    return load_processor(tiny_model)


def _ids(processor, words: list[str]) -> list[int]:
    vocab = processor.tokenizer.get_vocab()
    return [vocab[w] for w in words]


def _pictures(processor) -> tuple[Image.Image, Image.Image]:
    red = fit_to_processor(Image.new("RGB", (64, 64), (220, 20, 20)), processor)
    green = fit_to_processor(Image.new("RGB", (96, 64), (20, 200, 20)), processor)
    return red, green


def _episode(processor, glue: ChatGlue) -> Episode:
    """what colour? -> "blue" -> (the green picture) "look again" -> "green"."""
    red, green = _pictures(processor)
    messages = [message("user", "what color ?", 1)]
    prompt = PromptItem(glue.render(messages, True), [red], token_ids=glue.ids(messages, True))
    episode = Episode("k", 0, 0, prompt, messages, prompt_pad=glue.image_pad)
    turn = _ids(processor, ["blue", "<|im_end|>"])
    episode.add_turn(Completion(0, turn, "blue", [-0.5, -0.1], "stop"), "blue")
    obs = Observation("look again", [green])
    episode.add_observation(obs, glue.observation_ids(obs), sum(encode_images(processor, [green]).tokens))
    episode.add_turn(
        Completion(0, _ids(processor, ["green", "<|im_end|>"]), "green", [-0.2, -0.3], "stop"), "green"
    )
    return episode


def test_an_episode_holds_exactly_the_tokens_of_its_conversation_rendered_whole(processor) -> None:
    glue = ChatGlue(processor)
    episode = _episode(processor, glue)
    whole = glue.ids(episode.messages, generation=False)
    held = [*episode.prompt.token_ids, *episode.ids]
    assert whole[: len(held)] == held  # the template adds only its newline after the last turn
    assert not replay_mismatch(glue, episode)
    # the environment's tokens: the glue, the observation (one placeholder for its image), the assistant's opening
    env = [t for t, e in zip(episode.ids, episode.env_mask, strict=True) if e]
    assert env == glue.observation_ids(Observation("look again", [Image.new("RGB", (8, 8))]))
    assert env.count(glue.image_pad) == 1 and env[0] != glue.turn_end
    assert [math.isnan(x) for x in episode.logprobs] == episode.env_mask
    assert episode.engine_prompt().token_ids == held and len(episode.engine_prompt().images) == 2
    # drift: a turn whose tokens are not what its text renders to is caught
    drifted = _episode(processor, glue)
    drifted.messages[1] = message("assistant", "red")
    assert replay_mismatch(glue, drifted)


def test_placeholders_expand_to_each_images_tokens_as_the_processor_does(processor) -> None:
    red, green = _pictures(processor)
    text = processor.apply_chat_template(
        [message("user", "what color ?", 2)], add_generation_prompt=True, tokenize=False
    )
    by_processor = processor(text=[text], images=[red, green], return_tensors="pt")
    encoded = encode_images(processor, [red, green])
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    pad = ChatGlue(processor).image_pad
    expanded, used = expand_placeholders(ids, encoded.tokens, pad)
    assert expanded == by_processor["input_ids"][0].tolist() and used == 2
    assert encoded.tokens == [4, 6]  # 64x64 and 96x64 pictures in 32-pixel merged patches: 2 x 2 and 3 x 2
    torch.testing.assert_close(encoded.pixel_values, by_processor["pixel_values"])
    with pytest.raises(ValueError, match="3 image placeholders in the tokens but only 2 images"):
        expand_placeholders([*ids, pad], encoded.tokens, pad)


def test_expanding_an_episode_stretches_its_masks_and_maps_positions_back() -> None:
    pad = 9
    seq = Sequence(0, [1, 2, 3, pad, 4, 5], 1.0, [-0.1, -0.2, float("nan"), float("nan"), float("nan"), -0.3],
                   env_mask=[False, False, True, True, True, False])  # fmt: skip
    out, where = expand_episode(seq, [3], pad)
    assert out.completion_ids == [1, 2, 3, pad, pad, pad, 4, 5]
    assert out.env_mask == [False, False, True, True, True, True, True, False]
    assert out.completion_mm == [0, 0, 0, 1, 1, 1, 0, 0]
    assert where == [0, 1, 2, 3, 6, 7]
    assert out.scored().tolist() == [True, True, False, False, False, False, False, True]
    with pytest.raises(ValueError, match="1 observation placeholders for 2 images"):
        expand_episode(seq, [3, 4], pad)
    # a placeholder the model sampled would not be an observation: it stays one token (and is refused elsewhere)
    sampled = Sequence(0, [pad, 1], 1.0, [-0.1, -0.2], env_mask=[False, False])
    assert expand_episode(sampled, [], pad)[0].completion_ids == [pad, 1]


def test_the_learner_scores_an_episode_as_the_whole_conversation(
    tiny_model: Path, color_data: Path, processor
) -> None:
    from visionrl.train.learner import Learner, TrainBatch

    cfg = config_from_dict(
        {
            "output_dir": "unused",
            "model": {"path": str(tiny_model), "dtype": "float32"},
            "data": {"train": str(color_data / "train.jsonl")},
            "rewards": [{"name": "exact_match"}],
            "lora": {"rank": 8},
            "algorithm": {"group_size": 2},
            "rollout": {"prompts_per_step": 1, "max_new_tokens": 4},
        }
    )
    learner = Learner(cfg, device="cpu")
    glue = ChatGlue(processor)
    episode = _episode(processor, glue)
    seq = Sequence(0, episode.ids, 0.0, episode.logprobs, env_mask=episode.env_mask)
    got = learner.logprobs(TrainBatch([episode.train_prompt()], [seq]))[0]
    assert len(got) == len(episode.ids)  # per token as sent: the observation's placeholder is one entry
    # the same conversation as plain text prompts: the first turn after the first prompt, the second after all
    red, green = _pictures(processor)
    first = PromptItem(glue.render(episode.messages[:1], True), [red])
    second = PromptItem(glue.render(episode.messages[:3], True), [red, green])
    ref = learner.logprobs(
        TrainBatch(
            [first, second],
            [Sequence(0, episode.ids[:2], 0.0, [0.0, 0.0]), Sequence(1, episode.ids[-2:], 0.0, [0.0, 0.0])],
        )
    )
    torch.testing.assert_close(torch.tensor(got[:2]), torch.tensor(ref[0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(got[-2:]), torch.tensor(ref[1]), atol=1e-5, rtol=0)
    assert all(x == 0.0 for x, env in zip(got, episode.env_mask, strict=True) if env)  # not scored


def test_the_hf_engine_reads_a_token_prompt_as_the_text_prompt(tiny_model: Path, processor) -> None:
    from visionrl.config import LoraConfig
    from visionrl.rollout.hf_engine import HFEngine
    from visionrl.types import SamplingSpec

    engine = HFEngine(str(tiny_model), lora=LoraConfig(rank=8), forbidden_token_ids=[], seed=0)
    glue = ChatGlue(processor)
    episode = _episode(processor, glue)
    red, green = _pictures(processor)
    as_tokens = episode.engine_prompt()
    as_text = PromptItem(glue.render(episode.messages[:3], True), [red, green])
    assert glue.ids(episode.messages[:3], True) == as_tokens.token_ids[:-2]  # up to the last turn
    as_tokens.token_ids = as_tokens.token_ids[:-2]
    spec = SamplingSpec(n=1, greedy=True, max_tokens=3)
    by_tokens, by_text = engine.generate([as_tokens, as_text], spec)
    assert by_tokens[0].token_ids == by_text[0].token_ids
    torch.testing.assert_close(
        torch.tensor(by_tokens[0].logprobs), torch.tensor(by_text[0].logprobs), atol=1e-5, rtol=0
    )


def test_a_packed_episode_keeps_its_environment_tokens_out(
    tiny_model: Path, color_data: Path, processor
) -> None:
    """`train.packing`: an episode (observation images in its completion, NaN log-probs on the environment's
    tokens) packed in one row with a plain sequence scores as in padded rows (1e-5), its environment tokens 0."""
    from visionrl.train.encoding import episodes_expanded
    from visionrl.train.learner import Learner, TrainBatch

    raw = {
        "output_dir": "unused",
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "data": {"train": str(color_data / "train.jsonl")},
        "rewards": [{"name": "exact_match"}],
        "lora": {"rank": 8},
        "algorithm": {"group_size": 2},
        "rollout": {"prompts_per_step": 1, "max_new_tokens": 4},
    }
    learner = Learner(config_from_dict(raw), device="cpu")
    glue = ChatGlue(processor)
    episode = _episode(processor, glue)
    red, _ = _pictures(processor)
    plain = PromptItem(glue.render(episode.messages[:1], True), [red])
    batch = TrainBatch(
        [episode.train_prompt(), plain],
        [
            Sequence(0, episode.ids, 0.0, episode.logprobs, env_mask=episode.env_mask),
            Sequence(1, episode.ids[:2], 0.0, [0.0, 0.0]),
        ],
    )
    padded = learner.logprobs(batch)
    learner.cfg.train.packing = True
    encoded = learner.encode_prompts(batch.prompts)
    seqs, _ = episodes_expanded(learner.processor, encoded, batch.sequences)  # observations expanded
    mbs = learner._micro_batches(encoded, seqs, range(2))
    assert len(mbs) == 1 and mbs[0].segments is not None and len(mbs[0].image_grid_thw) == 3  # 2 + 1 pictures
    packed = learner.logprobs(batch)
    assert [len(x) for x in packed] == [len(episode.ids), 2]
    for p, q in zip(packed, padded, strict=True):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), atol=1e-5, rtol=0)
    assert all(x == 0.0 for x, env in zip(packed[0], episode.env_mask, strict=True) if env)
    assert all(x < 0.0 for x, env in zip(packed[0], episode.env_mask, strict=True) if not env)
