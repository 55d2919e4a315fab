"""CPU benchmark of one GRPO step through the whole stack (Ray actors, vLLM CPU engine, learner, sync).

Trains the tiny Qwen3-VL for a few steps on the colour task and reports the median time of each phase (and the
run's start-up: actors started, delivery check), so a
change on the hot path can be compared with the previous results file and with the measurements in docs/ENGINE_NOTES.md on this
machine (an in-process vLLM engine: 8 image prompts x n=4, 16 tokens in 0.25-0.4 s; a bare-PyTorch GRPO step of a
250K-parameter model, generation included, about 0.2 s). Prints a table, writes
benchmarks/results/cpu_loop-<engine>-<date>.json.

    .venv/bin/python benchmarks/cpu_loop.py [--steps 20] [--prompts 8] [--group 4] [--tokens 16] [--engine vllm]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
from pathlib import Path

ENGINE_NOTES = {"vllm_8x4x16_generate_s": "0.25-0.4", "bare_grpo_step_s": "about 0.2"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    from visionrl.config import config_from_dict
    from visionrl.data.synthetic import make_dataset
    from visionrl.metrics import (
        THROUGHPUT,
        TIMING_DELIVERY_CHECK,
        TIMING_PHASES,
        TIMING_START_ACTORS,
        TIMING_STARTUP,
    )
    from visionrl.models.tiny import build_tiny_model
    from visionrl.orchestrate.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = build_tiny_model(tmp_path / "model", seed=0)
        make_dataset(tmp_path / "data", "color", num_train=256, num_eval=32, seed=0)
        cfg = config_from_dict(
            {
                "output_dir": str(tmp_path / "run"),
                "model": {"path": str(model), "dtype": "float32"},
                "data": {"train": str(tmp_path / "data" / "train.jsonl")},
                "rewards": [{"name": "exact_match"}],
                "lora": {"rank": 16, "train_merger": True, "train_lm_head": True},
                "algorithm": {"group_size": args.group},
                "rollout": {
                    "engine": args.engine,
                    "prompts_per_step": args.prompts,
                    "max_new_tokens": args.tokens,
                    "max_model_len": 256,
                },
                "train": {"steps": args.steps, "torch_threads": 1},
                "logging": {"save_every": 10_000, "images_every": 10_000},
                "ray": {"num_cpus": 2},
            }
        )
        full = train(cfg).history
        history = full[2:]  # the first steps include warm-up
    startup = {k: full[0].get(k) for k in (TIMING_STARTUP, TIMING_START_ACTORS, TIMING_DELIVERY_CHECK)}
    rows = {k: statistics.median(h[k] for h in history) for k in TIMING_PHASES}
    rows[THROUGHPUT] = statistics.median(h[THROUGHPUT] for h in history)
    result = {
        "benchmark": "cpu_loop",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "kind": "CPU-only development machine"},
        "setup": vars(args) | {"model": "tiny Qwen3-VL (437K params)", "steps_measured": len(history)},
        "median": rows,
        "startup": startup,  # the run's start, with its first step
        "engine_notes": ENGINE_NOTES,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cpu_loop-{args.engine}-{result['date'][:10]}.json").write_text(
        json.dumps(result, indent=2) + "\n"
    )
    print(f"\n{args.prompts} prompts x {args.group} completions, {args.tokens} tokens, engine {args.engine}")
    print(f"{'phase (median over steps)':<30}{'seconds':>10}")
    for k, v in {**rows, **startup}.items():
        print(f"{k:<30}{v:>10.3f}")
    print(
        f"docs/ENGINE_NOTES.md: vLLM 8x4x16 generate {ENGINE_NOTES['vllm_8x4x16_generate_s']} s, "
        f"bare GRPO step {ENGINE_NOTES['bare_grpo_step_s']} s"
    )


if __name__ == "__main__":
    main()
