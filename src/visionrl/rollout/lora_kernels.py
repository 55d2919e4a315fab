"""vLLM's LoRA kernels tuned for one job: the shapes its engine runs, a search over the Triton kernels' block sizes
on the card, and the folder vLLM reads them from (`rollout.vllm_env: {VLLM_TUNED_CONFIG_FOLDER: DIR}`).

vLLM applies a LoRA linear as two Triton kernels, `shrink` (x @ A: hidden -> rank, one output per slice of a merged
projection) and `expand` (y += s @ B: rank -> the slices' outputs). Without a tuned folder every shape gets one
default block configuration (docs/ENGINE_NOTES.md, "LoRA kernel configs"): at the job's decode batch of 512 rows
and rank 64 LoRA costs about a fifth of the generation. A tuned folder holds `{GPU}_SHRINK.json` and
`{GPU}_EXPAND_TRUE.json`, each `[max_loras][num_slices][m][k][n] -> config`; vLLM takes the nearest m, k and n it
finds, and uses the file for every shape once it exists, so every slice count the model has must be present.

The search here is pure (`descend`, `tune`: timings come from a function), the files are plain JSON
(`vllm_files`, `write_folder`); `KernelTimer` times vLLM's own kernels on a CUDA device.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

Config = dict[str, int | None]
TimeFn = Callable[[Config], float]  # microseconds for one kernel call; raises for a config the card can't run

# The token counts tuned, in the order they are tuned (a time budget may cut the last ones): the job's decode batch
# (512 sequences) and smaller CUDA-graph sizes first, then prefill chunks. vLLM takes the nearest key for any other.
DEFAULT_MS = (512, 256, 128, 64, 16, 1, 1024, 4096, 16384)
SEARCH_SPACE: dict[str, dict[str, tuple[int, ...]]] = {
    "shrink": {
        "block_m": (16, 32, 64, 128),
        "block_n": (16, 32, 64),
        "block_k": (32, 64, 128, 256),
        "split_k": (1, 2, 4, 8, 16, 32, 64),
        "num_warps": (2, 4, 8),
        "num_stages": (2, 3, 4),
    },
    "expand": {
        "block_m": (16, 32, 64, 128),
        "block_n": (32, 64, 128, 256),
        "block_k": (16, 32, 64),
        "num_warps": (2, 4, 8),
        "num_stages": (2, 3, 4),
    },
}
# a linear, gate_up (2), qkv (3): vLLM indexes the file by the slice count, never nearest
SLICE_COUNTS = (1, 2, 3)


@dataclass(frozen=True)
class LoraShape:
    """One LoRA kernel of the model: `op` shrink (k = the input features, n = rank) or expand (k = rank, n = the
    largest slice's output features; `outs` every slice's), with `slices` outputs; `name` the projections using it."""

    op: str
    slices: int
    k: int
    n: int
    outs: tuple[int, ...]
    name: str


def language_model_config(model_dir: Path) -> dict[str, Any]:
    """The language model's part of a checkpoint's config.json (a VLM's `text_config`, else the whole file)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return dict(config.get("text_config", config))


def job_shapes(text_config: Mapping[str, Any], rank: int) -> list[LoraShape]:
    """The shrink and expand kernels of a decoder layer with LoRA on its seven projections (q, k, v, o, gate, up,
    down), from the language model's config; projections sharing a kernel shape are listed once."""
    hidden, inter = int(text_config["hidden_size"]), int(text_config["intermediate_size"])
    heads, kv_heads = int(text_config["num_attention_heads"]), int(text_config["num_key_value_heads"])
    head_dim = int(text_config.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    layers = [  # (name, input features, slice outputs)
        ("qkv_proj", hidden, (q, kv, kv)),
        ("o_proj", q, (hidden,)),
        ("gate_up_proj", hidden, (inter, inter)),
        ("down_proj", inter, (hidden,)),
    ]
    shapes: dict[tuple[str, int, int, int], LoraShape] = {}
    for name, k_in, outs in layers:
        for shape in (
            LoraShape("shrink", len(outs), k_in, rank, (rank,) * len(outs), name),
            LoraShape("expand", len(outs), rank, max(outs), outs, name),
        ):
            key = (shape.op, shape.slices, shape.k, shape.n)
            if key in shapes:
                shapes[key] = LoraShape(*key, shapes[key].outs, f"{shapes[key].name}+{name}")
            else:
                shapes[key] = shape
    return list(shapes.values())


def default_config(op: str, m: int, slices: int) -> Config:
    """vLLM 0.26's configuration when no tuned file exists (vllm/lora/ops/triton_ops/utils.py,
    `get_lora_op_configs`): the search's starting point, and what a tuned entry is measured against."""
    if op == "shrink":
        return {
            "block_m": 32, "block_n": 16, "block_k": 256 if m < 128 else 32, "split_k": 64 if m < 128 else 8,
            "num_warps": 4, "num_ctas": 1, "group_size_m": 8, "num_stages": 2, "max_nreg": None,
        }  # fmt: skip
    return {
        "block_m": 64, "block_n": 64 if slices > 1 else 128, "block_k": 32, "num_warps": 4, "num_ctas": 1,
        "num_stages": 2, "max_nreg": None,
    }  # fmt: skip


def _key(config: Config) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(config.items()))


def descend(
    time_fn: TimeFn,
    start: Config,
    space: Mapping[str, Iterable[int]],
    passes: int = 2,
    deadline: float = float("inf"),
) -> tuple[Config, float, float]:
    """Coordinate descent from `start`: each key of `space` in turn takes the value that times fastest with the
    others held, for `passes` rounds or until a round changes nothing. A config whose call raises (too many
    registers or too much shared memory for the card) is skipped. Returns the best config, its time and `start`'s
    (timed first, so the result is never slower than it). Past `deadline` (time.monotonic()) no new candidate is
    tried: the best so far is returned."""
    seen: dict[tuple[tuple[str, Any], ...], float] = {}
    errors: list[Exception] = []

    def timed(config: Config) -> float:
        key = _key(config)
        if key not in seen:
            try:
                seen[key] = float(time_fn(config))
            except Exception as err:  # this config does not compile or run here: not a candidate
                seen[key] = float("inf")
                errors.append(err)
        return seen[key]

    best, best_t = dict(start), timed(start)
    start_t = best_t
    if start_t == float("inf"):
        raise RuntimeError(
            f"vLLM's default LoRA kernel config does not run here ({start}): {errors[-1]!r}; if the device "
            "reported an error, every later kernel fails too: start the tuning again in a fresh process"
        ) from errors[-1]
    for _ in range(passes):
        moved = False
        for name, values in space.items():
            for value in values:
                if time.monotonic() > deadline:
                    return best, best_t, start_t
                trial = {**best, name: value}
                t = timed(trial)
                if t < best_t:
                    best, best_t, moved = trial, t, True
        if not moved:
            break
    return best, best_t, start_t


def tune(
    shapes: Iterable[LoraShape],
    ms: Iterable[int],
    timer: Callable[[LoraShape, int], TimeFn],
    passes: int = 2,
    progress: Callable[[dict[str, Any]], None] | None = None,
    budget_s: float = float("inf"),
) -> list[dict[str, Any]]:
    """The fastest config of every shape at every token count: one row each with the default's and the tuned
    config's microseconds (`timer(shape, m)` gives the time function of that kernel call). After `budget_s`
    seconds the remaining rows keep what they found (at least the default)."""
    deadline = time.monotonic() + budget_s
    rows = []
    shapes = list(shapes)
    for m in ms:
        for shape in shapes:
            time_fn = timer(shape, m)
            start = default_config(shape.op, m, shape.slices)
            best, best_t, start_t = descend(time_fn, start, SEARCH_SPACE[shape.op], passes, deadline)
            row = {
                "op": shape.op, "name": shape.name, "slices": shape.slices, "k": shape.k, "n": shape.n, "m": m,
                "default_us": start_t, "tuned_us": best_t, "config": best,
            }  # fmt: skip
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def vllm_files(rows: Iterable[Mapping[str, Any]], max_loras: int) -> dict[str, dict[str, Any]]:
    """The tuned rows as vLLM's files (name suffix -> data): `SHRINK` and `EXPAND_TRUE` (the linear layers add
    into their output), keyed `[max_loras + 1][slices][m][k][n]` (vLLM counts the no-LoRA slot). A slice count the
    rows lack gets the nearest one's entries: vLLM looks it up exactly."""
    files: dict[str, dict[str, Any]] = {}
    for row in rows:
        suffix = "SHRINK" if row["op"] == "shrink" else "EXPAND_TRUE"
        by_slices = files.setdefault(suffix, {}).setdefault(str(max_loras + 1), {})
        entry = by_slices.setdefault(str(row["slices"]), {}).setdefault(str(row["m"]), {})
        entry.setdefault(str(row["k"]), {})[str(row["n"])] = dict(row["config"])
    for data in files.values():
        for by_slices in data.values():
            have = sorted(int(s) for s in by_slices)
            for slices in SLICE_COUNTS:
                if str(slices) not in by_slices:
                    nearest = min(have, key=lambda s: abs(s - slices))
                    by_slices[str(slices)] = json.loads(json.dumps(by_slices[str(nearest)]))
    return files


def gpu_file_stem(device_name: str) -> str:
    """The card's name as vLLM spells it in the files' names ("NVIDIA H200" -> "NVIDIA_H200")."""
    return device_name.replace(" ", "_").replace("-", "_")


def write_folder(
    rows: Iterable[Mapping[str, Any]], folder: Path, device_name: str, max_loras: int = 1
) -> list[Path]:
    """Writes the tuned rows as vLLM's files for `device_name` into `folder` (created; files replaced whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, data in vllm_files(rows, max_loras).items():
        path = folder / f"{gpu_file_stem(device_name)}_{suffix}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        written.append(path)
    return written


def per_forward_us(rows: Iterable[Mapping[str, Any]], layers: int, m: int, key: str) -> float:
    """The LoRA kernels' microseconds in one forward of `m` tokens over `layers` decoder layers (a shape named
    "o_proj+down_proj" runs twice a layer); `key` default_us or tuned_us."""
    return layers * sum(r[key] * len(r["name"].split("+")) for r in rows if r["m"] == m)


def tune_model(
    text_config: Mapping[str, Any],
    rank: int,
    folder: Path,
    timer: Callable[[LoraShape, int], TimeFn],
    device_name: str,
    ms: Iterable[int] = DEFAULT_MS,
    budget_s: float = float("inf"),
    passes: int = 2,
) -> dict[str, Any]:
    """Tunes every LoRA kernel of the language model at `rank` and writes vLLM's files for `device_name` into
    `folder` (a progress bar on stderr). Returns the report: the rows, the seconds taken and, per token count,
    the kernels' time in one forward over all layers with vLLM's default and with the tuned configs."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    shapes, ms = job_shapes(text_config, rank), list(ms)
    bar = tqdm(total=len(shapes) * len(ms), desc="LoRA kernel shapes tuned", unit="shape")
    t = time.perf_counter()
    try:
        rows = tune(shapes, ms, timer, passes=passes, progress=lambda _row: bar.update(), budget_s=budget_s)
    finally:
        bar.close()
    files = write_folder(rows, folder, device_name)
    layers = int(text_config["num_hidden_layers"])
    per_forward = {
        str(m): {key: per_forward_us(rows, layers, m, f"{key}_us") for key in ("default", "tuned")}
        for m in ms
    }
    return {
        "device": device_name, "rank": rank, "budget_s": None if budget_s == float("inf") else budget_s,
        "tune_s": time.perf_counter() - t, "folder_files": [f.name for f in files],
        "per_decode_step_us": per_forward, "rows": rows,
    }  # fmt: skip


