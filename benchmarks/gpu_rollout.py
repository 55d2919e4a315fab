"""The rollout engine alone at the production job's shape, one vLLM setting at a time (generation speed).

visionrl's vLLM engine as the loop builds it from `configs/qwen3vl_8b_grpo_lora.yaml` (LoRA r64 with the merger,
log-probs, the job's image bounds and GPU share) on a Qwen3-VL-8B-shaped checkpoint (random bf16 weights), with
a non-zero adapter of the job's layout loaded, samples P prompts x G completions of T tokens (64 x 8 x 512 by
default; random weights never end a turn, so every completion has T tokens), one 448x448 image per prompt.
Each variant runs in a process of its own (a fresh engine; its memory returned at exit): the engine's start, a
short warm-up batch, then the timed batch. Reported per variant: generated tokens/s, the batch's seconds, the
engine's start, and the generated tokens/s against the job's own setting.

Variants (`--variants`, comma-separated; default all):
  job         the job file's engine as shipped (its adapter merged into the weights: rollout.lora_serving)
  adapter     the job's engine with the adapter served by vLLM's LoRA kernels (rollout.lora_serving: adapter);
              the LoRA-kernel variants below (lora_graphs, dual_stream, lora_specialize, tuned_lora) serve it so too
  merged      the adapter merged into the engine's base weights, no LoRA kernels (rollout.lora_serving: merged);
              its row also gives the adapter load's seconds (the merge) against the job's
  no_lora     the same engine without LoRA: what LoRA costs
  seqs_N      rollout.vllm_engine_args max_num_seqs=N (N: 256, 512, 1024)
  tokens_N    rollout.vllm_engine_args max_num_batched_tokens=N (N: 8192, 16384, 32768)
  share_X     rollout.gpu_memory_utilization=X (0.35 is the 80 GB setting's)
  lora_graphs vLLM's CUDA graphs captured with LoRA only (`cudagraph_specialize_lora: false`; by default it
              captures every graph twice, with and without an active LoRA, and the job always has one): the
              engine's start
  dual_stream vLLM's LoRA on a second CUDA stream beside the base layer's GEMM (VLLM_LORA_ENABLE_DUAL_STREAM=1,
              with programmatic dependent launch on Hopper): what of LoRA's cost overlaps
  lora_specialize  the LoRA kernels' grid sized by the adapters in use (`specialize_active_lora: true`; by default
              it is max_loras + 1 = 2 deep and the no-LoRA slot's blocks start only to exit, every LoRA kernel call)
  tuned_lora  vLLM's LoRA kernels tuned for the job's shapes on this card (lora_kernel_tune.py; the folder is kept
              beside the checkpoint and reused by a later call) through rollout.vllm_env's VLLM_TUNED_CONFIG_FOLDER

On a CUDA machine with vLLM, from the repository root:
    PYTHONPATH=src python benchmarks/gpu_rollout.py [--size 64x8x512] [--variants job,no_lora,seqs_512]
        [--work DIR] [--out benchmarks/results] [key=value ...]
On the CPU (the script's path, the CPU build and the tiny model; measures nothing):  ... --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

JOB = "configs/qwen3vl_8b_grpo_lora.yaml"
VARIANTS = [
    "job",
    "adapter",
    "no_lora",
    "seqs_256",
    "seqs_512",
    "seqs_1024",
    "tokens_8192",
    "tokens_16384",
    "tokens_32768",
    "lora_graphs",
    "dual_stream",
    "tuned_lora",
    "lora_specialize",
    "merged",
]
TUNE_BUDGET_S = 240.0  # tuned_lora's search (the rows it does not reach keep vLLM's default config)
# Variants that are an environment variable of the engine's process, not a job setting
VARIANT_ENV = {"dual_stream": {"VLLM_LORA_ENABLE_DUAL_STREAM": "1"}}


# Variants that measure vLLM's LoRA kernels: the adapter is served through them whatever the job ships
LORA_KERNEL_VARIANTS = ("adapter", "lora_graphs", "dual_stream", "lora_specialize", "tuned_lora")


def variant_overrides(name: str) -> list[str]:
    """The job-file overrides of a variant (`no_lora` is applied to the engine itself, not the job)."""
    serving = ["rollout.lora_serving=adapter"] if name in LORA_KERNEL_VARIANTS else []
    return serving + _setting(name)


def _setting(name: str) -> list[str]:
    kind, _, value = name.partition("_")
    if kind == "seqs":
        return [f"rollout.vllm_engine_args={{max_num_seqs: {int(value)}}}"]
    if kind == "tokens":
        return [f"rollout.vllm_engine_args={{max_num_batched_tokens: {int(value)}}}"]
    if kind == "share":
        return [f"rollout.gpu_memory_utilization={float(value)}"]
    if name == "lora_specialize":
        return ["rollout.vllm_engine_args={specialize_active_lora: true}"]
    if name == "lora_graphs":
        return ["rollout.vllm_engine_args={compilation_config: {cudagraph_specialize_lora: false}}"]
    if name == "merged":
        return ["rollout.lora_serving=merged"]
    if name in ("job", "adapter", "no_lora", "tuned_lora", *VARIANT_ENV):
        return []
    raise SystemExit(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}, or seqs_N, tokens_N, share_X")


def random_adapter(model_dir: Path, cfg: Any, seed: int = 0) -> Any:
    """An adapter of the job's LoRA layout for `model_dir` with random non-zero weights, as the engines receive one
    (built on the meta device: no base weights are loaded)."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import save
    from transformers import AutoConfig, AutoModelForImageTextToText

    from visionrl.models.loader import apply_lora, torch_dtype
    from visionrl.train.learner_state import adapter_config_bytes
    from visionrl.types import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterPayload

    with torch.device("meta"):
        peft_model = apply_lora(
            AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir)), cfg.lora
        )
    gen = torch.Generator().manual_seed(seed)
    dtype = torch_dtype(cfg.model.dtype)
    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    weights = {k: (torch.randn(tuple(v.shape), generator=gen) * 0.01).to(dtype) for k, v in state.items()}
    files = {ADAPTER_CONFIG: adapter_config_bytes(peft_model), ADAPTER_WEIGHTS: save(weights)}
    return AdapterPayload(version=1, files=files)


