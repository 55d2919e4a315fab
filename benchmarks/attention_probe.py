"""What this machine's torch offers a packed row's attention, in one call: versions, which of torch's varlen_attn,
FlexAttention and SDPA's flash kernel are there, and which kernel `train.packed_attention` resolves to; then each
path run once on one packed row of the 8B shape (32 query heads, 8 KV heads, head_dim 128, bf16; 11 sequences of
about 745 tokens in 8192), forward and backward, against the per-sequence SDPA loop, with its time.

On a CUDA machine, from the repository root:   PYTHONPATH=src python benchmarks/attention_probe.py [--out f.json]
On the CPU it prints what is there and checks the paths on a small row (float32, no times worth reading).
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import time
from typing import Any

import torch

from visionrl.models import packed_attention as pa


def availability() -> dict[str, Any]:
    """Versions and the attention kernels this torch has."""
    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "sdpa_flash_built": torch.backends.cuda.is_flash_attention_available(),
        "sdpa_flash_enabled": torch.backends.cuda.flash_sdp_enabled(),
        "sdpa_cudnn_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
        "varlen_missing": pa.varlen_missing(torch.bfloat16),
        "flex_missing": pa.flex_missing(),
    }
    try:
        from torch.nn.attention.varlen import varlen_attn

        out["varlen_attn_args"] = list(inspect.signature(varlen_attn).parameters)
    except ImportError:
        out["varlen_attn_args"] = None
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    out["resolved"] = {r: pa.resolve_kernel(r, dev, dtype, "sdpa") for r in pa.REQUESTS}
    return out


def packed_row(length: int, sequences: int, heads: int, kv_heads: int, dim: int, device: str, dtype: Any):
    """q [1, H, L, D], k and v [1, H_kv, L, D] (requiring grad) and the row's bounds: `sequences` of about equal
    length, the rest of the row a padding segment."""
    gen = torch.Generator(device=device).manual_seed(0)
    each = (length - 64) // sequences
    bounds = [i * each for i in range(sequences + 1)] + [length]
    qkv = [
        torch.randn(1, h, length, dim, generator=gen, device=device, dtype=dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    ]
    return qkv, bounds


def run_path(kernel: str, qkv: list[torch.Tensor], bounds: list[int], repeats: int) -> dict[str, Any]:
    """One path forward and backward on the row: its output and gradients, and its mean time in ms."""
    device = qkv[0].device
    if kernel == "sdpa_dense":  # what transformers gives SDPA for a packed row
        doc = torch.repeat_interleave(
            torch.arange(len(bounds) - 1, device=device), torch.tensor(bounds).diff().to(device)
        )
        pos = torch.arange(bounds[-1], device=device)
        mask = ((doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :]))[None, None]

        def fn() -> torch.Tensor:
            # as transformers does with a mask on CUDA: KV heads repeated (masked GQA would be the math kernel)
            q, k, v = qkv
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    elif kernel == "sdpa_causal_row":  # one causal row of the same length: the padded layout's kernel

        def fn() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(
                *qkv, is_causal=True, enable_gqa=True
            ).transpose(1, 2)
    else:
        pa.prepare(kernel)
        kw = pa.packed_attention_kwargs(bounds, kernel, device)

        def fn() -> torch.Tensor:
            return pa.packed_attention(torch.nn.Module(), *qkv, None, base=None, **kw)[0]

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = fn()
        grads = torch.autograd.grad(out.float().square().mean(), qkv)
        return out, list(grads)

    out, grads = step()  # warm-up (and compilation)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / repeats * 1000
    return {"out": out.detach(), "grads": grads, "ms": ms}


def compare_paths(cuda: bool) -> list[dict[str, Any]]:
    """Each path against the per-sequence loop on the real tokens (the padding segment's output is never read)."""
    shape = (
        (8192, 11, 32, 8, 128, "cuda", torch.bfloat16) if cuda else (256, 5, 4, 2, 16, "cpu", torch.float32)
    )
    qkv, bounds = packed_row(*shape)
    real = bounds[-2]
    ref = run_path(pa.REFERENCE, qkv, bounds, repeats=3)
    paths = ["sdpa_dense", "sdpa_causal_row"]
    # FlexAttention has no CPU backward: on the CPU its forward is checked by tests/models/test_packed_attention.py
    paths += [pa.VARLEN] if pa.varlen_missing() is None else []
    paths += [pa.FLEX] if cuda and pa.flex_missing() is None else []
    rows = [{"path": "reference (per-sequence SDPA loop)", "ms": ref["ms"]}]
    for path in paths:
        try:
            r = run_path(path, qkv, bounds, repeats=10 if cuda else 1)
        except Exception as e:  # a path that fails here is what the probe is for: report it, go on
            rows.append({"path": path, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        row: dict[str, Any] = {"path": path, "ms": r["ms"]}
        if path != "sdpa_causal_row":  # a different computation (attention crosses sequences): time only
            row["out_max_diff"] = float((r["out"][:, :real] - ref["out"][:, :real]).abs().max())
            row["grad_max_rel"] = max(
                float((g - h).norm() / h.norm()) for g, h in zip(r["grads"], ref["grads"], strict=True)
            )
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", help="also write the findings to this JSON file")
    args = p.parse_args()
    found = availability()
    for k, v in found.items():
        print(f"{k:>20}: {v}")
    found["paths"] = compare_paths(torch.cuda.is_available())
    print(f"\n{'path':<36}{'fwd+bwd ms':>12}{'out max diff':>14}{'grad max rel':>14}")
    for r in found["paths"]:
        if "error" in r:
            print(f"{r['path']:<36} {r['error']}")
            continue
        diff = f"{r['out_max_diff']:14.2e}{r['grad_max_rel']:14.2e}" if "out_max_diff" in r else ""
        print(f"{r['path']:<36}{r['ms']:12.2f}{diff}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=2)


if __name__ == "__main__":
    main()
