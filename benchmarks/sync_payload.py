"""The adapter's way from the learner to an engine, before vLLM reads it: build, Ray, write (the sync's profile).

A learner actor holds LoRA weights of the production job's layout (Qwen3-VL-8B's language model, r64 on the
attention and MLP projections of its 36 layers: 504 tensors, 333 MiB in bf16; random values) and builds the
engines' payload; an engine actor on the same node receives it through Ray's object store and writes its files
where vLLM reads them (/dev/shm). Timed as the loop times them (`timing/sync_build_s`, `sync_transfer_s`,
`sync_write_s`), for each way of building the payload:
  bytes    safetensors' own writer: each tensor to the host, a bytes object (the loop before 2026-12-06)
  packed   `visionrl.adapter.packed.pack_safetensors`: joined on the device, one copy into a numpy buffer, which
           Ray moves out of band and hands to the engine without a copy (the loop now)
The tensors sit on the GPU where there is one. Prints a table (median of --repeats), writes
benchmarks/results/sync_payload-<device>-<date>.json. On the 2026-12-06 H100 the loop measured build 0.48-0.51 s
and transfer 0.43-0.46 s with `bytes` (benchmarks/NOTES-gpu-learner.md).

    .venv/bin/python benchmarks/sync_payload.py [--repeats 5] [--layers 36] [--rank 64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

# Qwen3-VL-8B's language model: (in, out) of each LoRA-targeted projection
PROJECTIONS = {
    "self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (4096, 1024), "self_attn.v_proj": (4096, 1024),
    "self_attn.o_proj": (4096, 4096), "mlp.gate_proj": (4096, 12288), "mlp.up_proj": (4096, 12288),
    "mlp.down_proj": (12288, 4096),
}  # fmt: skip
WAYS = ("bytes", "packed")


def lora_weights(layers: int, rank: int, device: str) -> dict[str, Any]:
    """Random bf16 LoRA A and B of every targeted projection, named as peft's adapter file names them."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for layer in range(layers):
        for proj, (fan_in, fan_out) in PROJECTIONS.items():
            stem = f"base_model.model.model.language_model.layers.{layer}.{proj}"
            for part, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.01
                out[f"{stem}.{part}.weight"] = w.to(torch.bfloat16)
    return out


def build(weights: dict[str, Any], way: str) -> Any:
    """The weights file as the loop built it (`bytes`) or builds it (`packed`)."""
    from safetensors.torch import save

    from visionrl.adapter.packed import pack_safetensors

    if way == "bytes":
        return save({k: v.cpu().contiguous() for k, v in weights.items()}, metadata={"format": "pt"})
    return pack_safetensors(weights, {"format": "pt"})


def make_actors(layers: int, rank: int) -> tuple[Any, Any]:
    import ray

    @ray.remote(num_cpus=0)
    class Learner:
        def __init__(self) -> None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.weights = lora_weights(layers, rank, device)

        def size(self) -> tuple[int, int]:
            return len(self.weights), sum(v.numel() * v.element_size() for v in self.weights.values())

        def payload(self, way: str) -> Any:
            from visionrl.types import ADAPTER_WEIGHTS, AdapterPayload

            t = time.perf_counter()
            files = {ADAPTER_WEIGHTS: build(self.weights, way)}
            return AdapterPayload(
                version=1, files=files, built_s=time.perf_counter() - t, sent_at=time.time()
            )

    @ray.remote(num_cpus=0)
    class Engine:
        def receive(self, payload: Any) -> dict[str, float]:
            import shutil
            import tempfile

            transfer = time.time() - payload.sent_at
            folder = Path(
                tempfile.mkdtemp(prefix="vrl-sync-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
            )
            t = time.perf_counter()
            for name, data in payload.files.items():
                (folder / name).write_bytes(data)
            write = time.perf_counter() - t
            shutil.rmtree(folder)
            return {"build": payload.built_s, "transfer": transfer, "write": write}

    return Learner.remote(), Engine.remote()


def measure(repeats: int, layers: int, rank: int) -> dict[str, Any]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        learner, engine = make_actors(layers, rank)
        tensors, nbytes = ray.get(learner.size.remote())
        runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
        for i in range(repeats + 1):  # the first round warms both ways up and is left out
            for way in WAYS:
                parts = ray.get(engine.receive.remote(learner.payload.remote(way)))
                parts["total"] = parts["build"] + parts["transfer"] + parts["write"]
                if i:
                    runs[way].append(parts)
        rows = [
            {
                "way": w,
                **{k: statistics.median(r[k] for r in runs[w]) for k in runs[w][0]},
                "repeats": repeats,
            }
            for w in WAYS
        ]
        return {"tensors": tensors, "mib": nbytes / 2**20, "rows": rows}
    finally:
        ray.shutdown()


def machine() -> dict[str, Any]:
    import os

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"device": gpu or f"cpu ({os.cpu_count()} cores)", "python": platform.python_version(),
            "torch": torch.__version__, "ray": __import__("ray").__version__}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    got = measure(args.repeats, args.layers, args.rank)
    mach = machine()
    print(
        f"{got['tensors']} tensors, {got['mib']:.0f} MiB, on {mach['device']}; median of {args.repeats}, seconds"
    )
    print(f"{'way':8} {'build':>7} {'transfer':>9} {'write':>7} {'total':>7}")
    for r in got["rows"]:
        print(f"{r['way']:8} {r['build']:7.3f} {r['transfer']:9.3f} {r['write']:7.3f} {r['total']:7.3f}")
    now = datetime.datetime.now(datetime.UTC)
    tag = "gpu" if "cpu" not in mach["device"] else "cpu"
    out = Path(args.out) / f"sync_payload-{tag}-{now.date()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "sync_payload", "date": now.isoformat(timespec="seconds"), "machine": mach,
              "setup": {"layers": args.layers, "rank": args.rank, "dtype": "bfloat16"}, **got}  # fmt: skip
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
