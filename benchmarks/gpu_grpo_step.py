"""The production GRPO step on one GPU: `configs/qwen3vl_8b_grpo_lora.yaml` at Qwen3-VL-8B shape, end to end.

Writes a Qwen3-VL-8B-shaped checkpoint (random bf16 weights, real config values, a tokenizer with the real Qwen
special-token ids; `visionrl.models.shaped`) and the synthetic count task at 448x448, then runs visionrl's own
loop (`orchestrate.loop.train`: Ray actors, the vLLM engine, learner and engine colocated on the GPU) with the
shipped job file and overrides, for a few steps at each size (64 x 8 x 512 and 16 x 8 x 256 by default). Step 1
of each size warms up (CUDA graphs, allocator) and is left out of the figures.

Reported per size (benchmarks/results/gpu_grpo_step.json, and a table):
- per-phase seconds: rollout, reward, learner update (of which the old and reference log-prob passes), sync;
- tokens_per_s_per_gpu: prompt + image + response tokens of a step / step time / GPUs (EasyR1's definition);
- learner_tokens_per_s: the same tokens / update time; learner_mfu: 6 x parameters x those tokens / update time
  / 989 TFLOP/s (H200 dense bf16, datasheet; recompute and the old-log-prob pass are not counted as useful);
- rollout_generated_tokens_per_s; weights_gib; peak GPU memory of the learner and the engine processes and of
  the whole device (sampled with nvidia-smi every 0.5 s);
- the sync's profile (`sync_parts_s`): sync_load_s split into the learner's build of the adapter, its way to the
  engine, the files written, vLLM's add_lora, the old version removed and the caches reset; and sync_check_s split
  into the engines' fingerprint and the learner's scoring after it (`check_engine`; `check_learner`, 0 once the
  continuation is fixed at start-up: the learner then scores it during the load);
- start-up: `train` called to step 1's start (`startup_s`; of it the actors' start, model loads and vLLM's
  compile, and the delivery check) and to the end of step 1 (`start_to_step1_end_s`). A second size or length in
  one call starts with the compile caches of the first (vLLM's, Inductor's): a warm start.

TRL's GRPOTrainer on the same checkpoint, data and sizes (`--trl 64x8x512`; benchmarks/trl_grpo_step.py says what
is matched) runs after visionrl in its own process; its figures land in `trl` and, per size, in visionrl's row
(`trl_step_s`, `trl_tokens_per_s_per_gpu`, `trl_learner_tokens_per_s`, `trl_peak_mem_gib` and the ratios).

On a CUDA machine with vLLM and Ray, from the repository root:
    PYTHONPATH=src python benchmarks/gpu_grpo_step.py [--sizes 64x8x512,16x8x256] [--steps 3] [--trl 64x8x512]
        [--work DIR] [--merge] [--packing] [--lengths equal|spread|both] [key=value ...]
(`--work` keeps the checkpoint and data for a later call; `--merge` keeps the other rows of the results file.)
On the CPU (a smoke run of the same code with small shapes and the CPU vLLM):  ... --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from grpo_targets import print_targets, targets
from lengths import histogram, read_lengths

H200_BF16_FLOPS = 989e12
SYNC_PARTS = ("build", "transfer", "write", "add", "remove", "reset", "check_engine", "check_learner")
JOB = "configs/qwen3vl_8b_grpo_lora.yaml"


class GpuMemorySampler:
    """Peak GPU memory per process (named by its Ray actor title), per GPU (by index) and of the busiest GPU,
    from nvidia-smi."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.per_process: dict[str, float] = {}
        self.per_gpu: dict[str, float] = {}
        self.device_peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _query(self, *args: str) -> list[list[str]]:
        try:
            out = subprocess.run(
                ["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True
            )
        except OSError:  # no NVIDIA driver (the CPU smoke run)
            return []
        return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for index, used in self._query("--query-gpu=index,memory.used"):
                gib = float(used) / 1024
                self.per_gpu[index] = max(self.per_gpu.get(index, 0.0), gib)
                self.device_peak = max(self.device_peak, gib)
            for pid, used in self._query("--query-compute-apps=pid,used_memory"):
                name = _process_title(pid)
                self.per_process[name] = max(self.per_process.get(name, 0.0), float(used) / 1024)


def _process_title(pid: str) -> str:
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return f"pid {pid}"
    for actor in ("LearnerActor", "RolloutActor"):
        if actor in title:
            return actor
    return title[:40] or f"pid {pid}"


def build_model(out: Path, smoke: bool) -> float:
    """The checkpoint, written by a child process so that this one never holds a CUDA context."""
    code = (
        "from pathlib import Path; "
        "from visionrl.models.shaped import SMALL_TEXT, SMALL_VISION, build_shaped_checkpoint; "
        f"smoke = {smoke}; "
        f"build_shaped_checkpoint(Path({str(out)!r}), device='cpu' if smoke else 'cuda', "
        "dtype='float32' if smoke else 'bfloat16', text=SMALL_TEXT if smoke else None, "
        "vision=SMALL_VISION if smoke else None)"
    )
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t


def overrides_for(size: str, model: Path, data: Path, run: Path, steps: int, smoke: bool) -> list[str]:
    prompts, group, tokens = (int(x) for x in size.split("x"))
    over = [
        f"output_dir={run}",
        f"model.path={model}",
        f"data.train={data / 'train.jsonl'}",
        "data.eval=null",
        f"rollout.prompts_per_step={prompts}",
        f"algorithm.group_size={group}",
        f"rollout.max_new_tokens={tokens}",
        f"train.steps={steps}",
        "logging.eval_every=100000",
        "logging.save_every=100000",
        "logging.images_every=100000",
    ]
    if smoke:  # the same loop on the CPU: no GPUs, float32, the CPU engine's small KV cache
        over += [
            "model.dtype=float32",
            "rollout.gpus_per_engine=0",
            "ray.learner_gpus=0",
            "model.gradient_checkpointing=false",
            "algorithm.overlong_buffer=null",
            "train.compile=false",  # inductor on 2 CPU cores takes minutes; the smoke run checks the script
            "rollout.sleep_during_update=false",  # no GPU memory to share
        ]
    return over


def measure(
    size: str, history: list[dict[str, float]], params: float, memory: GpuMemorySampler
) -> dict[str, Any]:
    rows = history[1:] if len(history) > 1 else history  # step 1 warms up
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
    step_s, update_s = mean("timing/step_s"), mean("timing/update_s")
    tokens = mean("learner/sequence_tokens")
    return {
        "size": size,
        "steps_measured": len(rows),
        "step_s": step_s,
        "rollout_s": mean("timing/rollout_s"),
        "reward_s": mean("timing/reward_s"),
        "update_s": update_s,
        "old_logprob_s": mean("learner/old_logprob_s"),
        "ref_logprob_s": mean("learner/ref_logprob_s"),
        "engine_sleep_s": mean("timing/engine_sleep_s"),
        "engine_wake_s": mean("timing/engine_wake_s"),
        "sync_s": mean("timing/sync_s"),
        "sync_load_s": mean("timing/sync_load_s"),  # the adapter to the engine, loaded there
        "sync_check_s": mean("timing/sync_check_s"),  # the per-step fingerprint (delivery check)
        # sync_load_s's parts: the learner's build, the way to the engine (object store, actor queue), the files
        # written, vLLM's add_lora, the old version removed, the caches reset (the slowest engine's each)
        "sync_parts_s": {
            part: mean(f"timing/sync_{part}_s") for part in SYNC_PARTS if f"timing/sync_{part}_s" in rows[0]
        },
        "judge_s": mean("timing/judge_s"),  # part of reward_s: a `judge` reward's batches (0 without one)
        "judge_mean": mean("reward/judge_mean"),
        # the per-sync delivery check (orchestrate.delivery)
        "fingerprint_diff": mean("rollout/fingerprint_diff"),
        "rollout_wait_s": mean("timing/rollout_wait_s"),  # rollout.async_steps: the wait after the update
        "staleness": mean("rollout/staleness"),
        "sequence_tokens_per_step": tokens,
        "response_tokens_per_step": mean("response/tokens"),
        "response_length_mean": mean("response/length_mean"),
        "tokens_per_s_per_gpu": tokens / step_s,
        "learner_tokens_per_s": tokens / update_s,
        "learner_mfu": 6 * params * tokens / update_s / H200_BF16_FLOPS,
        "rollout_generated_tokens_per_s": mean("response/tokens") / mean("timing/rollout_s"),
        "peak_mem_gib": {
            "learner_torch_reserved": max(r.get("learner/peak_mem_gib", 0.0) for r in history),
            **{k: round(v, 2) for k, v in memory.per_process.items()},
            "device": memory.device_peak,
        },
        "logprob_diff": mean("rollout/logprob_diff"),
        **startup(history[0]),
    }


def startup(first: dict[str, float]) -> dict[str, float]:
    """The run's start-up, from its first step's metrics: `train` called to step 1's start, its parts (the
    actors started: model loads and vLLM's compile; the delivery check), and to the end of step 1."""
    out = {k: first.get(f"timing/{k}", 0.0) for k in ("startup_s", "start_actors_s", "delivery_check_s")}
    return out | {"start_to_step1_end_s": out["startup_s"] + first.get("timing/step_s", 0.0)}


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "vllm", "ray"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "missing"
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="64x8x512,16x8x256", help="PROMPTSxGROUPxTOKENS, comma-separated")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument(
        "--smoke", action="store_true", help="CPU: tiny shapes, checks the script, measures nothing"
    )
    p.add_argument(
        "--merge", action="store_true", help="keep the other sizes rows of an earlier results file"
    )
    p.add_argument("--trl", default="", help="sizes to run TRL's GRPOTrainer on too (trl_grpo_step.py)")
    p.add_argument("--trl-steps", type=int, default=2)
    p.add_argument(
        "--trl-recompute",
        default="on,off",
        help="TRL's settings to run: activation recompute on (its default), off (faster where memory allows)",
    )
    p.add_argument("--trl-hf-generation", action="store_true", help="TRL without vLLM (its slower mode)")
    p.add_argument("--work", default="", help="keep the checkpoint and data here (reused by a later call)")
    p.add_argument(
        "--targets-only",
        action="store_true",
        help="measure nothing: recompute the TRL ratios and the targets of the results file in --out",
    )
    p.add_argument(
        "--packing",
        action="store_true",
        help="the learner packs sequences end to end (train.packing=true) instead of padding them",
    )
    p.add_argument(
        "--lengths",
        choices=["equal", "spread", "both"],
        default="equal",
        help="completion lengths: all max_new_tokens (random weights never end a turn), or each its own, drawn "
        "from [T/8, T] (length_spread.py; its histogram in the row); both: a row of each per size, TRL's too",
    )
    p.add_argument(
        "--cap-gib",
        type=float,
        default=None,
        help="run as on a card of this many GiB (an H100 80GB: 79.6): the learner capped there "
        "(train.gpu_memory_gib) and the engine's share scaled to the same GiB of this card",
    )
    p.add_argument("overrides", nargs="*", help="extra key=value overrides of the job file, for every size")
    args = p.parse_args()
    if args.packing:
        args.overrides = [*args.overrides, "train.packing=true"]
    if args.cap_gib:
        import torch

        from visionrl.config import load_config

        if not torch.cuda.is_available():
            p.error(
                "--cap-gib needs a GPU: it caps the learner on the card and scales the engine's share of it"
            )
        total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        share = load_config(JOB).rollout.gpu_memory_utilization
        args.overrides = capped_overrides(args.overrides, args.cap_gib, total_gib, share)
    if args.targets_only:
        path = Path(args.out) / "gpu_grpo_step.json"
        report = json.loads(path.read_text())
        attach_trl(report)
        report["targets"] = targets(report)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print_targets(report["targets"])
        return
    logging_setup()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        model, data = work / "qwen3vl-8b-shaped", work / "count448"
        build_s = 0.0 if (model / "config.json").exists() else build_model(model, args.smoke)
        if not (data / "train.jsonl").exists():
            from visionrl.data.synthetic import make_dataset

            make_dataset(
                data, "count", num_train=512, num_eval=0, seed=0, image_size=64 if args.smoke else 448
            )
        params = _param_count(model)
        kinds = ["equal", "spread"] if args.lengths == "both" else [args.lengths]
        results = [
            run_visionrl(size, model, data, work, args.steps, args.smoke, params, args.overrides, lengths)
            for size in filter(None, args.sizes.split(","))
            for lengths in kinds
        ]
        trl_rows = [
            run_trl(
                size,
                model,
                data,
                work,
                args.trl_steps,
                args.trl_hf_generation,
                args.smoke,
                lengths,
                on == "on",
            )
            for size in filter(None, args.trl.split(","))
            for lengths in kinds
            for on in filter(None, args.trl_recompute.split(","))
        ]
        cfg0 = json.loads((model / "config.json").read_text())
    report = {
        "benchmark": "gpu_grpo_step",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"device": _device_name(), "gpus": 1, **versions()},
        "setup": {
            "job": JOB,
            "model": "Qwen3-VL-8B shape, random bf16 weights",
            "parameters": params,
            "weights_gib": params * 2 / 2**30,
            "text_layers": cfg0["text_config"]["num_hidden_layers"],
            "task": "synthetic count, one 448x448 image per prompt",
            "build_s": build_s,
            "placement": "colocated, one GPU",
        },
        "results": results,
        "trl": trl_rows,
    }
    if args.smoke:
        print(json.dumps(report, indent=1)[:600])
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_grpo_step.json"
    if args.merge and path.exists():  # several calls on one machine, one file: other rows are kept
        merge(report, json.loads(path.read_text()))
    attach_trl(report)
    report["targets"] = targets(report)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report["results"])
    print_targets(report["targets"])


