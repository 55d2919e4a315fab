"""vLLM's LoRA kernels tuned for the production job on this card: the folder the engine reads, and what it saves.

For every LoRA kernel shape of the job's model (shrink and expand of the merged qkv, o, gate_up and down
projections at the job's rank) and every token count of `--ms` (decode batches and prefill chunks), a coordinate
descent over the Triton block sizes from vLLM's default config (`visionrl.rollout.lora_kernels`), each candidate
timed as 20 calls of vLLM's own kernel in a CUDA graph. Writes the folder (`{GPU}_SHRINK.json`,
`{GPU}_EXPAND_TRUE.json`) and a results file with the default's and the tuned config's microseconds per shape,
and the LoRA kernels' time per decode step of `--decode-rows` sequences over all layers, before and after.
The job then uses it with `rollout.vllm_env={VLLM_TUNED_CONFIG_FOLDER: FOLDER}`; `gpu_rollout.py`'s `tuned_lora`
variant tunes (or reuses the folder) and measures the engine with it.

On a CUDA machine with vLLM, from the repository root:
    PYTHONPATH=src python benchmarks/lora_kernel_tune.py --model DIR [--folder DIR] [--out benchmarks/results]
On the CPU (a cost model instead of the card; checks the script's path, measures nothing):  ... --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

JOB = "configs/qwen3vl_8b_grpo_lora.yaml"
ROOT = Path(__file__).resolve().parents[1]
QWEN3_VL_8B_TEXT = {  # Qwen3-VL-8B's language model (its config.json's text_config), for --smoke without a model
    "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "num_hidden_layers": 36,
}  # fmt: skip


def text_config(model_dir: Path | None) -> dict[str, Any]:
    from visionrl.rollout.lora_kernels import language_model_config

    return dict(QWEN3_VL_8B_TEXT) if model_dir is None else language_model_config(model_dir)


def cost_model(shape: Any, m: int) -> Any:
    """--smoke's stand-in for the card: a made-up time with a minimum away from the default (no GPU)."""

    def time_fn(config: dict[str, Any]) -> float:
        if config["block_m"] * config.get("block_n", 16) > 8192:
            raise RuntimeError("out of shared memory (cost model)")
        tiles = -(-m // config["block_m"]) * -(-shape.n // config["block_n"]) * config.get("split_k", 1)
        return 2.0 + abs(tiles - 132) / 50 + config["num_stages"] * 0.1 + abs(config["block_k"] - 64) / 256

    return time_fn


def tune_folder(model_dir: Path | None, rank: int, folder: Path, ms: list[int], smoke: bool = False,
                passes: int = 2, budget_s: float = float("inf")) -> dict[str, Any]:  # fmt: skip
    """Tunes every shape of the model at `rank` on this card (a cost model with --smoke) into `folder`."""
    from visionrl.rollout.lora_kernels import KernelTimer, tune_model

    timer: Any = cost_model if smoke else KernelTimer()
    device = "NVIDIA H200" if smoke else timer.device_name
    report = tune_model(text_config(model_dir), rank, folder, timer, device, ms, budget_s, passes)
    if smoke:
        report["device"] = "cost model (--smoke)"
    return report


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "triton", "vllm"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    return info


def main() -> None:
    from visionrl.rollout.lora_kernels import DEFAULT_MS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, help="the checkpoint folder (its config.json); default Qwen3-VL-8B's shape"
    )
    p.add_argument("--rank", type=int, default=0, help="the LoRA rank (default: the job file's)")
    p.add_argument("--folder", type=Path, default=Path("lora-kernel-configs"), help="where vLLM's files go")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="the results file's folder")
    p.add_argument("--ms", default=",".join(str(m) for m in DEFAULT_MS), help="token counts, comma-separated")
    p.add_argument(
        "--decode-rows", type=int, default=512, help="the table's token count (the job's decode batch)"
    )
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=float("inf"), help="stop searching after this long")
    p.add_argument("--smoke", action="store_true", help="CPU: a cost model for the card, measures nothing")
    args = p.parse_args()
    rank = args.rank
    if not rank:
        from visionrl.config import load_config

        rank = load_config(ROOT / JOB, ["data.eval=null"]).lora.rank
    ms = [int(m) for m in args.ms.split(",")]
    report = tune_folder(
        args.model, rank, args.folder, ms, smoke=args.smoke, passes=args.passes, budget_s=args.budget_s
    )
    from visionrl.rollout.lora_kernels import report_table

    print(report_table(report, args.decode_rows))
    result = {"benchmark": "lora_kernel_tune", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": {**machine(), "device": report["device"]}, "job": JOB,
              "command": "benchmarks/lora_kernel_tune.py " + " ".join(sys.argv[1:]), **report}  # fmt: skip
    out = args.folder if args.smoke else args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_kernel_tune.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"vLLM's files in {args.folder}; results in {out / 'lora_kernel_tune.json'}")


if __name__ == "__main__":
    main()
