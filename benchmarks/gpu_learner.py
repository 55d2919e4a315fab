"""The learner's speed and memory levers, one at a time, on a Qwen3-VL-8B-shaped model (random bf16 weights).

Runs visionrl's own `Learner.train_step` (LoRA r64 on the LM projections and the merger, as the production job)
on one batch of P prompts x G completions (448x448 images, random completion tokens), with each lever switched on
in turn, and prints per-variant seconds, tokens/s and peak memory. Also times the Qwen3-VL vision tower alone
(its Conv3d patch embedding against the same weights as one matmul). Predictions and outcomes are kept in
benchmarks/NOTES-gpu-learner.md; the results file is benchmarks/results/gpu_learner.json.

On a CUDA machine, from the repository root:
    PYTHONPATH=src python benchmarks/gpu_learner.py [--prompts 16] [--group 8] [--new-tokens 512]
On the CPU (a smoke run of the same code with small shapes):  ... --smoke
Padding-free packing (`train.packing`): `--packing` turns it on in any mode; `--packing-levers` times the shipped
setting padded and then packed, on each attention path of a packed row (`train.packed_attention`: SDPA's dense
document mask, torch's varlen_attn, FlexAttention where torch has it), on equal and spread completion lengths
(`--lengths equal|spread|both`; spread: each length drawn from [T/8, T], seeded, its histogram printed), and prints
a summary of spread against equal tokens/s per path; `--attn` picks the learner's attention kernel. What the
machine's torch has: benchmarks/attention_probe.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lengths import histogram, histogram_line

from visionrl.models.shaped import SMALL_TEXT as SMOKE_TEXT
from visionrl.models.shaped import SMALL_VISION as SMOKE_VISION

# Each variant: a name, what it changes (applied on top of the previous ones unless `alone`), and the prediction
# written before the run (benchmarks/NOTES-gpu-learner.md explains them).
VARIANTS: list[dict[str, Any]] = [
    {
        "name": "before: full logits, image per row, all layers checkpointed",
        "train": {"logit_chunk_tokens": 0, "share_images": False},
        "ckpt": None,
    },
    {"name": "+ logits in chunks of 2048 tokens", "train": {"logit_chunk_tokens": 2048}},
    {"name": "+ each image encoded once per micro-batch", "train": {"share_images": True}},
    {"name": "+ checkpoint half the layers (18 of 36)", "ckpt": "half"},
    {"name": "  same, micro-batch 8192", "train": {"micro_batch_tokens": 8192}},
    {"name": "+ no checkpointing, micro-batch 4096", "ckpt": 0, "train": {"micro_batch_tokens": 4096}},
    {"name": "  same, micro-batch 8192", "train": {"micro_batch_tokens": 8192}},
]
# The job-file settings of each variant from the checkpointing ones on, for picking the production setting.
SETTINGS = {
    3: ["model.checkpoint_layers=18", "train.micro_batch_tokens=16384"],
    4: ["model.checkpoint_layers=18", "train.micro_batch_tokens=8192"],
    5: ["model.gradient_checkpointing=false", "train.micro_batch_tokens=4096"],
    6: ["model.gradient_checkpointing=false", "train.micro_batch_tokens=8192"],
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def job(model_dir: Path, args: argparse.Namespace):
    from visionrl.config import config_from_dict

    return config_from_dict(
        {
            "output_dir": "unused",
            "model": {
                "path": str(model_dir),
                "dtype": "float32" if args.smoke else "bfloat16",
                "gradient_checkpointing": True,
                "attn_implementation": args.attn,
            },
            "data": {"train": "unused.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "lora": {"rank": 64, "alpha": 128, "train_merger": True},
            "algorithm": {"group_size": args.group, "updates_per_batch": 2, "clip_high": 0.28},
            "rollout": {"prompts_per_step": args.prompts, "max_new_tokens": args.new_tokens},
            "train": {"lr": 1e-5, "micro_batch_tokens": 16384, "packing": args.packing},
        }
    )


def make_batch(learner, args: argparse.Namespace, spread: bool):
    """P prompts with one image each, G random completions per prompt: all of length T, or spread over [T/8, T]."""
    from PIL import Image

    from visionrl.models.sequences import Sequence
    from visionrl.train.learner import TrainBatch
    from visionrl.types import PromptItem

    msgs = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "how many shapes are there?"}],
        }
    ]
    text = learner.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    size = args.image_size
    prompts = [
        PromptItem(text=text, images=[Image.new("RGB", (size, size), (37 * i % 255, 90, 200))])
        for i in range(args.prompts)
    ]
    gen = torch.Generator().manual_seed(0)
    vocab = learner.model.get_base_model().config.text_config.vocab_size
    seqs = []
    for i in range(args.prompts * args.group):
        n = (
            args.new_tokens
            if not spread
            else int(torch.randint(args.new_tokens // 8, args.new_tokens + 1, (1,), generator=gen))
        )
        seqs.append(
            Sequence(
                prompt=i // args.group,
                completion_ids=torch.randint(100, min(vocab, 150_000), (n,), generator=gen).tolist(),
                advantage=float(torch.randn((), generator=gen)),
                sampling_logprobs=[-11.0] * n,
            )
        )
    return TrainBatch(prompts, seqs)


def length_histogram(batch, new_tokens: int) -> list[dict[str, int]]:
    """The batch's completion lengths in eight equal bins of [1, T] (lengths.histogram, as the loop's rows)."""
    return histogram([len(s.completion_ids) for s in batch.sequences], new_tokens)


def configure(learner, variant: dict[str, Any]) -> None:
    for k, v in variant.get("train", {}).items():
        setattr(learner.cfg.train, k, v)
    for k, v in variant.get("algorithm", {}).items():
        setattr(learner.cfg.algorithm, k, v)
    if "kernel" in variant:  # a packed row's attention (models.packed_attention), switched in place
        from visionrl.models.packed_attention import setup_packed_attention

        base = learner.model.get_base_model()
        attn = learner.cfg.model.attn_implementation
        learner.packed_kernel = setup_packed_attention(base, variant["kernel"], attn)
    if "ckpt" in variant:
        n = variant["ckpt"]
        layers = len(learner.model.get_base_model().model.language_model.layers)
        n = {"half": layers // 2, "all": layers}.get(n, n)
        if n == 0:
            learner.model.gradient_checkpointing_disable()
        else:
            from visionrl.models.loader import checkpoint_layers

            checkpoint_layers(learner.model, n)


def timed_step(learner, batch) -> dict[str, float]:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _sync()
    t = time.perf_counter()
    stats = learner.train_step(batch)
    _sync()
    wall = time.perf_counter() - t
    return {
        "step_s": wall,
        "old_logprob_s": stats["learner/old_logprob_s"],
        "sequence_tokens": stats["learner/sequence_tokens"],
        "tokens_per_s": stats["learner/sequence_tokens"] / wall,
        "peak_mem_gib": stats.get("learner/peak_mem_gib", 0.0),
        "micro_batches": stats["learner/micro_batches"],
    }


def vision_tower(learner, args: argparse.Namespace, n_images: int) -> dict[str, float]:
    """The vision tower alone on n_images: forward, and its Conv3d patch embedding vs the same weights as a matmul."""
    from PIL import Image

    visual = learner.model.get_base_model().model.visual
    imgs = [Image.new("RGB", (args.image_size, args.image_size), (i, 90, 200)) for i in range(n_images)]
    enc = learner.processor.image_processor(images=imgs, return_tensors="pt")
    dev, dt = learner.device, learner.model.dtype
    px, grid = enc["pixel_values"].to(dev, dt), enc["image_grid_thw"].to(dev)
    out: dict[str, float] = {}
    with torch.no_grad():
        for label, fn in (
            ("vision_forward_ms", lambda: visual(px, grid_thw=grid)),
            # the loader runs the patch embedding as a matmul (visionrl.models.patch_embed); the class's own
            # forward is the Conv3d
            ("patch_embed_conv3d_ms", lambda: type(visual.patch_embed).forward(visual.patch_embed, px)),
            ("patch_embed_matmul_ms", lambda: visual.patch_embed(px)),
        ):
            fn()
            _sync()
            t = time.perf_counter()
            for _ in range(3):
                fn()
            _sync()
            out[label] = (time.perf_counter() - t) / 3 * 1000
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument(
        "--smoke", action="store_true", help="small shapes on the CPU: checks the script, measures nothing"
    )
    p.add_argument(
        "--best-to",
        help="write the job-file overrides of the fastest variant whose peak fits --memory-budget-gib here",
    )
    p.add_argument("--memory-budget-gib", type=float, default=76.0, help="the learner's share when colocated")
    p.add_argument(
        "--packing",
        action="store_true",
        help="train.packing: sequences end to end in rows of the token budget instead of padded micro-batches",
    )
    p.add_argument(
        "--lengths",
        choices=["equal", "spread", "both"],
        default="both",
        help="completion lengths: all T, or each drawn from [T/8, T] (seeded; its histogram is printed); the "
        "lever modes time the lengths asked for, the default run its variants on this one (both: equal) and "
        "one row on the spread",
    )
    p.add_argument(
        "--packing-levers",
        action="store_true",
        help="only the shipped setting padded and then packed, on the lengths asked for; adds their rows to the "
        "results file as `packing` (the target: spread lengths at least 95%% of the equal-length tokens/s)",
    )
    p.add_argument(
        "--layout-only",
        action="store_true",
        help="only the no-recompute settings on equal and spread completion lengths; adds their rows to the "
        "results file as `layout` (the rows' layout: all padding at the end, no attention mask)",
    )
    p.add_argument(
        "--next-levers",
        action="store_true",
        help="only the levers after the shipped setting (no recompute, micro-batch 8192): the engine's log-probs "
        "as the old policy, then compiled decoder layers; adds their rows to the results file as `next_levers`",
    )
    p.add_argument("--compile-layers", action="store_true", help="--packing-levers with train.compile")
    p.add_argument(
        "--lean",
        action="store_true",
        help="--packing-levers at the job file's 80 GB setting (every layer recomputed, micro-batch 4096) "
        "instead of the shipped one (no recompute, micro-batch 8192)",
    )
    p.add_argument(
        "--attn",
        default="sdpa",
        help="model.attn_implementation of the learner (sdpa, eager, flash_attention_2)",
    )
    args = p.parse_args()
    if args.smoke:  # the script's path on small shapes (the 8B batch's logits would fill the CPU's memory)
        args.prompts, args.group, args.new_tokens, args.image_size = 2, 4, 64, 64
    if args.layout_only:
        layout_rows(args)
        return
    if args.next_levers:
        next_lever_rows(args)
        return
    if args.packing_levers:
        packing_rows(args)
        return
    from visionrl.train.learner import Learner

    device = "cpu" if args.smoke else "cuda"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = shaped_checkpoint(Path(tmp), args)
        t_build = time.perf_counter() - t0
        cfg = job(model_dir, args)
        learner = Learner(cfg, device=device)
        batch = make_batch(learner, args, spread=args.lengths == "spread")
        configure(learner, VARIANTS[0])
        learner.train_step(batch)  # warm-up: kernels, cuBLAS handles, the allocator's first segments
        for v in VARIANTS:
            configure(learner, v)
            try:
                r = timed_step(learner, batch)
            except torch.OutOfMemoryError:
                rows.append({"variant": v["name"], "error": "out of memory"})
                print(f"{v['name']:<62} out of memory", flush=True)
                continue
            rows.append({"variant": v["name"], **r})
            print(
                f"{v['name']:<62} {r['step_s']:7.1f} s {r['tokens_per_s']:9.0f} tok/s {r['peak_mem_gib']:6.1f} GiB",
                flush=True,
            )
        if args.lengths != "spread":
            spread = make_batch(learner, args, spread=True)
            r = timed_step(learner, spread)
            rows.append({"variant": "last variant, completion lengths spread over [T/8, T]", **r})
            print(f"spread lengths: {histogram_line(length_histogram(spread, args.new_tokens))}")
        vision = vision_tower(learner, args, 64)
        weights_gib = sum(t.numel() * t.element_size() for t in learner.model.parameters()) / 2**30
    result = {
        "benchmark": "gpu_learner",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "device": torch.cuda.get_device_name(0)
            if torch.cuda.is_available()
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "peft": __import__("peft").__version__,
        },
        "setup": {
            **vars(args),
            "build_s": t_build,
            "weights_gib": weights_gib,
            "lora": "r64 LM projections + merger",
        },
        "variants": rows,
        "vision_tower_64_images": vision,
    }
    fits = [
        (r["step_s"], i)
        for i, r in enumerate(rows[: len(VARIANTS)])
        if i in SETTINGS and "error" not in r and r["peak_mem_gib"] <= args.memory_budget_gib
    ]
    result["best_within_budget"] = SETTINGS[min(fits)[1]] if fits else None
    if args.best_to and fits:
        Path(args.best_to).write_text(" ".join(SETTINGS[min(fits)[1]]) + "\n")
    if args.smoke:
        print(json.dumps(result, indent=1)[:400], result["best_within_budget"])
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_learner.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'variant':<62}{'s':>8}{'tok/s':>9}{'old-lp s':>10}{'GiB':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<62} {r['error']}")
            continue
        print(
            f"{r['variant']:<62}{r['step_s']:8.1f}{r['tokens_per_s']:9.0f}{r['old_logprob_s']:10.1f}{r['peak_mem_gib']:7.1f}"
        )
    print("best within budget:", result["best_within_budget"])
    print(json.dumps(vision))


def shaped_checkpoint(tmp: Path, args: argparse.Namespace) -> Path:
    """The 8B-shaped checkpoint (small shapes with --smoke) in `tmp`."""
    from visionrl.models.shaped import build_shaped_checkpoint

    return build_shaped_checkpoint(
        tmp / "qwen3vl-8b-shaped",
        device="cpu" if args.smoke else "cuda",
        dtype="float32" if args.smoke else "bfloat16",
        text=SMOKE_TEXT if args.smoke else None,
        vision=SMOKE_VISION if args.smoke else None,
    )


def lever_rows(args: argparse.Namespace, variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of `variants` applied on top of the ones before (after a warm-up step with VARIANTS[0]), timed on
    equal and on spread completion lengths; a variant that compiles the decoder layers (`compile`) has its
    first step, the compilation, timed apart."""
    from visionrl.train.forward import compile_decoder_layers
    from visionrl.train.learner import Learner

    device = "cpu" if args.smoke else "cuda"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shaped_checkpoint(Path(tmp), args)
        learner = Learner(job(model_dir, args), device=device)
        equal, spread = make_batch(learner, args, spread=False), make_batch(learner, args, spread=True)
        batches = [("equal lengths", equal), ("lengths spread over [T/8, T]", spread)]
        batches = [b for b in batches if args.lengths == "both" or b[0].startswith(args.lengths)]
        configure(learner, VARIANTS[0])
        learner.train_step(batches[0][1])  # warm-up
        for v in variants:
            configure(learner, v)
            if v.get("compile") or v.get("warmup"):  # compiles (again, for a new attention kernel): apart
                if v.get("compile"):
                    compile_decoder_layers(learner.model)
                rows.append({"variant": f"{v['name']}: first step (compiles)", **timed_step(learner, equal)})
            for name, batch in batches:
                try:
                    r = timed_step(learner, batch)
                except torch.OutOfMemoryError:
                    r = {"error": "out of memory"}
                hist = length_histogram(batch, args.new_tokens)
                rows.append({"variant": f"{v['name'].strip()}, {name}", **r, "length_histogram": hist})
                rows[-1].update(
                    lever=v["name"].strip(),
                    lengths="spread" if "spread" in name else "equal",
                    kernel=kernel_of(learner),
                )
                print(json.dumps(rows[-1]), flush=True)
    print_lever_table(rows)
    return rows


