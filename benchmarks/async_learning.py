"""Does a one-step-stale run learn like a synchronous one? The colour task on the CPU, several seeds.

The job of `tests/integration/test_async_rollouts.py::test_the_colour_task_is_learned_with_async_rollouts`
(the pretrained tiny Qwen3-VL, 32 prompts x 8, the vLLM CPU engine, LoRA on the LM, merger and lm_head),
run with `rollout.async_steps` 0 and 1 (and, as `async-engine-old`, 1 with the engine's log-probs as the PPO
ratio's old policy) for each seed (`train.seed`: LoRA init, data order, sampling) and each
learning-rate schedule. Per run: held-out greedy accuracy every `--eval-every` steps (64 records, chance 0.25),
the mean reward of the first and last 5 steps, the last 5 steps' policy entropy, and whether the run collapsed
(last 5 steps: mean reward at most 0.3 and entropy below 0.2, i.e. one answer for every image). Prints a table
and writes benchmarks/results/async_learning.json; benchmarks/NOTES-async.md has the prediction and outcome.

    .venv/bin/python benchmarks/async_learning.py [--seeds 1,2] [--schedules constant] [--variants sync,async]
        [--steps 100] [--out DIR]   (the results file is replaced: name another --out to keep one)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

# what is compared: the synchronous run, the one-step-off run, and the one-step-off run whose PPO ratio is taken
# against the engine's sampling log-probs (the stale policy) instead of the learner's current one
VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"async_steps": 0, "algorithm": {}},
    "async": {"async_steps": 1, "algorithm": {}},
    "async-engine-old": {
        "async_steps": 1,
        "algorithm": {"rollout_correction": "off", "old_logprobs": "engine"},
    },
}
SCHEDULES = {
    "constant": {"lr_schedule": "constant"},
    "cosine": {"lr_schedule": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1},  # the demo's
}


def run(model: Path, data: Path, out: Path, seed: int, schedule: str, variant: str, steps: int, every: int):
    from visionrl.config import config_from_dict
    from visionrl.orchestrate.loop import train

    async_steps, algorithm = VARIANTS[variant]["async_steps"], VARIANTS[variant]["algorithm"]
    cfg = config_from_dict(
        {
            "output_dir": str(out),
            "model": {"path": str(model), "dtype": "float32"},
            "data": {
                "train": str(data / "train.jsonl"),
                "eval": str(data / "eval.jsonl"),
                "max_eval_samples": 64,
                "balance_key": "answer",
            },
            "rewards": [{"name": "exact_match", "kwargs": {"first_word": True}}],
            "lora": {"rank": 16, "alpha": 16, "train_merger": True, "train_lm_head": True},
            "algorithm": {"group_size": 8, **algorithm},
            "rollout": {
                "prompts_per_step": 32,
                "max_new_tokens": 2,
                "max_model_len": 256,
                "async_steps": async_steps,
            },
            "train": {"lr": 3e-3, "torch_threads": 1, "steps": steps, "seed": seed, **SCHEDULES[schedule]},
            "logging": {"eval_every": every, "save_every": 10_000, "images_every": 10_000},
            "ray": {"num_cpus": 2},
        }
    )
    history = train(cfg).history
    mean = lambda rows, key: sum(h[key] for h in rows) / len(rows)  # noqa: E731
    last = history[-5:]
    reward_last, entropy_last = mean(last, "reward/mean"), mean(last, "policy/entropy")
    return {
        "seed": seed,
        "schedule": schedule,
        "variant": variant,
        "async_steps": async_steps,
        "accuracy": [h["eval/accuracy"] for h in history if h.get("eval/accuracy") is not None],
        "reward_first5": mean(history[:5], "reward/mean"),
        "reward_last5": reward_last,
        "entropy_last5": entropy_last,
        "collapsed": reward_last <= 0.3 and entropy_last < 0.2,
        "correction_weight_min": min(h.get("rollout/correction_weight_mean", 1.0) for h in history),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--schedules", default="constant", help=f"comma-separated, of {list(SCHEDULES)}")
    p.add_argument("--variants", default="sync,async", help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    unknown += [s for s in args.schedules.split(",") if s not in SCHEDULES]
    if unknown:
        p.error(f"unknown variant(s) or schedule(s): {unknown}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from visionrl.data.synthetic import make_dataset
    from visionrl.models.tiny import build_tiny_model

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", seed=0, pretrain=True)
        data = Path(tmp) / "color"
        make_dataset(data, "color", num_train=256, num_eval=64, seed=0)
        for schedule in args.schedules.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                for variant in args.variants.split(","):
                    out = Path(tmp) / f"run-{schedule}-{seed}-{variant}"
                    rows.append(run(model, data, out, seed, schedule, variant, args.steps, args.eval_every))
                    print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n{'schedule':<10}{'seed':>5} {'variant':<17} {'accuracy':<34}{'reward':>14}{'entropy':>9}  collapsed"
    )
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["accuracy"])
        reward = f"{r['reward_first5']:.2f}->{r['reward_last5']:.2f}"
        print(
            f"{r['schedule']:<10}{r['seed']:>5} {r['variant']:<17} {acc:<34}{reward:>14}"
            f"{r['entropy_last5']:>9.2f}  {r['collapsed']}"
        )
    path = Path(args.out) / "async_learning.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "async_learning",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "runs": rows,
    }
    path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
