"""CPU benchmark of the episode pipelines: a step's episodes on one in-process vLLM engine (the CPU build, the
pre-trained tiny model), turn by turn (every live episode generates its turn, then every environment steps) or
continuous (an episode's next turn joins the engine's running batch as soon as its environment answers), for
environments whose every step takes d seconds (lockstep) or a delay drawn from [0, 2d] (staggered).

Prediction and outcome: benchmarks/NOTES-zoom.md ("Continuous episodes"). Prints a table, writes
benchmarks/results/episode_pipeline-<date>.json.

    PYTHONPATH=src .venv/bin/python benchmarks/episode_pipeline.py [--records 16] [--group 4] [--turns 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from visionrl.envs import Env, Observation, StepResult


class SlowRetry(Env):
    """Name the picture's colour; a wrong answer gets the picture again. A step takes `delay` seconds, or with
    `staggered` a delay drawn from [0, 2 * delay]."""

    def __init__(self, delay: float = 0.0, staggered: bool = False) -> None:
        self.delay, self.staggered = delay, staggered

    def reset(self, record: dict[str, Any]) -> Observation:
        self.answer, self.picture = str(record["answer"]), record["images"][0]
        return Observation(record["prompt"], [self.picture])

    def step(self, action: str) -> StepResult:
        time.sleep(self.delay * (random.uniform(0.0, 2.0) if self.staggered else 1.0))
        if action.strip().split()[:1] == [self.answer]:
            return StepResult(None, reward=1.0, done=True)
        return StepResult(Observation("look again", [self.picture]))


def _time(runner: Any, prompts: list[Any], lane: Any, spec: Any, repeats: int) -> dict[str, float]:
    runner.run(prompts[:4], lane, spec)  # warm-up
    times, turns, env_s = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        batch = runner.run(prompts, lane, spec)
        times.append(time.perf_counter() - t0)
        turns.append(batch.metrics["episode/turns_mean"])
        env_s.append(batch.metrics["timing/env_s"])
    return {"step_s": statistics.median(times), "turns_mean": statistics.mean(turns),
            "env_s": statistics.median(env_s)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--delays", default="0,0.2,1.0")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument(
        "--model", default=None, help="the pre-trained tiny model's folder: built there if missing"
    )
    args = p.parse_args()

    from visionrl.config_env import EnvConfig
    from visionrl.data import load_dataset
    from visionrl.data.images import ImageBudget
    from visionrl.data.prompts import build_prompt
    from visionrl.data.synthetic import make_dataset
    from visionrl.envs.episodes import EpisodeRunner
    from visionrl.envs.pool import LocalEnvs
    from visionrl.models.loader import load_processor
    from visionrl.models.tiny import build_tiny_model
    from visionrl.rollout.vllm_engine import VLLMEngine
    from visionrl.types import SamplingSpec

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model or Path(tmp) / "model")
        if not (model / "config.json").exists():
            build_tiny_model(model, seed=0, pretrain=True)  # answers, and stops
        make_dataset(Path(tmp) / "data", "color", num_train=args.records, num_eval=0, seed=0)
        processor = load_processor(model, ImageBudget())
        prompts = [
            build_prompt(s, processor, keep_source=True)
            for s in load_dataset(Path(tmp) / "data" / "train.jsonl")
        ]
        engine = VLLMEngine(str(model), lora_rank=0, tower_lora=False, forbidden_token_ids=[], dtype="float32",
                            max_model_len=1024, enforce_eager=True)  # fmt: skip
        spec = SamplingSpec(n=args.group, temperature=1.0, max_tokens=3, seed=0)
        for delay in (float(d) for d in args.delays.split(",")):
            for kind in ("lockstep", "staggered") if delay else ("lockstep",):
                kwargs = {"delay": delay, "staggered": kind == "staggered"}
                env = EnvConfig(name=f"{__name__}:SlowRetry", kwargs=kwargs, max_turns=args.turns)
                runner = EpisodeRunner(env, processor, LocalEnvs(env), max_model_len=1024)
                for mode, lane in (("turns", engine.generate), ("continuous", engine)):
                    row = {"env_delay_s": delay, "env": kind, "mode": mode}
                    rows.append(row | _time(runner, prompts, lane, spec, args.repeats))
                    print(rows[-1], flush=True)
        assert not engine.in_flight()
        engine.close()
    _report(args, rows)


def _report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    result = {
        "benchmark": "episode_pipeline",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "kind": "CPU-only development machine, shared with other work",
        },  # fmt: skip
        "setup": vars(args)
        | {"model": "tiny Qwen3-VL, pre-trained", "engine": "vLLM 0.32 CPU build, in-process"},
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"episode_pipeline-{result['date'][:10]}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n{args.records} records x {args.group} episodes, at most {args.turns} turns, one vLLM engine (CPU)"
    )
    print(f"{'env step':>9} {'env':>10} {'mode':>11} {'episodes s':>11} {'turns':>6} {'env s':>6}")
    for r in rows:
        print(
            f"{r['env_delay_s']:>9.1f} {r['env']:>10} {r['mode']:>11} {r['step_s']:>11.2f} {r['turns_mean']:>6.2f}"
            f" {r['env_s']:>6.2f}"
        )


if __name__ == "__main__":
    main()
