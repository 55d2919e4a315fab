"""TRL's GRPOTrainer on the work of `benchmarks/gpu_grpo_step.py`: the peer figures of the same run.

Same checkpoint (Qwen3-VL-8B shape, random bf16 weights), same data (the count task at 448x448, the job's system
prompt), LoRA r64 / alpha 128 on the same modules (visionrl's own target regex: the language model's projections
and the vision merger), the same P prompts x G completions x max new tokens, bf16, 2 optimizer steps per rollout
batch, clip 0.2 / 0.28, token-mean loss, no KL, truncated importance weights (TRL's default), and the fastest
single-GPU mode TRL has: vLLM colocated in the trainer's process (`vllm_mode="colocate"`, 40% of the GPU, as the
job gives visionrl's engine). TRL merges the adapter into the base weights and loads the whole model into vLLM
every step: that is its sync. Gradient checkpointing is on unless `--no-gradient-checkpointing`.

Timing: wall time between the ends of rollout batches (two optimizer steps each); generation and weight sync
measured by wrapping TRL's methods (with a CUDA synchronise); the learner is the rest (rewards included: ms). Tokens per step:
TRL's own `num_tokens` count (prompt with image tokens + completion). Memory: nvidia-smi per process (trainer and
engine share one process), and torch's allocator peak above what was resident after start (weights + engine),
i.e. what training adds.

Run by `gpu_grpo_step.py --trl` (which passes the checkpoint and data), or alone:
    python benchmarks/trl_grpo_step.py --model DIR --data DIR --size 64x8x512 --steps 2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lengths import histogram, read_lengths

JOB = "configs/qwen3vl_8b_grpo_lora.yaml"


def trl_records(data: Path, num: int, system_prompt: str | None) -> list[dict[str, Any]]:
    """The count task's records in TRL's conversational multimodal layout: `prompt` messages and one `image`."""
    from PIL import Image

    rows = []
    for line in (data / "train.jsonl").read_text().splitlines()[:num]:
        rec = json.loads(line)
        user = next(m for m in rec["messages"] if m["role"] == "user")
        text = " ".join(p["text"] for p in user["content"] if p["type"] == "text")
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        if system_prompt:
            prompt.insert(0, {"role": "system", "content": [{"type": "text", "text": system_prompt}]})
        image = Image.open(data / rec["images"][0]).convert("RGB")
        rows.append({"prompt": prompt, "image": image, "answer": rec["answer"]})
    return rows


class Timers:
    """Seconds spent in wrapped callables, per rollout batch."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        import torch

        inner = getattr(obj, attr)

        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        def timed(*args: Any, **kwargs: Any) -> Any:
            sync()
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def run(
    model: Path,
    data: Path,
    size: str,
    steps: int,
    checkpointing: bool,
    smoke: bool = False,
    vllm: bool = True,
) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from visionrl.config import load_config
    from visionrl.models.loader import load_processor, lora_target_regex, vision_token_ids
    from visionrl.rewards.builtin import format_reward, numeric

    prompts, group, tokens = (int(x) for x in size.split("x"))
    cfg = load_config(JOB, [f"model.path={model}", f"data.train={data / 'train.jsonl'}"])
    updates = cfg.algorithm.updates_per_batch
    micro = min(
        8, prompts * group // updates
    )  # completions per micro-batch (about 6k tokens at 512 new tokens)
    # Vision tokens are never sampled, as in visionrl's engines: a sampled <|image_pad|> makes the training
    # forward fail ("Image features and image tokens do not match"; TRL died so at 64 x 8 x 512 without this).
    from transformers import AutoConfig

    banned = vision_token_ids(AutoConfig.from_pretrained(model), load_processor(model))
    use_vllm = vllm and not smoke  # the CPU smoke run checks the script with TRL's transformers generation
    gen = {"logit_bias": {i: -100.0 for i in banned}} if use_vllm else {"suppress_tokens": banned}
    dataset = Dataset.from_list(trl_records(data, prompts * (steps + 1), cfg.data.system_prompt))

    def text(c: Any) -> str:  # TRL passes conversational completions as message lists
        return c[-1]["content"] if isinstance(c, list) else str(c)

    def trl_numeric(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        return [numeric(text(c), a, {}) for c, a in zip(completions, answer, strict=True)]

    def trl_format(completions: list[Any], **_: Any) -> list[float]:
        return [format_reward(text(c), None, {}) for c in completions]

    args = GRPOConfig(
        output_dir=str(Path("/tmp") / "trl-grpo-bench"),
        learning_rate=cfg.train.lr,
        model_init_kwargs={
            "dtype": torch.float32 if smoke else torch.bfloat16,
            "attn_implementation": cfg.model.attn_implementation,
        },
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=prompts * group // micro // updates,
        steps_per_generation=prompts * group // micro,
        num_generations=group,
        max_completion_length=tokens,
        num_iterations=1,
        max_steps=steps * updates,
        bf16=not smoke,
        use_cpu=smoke,
        gradient_checkpointing=checkpointing,
        beta=cfg.algorithm.kl_coef,
        epsilon=cfg.algorithm.clip_low,
        epsilon_high=cfg.algorithm.clip_high,
        loss_type="dapo",
        reward_weights=[r.weight for r in cfg.rewards],
        temperature=cfg.rollout.temperature,
        use_vllm=use_vllm,
        generation_kwargs=gen,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        vllm_max_model_length=cfg.rollout.max_model_len,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
        dataloader_num_workers=0,
    )
    peft = LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=int(cfg.lora.alpha),
        lora_dropout=cfg.lora.dropout,
        target_modules=lora_target_regex(cfg.lora),
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=[trl_numeric, trl_format],
        args=args,
        train_dataset=dataset,
        peft_config=peft,
    )
    init_s = time.perf_counter() - t0
    timers = Timers()
    if args.use_vllm:
        timers.wrap(trainer.vllm_generation, "generate", "generate_s")
        timers.wrap(trainer.vllm_generation, "sync_weights", "sync_s")
    cuda = torch.cuda.is_available()
    resident = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    batches: list[dict[str, float]] = []

    class EveryBatch(TrainerCallback):
        t = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, _control: Any, **_: Any) -> None:
            if state.global_step % updates:
                return
            now = time.perf_counter()
            logs = [h for h in state.log_history if "num_tokens" in h]
            batches.append(
                {
                    "step_s": now - EveryBatch.t,
                    "num_tokens": logs[-1]["num_tokens"] if logs else float("nan"),
                    "completion_length": logs[-1].get("completions/mean_length", float("nan"))
                    if logs
                    else 0.0,
                    **timers.take(),
                }
            )
            EveryBatch.t = now

    trainer.add_callback(EveryBatch())
    EveryBatch.t = time.perf_counter()
    trainer.train()
    return summarise(
        batches, size, init_s, torch.cuda.max_memory_allocated() - resident, resident, trl.__version__
    )