def kernel_of(learner) -> str:
    """The attention a micro-batch of the learner runs on: padded rows, or the packed row's kernel."""
    return learner.packed_kernel if learner.cfg.train.packing else "padded"


def print_lever_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a table, each with the histogram of its completion lengths (T/8-wide bins)."""
    print(f"\n{'variant':<90}{'s':>8}{'tok/s':>9}{'old-lp s':>10}{'GiB':>7}  completion lengths")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<90} {r['error']}")
            continue
        hist = histogram_line(r["length_histogram"]) if "length_histogram" in r else ""
        print(
            f"{r['variant']:<90}{r['step_s']:8.2f}{r['tokens_per_s']:9.0f}{r['old_logprob_s']:10.2f}"
            f"{r['peak_mem_gib']:7.1f}  {hist}"
        )


def save_section(args: argparse.Namespace, key: str, section: dict[str, Any]) -> None:
    """`section`, dated, under `key` of the results file, the file's other keys kept (nothing with --smoke)."""
    if args.smoke:
        return
    path = Path(args.out) / "gpu_learner.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result[key] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **section}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def layout_rows(args: argparse.Namespace) -> None:
    rows = lever_rows(args, VARIANTS[5:7])
    what = (
        "rows [prompt | completion | pad], no attention mask (models.sequences); "
        "no-grad passes at max(16384, micro_batch_tokens) tokens"
    )
    save_section(args, "layout", {"what": what, "rows": rows})


