"""`make demo`: build the tiny base model and a colour task, train by GRPO on the CPU, show it learned.

Steps (each skipped when its output exists, except training and evaluation, which always run):
1. `runs/demo/base-model`: the tiny Qwen3-VL (random init + a short pre-training that teaches the answer format).
2. `runs/demo/data/{train,eval}.jsonl`: the synthetic `color` task (4 answers, chance = 0.25); `--task
   same_color` (with `--config configs/same_color.yaml`) runs the two-image task instead (chance = 0.5).
3. train `configs/demo.yaml` into `runs/demo` (Ray + vLLM rollouts + LoRA learner).
4. evaluate the base and the final adapter on the held-out set (and the adapter with images permuted).
5. print a before/after table, write a picture of answers, say where to point TensorBoard.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from visionrl.config import JobConfig

REPO = Path(__file__).resolve().parents[2]
EASY_VQA_EVAL = (
    3000  # held-out questions drawn from easy-VQA's test split: +-1% on the accuracy, minutes to run
)


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m visionrl.demo", description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/demo")
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--task",
        default="color",
        choices=["color", "same_color", "easy-vqa", "zoom"],
        help="a synthetic task, or the easy-VQA data set (pip install easy-vqa; held out: 3,000 test questions); "
        "zoom: multi-turn episodes with a crop tool (configs/zoom.yaml, runs/zoom)",
    )
    p.add_argument(
        "--judge",
        action="store_true",
        help="a tiny judge model as the only reward (configs/demo_judge.yaml, runs/demo_judge): builds the judge "
        "and measures it, then trains with its P(yes) instead of exact match",
    )
    p.add_argument("overrides", nargs="*", help="job overrides, e.g. train.steps=50")
    args = p.parse_args(argv)
    if args.task == "zoom":
        args.dir = "runs/zoom" if args.dir == "runs/demo" else args.dir
        args.config = (
            str(REPO / "configs" / "zoom.yaml") if args.config.endswith("demo.yaml") else args.config
        )
    if args.judge:
        args.dir = "runs/demo_judge" if args.dir == "runs/demo" else args.dir
        args.config = (
            str(REPO / "configs" / "demo_judge.yaml") if args.config.endswith("demo.yaml") else args.config
        )

    import torch

    torch.set_num_threads(1)
    run = Path(args.dir)
    from visionrl.orchestrate.console import libraries_to
    from visionrl.run_layout import RunDir

    with libraries_to(
        RunDir(run).libraries_log
    ):  # the libraries' output in the run's folder, not on the console
        return _demo(args, run)


def _demo(args: argparse.Namespace, run: Path) -> int:
    """Steps 1-5 of the demo in `run` (see `main`); 0 when the trained adapter reaches the job's target."""
    from visionrl.data.easy_vqa import TASK_NAME as EASY_VQA
    from visionrl.data.synthetic import TASKS
    from visionrl.orchestrate.loop import train

    t_start = time.perf_counter()
    base, data = prepare(run, args.task, args.seed)
    judge_report = prepare_judge(run, data, args.seed) if args.judge else None
    cfg = demo_config(args.config, run, base, data, args.overrides)
    _say(
        f"3/5 training: {cfg.rollout.prompts_per_step} prompts x {cfg.algorithm.group_size} completions per step, "
        f"up to {cfg.train.steps} steps (stops early at {cfg.train.target_accuracy} held-out accuracy)"
    )
    t0 = time.perf_counter()
    result = train(cfg)
    train_min = (time.perf_counter() - t0) / 60
    _say("4/5 evaluating base model and trained adapter on the held-out set")
    ev = run / "eval"
    reports = evaluate_trained(cfg, base, data, result.adapter_dir, ev, with_base=True)
    if args.task == EASY_VQA:
        question, chance = "", "yes/no 0.5, shape 0.333, color 0.125"
    elif args.task == "zoom":
        question, chance = "What color is the square in the ...?", "0.250 (4 answers)"
    else:
        task = TASKS[args.task]
        question, chance = task.question, f"{1 / len(task.answers):.3f} ({len(task.answers)} answers)"
    picture = _answer_picture(data / "eval.jsonl", ev / "final.json", ev / "final_samples.png", question)
    total_min = (time.perf_counter() - t_start) / 60
    _summary(reports, result.steps, train_min, total_min, run, picture, chance)
    if judge_report is not None:
        print(
            f"judge:       agreement with the true labels {judge_report['agreement']:.3f}, with the images "
            f"permuted {judge_report['agreement, images permuted']:.3f} (chance 0.5); "
            f"the only reward of the training ({run / 'judge-model'})"
        )
    by_type = {name: per_type(r, data / "eval.jsonl") for name, r in reports.items()}
    if any(by_type.values()):
        _per_type_table(by_type)
    learned = reports["final"]["accuracy"] >= (cfg.train.target_accuracy or 0.9)
    return 0 if learned else 1


