"""Does `make demo` learn on every seed? The demo recipe (configs/demo.yaml) over N seeds, one after another.

The base model and data are built once, as `make demo` builds them (`--data-seed`, default 0); each run then
changes `train.seed`, which seeds the LoRA init, the data order and the engine's sampler (one seed per step,
derived from it). Per seed: held-out accuracy of the final adapter and of the adapter with the images permuted
(128 records, chance 0.25), the first step whose evaluation reached the target, training minutes, and the step at
which the policy's entropy first fell below 0.05 nats per token (null when it never did). Prints a table and
writes benchmarks/results/demo_seeds.json (replaced; `--out` names another file), with the machine and date.

    .venv/bin/python benchmarks/demo_seeds.py [--seeds 0,1,2,3,4] [--dir runs/demo-seeds] [override ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENTROPY_COLLAPSE = 0.05  # nats per token: below it the 8 samples of a group nearly always agree


def first_step(history: list[dict[str, Any]], key: str, test: Any) -> int | None:
    """The first step whose metric `key` passes `test` (steps without it are skipped), or None."""
    return next((h["step"] for h in history if h.get(key) is not None and test(h[key])), None)


def run_seed(seed: int, args: argparse.Namespace, base: Path, data: Path) -> dict[str, Any]:
    from visionrl.demo import demo_config, evaluate_trained
    from visionrl.orchestrate.loop import train

    out = Path(args.dir) / f"seed{seed}"
    shutil.rmtree(
        out, ignore_errors=True
    )  # every seed starts fresh (a run refuses another run's checkpoints)
    cfg = demo_config(args.config, out, base, data, [f"train.seed={seed}", *args.overrides])
    target = cfg.train.target_accuracy or 0.9
    t0 = time.perf_counter()
    result = train(cfg)
    minutes = (time.perf_counter() - t0) / 60
    reports = evaluate_trained(cfg, base, data, result.adapter_dir, out / "eval", with_base=False)
    h = result.history
    return {
        "seed": seed,
        "final_accuracy": reports["final"]["accuracy"],
        "ablated_accuracy": reports["final, images permuted"]["accuracy"],
        "steps_to_target": first_step(h, "eval/accuracy", lambda a: a >= target),
        "steps": result.steps,
        "training_minutes": round(minutes, 2),
        "entropy_collapse_step": first_step(h, "policy/entropy", lambda e: e < ENTROPY_COLLAPSE),
        "eval_accuracy": [h_["eval/accuracy"] for h_ in h if h_.get("eval/accuracy") is not None],
        "entropy_last": h[-1].get("policy/entropy") if h else None,
    }


def summary(rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    acc = [r["final_accuracy"] for r in rows]
    minutes = [r["training_minutes"] for r in rows]
    return {
        "seeds_at_target": sum(a >= target for a in acc),
        "num_seeds": len(rows),
        "final_accuracy": {"min": min(acc), "median": statistics.median(acc), "max": max(acc)},
        "training_minutes": {"min": min(minutes), "median": statistics.median(minutes), "max": max(minutes)},
    }


def print_table(rows: list[dict[str, Any]], s: dict[str, Any], target: float) -> None:
    print(
        f"\n{'seed':>5}{'final':>8}{'permuted':>10}{'steps to ' + str(target):>15}{'steps':>7}"
        f"{'minutes':>9}{'entropy<0.05 at':>17}"
    )
    for r in rows:
        print(
            f"{r['seed']:>5}{r['final_accuracy']:>8.3f}{r['ablated_accuracy']:>10.3f}"
            f"{str(r['steps_to_target']):>15}{r['steps']:>7}{r['training_minutes']:>9.2f}"
            f"{str(r['entropy_collapse_step']):>17}"
        )
    a, m = s["final_accuracy"], s["training_minutes"]
    print(
        f"\n{s['seeds_at_target']} of {s['num_seeds']} seeds at {target} or above; final accuracy min "
        f"{a['min']:.3f} / median {a['median']:.3f} / max {a['max']:.3f}; training minutes min {m['min']:.2f} / "
        f"median {m['median']:.2f} / max {m['max']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the base model and data (make demo: 0)")
    p.add_argument("--dir", default="runs/demo-seeds")
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "demo_seeds.json"))
    p.add_argument("overrides", nargs="*", help="job overrides for every seed, e.g. algorithm.entropy_coef=0")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from visionrl.demo import prepare

    base, data = prepare(Path(args.dir), "color", args.data_seed)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for seed in seeds:
        rows.append(run_seed(seed, args, base, data))
        print(f"[demo_seeds] seed {seed}: final {rows[-1]['final_accuracy']:.3f}", flush=True)
    target = 0.9
    s = summary(rows, target)
    print_table(rows, s, target)
    doc = {
        "benchmark": "demo_seeds",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": Path(args.config).name,
        "overrides": args.overrides,
        "target": target,
        "summary": s,
        "seeds": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"results: {args.out}")
    return 0 if s["seeds_at_target"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
