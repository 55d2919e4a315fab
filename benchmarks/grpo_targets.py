"""The targets of the GPU path (`benchmarks/gpu_grpo_step.py`'s `targets` block), judged from a results file's own
numbers: at 64 x 8 x 512 on one H200 unless a TRL row sets the size. A missed target names what explains it: the
shipped setting's reason where it misses on purpose, otherwise the row's own profile (where the step's seconds go),
so the file says why without a second run (benchmarks/NOTES-gpu-learner.md has the levers tried).
"""

from __future__ import annotations

from typing import Any

TOKENS_PER_S_PER_GPU_MIN = 9000.0  # equal lengths
TOKENS_PER_S_PER_GPU_SPREAD_MIN = 8500.0  # each completion its own length (--lengths spread)
GENERATED_TOKENS_PER_S_MIN = 18000.0  # the rollout's generated tokens/s, equal lengths
SYNC_S_MAX = 0.5  # the adapter to every engine and its check, a step
START_TO_STEP1_END_S_MAX = 180.0  # `visionrl train` to the end of step 1, warm compile caches
LEARNER_VS_TRL_MIN = 2.5
EXTRA_MEM_VS_TRL_MAX = 0.5
WHY_MEMORY = (
    "by design: the learner takes the memory the sleeping engine frees (no activation recompute, 8192-token "
    "micro-batches: that is the update's speed); TRL recomputes activations in about 6k-token micro-batches. "
    "model.gradient_checkpointing: true is the lean setting (an 80 GB GPU)"
)
_STEP_KEYS = (
    "step_s",
    "rollout_s",
    "update_s",
    "sync_s",
    "rollout_generated_tokens_per_s",
    "learner_tokens_per_s",
)


def step_profile(row: dict[str, Any], value: float, bound: float) -> str:
    """Where the step's seconds go, and the step the bound needs (tokens/s/GPU is tokens per step / step time)."""
    if not all(k in row for k in _STEP_KEYS):
        return ""
    return (
        f"step {row['step_s']:.1f} s = rollout {row['rollout_s']:.1f} s "
        f"({row['rollout_generated_tokens_per_s']:,.0f} generated tokens/s) + update {row['update_s']:.1f} s "
        f"({row['learner_tokens_per_s']:,.0f} learner tokens/s) + sync {row['sync_s']:.2f} s + the rest; "
        f"{bound:,.0f} needs a step of at most {row['step_s'] * value / bound:.1f} s"
    )


def sync_profile(row: dict[str, Any]) -> str:
    parts = {**row.get("sync_parts_s", {})}
    if not parts:
        return ""
    listed = ", ".join(f"{name} {seconds:.2f}" for name, seconds in parts.items())
    return f"load {row.get('sync_load_s', 0.0):.2f} s + check {row.get('sync_check_s', 0.0):.2f} s; parts (s): {listed}"


def startup_profile(row: dict[str, Any]) -> str:
    if "startup_s" not in row:
        return ""
    first = row["start_to_step1_end_s"] - row["startup_s"]
    return (
        f"start-up {row['startup_s']:.0f} s (actors and model loads {row.get('start_actors_s', 0.0):.0f} s, delivery "
        f"check {row.get('delivery_check_s', 0.0):.0f} s) + step 1 {first:.0f} s; a call's first run starts cold"
    )


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with the measured value and met / missed; a missed one names what explains it. Memory beyond
    the frozen weights: the learner process's peak minus the bf16 weights, against what TRL's training adds above
    its resident weights and engine."""
    weights = float(report["setup"]["weights_gib"])
    rows = {r["size"]: r for r in report["results"]}
    out: list[dict[str, Any]] = []

    def add(name: str, size: str, value: float, bound: float, at_most: bool, why: str = "") -> None:
        met = value <= bound if at_most else value >= bound
        out.append(
            {"target": name, "size": size, "value": value, "bound": bound, "met": met}
            | ({} if met else {"why": why or "not explained yet"})
        )

    for size, bound in (
        ("64x8x512", TOKENS_PER_S_PER_GPU_MIN),
        ("64x8x512 spread", TOKENS_PER_S_PER_GPU_SPREAD_MIN),
    ):
        if size in rows:
            value = rows[size]["tokens_per_s_per_gpu"]
            add("tokens_per_s_per_gpu", size, value, bound, False, step_profile(rows[size], value, bound))
    equal = rows.get("64x8x512", {})
    if "rollout_generated_tokens_per_s" in equal:
        add("rollout_generated_tokens_per_s", "64x8x512", equal["rollout_generated_tokens_per_s"],
            GENERATED_TOKENS_PER_S_MIN, False,
            "LoRA on every projection: benchmarks/gpu_rollout.py measures the engine with and without it")  # fmt: skip
    if "sync_parts_s" in equal:
        add("sync_s", "64x8x512", equal["sync_s"], SYNC_S_MAX, True, sync_profile(equal))
    if "start_to_step1_end_s" in equal:
        add("start_to_step1_end_s", "64x8x512", equal["start_to_step1_end_s"], START_TO_STEP1_END_S_MAX, True,
            startup_profile(equal))  # fmt: skip
    _trl_targets(report, rows, weights, add)
    return out


def learner_profile(row: dict[str, Any], peer: dict[str, Any], settings: int) -> str:
    """visionrl's learner against TRL's (its setting, and whether it is the only one measured), and the speed
    and MFU the ratio's bound needs."""
    if "learner_mfu" not in row:
        return ""
    need = LEARNER_VS_TRL_MIN * peer["trl_learner_tokens_per_s"]
    recompute = {True: "recompute on", False: "recompute off"}.get(peer.get("gradient_checkpointing"), "")
    only = ", the only TRL setting measured at this size" if settings == 1 else ", its fastest setting"
    return (
        f"visionrl's learner {row['learner_tokens_per_s']:,.0f} tokens/s ({row['learner_mfu']:.0%} MFU) against "
        f"TRL's {peer['trl_learner_tokens_per_s']:,.0f} ({recompute}{only}); {LEARNER_VS_TRL_MIN:g}x needs "
        f"{need:,.0f} tokens/s ({row['learner_mfu'] * need / row['learner_tokens_per_s']:.0%} MFU)"
    )


def _trl_targets(report: dict[str, Any], rows: dict[str, Any], weights: float, add: Any) -> None:
    """Against TRL's fastest setting of each size (every TRL row with a learner speed is one setting)."""
    measured = [r for r in report.get("trl", []) if "trl_learner_tokens_per_s" in r]
    for size in dict.fromkeys(r["size"] for r in measured):
        settings = [r for r in measured if r["size"] == size]
        peer = max(settings, key=lambda r: r["trl_learner_tokens_per_s"])
        row = rows.get(size)
        if row is None:
            continue
        ratio = row["learner_tokens_per_s"] / peer["trl_learner_tokens_per_s"]
        add("learner_tokens_per_s_vs_trl", size, ratio, LEARNER_VS_TRL_MIN, False,
            learner_profile(row, peer, len(settings)))  # fmt: skip
        peak = row["peak_mem_gib"].get("LearnerActor", row["peak_mem_gib"].get("learner_torch_reserved", 0.0))
        extra = (peak - weights) / peer["trl_training_extra_gib"]
        add("memory_beyond_weights_vs_trl", size, extra, EXTRA_MEM_VS_TRL_MAX, True, WHY_MEMORY)


def print_targets(rows: list[dict[str, Any]]) -> None:
    for t in rows:
        verdict = "met" if t["met"] else f"MISSED ({t['why']})"
        print(f"target {t['target']} at {t['size']}: {t['value']:.3g} against {t['bound']:g}: {verdict}")