def summarise(
    batches: list[dict[str, float]], size: str, init_s: float, extra: int, resident: int, version: str
) -> dict[str, Any]:
    prev = [0.0] + [b["num_tokens"] for b in batches]
    for b, before in zip(batches, prev, strict=False):
        b["sequence_tokens"] = b["num_tokens"] - before
    rows = batches[1:] if len(batches) > 1 else batches  # the first batch warms up
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
    step_s, tokens = mean("step_s"), mean("sequence_tokens")
    learner_s = step_s - mean("generate_s") - mean("sync_s")
    return {
        "size": size,
        "trl_version": version,
        "mode": "vLLM colocate (in the trainer's process)",
        "init_s": init_s,
        "steps_measured": len(rows),
        "trl_step_s": step_s,
        "trl_generate_s": mean("generate_s"),
        "trl_sync_s": mean("sync_s"),
        "trl_learner_s": learner_s,
        "trl_sequence_tokens_per_step": tokens,
        "trl_completion_length_mean": mean("completion_length"),
        "trl_tokens_per_s_per_gpu": tokens / step_s,
        "trl_learner_tokens_per_s": tokens / learner_s,
        "trl_training_extra_gib": extra / 2**30,
        "trl_resident_after_start_gib": resident / 2**30,
        "batches": batches,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--size", default="64x8x512")
    p.add_argument("--steps", type=int, default=2, help="rollout batches (the first warms up)")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--json", type=Path, required=True, help="where the row is written")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, TRL's transformers generation")
    p.add_argument("--hf-generation", action="store_true", help="TRL's transformers generation, not vLLM")
    p.add_argument(
        "--lengths",
        choices=["equal", "spread"],
        default="equal",
        help="spread: each completion ends at its own length in [T/8, T] (length_spread.py, in TRL's vLLM)",
    )
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_grpo_step import GpuMemorySampler

    log = a.json.with_suffix(".lengths")
    if a.lengths == "spread":
        import length_spread

        log.unlink(missing_ok=True)
        os.environ.update(length_spread.spread_environment(a.model, log))
        length_spread.use_in_vllm()

    with GpuMemorySampler() as memory:
        row = run(
            a.model, a.data, a.size, a.steps, not a.no_gradient_checkpointing, a.smoke, not a.hf_generation
        )
    row["gradient_checkpointing"] = not a.no_gradient_checkpointing
    row["lengths"] = a.lengths
    if a.lengths == "spread":
        import length_spread

        tokens = int(a.size.split("x")[2])
        row["length_histogram"] = histogram(read_lengths(log), tokens)
    row["trl_peak_mem_gib"] = memory.device_peak
    row["trl_peak_mem_per_process_gib"] = {k: round(v, 2) for k, v in memory.per_process.items()}
    a.json.write_text(json.dumps(row, indent=2) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "batches"}), flush=True)


if __name__ == "__main__":
    main()
