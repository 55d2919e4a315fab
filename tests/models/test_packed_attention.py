"""The attention of packed rows (`visionrl.models.packed_attention`) on random tensors: cu_seqlens by hand, each
kernel against SDPA with the dense causal document mask, torch's varlen_attn called right for each torch
signature (a stand-in kernel: there is no CUDA here), the kernel each request resolves to, and no dense mask built
for the registered implementation."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from visionrl.models import packed_attention as pa
from visionrl.models.packing import collate_packed
from visionrl.models.sequences import EncodedPrompt, Sequence

BOUNDS = [0, 5, 14, 20, 32]  # three sequences of 5, 9 and 6 tokens, then 12 of padding


def test_cu_seqlens_of_a_packed_row() -> None:
    # prompts of 3 and 5 tokens; sequences (prompt 1, 2 tokens), (prompt 0, 4), (prompt 0, 1) in that order:
    # 3 + 2 = 5, 5 + 4 = 9, 5 + 1 = 6 tokens, 20 in all, padded to 32 (a multiple of 16) as a segment of its own
    prompts = [
        EncodedPrompt(torch.tensor([10, 11, 12, 13, 14]), torch.zeros(5, dtype=torch.long), None, None),
        EncodedPrompt(torch.tensor([20, 21, 22]), torch.zeros(3, dtype=torch.long), None, None),
    ]
    seqs = [Sequence(0, [1, 2, 3, 4], 1.0, [-1.0] * 4), Sequence(1, [5, 6], -1.0, [-1.0] * 2)]
    seqs.append(Sequence(0, [7], 0.5, [-1.0]))
    mb = collate_packed(prompts, seqs, [1, 0, 2], pad_id=0)
    assert mb.segments is not None and mb.segments.bounds == BOUNDS
    cu, longest = pa.cu_seqlens(mb.segments.bounds)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 14, 20, 32] and longest == 12
    kw = pa.packed_attention_kwargs(mb.segments.bounds, pa.REFERENCE, torch.device("cpu"))
    assert kw["packed_kernel"] == "reference" and kw["packed_cu_seqlens"].tolist() == BOUNDS
    assert kw["packed_max_len"] == 12 and "packed_block_mask" not in kw
    # a row that fills its multiple of 16 exactly has no padding segment
    full = collate_packed(prompts, [Sequence(0, list(range(11)), 1.0, [-1.0] * 11)], [0], pad_id=0)
    assert full.segments is not None and pa.cu_seqlens(full.segments.bounds)[0].tolist() == [0, 16]
    assert pa.packed_attention_kwargs(BOUNDS, pa.SDPA_MASK, torch.device("cpu")) == {}


def _qkv(heads: int = 4, kv_heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    n = BOUNDS[-1]
    return tuple(torch.randn(1, h, n, dim, generator=gen) for h in (heads, kv_heads, kv_heads))


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with the dense [L, L] causal document mask (what transformers builds), -> [1, L, H, D]."""
    doc = torch.repeat_interleave(torch.arange(len(BOUNDS) - 1), torch.tensor(BOUNDS).diff())
    pos = torch.arange(BOUNDS[-1])
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", [pa.REFERENCE, pa.FLEX])
def test_kernels_equal_sdpa_with_the_dense_document_mask(kernel: str) -> None:
    q, k, v = _qkv()
    kw = pa.packed_attention_kwargs(BOUNDS, kernel, torch.device("cpu"))
    out, weights = pa.packed_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, base=None, **kw)
    assert weights is None and out.shape == (1, 32, 4, 8)
    assert (out - _dense(q, k, v, 0.3)).abs().max() <= 1e-6
    # a change in the first sequence's keys and values reaches none of the later positions
    k2, v2 = k.clone(), v.clone()
    k2[..., :5, :], v2[..., :5, :] = 3.0, -2.0
    out2, _ = pa.packed_attention(torch.nn.Module(), q, k2, v2, None, scaling=0.3, base=None, **kw)
    assert (out2[:, :5] - out[:, :5]).abs().max() > 0.5 and torch.equal(out2[:, 5:], out[:, 5:])


def test_padded_calls_go_to_the_base_attention() -> None:
    q, k, v = _qkv()
    seen: list[Any] = []

    def base(module: Any, *args: Any, **kwargs: Any) -> tuple[str, None]:
        seen.append((args[3], kwargs))
        return "base", None

    out, _ = pa.packed_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, base=base, position_ids=1)
    assert out == "base"
    assert seen == [(None, {"dropout": 0.0, "scaling": 0.3, "position_ids": 1})]


# varlen_attn's keyword arguments in torch 2.10 (is_causal), 2.11 (scale, window_size) and 2.12 on (enable_gqa)
SIGNATURES = {
    "2.10": ("is_causal", "return_aux"),
    "2.11": ("return_aux", "scale", "window_size"),
    "2.12": ("return_aux", "scale", "window_size", "enable_gqa"),
}


