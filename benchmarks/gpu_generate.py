"""Where the HF rollout engine's time goes on a GPU: plain `generate` vs the engine's extras, on the
Qwen3-VL-8B-shaped model of gpu_step.py (8 prompts x n=8, 256 new tokens, one 448x448 image each).

Variants, all timed on the same prompts in one run:
- plain:        model.generate, no LoRA, no scores (the baseline setting of docs/ENGINE_NOTES.md)
- lora:         the peft model (LoRA r64, unmerged), no scores
- lora+scores:  as the HF engine runs: unmerged LoRA, processed scores kept for log-probs
- merged+scores: LoRA merged into the weights for generation, scores kept
Prints a table, writes benchmarks/results/gpu_generate-<date>.json.

    PYTHONPATH=src python benchmarks/gpu_generate.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_step import build_8b_checkpoint, job, make_prompts, timed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args()
    from visionrl.models.loader import apply_lora, load_base_model, load_processor

    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_8b_checkpoint(Path(tmp) / "m")
        cfg = job(model_dir, 8, 8, args.new_tokens, 4096)
        processor = load_processor(model_dir)
        processor.tokenizer.padding_side = "left"
        prompts = make_prompts(processor, 8)
        enc = processor(
            text=[x.text for x in prompts],
            images=[x.images[0] for x in prompts],
            return_tensors="pt",
            padding=True,
        ).to("cuda")
        base = load_base_model(model_dir, "bfloat16", "cuda")
        common = {
            "max_new_tokens": args.new_tokens,
            "min_new_tokens": args.new_tokens,
            "num_return_sequences": 8,
            "do_sample": True,
            "temperature": 1.0,
            "top_k": 0,
            "pad_token_id": 0,
        }

        def run(model, scores: bool) -> float:
            model.generate(**enc, **{**common, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
            out, t = timed(
                lambda: model.generate(**enc, **common, output_scores=scores, return_dict_in_generate=True)
            )
            return out.sequences[:, enc["input_ids"].shape[1] :].numel() / t

        rows["plain_tokens_per_s"] = run(base, False)
        peft_model = apply_lora(base, cfg.lora).eval()
        with torch.no_grad():
            for n, w in peft_model.named_parameters():
                if "lora_B" in n:
                    w.normal_(std=1e-3)
        rows["lora_tokens_per_s"] = run(peft_model, False)
        rows["lora_scores_tokens_per_s"] = run(peft_model, True)
        peft_model.merge_adapter()
        rows["merged_scores_tokens_per_s"] = run(peft_model, True)
        rows["merged_tokens_per_s"] = run(peft_model, False)
    result = {
        "benchmark": "gpu_generate",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__},
        "setup": {
            "prompts": 8,
            "n": 8,
            "new_tokens": args.new_tokens,
            "model": "Qwen3-VL-8B-shaped bf16",
            "lora": "r64 LM projections",
        },
        "results": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_generate-{result['date'][:10]}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'variant':<32}{'tokens/s':>10}")
    for k, v in rows.items():
        print(f"{k:<32}{v:>10.1f}")


if __name__ == "__main__":
    main()