def capped_overrides(overrides: list[str], cap_gib: float, total_gib: float, job_share: float) -> list[str]:
    """`overrides` for a card of `cap_gib` GiB run on one of `total_gib`: the learner capped at `cap_gib` and the
    engine's share (the last override's, else the job's) scaled so that it takes the same GiB as there."""
    key = "rollout.gpu_memory_utilization="
    share = next((float(o[len(key) :]) for o in reversed(overrides) if o.startswith(key)), job_share)
    kept = [o for o in overrides if not o.startswith(key)]
    return [*kept, f"{key}{share * cap_gib / total_gib:.4f}", f"train.gpu_memory_gib={cap_gib:g}"]


def row_label(size: str, lengths: str, extra: list[str]) -> str:
    """What a visionrl row is called: its size, "spread" for spread lengths, and a learner cap (`--cap-gib`) in GiB,
    so that a capped run never replaces the card's own row of that size when results merge."""
    cap = [o.split("=", 1)[1] for o in extra if o.startswith("train.gpu_memory_gib=")]
    return " ".join(
        [size, *(["spread"] if lengths == "spread" else []), *([f"at {cap[-1]} GiB"] if cap else [])]
    )


def run_visionrl(
    size: str, model: Path, data: Path, work: Path, steps: int, smoke: bool, params: float, extra: list[str],
    lengths: str = "equal",
) -> dict[str, Any]:  # fmt: skip
    """visionrl's loop at `size`; with `lengths` spread, every completion ends at its own length (the rollout
    engines get length_spread.SpreadLengths through rollout.vllm_engine_args). The row's size is `row_label`'s."""
    from visionrl.config import load_config
    from visionrl.orchestrate.loop import train

    label = row_label(size, lengths, extra)
    over = overrides_for(size, model, data, work / f"run-{label.replace(' ', '-')}", steps, smoke) + list(
        extra
    )
    log = work / f"lengths-{label.replace(' ', '-')}.txt"
    saved = dict(os.environ)
    import length_spread  # vLLM's logits processor interface: this benchmark runs vLLM anyway

    if lengths == "spread":
        log.unlink(missing_ok=True)
        os.environ.update(
            length_spread.spread_environment(model, log)
        )  # before Ray starts: its workers inherit
        over.append("rollout.vllm_engine_args={logits_processors: [length_spread:SpreadLengths]}")
    cfg = load_config(JOB, over)
    try:
        with GpuMemorySampler() as memory:
            t = time.perf_counter()
            result = train(cfg)
            wall = time.perf_counter() - t
    finally:
        os.environ.clear()
        os.environ.update(saved)
    row = measure(label, result.history, params, memory)
    row["wall_s_including_start"] = wall
    row["overrides"] = list(extra)
    row["lengths"] = lengths
    if lengths == "spread":
        row["length_histogram"] = histogram(read_lengths(log), int(size.split("x")[2]))
    print(json.dumps(row), flush=True)
    return row


