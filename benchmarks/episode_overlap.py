"""CPU benchmark of `env.overlap`: a step's episodes played all together (the engine generates every episode's
turn, then every environment steps) or in two halves (the engine generates one half's turn while the environments
step the other's), for environments that answer at once and ones that take 0.2 s or 1 s a step.

Expected before measuring: with no environment time, the halves cost a little (two engine batches of half the
size a turn instead of one); with an environment time E a turn, the all-together step pays turns x (G + E) while
the halves pay about turns x max(G, E) plus one E, where G is a turn's generation: the saving is about E a turn
up to the generation time. Prints a table, writes benchmarks/results/episode_overlap-<date>.json.

    .venv/bin/python benchmarks/episode_overlap.py [--records 32] [--group 4] [--turns 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from visionrl.envs import Env, Observation, StepResult


class SlowRetry(Env):
    """Name the picture's colour; a wrong answer gets the picture again. Each step takes `delay` seconds."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def reset(self, record: dict[str, Any]) -> Observation:
        self.answer, self.picture = str(record["answer"]), record["images"][0]
        return Observation(record["prompt"], [self.picture])

    def step(self, action: str) -> StepResult:
        time.sleep(self.delay)
        if action.strip().split()[:1] == [self.answer]:
            return StepResult(None, reward=1.0, done=True)
        return StepResult(Observation("look again", [self.picture]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=32)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--delays", default="0,0.2,1.0")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    from visionrl.config import LoraConfig
    from visionrl.config_env import EnvConfig
    from visionrl.config_rollout import RolloutConfig
    from visionrl.data import load_dataset
    from visionrl.data.images import ImageBudget
    from visionrl.data.prompts import build_prompt
    from visionrl.data.synthetic import make_dataset
    from visionrl.envs.episodes import EpisodeRunner
    from visionrl.envs.pool import LocalEnvs
    from visionrl.models.loader import load_processor
    from visionrl.models.tiny import build_tiny_model
    from visionrl.rollout.factory import make_engine
    from visionrl.types import SamplingSpec

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", seed=0, pretrain=True)  # answers, and stops
        make_dataset(Path(tmp) / "data", "color", num_train=args.records, num_eval=0, seed=0)
        budget = ImageBudget()
        processor = load_processor(model, budget)
        samples = load_dataset(Path(tmp) / "data" / "train.jsonl")
        prompts = [build_prompt(s, processor, keep_source=True) for s in samples]
        engine = make_engine(
            str(model), lora=LoraConfig(), rollout=RolloutConfig(), forbidden_token_ids=[], dtype="float32",
            seed=0, budget=budget,
        )  # fmt: skip
        spec = SamplingSpec(n=args.group, temperature=1.0, max_tokens=3, seed=0)
        try:
            for delay in (float(d) for d in args.delays.split(",")):
                for overlap in (False, True):
                    env = EnvConfig(
                        name=f"{__name__}:SlowRetry", kwargs={"delay": delay},  # this module, however run
                        max_turns=args.turns, overlap=overlap,
                    )  # fmt: skip
                    runner = EpisodeRunner(env, processor, LocalEnvs(env), max_model_len=1024)
                    runner.run(prompts[:4], engine.generate, spec)  # warm-up
                    times, turns = [], []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        batch = runner.run(prompts, engine.generate, spec)
                        times.append(time.perf_counter() - t0)
                        turns.append(batch.metrics["episode/turns_mean"])
                    rows.append({"env_delay_s": delay, "overlap": overlap, "step_s": statistics.median(times),
                                 "turns_mean": statistics.mean(turns), "env_s": batch.metrics["timing/env_s"]})  # fmt: skip
        finally:
            engine.close()
    result = {
        "benchmark": "episode_overlap",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "kind": "CPU-only development machine"},
        "setup": vars(args)
        | {"model": "tiny Qwen3-VL, pre-trained", "engine": "vLLM (CPU build), in-process"},
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"episode_overlap-{result['date'][:10]}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n{args.records} records x {args.group} episodes, at most {args.turns} turns, vLLM CPU in-process"
    )
    print(f"{'env step':>9} {'overlap':>8} {'episodes s':>11} {'turns':>6} {'env s':>6}")
    for r in rows:
        print(
            f"{r['env_delay_s']:>9.1f} {r['overlap']!s:>8} {r['step_s']:>11.2f} {r['turns_mean']:>6.2f} {r['env_s']:>6.2f}"
        )


if __name__ == "__main__":
    main()
