"""The production GRPO step on two GPUs against one: the setup of `benchmarks/gpu_grpo_step.py` (Qwen3-VL-8B
shape, random bf16 weights, the synthetic count task at 448x448, `configs/qwen3vl_8b_grpo_lora.yaml`), run by
visionrl's own loop in three layouts:

- `1gpu`: one learner rank and one engine sharing GPU 0 (the one-GPU figures, measured in the same run);
- `colocated`: 2 learner ranks sharded with FSDP2 over nccl + 2 engines, rank i and engine i on GPU i;
- `split-async`: 1 engine GPU + 1 learner GPU, `rollout.async_steps: 1` (the engine generates the next batch
  while the learner trains this one; vLLM's sleep mode is off, since nothing shares a GPU), with the engine's
  log-probs as the old policy, as recommended for stale batches.

Every layout starts from the best one-GPU settings measured so far (benchmarks/NOTES-gpu-learner.md): 8192-token
micro-batches; colocated layouts sleep the engine during the update at 60% of the GPU; the split engine takes
85% of its own GPU. Reported per layout (benchmarks/results/gpu_scaling.json, and a table): step time, per-phase
seconds, tokens_per_s_per_gpu (prompt + image + response tokens of a step / step time / GPUs used), the speed-up
of the step and the scaling efficiency against `1gpu`, and the peak memory of every GPU (nvidia-smi, 0.5 s).

On a machine with two CUDA GPUs, vLLM and Ray, from the repository root:
    PYTHONPATH=src python benchmarks/gpu_scaling.py [--size 64x8x512] [--steps 2]
        [--layouts 1gpu,colocated,split-async] [--work DIR] [--merge] [key=value ...]
A 64 x 8 x 512 layout needs about 500 s (engine start included): one layout per call, `--work` keeps the
checkpoint and data for the next call and `--merge` keeps the rows of the layouts not run now.
On the CPU, `--smoke` runs the same code with small shapes, the HF engine and each layout's rank, engine and
async keys (no GPUs: the placement keys are left out), and writes nothing: it checks the script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path
from typing import Any

from gpu_grpo_step import (
    JOB,
    GpuMemorySampler,
    _device_name,
    _param_count,
    build_model,
    logging_setup,
    measure,
    overrides_for,
    versions,
)

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1gpu": (
        1,
        ["rollout.sleep_during_update=true", "rollout.gpu_memory_utilization=0.6"],
    ),
    "colocated": (
        2,
        [
            "ray.placement=colocated",
            "ray.num_learners=2",
            "rollout.num_engines=2",
            "train.fsdp=on",
            "rollout.sleep_during_update=true",
            "rollout.gpu_memory_utilization=0.6",
        ],
    ),
    "split-async": (
        2,
        [
            "ray.placement=split",
            "ray.learner_gpus=1",
            "rollout.gpus_per_engine=1",
            "rollout.async_steps=1",
            "algorithm.rollout_correction=off",  # the recommended old policy for stale batches
            "algorithm.old_logprobs=engine",  #   (benchmarks/NOTES-async.md)
            "rollout.sleep_during_update=false",
            "rollout.gpu_memory_utilization=0.85",
        ],
    ),
}
COMMON = ["train.micro_batch_tokens=8192"]
SMOKE_KEYS = (
    "ray.num_learners=",
    "rollout.num_engines=",
    "train.fsdp=",
    "rollout.async_steps=",
    "algorithm.",
)


def layout_overrides(layout: str, smoke: bool) -> list[str]:
    _, over = LAYOUTS[layout]
    if smoke:  # CPU: the layout's ranks, engines and async steps, the light HF engine, no GPU keys
        return ["rollout.engine=hf", *[o for o in over if o.startswith(SMOKE_KEYS)]]
    return COMMON + over


def run_layout(
    layout: str,
    size: str,
    model: Path,
    data: Path,
    run: Path,
    steps: int,
    params: float,
    extra: list[str],
    smoke: bool = False,
) -> dict[str, Any]:
    from visionrl.config import load_config
    from visionrl.orchestrate.loop import train

    gpus = LAYOUTS[layout][0]
    over = layout_overrides(layout, smoke)
    cfg = load_config(JOB, overrides_for(size, model, data, run, steps, smoke) + over + list(extra))
    with GpuMemorySampler() as memory:
        result = train(cfg)
    row = measure(size, result.history, params, memory)
    row.update(
        layout=layout,
        gpus=gpus,
        tokens_per_s_per_gpu=row["sequence_tokens_per_step"] / row["step_s"] / gpus,
        peak_gib_per_gpu={k: round(v, 2) for k, v in sorted(memory.per_gpu.items())},
        overrides=over + list(extra),
    )
    print(json.dumps(row), flush=True)
    return row


def compare(rows: list[dict[str, Any]]) -> None:
    """Each layout's step speed-up over `1gpu` and its scaling efficiency (speed-up / GPUs)."""
    base = next((r for r in rows if r["layout"] == "1gpu"), None)
    if base is None:
        return
    for r in rows:
        r["step_speedup_vs_1gpu"] = base["step_s"] / r["step_s"]
        r["scaling_efficiency"] = r["step_speedup_vs_1gpu"] / r["gpus"]


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["gpus", "step_s", "rollout_s", "update_s", "sync_s", "rollout_wait_s", "tokens_per_s_per_gpu"]
    cols += ["step_speedup_vs_1gpu", "scaling_efficiency"]
    print(f"\n{'layout':<13}" + "".join(f"{c[:14]:>15}" for c in cols))
    for r in rows:
        print(f"{r['layout']:<13}" + "".join(f"{r.get(c, float('nan')):>15.3g}" for c in cols))
        print(f"{'':<13}peak GiB per GPU: {r['peak_gib_per_gpu']}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="64x8x512", help="PROMPTSxGROUPxTOKENS")
    p.add_argument("--steps", type=int, default=2, help="step 1 warms up and is left out")
    p.add_argument("--layouts", default="1gpu,colocated,split-async", help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--merge", action="store_true", help="keep the rows of layouts not run now")
    p.add_argument("--work", default="", help="keep the checkpoint and data here (reused by a later call)")
    p.add_argument(
        "--smoke", action="store_true", help="CPU: small shapes, checks the script, writes nothing"
    )
    p.add_argument("overrides", nargs="*", help="extra key=value overrides of the job file, for every layout")
    args = p.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {unknown}; choose from {list(LAYOUTS)}")
    logging_setup()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        model, data = work / "qwen3vl-8b-shaped", work / "count448"
        if not (model / "config.json").exists():
            build_model(model, smoke=args.smoke)
        if not (data / "train.jsonl").exists():
            from visionrl.data.synthetic import make_dataset

            size = 64 if args.smoke else 448
            make_dataset(data, "count", num_train=512, num_eval=0, seed=0, image_size=size)
        params = _param_count(model)
        rows = [
            run_layout(
                x, args.size, model, data, work / f"run-{x}", args.steps, params, args.overrides, args.smoke
            )
            for x in layouts
        ]
    if args.smoke:
        compare(rows)
        print_table(rows)
        return
    path = Path(args.out) / "gpu_scaling.json"
    if args.merge and path.exists():
        rows = [r for r in json.loads(path.read_text())["results"] if r["layout"] not in layouts] + rows
    compare(rows)
    report = {
        "benchmark": "gpu_scaling",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"device": _device_name(), **versions()},
        "setup": {"job": JOB, "size": args.size, "model": "Qwen3-VL-8B shape, random bf16 weights"},
        "results": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