def run_trl(
    size: str,
    model: Path,
    data: Path,
    work: Path,
    steps: int,
    hf: bool,
    smoke: bool,
    lengths: str = "equal",
    recompute: bool = True,
) -> dict[str, Any]:
    """TRL in its own process: a clean GPU, and its vLLM engine never meets visionrl's."""
    label = size if lengths == "equal" else f"{size} spread"
    out = work / f"trl-{label.replace(' ', '-')}-recompute-{'on' if recompute else 'off'}.json"
    script = Path(__file__).resolve().parent / "trl_grpo_step.py"
    cmd = [sys.executable, str(script), "--model", str(model), "--data", str(data), "--size", size]
    proc = subprocess.run(
        [
            *cmd,
            "--steps",
            str(steps),
            "--json",
            str(out),
            "--lengths",
            lengths,
            *(["--hf-generation"] if hf else []),
            *([] if recompute else ["--no-gradient-checkpointing"]),
        ]
    )
    if proc.returncode != 0 or not out.exists():
        status = f"TRL run failed (exit {proc.returncode}); its output is in the log"
        return {"size": label, "gradient_checkpointing": recompute, "status": status}
    row = json.loads(out.read_text())
    row["size"] = label
    return dict(row)


def row_key(table: str, row: dict[str, Any]) -> tuple[str, Any]:
    """What a row measures: its size, and for TRL also its setting (a row without one: recompute on, TRL's
    default and the only setting run before both were)."""
    return row["size"], row.get("gradient_checkpointing", True) if table == "trl" else None