NEXT_LEVERS: list[dict[str, Any]] = [
    {"name": "shipped: no recompute, micro-batch 8192", "ckpt": 0, "train": {"micro_batch_tokens": 8192}},
    {
        "name": "+ engine log-probs as the old policy (no old-log-prob pass)",
        # in this order: each assignment is validated, and old_logprobs=engine needs the correction off
        "algorithm": {"rollout_correction": "off", "old_logprobs": "engine"},
    },
    {"name": "+ compiled decoder layers", "compile": True},
]


def next_lever_rows(args: argparse.Namespace) -> None:
    """The levers of benchmarks/NOTES-gpu-learner.md's CPU-only session, each on top of the one before."""
    rows = lever_rows(args, NEXT_LEVERS)
    device = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    save_section(
        args, "next_levers", {"device": device, "versions": {"torch": torch.__version__}, "rows": rows}
    )


PACKING_LEVERS: list[dict[str, Any]] = [
    {
        "name": "shipped: no recompute, micro-batch 8192, engine log-probs, padded rows",
        "ckpt": 0,
        "train": {"micro_batch_tokens": 8192, "packing": False},
        "algorithm": {"rollout_correction": "off", "old_logprobs": "engine"},
    },
    {
        "name": "+ packed rows, SDPA with the dense document mask",
        "train": {"packing": True},
        "kernel": "sdpa_mask",
    },
    {"name": "  packed rows, varlen_attn", "kernel": "varlen"},
    {"name": "  packed rows, FlexAttention (document block mask)", "kernel": "flex"},
]