def prepare(run: Path, task: str, seed: int) -> tuple[Path, Path]:
    """Steps 1-2: the tiny base model and the task's data under `run` (each kept when it exists), and the
    outputs of an earlier training there removed; returns (base model dir, data dir)."""
    from visionrl.data.easy_vqa import TASK_NAME as EASY_VQA
    from visionrl.data.easy_vqa import write_easy_vqa
    from visionrl.data.synthetic import make_dataset
    from visionrl.models.tiny import build_tiny_model

    base, data = run / "base-model", run / "data"
    if not (base / "config.json").is_file():
        _say(f"1/5 building the tiny base model in {base} (random init + ~30 s pre-training)")
        build_tiny_model(base, seed=seed, pretrain=True, recipe=task)
    else:
        _say(f"1/5 base model: {base} (exists)")
    if not (data / "eval.jsonl").is_file():
        _say(f"2/5 writing the {task} data into {data}")
        if task == EASY_VQA:
            write_easy_vqa(data, None, EASY_VQA_EVAL, seed=seed)
        elif task == "zoom":
            from visionrl.data.zoom import make_zoom_dataset

            make_zoom_dataset(data, num_train=512, num_eval=128, seed=seed)
        else:
            make_dataset(data, task, num_train=512, num_eval=128, seed=seed)
    else:
        _say(f"2/5 data: {data} (exists)")
    for stale in ("tensorboard", "checkpoints", "adapter", "eval"):
        shutil.rmtree(run / stale, ignore_errors=True)
    return base, data


def prepare_judge(run: Path, data: Path, seed: int) -> dict[str, float]:
    """`--judge`: the tiny judge under `run` (kept when it exists), measured on the held-out questions."""
    from visionrl.models.tiny import build_tiny_model

    judge = run / "judge-model"
    if not (judge / "config.json").is_file():
        _say(
            f"   building the tiny judge in {judge} (recipe judge-color: about 80 s of pre-training, the best of ten judges kept)"
        )
        build_tiny_model(judge, seed=seed, pretrain=True, recipe="judge-color")
    _say(
        "   measuring the judge on the held-out questions (the true colour and another as the proposed answer)"
    )
    report = judge_agreement(
        judge, data / "eval.jsonl", REPO / "configs" / "judges" / "color_match.txt", seed
    )
    _say(
        f"   judge agreement with the true labels {report['agreement']:.3f}, with the images permuted "
        f"{report['agreement, images permuted']:.3f}"
    )
    return report


def demo_config(config: str | Path, run: Path, base: Path, data: Path, overrides: list[str]) -> JobConfig:
    """The demo's job file pointed at `run`, its base model and data (and a judge's model and template), with the
    user's overrides last."""
    from visionrl.config import load_config
    from visionrl.config_yaml import UniqueKeyLoader

    paths = [f"output_dir={run}", f"model.path={base}", f"data.train={data / 'train.jsonl'}"]
    rewards = (yaml.load(Path(config).read_text(), Loader=UniqueKeyLoader) or {}).get("rewards") or []
    judges = [r.setdefault("kwargs", {}) for r in rewards if r.get("name") == "judge"]
    for kwargs in judges:
        kwargs["model"] = str(run / "judge-model")
        kwargs["template"] = str(REPO / kwargs["template"])  # the file is the repository's
    if judges:
        paths.append(f"rewards={json.dumps(rewards)}")
    return load_config(config, [*paths, f"data.eval={data / 'eval.jsonl'}", *overrides])


def evaluate_trained(
    cfg: JobConfig, base: Path, data: Path, adapter: Path, ev: Path, *, with_base: bool
) -> dict[str, dict[str, Any]]:
    """Step 4: held-out reports of the base (if `with_base`), the trained adapter, and the adapter with the images
    permuted across questions (back at chance when the model reads the image), written under `ev`."""
    from visionrl.data.images import ImageBudget
    from visionrl.eval.local import evaluate_local

    common: dict[str, Any] = {
        "data": str(data / "eval.jsonl"),
        "max_tokens": cfg.rollout.max_new_tokens,
        # the job's first rule reward; a job judged by a model only is measured by exact match
        "rewards": [r.name for r in cfg.rewards if r.name != "judge"][:1] or ["exact_match"],
        "budget": ImageBudget.of(cfg.data),  # the base too is shown the images as the job drew them
        "env": cfg.env,  # multi-turn: one greedy episode per question, with the job's environment
        "max_samples": cfg.data.max_eval_samples if cfg.env is not None else None,
    }
    reports = {}
    if with_base:
        reports["base"] = evaluate_local(base=str(base), adapter=None, out=str(ev / "base.json"), **common)
    reports["final"] = evaluate_local(
        base=str(base), adapter=str(adapter), out=str(ev / "final.json"), **common
    )
    reports["final, images permuted"] = evaluate_local(
        base=str(base), adapter=str(adapter), out=str(ev / "final_ablated.json"), ablate_images=True, **common
    )
    if cfg.env is not None and cfg.env.name == "zoom":  # the tool called as trained, but it shows nothing new
        whole = cfg.env.model_copy(update={"kwargs": {**cfg.env.kwargs, "tool": "whole"}})
        reports["final, crop shows the whole picture"] = evaluate_local(
            base=str(base),
            adapter=str(adapter),
            out=str(ev / "final_no_zoom.json"),
            **{**common, "env": whole},
        )
    return reports


