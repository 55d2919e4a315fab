"""One-step-off rollouts (`rollout.async_steps: 1`) through the real loop: Ray actors, the vLLM CPU engine or the
HF engine, the tiny Qwen3-VL. Staleness and adapter versions per step, the consistency guard comparing the same
adapter version, the correction metrics, and a resume that continues exactly like the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from visionrl.checkpoint import latest_checkpoint, load_checkpoint
from visionrl.config import JobConfig, config_from_dict

pytestmark = pytest.mark.slow


def _cfg(model: Path, data_dir: Path, out: Path, **over: dict) -> JobConfig:
    raw = {
        "output_dir": str(out),
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train": str(data_dir / "train.jsonl"), "balance_key": "answer"},
        "rewards": [{"name": "exact_match", "kwargs": {"first_word": True}}],
        "lora": {"rank": 16, "alpha": 16, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 8},
        "rollout": {"prompts_per_step": 8, "max_new_tokens": 2, "max_model_len": 256, "async_steps": 1},
        "train": {"lr": 3e-3, "lr_schedule": "constant", "torch_threads": 1, "steps": 4},
        "logging": {"save_every": 100, "images_every": 100},
        "ray": {"num_cpus": 2},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


def test_async_steps_train_one_version_behind_and_the_guard_compares_the_sampling_version(
    pretrained_tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    from visionrl.orchestrate.loop import train

    result = train(_cfg(pretrained_tiny_model, color_data, tmp_path / "run", rollout={"prompts_per_step": 4}))
    h = result.history
    assert [x["step"] for x in h] == [1, 2, 3, 4]
    # Step 1's batch is sampled before any update (version 0, learner at 0); every later batch is sampled
    # while the learner trains the step before, so with the version before the learner's: staleness 1.
    assert [x["rollout/adapter_version"] for x in h] == [0.0, 0.0, 1.0, 2.0]
    assert [x["rollout/staleness"] for x in h] == [0.0, 1.0, 1.0, 1.0]
    assert load_checkpoint(latest_checkpoint(tmp_path / "run")).extra["adapter_version"] == 4  # 4 updates
    # The guard scores each batch under the version that sampled it: vLLM and the learner agree to ~1e-6 in
    # float32 (docs/ENGINE_NOTES.md), while one update at lr 3e-3 moves the log-probs far more than 1e-3
    # (the off-policy gap, which the correction weights see instead: their mismatch KL is not 0).
    assert all(x["rollout/logprob_diff"] < 1e-3 for x in h), [x["rollout/logprob_diff"] for x in h]
    assert all(0.5 < x["rollout/correction_weight_mean"] <= 2.0 for x in h)
    assert h[0]["rollout/mismatch_kl"] < 1e-6  # step 1 is on-policy
    assert all(x["rollout/mismatch_kl"] > 1e-5 for x in h[1:]), [x["rollout/mismatch_kl"] for x in h]
    assert len({x["reward/mean"] for x in h}) > 1 and all(x["policy/grad_norm"] > 0 for x in h)  # it trains
    # the next batch was collected during the update: its rollout time is reported, and the wait after it
    assert all(x["timing/rollout_s"] > 0 and "timing/rollout_wait_s" in x for x in h)


def _same(a: dict, b: dict) -> bool:
    keys = ["rollout/adapter_version", "rollout/staleness", "reward/mean", "loss/policy", "policy/grad_norm"]
    return all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7) for k in keys)


def test_a_checkpoint_between_async_steps_resumes_exactly(
    pretrained_tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """A checkpoint at step 2 (logging.save_every): the run resumed from it gives steps 3-4 of the uninterrupted
    run, number for number: the data position and the adapter the next batch is sampled with are those of the
    uninterrupted run (orchestrate.pipeline)."""
    from visionrl.orchestrate.loop import train

    over = {"rollout": {"engine": "hf", "prompts_per_step": 4}, "logging": {"save_every": 2}}
    straight = train(
        _cfg(pretrained_tiny_model, color_data, tmp_path / "a", train={"steps": 4}, **over)
    ).history
    # step 2 is checkpointed: it starts no prefetch, so step 3 is sampled fresh (staleness 0), step 4 is stale
    assert [x["rollout/staleness"] for x in straight] == [0.0, 1.0, 0.0, 1.0]
    first = train(_cfg(pretrained_tiny_model, color_data, tmp_path / "b", train={"steps": 2}, **over)).history
    resumed = train(
        _cfg(pretrained_tiny_model, color_data, tmp_path / "b", train={"steps": 4}, **over), resume=True
    )
    assert [x["step"] for x in resumed.history] == [3, 4]
    for a, b in zip(straight, first + resumed.history, strict=True):
        assert _same(a, b), (a, b)
    assert len({x["reward/mean"] for x in straight}) > 1  # the steps differ: the comparison can fail


def test_async_steps_with_the_engines_old_policy_run_no_old_pass_and_no_correction(
    pretrained_tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """The recommended one-step-off setting (benchmarks/NOTES-async.md): the ratio is against the engine's
    sampling log-probs, so the learner runs no old-log-prob pass (2 updates per batch) and no correction
    weights exist; the guard still scores each stale batch under its sampling version."""
    from visionrl.orchestrate.loop import train

    over = {
        "rollout": {"engine": "hf", "prompts_per_step": 4},
        "algorithm": {"updates_per_batch": 2, "rollout_correction": "off", "old_logprobs": "engine"},
        "train": {"steps": 3},
    }
    h = train(_cfg(pretrained_tiny_model, color_data, tmp_path / "run", **over)).history
    assert [x["rollout/staleness"] for x in h] == [0.0, 1.0, 1.0]
    assert all(x["learner/old_logprob_s"] < 0.01 for x in h)  # no pass: only the timer's own cost
    assert not any("rollout/correction_weight_mean" in x for x in h)
    assert all(x["rollout/logprob_diff"] < 1e-3 for x in h), [x["rollout/logprob_diff"] for x in h]
    # stale batches: the ratio against the sampling policy is not 1, so some tokens are clipped or at least
    # the approximate KL to the sampling policy is non-zero
    assert all(x["policy/approx_kl"] != 0.0 for x in h[1:]) and all(x["policy/grad_norm"] > 0 for x in h)


def test_dynamic_sampling_rounds_run_in_the_background_with_one_version(
    pretrained_tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """DAPO's dynamic sampling inside the prefetch: every extra round of a step's batch is sampled in the
    background thread with the same (stale) adapter, so the batch stays one version behind, the guard scores
    all of it under that version, and only groups whose rewards differ are trained on."""
    from visionrl.orchestrate.loop import train

    over = {
        "rollout": {"engine": "hf", "prompts_per_step": 4},
        "algorithm": {"dynamic_sampling": True, "max_sampling_rounds": 3},
        "train": {"steps": 5},
    }
    h = train(_cfg(pretrained_tiny_model, color_data, tmp_path / "run", **over)).history
    assert [x["step"] for x in h] == [1, 2, 3, 4, 5]
    assert all(1.0 <= x["rollout/sampling_rounds"] <= 3.0 for x in h)
    assert any(x["rollout/sampling_rounds"] > 1.0 for x in h), "no step needed a second round: nothing tested"
    assert all(0.0 < x["rollout/groups_kept"] <= 4.0 for x in h)  # the base answers colours: groups differ
    assert [x["rollout/staleness"] for x in h] == [0.0, 1.0, 1.0, 1.0, 1.0]
    # several rounds, one version: the learner's log-probs under it match the engine's (float32: ~1e-6)
    assert all(x["rollout/logprob_diff"] < 1e-3 for x in h), [x["rollout/logprob_diff"] for x in h]


# The same job with rollout.async_steps=0, measured 2026-12-01 (benchmarks/NOTES-async.md): held-out accuracy
# 0.41 / 0.50 / 0.50 / 0.48 / 0.50 at steps 20-100 (chance 0.25), mean reward 0.21 -> 0.52. The async run of that
# day: 0.42 / 0.50 / 0.50 / 0.52 / 0.62, reward 0.21 -> 0.60. Evaluations swing by about 0.1 (64 records).
ACC_SYNC_FINAL = 0.50
ACC_TARGET = ACC_SYNC_FINAL - 0.15  # what the async run must reach: it stops after two evaluations at it


def test_the_colour_task_is_learned_with_async_rollouts(
    pretrained_tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """The demo's task and settings (32 prompts x 8, vLLM engine, LoRA on LM + merger + lm_head) with
    rollout.async_steps=1: from the chance-level base the held-out accuracy rises, to within 0.15 of what the
    synchronous run reaches in 100 steps, at two evaluations in a row (the run stops there, train.target_accuracy;
    measured, it got there by step 40)."""
    from visionrl.orchestrate.loop import train

    cfg = _cfg(
        pretrained_tiny_model,
        color_data,
        tmp_path / "run",
        data={"eval": str(color_data / "eval.jsonl"), "max_eval_samples": 64},
        rollout={"prompts_per_step": 32},
        # the demo's schedule: with a constant lr 3e-3 the stale run collapsed to one colour after 80 steps
        train={
            "steps": 100,
            "lr_schedule": "cosine",
            "warmup_steps": 5,
            "min_lr_ratio": 0.1,
            "target_accuracy": ACC_TARGET,
        },
        logging={"eval_every": 20},
    )
    history = train(cfg).history
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    accuracy = [h["eval/accuracy"] for h in history if h.get("eval/accuracy") is not None]
    assert first < 0.35, f"the base should start near chance (0.25), got {first:.2f}"
    assert last > first + 0.1, f"mean reward did not rise: first 5 steps {first:.2f}, last 5 {last:.2f}"
    assert len(accuracy) >= 2 and min(accuracy[-2:]) >= ACC_TARGET, (
        f"held-out accuracy every 20 steps: {accuracy}"
    )
    assert all(h["rollout/staleness"] == 1.0 for h in history[1:-1])