def report_table(report: Mapping[str, Any], m: int) -> str:
    """The report's rows at `m` tokens as a text table, with the whole forward's LoRA time before and after."""
    lines = [
        f"LoRA kernels at {m} tokens ({report['device']}, rank {report['rank']})",
        f"{'op':<8}{'projections':<20}{'slices':>7}{'k':>7}{'n':>7}{'default us':>12}{'tuned us':>10}{'x':>7}",
    ]
    for r in report["rows"]:
        if r["m"] == m:
            lines.append(
                f"{r['op']:<8}{r['name']:<20}{r['slices']:>7}{r['k']:>7}{r['n']:>7}"
                f"{r['default_us']:>12.1f}{r['tuned_us']:>10.1f}{r['default_us'] / r['tuned_us']:>7.2f}"
            )
    step = report["per_decode_step_us"].get(str(m))
    if step:
        lines.append(
            f"all layers, one forward of {m} tokens: {step['default'] / 1000:.2f} ms with vLLM's default configs, "
            f"{step['tuned'] / 1000:.2f} ms tuned"
        )
    return "\n".join(lines)


class KernelTimer:
    """Times vLLM's own shrink and expand kernels on the CUDA device with a given config (vLLM's config lookup is
    replaced for the call): bf16 weights of `max_loras` adapters, every token on adapter 0, the metadata vLLM's
    LoRA wrapper builds, `reps` calls captured in a CUDA graph as the engine's decode runs them. Each config's
    output is first checked against a float32 matmul (1% of the largest value): one that differs is refused."""

    def __init__(self, max_loras: int = 1, reps: int = 20, replays: int = 5) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "tuning vLLM's LoRA kernels needs a CUDA device: run it on the GPU the job uses"
            )
        self.max_loras, self.reps, self.replays = max_loras, reps, replays
        self.device_name = torch.cuda.get_device_name()

    def __call__(self, shape: LoraShape, m: int) -> TimeFn:
        import torch
        from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op, utils
        from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

        # vLLM caches each weight list's pointer table by address: a freed shape's address reused by the next
        # shape's weights would get the old strides
        utils._LORA_A_PTR_DICT.clear()
        utils._LORA_B_PTR_DICT.clear()
        dev, bf16 = torch.device("cuda"), torch.bfloat16
        meta = LoRAKernelMeta.make(self.max_loras, m, device=dev)
        meta.prepare_tensors(torch.zeros(m, dtype=torch.int32, device=dev))
        args = meta.meta_args(m, False)
        if shape.op == "shrink":
            x = torch.randn(m, shape.k, dtype=bf16, device=dev)
            weights = [
                torch.randn(self.max_loras, shape.n, shape.k, dtype=bf16, device=dev) for _ in shape.outs
            ]
            out = torch.empty(shape.slices, m, shape.n, dtype=torch.float32, device=dev)
            ref = torch.stack([x.float() @ w[0].float().T for w in weights])
            module = lora_shrink_op
            call = partial(lora_shrink_op._lora_shrink, x, weights, out, *args, 1.0)
        else:
            s = torch.randn(shape.slices, m, shape.k, dtype=torch.float32, device=dev)
            weights = [torch.randn(self.max_loras, n, shape.k, dtype=bf16, device=dev) for n in shape.outs]
            out = torch.zeros(m, sum(shape.outs), dtype=bf16, device=dev)
            ref = torch.cat([s[i] @ w[0].float().T for i, w in enumerate(weights)], dim=1)
            module = lora_expand_op
            call = partial(
                lora_expand_op._lora_expand, s, weights, out, *args, offset_start=0, add_inputs=True
            )

        def time_fn(config: Config) -> float:
            original = module.get_lora_op_configs
            module.get_lora_op_configs = lambda *a, **k: config
            try:
                out.zero_()  # expand adds into its output
                call()  # compiles the kernel for this config, caches the weights' pointer table
                error = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                if not error <= 1e-2:  # a config that computes something else is no candidate
                    raise ArithmeticError(f"LoRA {shape.op} config {config} is off by {error:.3g} (relative)")
                return self._graph_us(call)
            finally:
                module.get_lora_op_configs = original

        return time_fn

    def _graph_us(self, call: Callable[[], None]) -> float:
        import torch

        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.reps):
                call()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / (self.replays * self.reps)