def one_variant(args: argparse.Namespace) -> dict[str, Any]:
    """In this process: the engine of `args.one`, its start, a warm-up, the timed batch."""
    from visionrl.config import load_config
    from visionrl.models.loader import checkpoint_vision_token_ids
    from visionrl.orchestrate.actors import engine_budget
    from visionrl.orchestrate.prompt_stream import PromptStream
    from visionrl.rollout.factory import make_engine
    from visionrl.types import SamplingSpec

    prompts, group, tokens = (int(x) for x in args.size.split("x"))
    over = [f"model.path={args.model}", f"data.train={args.data / 'train.jsonl'}", "data.eval=null",
            f"rollout.prompts_per_step={prompts}", f"algorithm.group_size={group}",
            f"rollout.max_new_tokens={tokens}", *variant_overrides(args.one), *args.overrides]  # fmt: skip
    if args.smoke:
        over += [
            "model.dtype=float32",
            "rollout.gpus_per_engine=0",
            "ray.learner_gpus=0",
            "algorithm.overlong_buffer=null",
        ]
    tuned = None
    if args.one == "tuned_lora":
        tuned = tuned_lora_folder(args, load_config(JOB, over).lora.rank)
        over.append(f"rollout.vllm_env={{VLLM_TUNED_CONFIG_FOLDER: {tuned['folder']}}}")
    cfg = load_config(JOB, over)
    # rollout.vllm_env reaches a loop's engines through their Ray actors' runtime_env; this engine is built here,
    # in this process, so the job's settings go into its environment (its engine core inherits it)
    os.environ.update(cfg.rollout.vllm_env)
    env = {**VARIANT_ENV.get(args.one, {}), **cfg.rollout.vllm_env}
    lora = cfg.lora.model_copy(update={"rank": 0}) if args.one == "no_lora" else cfg.lora
    items = PromptStream(cfg).next_batch()  # the job's prompts: its system prompt, its image bounds
    t = time.perf_counter()
    engine = make_engine(cfg.model.path, lora=lora, rollout=cfg.rollout,
                         forbidden_token_ids=checkpoint_vision_token_ids(cfg.model.path), dtype=cfg.model.dtype,
                         seed=0, budget=engine_budget(cfg))  # fmt: skip
    start_s = time.perf_counter() - t
    load: dict[str, Any] = {}
    try:
        if lora.rank:  # two versions: the second load is a step's (the first one also reads what it keeps)
            payload = random_adapter(args.model, cfg)
            t = time.perf_counter()
            engine.load_adapter(payload)
            first_s, t = time.perf_counter() - t, time.perf_counter()
            engine.load_adapter(dataclasses.replace(payload, version=2))
            load = {"adapter_load_s": time.perf_counter() - t, "first_adapter_load_s": first_s,
                    "load_parts_s": getattr(engine, "load_parts", {})}  # fmt: skip
        r = cfg.rollout
        spec = SamplingSpec(n=group, temperature=r.temperature, top_p=r.top_p, max_tokens=tokens, seed=0)
        engine.generate(items[:4], SamplingSpec(n=2, max_tokens=16, temperature=1.0, seed=1))  # warm-up
        t = time.perf_counter()
        out = engine.generate(items, spec)
        batch_s = time.perf_counter() - t
        # what the engine serves, to compare across variants (the same adapter: merged serving against the job's)
        greedy = [{"tokens": g[0].token_ids, "logprobs": g[0].logprobs} for g in
                  engine.generate(items[:4], SamplingSpec(n=1, greedy=True, max_tokens=32)) if g]  # fmt: skip
    finally:
        engine.close()
    generated = sum(len(c.token_ids) for group_out in out for c in group_out)
    return {"variant": args.one, "engine_start_s": start_s, "batch_s": batch_s, "generated_tokens": generated,
            "generated_tokens_per_s": generated / batch_s, "overrides": variant_overrides(args.one),
            "env": env, "env_known_to_vllm": known_env(env), "env_seen_by_vllm": seen_env(env), **load,
            "greedy": greedy, **({"lora_kernels": tuned} if tuned else {})}  # fmt: skip