def merge(report: dict[str, Any], earlier: dict[str, Any]) -> None:
    """Keep the earlier file's rows of what was not run now (sizes; TRL's sizes and settings), its other keys
    (e.g. `before`), and each replaced row under `superseded` with the date of the file it came from."""
    superseded = list(earlier.get("superseded", []))
    for key in ("results", "trl"):
        ran = {row_key(key, r) for r in report[key]}
        rows = earlier.get(key) if isinstance(earlier.get(key), list) else []
        report[key] = [r for r in rows if row_key(key, r) not in ran] + report[key]
        superseded += [
            {**r, "table": key, "file_date": earlier.get("date")} for r in rows if row_key(key, r) in ran
        ]
    for key, value in earlier.items():
        report.setdefault(key, value)
    if superseded:
        report["superseded"] = superseded


def attach_trl(report: dict[str, Any]) -> None:
    """Each of visionrl's rows gets the figures of TRL's fastest setting of the same size (its learner) and the
    ratios the targets are set in."""
    trl: dict[str, dict[str, Any]] = {}
    for r in report["trl"]:
        best = trl.get(r["size"])
        if "trl_step_s" in r and (
            best is None or r["trl_learner_tokens_per_s"] > best["trl_learner_tokens_per_s"]
        ):
            trl[r["size"]] = r
    for row in report["results"]:
        peer = trl.get(row["size"])
        if peer is None:
            continue
        for key in ("trl_step_s", "trl_tokens_per_s_per_gpu", "trl_learner_tokens_per_s", "trl_peak_mem_gib"):
            row[key] = peer[key]
        row["trl_gradient_checkpointing"] = peer.get("gradient_checkpointing", True)
        row["learner_tokens_per_s_vs_trl"] = row["learner_tokens_per_s"] / peer["trl_learner_tokens_per_s"]
        row["step_speedup_vs_trl"] = peer["trl_step_s"] / row["step_s"]


def print_table(results: list[dict[str, Any]]) -> None:
    cols = [
        "step_s",
        "rollout_s",
        "update_s",
        "old_logprob_s",
        "sync_s",
        "tokens_per_s_per_gpu",
        "learner_tokens_per_s",
        "learner_mfu",
        "rollout_generated_tokens_per_s",
        "trl_step_s",
        "trl_learner_tokens_per_s",
    ]
    print(f"\n{'size':<18}" + "".join(f"{c[:14]:>15}" for c in cols))
    for r in results:
        print(f"{r['size']:<18}" + "".join(f"{r.get(c, float('nan')):>15.3g}" for c in cols))
        print(f"{'':<18}peak GiB: {r['peak_mem_gib']}")


def _param_count(model: Path) -> float:
    from safetensors import safe_open

    n = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                size = 1
                for d in st.get_slice(k).get_shape():
                    size *= d
                n += size
    return float(n)


def _device_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "cpu"


def logging_setup() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


if __name__ == "__main__":
    main()