def judge_agreement(judge_dir: Path, data: Path, template: Path, seed: int = 0) -> dict[str, float]:
    """The tiny judge measured on the held-out colour questions: for each, the true colour and another one as the
    proposed answer; its agreement with the true labels (P(yes) > 0.5 exactly for the true colour), and the same
    with every image moved to another question (near 0.5 when the judge reads the image, not the words)."""
    import random

    from visionrl.data import load_dataset
    from visionrl.data.synthetic import TASKS
    from visionrl.judge.model import ModelJudge
    from visionrl.rewards.judge import JudgeRequest, JudgeSpec, load_template, render

    text = load_template(template)
    spec = JudgeSpec.from_kwargs({"backend": "vllm", "model": str(judge_dir), "template": str(template)})
    ds = load_dataset(data)
    rng, colours, question = random.Random(seed), TASKS["color"].answers, TASKS["color"].question
    pairs = []
    for i in range(len(ds)):
        wrong = rng.choice([c for c in colours if c != ds[i].answer])
        pairs += [(i, ds[i].answer, True), (i, wrong, False)]
    judge = ModelJudge(spec)
    try:
        result = {}
        for name, shift in (("agreement", 0), ("agreement, images permuted", 1)):
            requests = [
                JudgeRequest(render(text, question, None, said), tuple(ds[(i + shift) % len(ds)].images))
                for i, said, _ in pairs
            ]
            verdicts = judge.judge(requests)
            right = [
                isinstance(v, float) and (v > 0.5) == label
                for v, (_, _, label) in zip(verdicts, pairs, strict=True)
            ]
            result[name] = sum(right) / len(right)
    finally:
        judge.close()
    return result


def per_type(report: dict[str, Any], data: Path) -> dict[str, tuple[float, int]]:
    """Accuracy and count per `metadata.question_type` of the evaluated records ({} when there is none)."""
    kinds = {}
    for line in data.read_text().splitlines():
        record = json.loads(line)
        kind = record.get("metadata", {}).get("question_type")
        if kind is not None:
            kinds[record["id"]] = kind
    tally: dict[str, list[int]] = {}
    for sample in report["samples"]:
        if sample["id"] in kinds:
            t = tally.setdefault(kinds[sample["id"]], [0, 0])
            t[0] += bool(sample["correct"])
            t[1] += 1
    return {k: (c / n, n) for k, (c, n) in sorted(tally.items())}


def _per_type_table(by_type: dict[str, dict[str, tuple[float, int]]]) -> None:
    kinds = sorted({k for table in by_type.values() for k in table})
    print(f"\n{'accuracy by question type':<26}" + "".join(f"{k:>10}" for k in kinds))
    for name, table in by_type.items():
        print(f"{name:<26}" + "".join(f"{table[k][0]:>10.3f}" if k in table else f"{'-':>10}" for k in kinds))
    counts = next(iter(by_type.values()))
    print(f"{'samples':<26}" + "".join(f"{counts[k][1]:>10}" if k in counts else f"{'-':>10}" for k in kinds))


def _answer_picture(data: Path, report: Path, out: Path, question: str) -> Path | None:
    """A grid of held-out images with the trained model's answers (green right, red wrong)."""
    from visionrl.data import load_dataset
    from visionrl.pictures import RolloutSample, render_rollout_grid

    samples = json.loads(report.read_text())["samples"][:12]
    ds = load_dataset(data, max_samples=len(samples))
    cells = [
        RolloutSample(
            image=ds[i].images[0],
            question=question,
            completion=s.get("completion") or "",
            answer=str(s["answer"]),
            reward=1.0 if s["correct"] else 0.0,
        )
        for i, s in enumerate(samples)
    ]
    render_rollout_grid(cells, cols=6, cell=128).save(out)
    return out


def _summary(
    reports: dict,
    steps: int,
    train_min: float,
    total_min: float,
    run: Path,
    picture: Path | None,
    chance: str,
) -> None:
    width = max(26, *(len(name) + 2 for name in reports))
    print()
    print(f"{'model':<{width}}{'held-out accuracy':>18}{'samples':>9}")
    for name, r in reports.items():
        print(f"{name:<{width}}{r['accuracy']:>18.3f}{r['num_samples']:>9}")
    print(
        f"\nchance level {chance}; trained {steps} steps in {train_min:.1f} min, demo total {total_min:.1f} min"
    )
    print(f"adapter:     {run / 'adapter'} (PEFT files + visionrl_manifest.json)")
    print(f"reports:     {run / 'eval'}/{{base,final,final_ablated}}.json (+ .md)")
    if picture:
        print(f"picture:     {picture}")
    print(f"TensorBoard: tensorboard --logdir {run / 'tensorboard'}")


if __name__ == "__main__":
    sys.exit(main())