def packing_rows(args: argparse.Namespace) -> None:
    """The shipped learner setting padded, then packed on each attention path of a packed row (dense document
    mask, torch's varlen_attn, FlexAttention where this torch has it), on the lengths asked for (`--lengths`);
    compiled layers with `--compile-layers` (each path's first step, which compiles, timed apart). The target:
    packed spread >= 95% of equal tokens/s."""
    from visionrl.models.packed_attention import flex_missing

    levers = [dict(v) for v in PACKING_LEVERS if v.get("kernel") != "flex" or flex_missing() is None]
    if args.lean:  # the 80 GB card's setting (the job file's header)
        first = levers[0]
        name = first["name"].replace("no recompute, micro-batch 8192", "80 GB: recompute, micro-batch 4096")
        levers[0] = {
            **first,
            "name": name,
            "ckpt": "all",
            "train": {**first["train"], "micro_batch_tokens": 4096},
        }
    if args.compile_layers:
        levers = [{**levers[0], "compile": True}] + [{**v, "warmup": True} for v in levers[1:]]
    args.packing = True  # the learner starts packed: the registered attention is installed (then switched)
    rows = lever_rows(args, levers)
    summary = packing_summary(rows)
    device = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    section = {"device": device, "attn": args.attn, "versions": {"torch": torch.__version__}, "rows": rows}
    save_section(args, "packing", {**section, "summary": summary})