def greedy_agreement(row: dict[str, Any], job: dict[str, Any]) -> dict[str, float]:
    """How far a variant's greedy completions are from the job's on the same prompts and adapter: the share of
    tokens before the first divergence, and the mean |log-prob difference| over those tokens."""
    same, total, diffs = 0, 0, []
    for a, b in zip(row.get("greedy", []), job.get("greedy", []), strict=False):
        total += len(b["tokens"])
        for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"], strict=False):
            if ta != tb:
                break
            same += 1
            diffs.append(abs(la - lb))
    return {
        "same_prefix_share": same / max(total, 1),
        "mean_abs_logprob_diff": sum(diffs) / max(len(diffs), 1),
    }


def tuned_lora_folder(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """The job's LoRA kernels tuned on this card, in a folder beside the checkpoint (an earlier call's is reused):
    the folder, the tuning's seconds and the kernels' time per decode forward of 512 rows before and after."""
    import gc

    from lora_kernel_tune import tune_folder

    from visionrl.rollout.lora_kernels import DEFAULT_MS

    folder = args.model.parent / "lora-kernels"
    report_file = folder / "lora_kernel_tune.json"
    if report_file.exists():
        report, reused = json.loads(report_file.read_text()), True
    else:
        report = tune_folder(
            None if args.smoke else args.model,
            rank,
            folder,
            list(DEFAULT_MS),
            smoke=args.smoke,
            budget_s=TUNE_BUDGET_S,
        )
        report_file.write_text(json.dumps(report, indent=1) + "\n")
        reused = False
        gc.collect()  # the tuner's tensors and graphs, before vLLM measures the card's free memory
        if not args.smoke:
            import torch

            torch.cuda.empty_cache()
    return {"folder": str(folder), "reused": reused, "tune_s": report["tune_s"],
            "per_decode_step_us_512": report["per_decode_step_us"].get("512")}  # fmt: skip


def known_env(env: dict[str, str]) -> dict[str, bool]:
    """Whether this vLLM reads each of the variant's environment variables (one it does not know changes nothing,
    and the variant then measures the job's engine again)."""
    import vllm.envs

    return {name: hasattr(vllm.envs, name) for name in env}


def seen_env(env: dict[str, str]) -> dict[str, bool]:
    """Whether vLLM, in this process (whose environment its engine core inherits), reads each variable's value.
    Parsed afresh from the environment: once an engine has started in a process, `vllm.envs` answers from a cache
    of the values at that time."""
    import vllm.envs

    def seen(name: str, value: str) -> bool:
        parse = vllm.envs.environment_variables.get(name)
        got = parse() if parse is not None else getattr(vllm.envs, name, None)
        return got == (value.lower() in ("1", "true")) if isinstance(got, bool) else str(got) == value

    return {name: seen(name, value) for name, value in env.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="64x8x512", help="PROMPTSxGROUPxTOKENS")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--work", default="", help="keep the checkpoint and data here (reused by a later call)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument(
        "--smoke", action="store_true", help="CPU: small shapes, checks the script, measures nothing"
    )
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child process: this variant only
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    p.add_argument(
        "overrides", nargs="*", help="extra key=value overrides of the job file, for every variant"
    )
    args = p.parse_args()
    if args.one:
        args.json.write_text(json.dumps(one_variant(args)))
        return
    from gpu_grpo_step import build_model

    from visionrl.data.synthetic import make_dataset

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        model, data = work / "qwen3vl-8b-shaped", work / "count448"
        if not (model / "config.json").exists():
            build_model(model, args.smoke)
        if not (data / "train.jsonl").exists():
            make_dataset(
                data, "count", num_train=512, num_eval=0, seed=0, image_size=64 if args.smoke else 448
            )
        rows: list[dict[str, Any]] = []
        for name in filter(None, args.variants.split(",")):
            rows.append(run_variant(name, args, model, data, work))
            report = report_of(rows, args)
            if not args.smoke:  # after every variant: a call cut at its time limit keeps what it measured
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / "gpu_rollout.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'variant':<16}{'tokens/s':>10}{'batch s':>9}{'start s':>9}{'vs job':>8}")
    for r in rows:
        if "generated_tokens_per_s" not in r:
            print(f"{r['variant']:<16} {r['status']}")
            continue
        vs = f"{r['vs_job']:8.2f}" if "vs_job" in r else f"{'-':>8}"
        print(
            f"{r['variant']:<16}{r['generated_tokens_per_s']:10.0f}{r['batch_s']:9.1f}{r['engine_start_s']:9.1f}{vs}"
        )


