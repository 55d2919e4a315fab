"""CPU benchmark of one-step-off rollouts: the loop with `rollout.async_steps` 0 and 1, the rest equal.

The tiny Qwen3-VL on the colour task through the whole stack (embedded Ray, the vLLM CPU engine and the
learner in their own actor processes, reward worker, adapter sync). With async_steps 1 the engine generates
(and the reward worker scores) the next batch while the learner trains; the table shows per step (medians
after the warm-up steps): the wall time, the batch's rollout + reward time, the update time, the time the
loop still waited for the next batch after the update, and the overlap = the share of rollout + reward time
hidden behind the update (1 - wait / (rollout + reward)). Writes benchmarks/results/async_rollouts.json.
benchmarks/NOTES-async.md has the prediction and the outcome.

ray.placement=split needs GPUs (config check), so this runs colocated: on CPUs that still puts the engine and
the learner in separate processes, which is what the overlap needs; they share the machine's cores.

    .venv/bin/python benchmarks/async_rollouts.py [--steps 14] [--prompts 16] [--group 8] [--tokens 16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

WARMUP = 3  # steps left out of the medians: engine warm-up, first LoRA load


def _run(model: Path, data: Path, out: Path, async_steps: int, args: argparse.Namespace) -> dict[str, Any]:
    from visionrl import metrics as tags
    from visionrl.config import config_from_dict
    from visionrl.orchestrate.loop import train

    cfg = config_from_dict(
        {
            "output_dir": str(out),
            "model": {"path": str(model), "dtype": "float32"},
            "data": {"train": str(data / "train.jsonl"), "balance_key": "answer"},
            "rewards": [{"name": "exact_match", "kwargs": {"first_word": True}}],
            "lora": {"rank": 16, "train_merger": True, "train_lm_head": True},
            "algorithm": {"group_size": args.group},
            "rollout": {
                "prompts_per_step": args.prompts,
                "max_new_tokens": args.tokens,
                "max_model_len": 256,
                "async_steps": async_steps,
            },
            "train": {"steps": args.steps, "torch_threads": 1, "lr": 3e-3, "lr_schedule": "constant"},
            "logging": {"save_every": 10_000, "images_every": 10_000},
            "ray": {"num_cpus": 2},
        }
    )
    t0 = time.perf_counter()
    history = train(cfg).history
    total = time.perf_counter() - t0
    steady = history[WARMUP:-1]  # the last step has no next batch to prefetch
    wait = tags.TIMING_ROLLOUT_WAIT

    def med(key: str) -> float:
        return statistics.median(h.get(key, 0.0) for h in steady)

    # Batch s+1 is collected during step s: its rollout + reward time is logged with step s+1, the wait with s.
    collect = [h[tags.TIMING_ROLLOUT] + h.get(tags.TIMING_REWARD, 0.0) for h in history]
    hidden = [1.0 - history[i][wait] / collect[i + 1] for i in range(WARMUP, len(history) - 1) if async_steps]
    return {
        "async_steps": async_steps,
        "wall_per_step_s": med(tags.TIMING_STEP),
        "rollout_reward_s": statistics.median(collect[WARMUP:-1]),
        "update_s": med(tags.TIMING_UPDATE),
        "rollout_wait_s": med(wait),
        "sync_s": med(tags.TIMING_SYNC),
        "overlap": statistics.median(hidden) if hidden else 0.0,
        "staleness": [h.get(tags.STALENESS) for h in history],
        "run_wall_s": total,
        "steps": len(history),
        "steps_measured": len(steady),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    from visionrl.data.synthetic import make_dataset
    from visionrl.models.tiny import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = build_tiny_model(tmp_path / "model", seed=0)
        make_dataset(tmp_path / "data", "color", num_train=256, num_eval=32, seed=0)
        for a in (0, 1):
            rows.append(_run(model, tmp_path / "data", tmp_path / f"run{a}", a, args))
    result = {
        "benchmark": "async_rollouts",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "kind": "CPU-only development machine",
            "platform": platform.platform(),
        },
        "setup": vars(args)
        | {"model": "tiny Qwen3-VL (random weights)", "engine": "vllm (CPU build)", "warmup_steps": WARMUP},
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_rollouts.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n{args.prompts} prompts x {args.group} completions, {args.tokens} tokens, {args.steps} steps each"
    )
    head = ("async_steps", "wall/step s", "rollout+reward s", "update s", "wait s", "sync s", "overlap")
    print(" | ".join(head))
    for r in rows:
        print(
            f"{r['async_steps']:>11} | {r['wall_per_step_s']:>11.3f} | {r['rollout_reward_s']:>16.3f} | "
            f"{r['update_s']:>8.3f} | {r['rollout_wait_s']:>6.3f} | {r['sync_s']:>6.3f} | {r['overlap']:>7.0%}"
        )
    speedup = rows[0]["wall_per_step_s"] / rows[1]["wall_per_step_s"]
    print(f"wall per step, synchronous / async: {speedup:.2f}x")


if __name__ == "__main__":
    main()
