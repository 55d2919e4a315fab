"""GPU benchmark of the learner step and the HF rollout engine on a Qwen3-VL-8B-shaped model (random bf16 weights).

Measures, with visionrl's own code paths (Learner, HFEngine, adapter payload):
- learner update: LoRA r64 on all LM projections, gradient checkpointing, token-budget micro-batches;
  tokens/s (prompt + completion tokens, forward + backward) and peak memory;
- learner log-probs (no grad) tokens/s;
- HF engine: 8 prompts x n=8 = 64 completions of 256 new tokens, generated tokens/s;
- adapter sync: payload bytes and the time to serialise it and load it into the engine.
Compare with the baselines in docs/ENGINE_NOTES.md, measured on the same machine (HF generate 836 tokens/s; LoRA r64
forward+backward 4,970 tokens/s, 26 GiB peak). Prints a table and writes benchmarks/results/gpu_step-<date>.json.

Run on a CUDA machine from the repository root:  PYTHONPATH=src python benchmarks/gpu_step.py [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

import torch

BASELINES = {
    "hf_generate_tokens_per_s": 836.0,
    "lora_fwd_bwd_tokens_per_s": 4970.0,
    "lora_fwd_bwd_peak_gib": 26.0,
}


def build_8b_checkpoint(out: Path) -> Path:
    """A Qwen3-VL-8B-shaped checkpoint with random bf16 weights (`visionrl.models.shaped`)."""
    from visionrl.models.shaped import build_shaped_checkpoint

    return build_shaped_checkpoint(out, device="cuda")


def job(model_dir: Path, prompts: int, group: int, new_tokens: int, micro_tokens: int):
    from visionrl.config import config_from_dict

    return config_from_dict(
        {
            "output_dir": "unused",
            "model": {"path": str(model_dir), "dtype": "bfloat16", "gradient_checkpointing": True},
            "data": {"train": "unused.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "lora": {"rank": 64, "alpha": 128},
            "algorithm": {"group_size": group},
            "rollout": {
                "engine": "hf",
                "prompts_per_step": prompts,
                "max_new_tokens": new_tokens,
                "max_model_len": 4096,
            },
            "train": {"lr": 1e-5, "micro_batch_tokens": micro_tokens},
        }
    )


def make_prompts(processor, n: int):
    from PIL import Image

    from visionrl.types import PromptItem

    msgs = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape? " * 8}],
        }
    ]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return [
        PromptItem(text=text, images=[Image.new("RGB", (448, 448), (40 * i % 255, 90, 200))])
        for i in range(n)
    ]


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro-tokens", type=int, default=4096)
    args = p.parse_args()
    from visionrl.models.sequences import Sequence
    from visionrl.train.learner import Learner, TrainBatch
    from visionrl.types import SamplingSpec

    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, t_build = timed(lambda: build_8b_checkpoint(Path(tmp) / "qwen3vl-8b-shaped"))
        cfg = job(model_dir, args.prompts, args.group, args.new_tokens, args.micro_tokens)
        learner, t_load = timed(lambda: Learner(cfg, device="cuda"))
        prompts = make_prompts(learner.processor, args.prompts)
        prompt_len = len(learner.encode_prompts(prompts[:1])[0].input_ids)
        gen = torch.Generator().manual_seed(0)
        seqs = [
            Sequence(
                prompt=i // args.group,
                completion_ids=torch.randint(200, 100_000, (args.new_tokens,), generator=gen).tolist(),
                advantage=float((i % 2) * 2 - 1),
                sampling_logprobs=[0.0] * args.new_tokens,
            )
            for i in range(args.prompts * args.group)
        ]
        batch = TrainBatch(prompts, seqs)
        seq_tokens = len(seqs) * (prompt_len + args.new_tokens)
        learner.train_step(batch)  # warm-up
        torch.cuda.reset_peak_memory_stats()
        stats, t_update = timed(lambda: learner.train_step(batch))
        rows["learner_update_tokens_per_s"] = seq_tokens / t_update
        rows["learner_update_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows["learner_micro_batches"] = stats["learner/micro_batches"]
        _, t_lp = timed(lambda: learner.logprobs(batch))
        rows["learner_logprobs_tokens_per_s"] = seq_tokens / t_lp
        payload, t_payload = timed(learner.adapter_payload)
        rows["adapter_mib"] = sum(len(b) for b in payload.files.values()) / 2**20
        rows["adapter_serialise_s"] = t_payload
        learner = None  # free the GPU memory before the engine loads
        torch.cuda.empty_cache()

        from visionrl.rollout.hf_engine import HFEngine

        engine = HFEngine(str(model_dir), lora=cfg.lora, forbidden_token_ids=[3, 4, 5, 6], dtype="bfloat16")
        _, t_sync = timed(lambda: engine.load_adapter(payload))
        rows["adapter_load_engine_s"] = t_sync
        spec = SamplingSpec(n=args.group, temperature=1.0, max_tokens=args.new_tokens, seed=0)
        engine.generate(prompts[:2], SamplingSpec(n=2, max_tokens=8))  # warm-up
        torch.cuda.reset_peak_memory_stats()
        out, t_gen = timed(lambda: engine.generate(prompts, spec))
        generated = sum(len(c.token_ids) for g in out for c in g)
        rows["hf_generate_tokens_per_s"] = generated / t_gen
        rows["hf_generate_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result = {
        "benchmark": "gpu_step",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
        },
        "setup": {
            **vars(args),
            "prompt_tokens": prompt_len,
            "sequences": len(seqs),
            "model": "Qwen3-VL-8B-shaped, random bf16",
            "lora": "r64 on LM projections",
            "build_s": t_build,
            "learner_load_s": t_load,
        },
        "results": rows,
        "baselines_facts_md": BASELINES,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"gpu_step-{result['date'][:10]}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'metric':<34}{'visionrl':>12}{'baseline':>12}")
    for k, v in rows.items():
        base = BASELINES.get(k) or BASELINES.get(k.replace("learner_update", "lora_fwd_bwd"))
        print(f"{k:<34}{v:>12.2f}{(f'{base:.1f}' if base else '-'):>12}")


if __name__ == "__main__":
    main()