def report_of(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The results file of the variants measured so far: each against the job's engine when it was measured."""
    from gpu_grpo_step import versions

    job = next((r for r in rows if r["variant"] == "job" and "generated_tokens_per_s" in r), None)
    for r in rows:
        if job and "generated_tokens_per_s" in r:
            r["vs_job"] = r["generated_tokens_per_s"] / job["generated_tokens_per_s"]
            if r is not job and r["variant"] != "no_lora":
                r["greedy_vs_job"] = greedy_agreement(r, job)
    return {
        "benchmark": "gpu_rollout",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"device": _device(), **versions()},
        "setup": {
            "job": JOB,
            "size": args.size,
            "overrides": args.overrides,
            "model": "Qwen3-VL-8B shape, random bf16 weights (every completion runs to T)",
        },  # fmt: skip
        "results": rows,
    }


def run_variant(name: str, args: argparse.Namespace, model: Path, data: Path, work: Path) -> dict[str, Any]:
    """One variant in a child process (a fresh engine); its row, or why it failed (its output is above)."""
    result = work / f"rollout-{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--one", name, "--model", str(model), "--data", str(data),
           "--json", str(result), "--size", args.size, *(["--smoke"] if args.smoke else []), *args.overrides]  # fmt: skip
    # torch touches CUDA in this child before vLLM starts its engine core, which a forked core cannot inherit
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn", **VARIANT_ENV.get(name, {})}
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0 or not result.exists():
        return {"variant": name, "status": f"failed (exit {proc.returncode}); its output is in the log"}
    row = json.loads(result.read_text())
    print(json.dumps(row), flush=True)
    return dict(row)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