@pytest.mark.parametrize("version", list(SIGNATURES))
@pytest.mark.parametrize("scaling", [8**-0.5, 0.3])
def test_varlen_is_called_right_for_each_torch_signature(
    version: str, scaling: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in varlen_attn that takes only `version`'s arguments and computes causal attention per segment
    from the packed [T, H, D] layout: the path's result equals the dense-mask SDPA whatever the signature."""
    import torch.nn.attention.varlen as varlen

    accepted = SIGNATURES[version]
    calls: list[dict[str, Any]] = []

    def fake(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, **kw: Any) -> torch.Tensor:
        assert set(kw) <= set(accepted), kw
        assert kw.get("window_size", (-1, 0)) == (-1, 0) and kw.get("is_causal", True) is True
        assert q.shape[1] == k.shape[1] or kw.get("enable_gqa"), "GQA needs the flag or repeated KV heads"
        assert torch.equal(cu_q, cu_k) and max_q == max_k == 12 and q.is_contiguous()
        calls.append(kw)
        bounds = cu_q.tolist()
        parts = [
            F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True,
                scale=kw.get("scale"), enable_gqa=True,
            ).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]  # fmt: skip
        return torch.cat(parts)

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    monkeypatch.setattr(pa, "_VARLEN_ARGS", frozenset(accepted))
    q, k, v = _qkv()
    kw = pa.packed_attention_kwargs(BOUNDS, pa.VARLEN, torch.device("cpu"))
    out, _ = pa.packed_attention(torch.nn.Module(), q, k, v, None, scaling=scaling, base=None, **kw)
    assert len(calls) == 1 and out.shape == (1, 32, 4, 8)
    assert (out - _dense(q, k, v, scaling)).abs().max() <= 1e-6


def test_install_reads_this_torch_varlen_signature() -> None:
    from torch.nn.attention.varlen import varlen_attn

    params = set(inspect.signature(varlen_attn).parameters)
    assert {"window_size", "scale"} <= params or "is_causal" in params


def test_each_request_resolves_to_a_kernel_that_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    f32 = torch.float32
    assert pa.resolve_kernel("sdpa_mask", "cuda", torch.bfloat16, "sdpa") == "sdpa_mask"
    assert pa.resolve_kernel("varlen", "cuda", torch.bfloat16, "flash_attention_2") == "model_own"
    # the CPU: the exact loop for every request (FlexAttention has no CPU backward)
    for requested in ("auto", "varlen", "flex"):
        assert pa.resolve_kernel(requested, "cpu", f32, "sdpa") == "reference"
    assert pa.resolve_kernel("flex", "cuda", torch.bfloat16, "sdpa") == "flex"
    pa._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        # no usable varlen kernel: FlexAttention, then SDPA's dense mask, each with the reason said once
        monkeypatch.setattr(pa, "varlen_missing", lambda dtype: "no varlen here")
        assert pa.resolve_kernel("auto", "cuda", torch.bfloat16, "sdpa") == "flex"
        assert pa.resolve_kernel("auto", "cuda", torch.bfloat16, "sdpa") == "flex"
        monkeypatch.setattr(pa, "flex_missing", lambda: "no flex here")
        assert pa.resolve_kernel("varlen", "cuda", torch.bfloat16, "sdpa") == "sdpa_mask"
        assert pa.resolve_kernel("flex", "cuda", torch.bfloat16, "sdpa") == "sdpa_mask"
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "train.packed_attention=auto: no varlen here; packed rows use FlexAttention instead",
        "train.packed_attention=varlen: no varlen here; no flex here; packed rows use SDPA with a dense document "
        "mask",
        "train.packed_attention=flex: no flex here; packed rows use SDPA with a dense document mask",
    ]
    monkeypatch.undo()
    if not torch.cuda.is_available():
        assert pa.varlen_missing() == "varlen_attn is CUDA only"


def test_the_registered_implementation_builds_no_dense_mask() -> None:
    """transformers' create_causal_mask for a packed row (restarting text positions): SDPA gets the dense
    [1, 1, L, L] document mask, the registered implementation none (its boundaries travel as cu_seqlens); a
    padding mask is still built for it."""
    from transformers import Qwen3VLTextConfig
    from transformers.masking_utils import create_causal_mask

    config = Qwen3VLTextConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(BOUNDS, BOUNDS[1:], strict=False)])[None]
    embeds = torch.zeros(1, 32, 16)
    config._attn_implementation = "sdpa"
    dense = create_causal_mask(config, embeds, None, None, position_ids=positions)
    assert dense is not None and dense.shape == (1, 1, 32, 32) and int(dense.sum()) == 15 + 45 + 21 + 78
    config._attn_implementation = pa.register("sdpa")
    assert create_causal_mask(config, embeds, None, None, position_ids=positions) is None
    padding = torch.ones(1, 32, dtype=torch.long)
    padding[0, 20:] = 0
    masked = create_causal_mask(config, embeds, padding, None, position_ids=positions)
    assert masked is not None and masked.shape == (1, 1, 32, 32)
