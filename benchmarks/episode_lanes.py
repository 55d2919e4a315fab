"""CPU benchmark of episode lanes: a step's episodes on two engines, played either together (each turn waits for
both engines, then every environment steps) or in one lane per engine (the environments step one engine's
episodes while the other engine generates), for environments that answer at once or take 0.2 s or 1 s a step.

Expected before measuring: together, a turn costs G + E (G: both engines generating their halves at once, E:
the environments' step, one batch, its calls at once). In lanes each engine alternates its own generation and its
episodes' environment step, and nothing waits for the other engine: on two cores both engines still generate at
once, but a lane whose episodes finish early is not held by the other, and E overlaps the other lane's
generation when the lanes fall out of step. Saving: up to min(E, G) a turn; none with E = 0. HF engines (in-process, one torch thread each).
Prints a table, writes benchmarks/results/episode_lanes-<date>.json.

    .venv/bin/python benchmarks/episode_lanes.py [--records 16] [--group 4] [--turns 3] [--repeats 3]
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


def together(engines: list[Any]) -> Any:
    """One generate over all engines at once that returns when the slowest is done (as `Workers.rollout`)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=len(engines))

    def generate(prompts: list[Any], spec: Any) -> list[Any]:
        chunks = [prompts[i :: len(engines)] for i in range(len(engines))]
        parts = list(
            pool.map(
                lambda ec: ec[0].generate(ec[1], spec) if ec[1] else [], zip(engines, chunks, strict=True)
            )
        )
        out: list[Any] = [None] * len(prompts)
        for i, part in enumerate(parts):
            out[i :: len(engines)] = part
        return out

    return generate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--delays", default="0,0.2,1.0")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import torch

    from visionrl.config import LoraConfig
    from visionrl.config_env import EnvConfig
    from visionrl.data import load_dataset
    from visionrl.data.images import ImageBudget
    from visionrl.data.prompts import build_prompt
    from visionrl.data.synthetic import make_dataset
    from visionrl.envs.episodes import EpisodeRunner
    from visionrl.envs.pool import LocalEnvs
    from visionrl.models.loader import load_processor
    from visionrl.models.tiny import build_tiny_model
    from visionrl.rollout.hf_engine import HFEngine
    from visionrl.types import SamplingSpec

    torch.set_num_threads(1)  # one core per engine
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", seed=0, pretrain=True)  # answers, and stops
        make_dataset(Path(tmp) / "data", "color", num_train=args.records, num_eval=0, seed=0)
        processor = load_processor(model, ImageBudget())
        prompts = [
            build_prompt(s, processor, keep_source=True)
            for s in load_dataset(Path(tmp) / "data" / "train.jsonl")
        ]
        engines = [HFEngine(str(model), lora=LoraConfig(), forbidden_token_ids=[], seed=i) for i in range(2)]
        spec = SamplingSpec(n=args.group, temperature=1.0, max_tokens=3, seed=0)
        for delay in (float(d) for d in args.delays.split(",")):
            env = EnvConfig(name=f"{__name__}:SlowRetry", kwargs={"delay": delay}, max_turns=args.turns)
            runner = EpisodeRunner(env, processor, LocalEnvs(env), max_model_len=1024)
            for mode, rollout in (("together", together(engines)), ("lanes", [e.generate for e in engines])):
                runner.run(prompts[:2], rollout, spec)  # warm-up
                times, turns = [], []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    batch = runner.run(prompts, rollout, spec)
                    times.append(time.perf_counter() - t0)
                    turns.append(batch.metrics["episode/turns_mean"])
                rows.append({"env_delay_s": delay, "mode": mode, "step_s": statistics.median(times),
                             "turns_mean": statistics.mean(turns), "env_s": batch.metrics["timing/env_s"]})  # fmt: skip
    result = {
        "benchmark": "episode_lanes",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "kind": "CPU-only development machine"},
        "setup": vars(args)
        | {"model": "tiny Qwen3-VL, pre-trained", "engines": "2 HF engines, in-process, 1 thread"},
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"episode_lanes-{result['date'][:10]}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{args.records} records x {args.group} episodes, at most {args.turns} turns, 2 HF engines")
    print(f"{'env step':>9} {'mode':>9} {'episodes s':>11} {'turns':>6} {'env s':>6}")
    for r in rows:
        print(
            f"{r['env_delay_s']:>9.1f} {r['mode']:>9} {r['step_s']:>11.2f} {r['turns_mean']:>6.2f} {r['env_s']:>6.2f}"
        )


if __name__ == "__main__":
    main()