def packing_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per lever (the attention path asked for, and the kernel that ran): tokens/s at equal and spread lengths,
    spread as a share of its own equal-length figure and of the padded equal-length one (the target: >= 95%)."""
    by: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if "kernel" in r and "tokens_per_s" in r:
            by.setdefault((r["lever"], r["kernel"]), {})[r["lengths"]] = r["tokens_per_s"]
    padded_equal = next((t.get("equal") for (_, k), t in by.items() if k == "padded"), None)
    out = []
    print(
        f"\n{'lever':<56}{'kernel':<11}{'equal tok/s':>12}{'spread tok/s':>13}{'spread/eq':>10}{'/padded eq':>11}"
    )
    for (lever, kernel), t in by.items():
        eq, sp = t.get("equal"), t.get("spread")
        own = sp / eq if eq and sp else None
        vs_padded = sp / padded_equal if padded_equal and sp else None
        out.append(
            {"lever": lever, "kernel": kernel, "equal": eq, "spread": sp}
            | {"spread_over_equal": own, "spread_over_padded_equal": vs_padded}
        )
        tps = "".join(f"{x:>{w}.0f}" if x else f"{'-':>{w}}" for x, w in ((eq, 12), (sp, 13)))
        shares = "".join(f"{x:>{w}.1%}" if x else f"{'-':>{w}}" for x, w in ((own, 10), (vs_padded, 11)))
        print(f"{lever[:55]:<56}{kernel:<11}{tps}{shares}")
    return out


if __name__ == "__main__":
    main()
