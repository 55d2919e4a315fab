"""Attention of packed rows (`train.packed_attention`) through transformers' own extension point.

A packed row (`models.packing`) holds several sequences; by default transformers reads their boundaries off the
restarting text positions and gives SDPA a dense [L, L] document mask, which computes every block of the row and
leaves SDPA's fused causal kernel. Here the language model's attention is a function registered with
`AttentionInterface` (and a mask function with `AttentionMaskInterface` that builds no mask when none is needed);
the learner passes each packed forward the row's `cu_seqlens` (`packed_attention_kwargs`), and the function runs
causal attention within each sequence only:
- `varlen`: torch's `torch.nn.attention.varlen.varlen_attn` (CUDA, bf16/fp16; in torch from 2.10);
- `flex`: FlexAttention with a causal document `BlockMask` built once per forward;
- `reference`: causal SDPA per sequence, a loop (the CPU's exact path, what the tests check the plumbing with).
Calls without those kwargs (padded micro-batches) go to the model's own SDPA or eager attention unchanged. The
vision tower keeps its attention: only the text config's implementation is switched (docs/ENGINE_NOTES.md).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# `train.packed_attention` values, and the kernels one of them resolves to (`resolve_kernel`)
REQUESTS = ("auto", "sdpa_mask", "varlen", "flex")
SDPA_MASK, VARLEN, FLEX, REFERENCE, MODEL_OWN = "sdpa_mask", "varlen", "flex", "reference", "model_own"
NAME = "visionrl_packed"  # + "_sdpa" / "_eager": the base implementation padded micro-batches keep
_WARNED: set[str] = set()
# The keyword arguments of this torch's varlen_attn, read once (`prepare`) outside any compiled region: 2.10 takes
# `is_causal`, 2.11 `window_size` and `scale`, 2.12 also `enable_gqa` (torch's docs of each version).
_VARLEN_ARGS: frozenset[str] = frozenset()
_FLEX: dict[str, Any] = {}  # "compiled": flex_attention wrapped in torch.compile (`prepare`)


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def varlen_missing(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why torch's varlen kernel cannot run on this machine at `dtype`, or None when it can."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (added in 2.10)"
    if not torch.cuda.is_available():
        return "varlen_attn is CUDA only"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention kernels"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"varlen_attn (flash attention) needs bfloat16 or float16, the model runs in {dtype}"
    return None


def flex_missing() -> str | None:
    """Why FlexAttention cannot run here, or None when it can."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    return None


def resolve_kernel(requested: str, device: str, dtype: torch.dtype, model_attn: str) -> str:
    """The kernel a packed row runs on: `requested` (REQUESTS) where it can run, else the next one down
    (varlen -> flex -> SDPA's dense mask), with a one-time warning naming why. On the CPU every request but
    sdpa_mask is the per-sequence reference (FlexAttention has no CPU backward); FlashAttention 2 keeps its own
    varlen path (it reads the boundaries off the positions)."""
    if requested == SDPA_MASK:
        return SDPA_MASK
    if model_attn == "flash_attention_2":
        return MODEL_OWN
    if device != "cuda":
        return REFERENCE
    flex_why = flex_missing()
    if requested == FLEX:
        return FLEX if flex_why is None else _dense(requested, flex_why)
    varlen_why = varlen_missing(dtype)
    if varlen_why is None:
        return VARLEN
    if flex_why is None:
        _warn_once(f"train.packed_attention={requested}: {varlen_why}; packed rows use FlexAttention instead")
        return FLEX
    return _dense(requested, f"{varlen_why}; {flex_why}")


def _dense(requested: str, why: str) -> str:
    _warn_once(f"train.packed_attention={requested}: {why}; packed rows use SDPA with a dense document mask")
    return SDPA_MASK


def install(model: Any, kernel: str, model_attn: str) -> None:
    """Make `kernel` the language model's attention for packed rows: the text config switched to the function
    `register` makes, or back to `model_attn` for the kernels that read the boundaries off the positions (so a
    learner can change kernels between steps); the vision tower keeps `model_attn` (it has its own cu_seqlens)."""
    prepare(kernel)
    name = model_attn if kernel in (SDPA_MASK, MODEL_OWN) else register(model_attn)
    if model.config.text_config._attn_implementation != name:
        model.set_attn_implementation({"text_config": name})


def prepare(kernel: str) -> None:
    """What `kernel` needs before its first call, done outside any compiled region: the varlen_attn signature of
    this torch read, FlexAttention wrapped in torch.compile (it compiles lazily, on the first call)."""
    global _VARLEN_ARGS
    if kernel == VARLEN:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_ARGS = frozenset(inspect.signature(varlen_attn).parameters)
    if kernel == FLEX and "compiled" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=True)


def register(model_attn: str) -> str:
    """Register `packed_attention` (and its mask function) with transformers under NAME + the base attention that
    padded micro-batches keep (sdpa or eager); returns the name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.models.qwen3_vl.modeling_qwen3_vl import eager_attention_forward

    sdpa = model_attn == "sdpa"
    base, base_mask = (sdpa_attention_forward, sdpa_mask) if sdpa else (eager_attention_forward, eager_mask)
    name = f"{NAME}_{'sdpa' if sdpa else 'eager'}"
    AttentionInterface.register(name, functools.partial(packed_attention, base=base))
    AttentionMaskInterface.register(name, functools.partial(_mask, base=base_mask, skip=sdpa))
    return name


def _mask(
    *args: Any, base: Any, skip: bool, attention_mask: torch.Tensor | None = None, **kwargs: Any
) -> Any:
    """No mask where there is no padding mask and SDPA is the base: a padded row is causal (SDPA's `is_causal`)
    and a packed row's boundaries travel as cu_seqlens, so the dense [L, L] mask is never built. Eager needs its
    additive causal mask for padded rows: built as before (a packed row ignores it)."""
    if skip and attention_mask is None:
        return None
    return base(*args, attention_mask=attention_mask, **kwargs)


def cu_seqlens(bounds: list[int]) -> tuple[torch.Tensor, int]:
    """The row's segment boundaries as varlen kernels take them: int32 [segments + 1] (0, ends of each segment,
    the row's length last, the padding a segment of its own) and the longest segment."""
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    return torch.tensor(bounds, dtype=torch.int32), max(lengths)


def packed_attention_kwargs(bounds: list[int], kernel: str, device: torch.device) -> dict[str, Any]:
    """The model kwargs a packed forward passes down to every text attention call (none for the kernels that
    read the boundaries off the positions). FLEX's block mask is built here, once per forward, not per layer."""
    if kernel in (SDPA_MASK, MODEL_OWN):
        return {}
    cu, longest = cu_seqlens(bounds)
    out: dict[str, Any] = {
        "packed_kernel": kernel,
        "packed_cu_seqlens": cu.to(device),
        "packed_max_len": longest,
    }
    if kernel == FLEX:
        out["packed_block_mask"] = document_block_mask(cu.to(device))
    return out


def document_block_mask(cu: torch.Tensor) -> Any:
    """FlexAttention's BlockMask of a packed row: causal, and only within the segment of each query."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = int(cu[-1])
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu.diff().long())

    def causal_document(b: Any, h: Any, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (doc[q] == doc[kv]) & (q >= kv)

    return create_block_mask(causal_document, None, None, n, n, device=cu.device)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    base: Any,
    packed_kernel: str | None = None,
    packed_cu_seqlens: torch.Tensor | None = None,
    packed_max_len: int | None = None,
    packed_block_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention: q [1, H, L, D], k and v [1, H_kv, L, D] -> [1, L, H, D]. Without the packed
    kwargs (a padded micro-batch) the model's own attention; with them causal attention inside each segment."""
    if packed_kernel is None or packed_cu_seqlens is None:
        return base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("packed attention runs without attention dropout (Qwen-VL trains with none)")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    if packed_kernel == VARLEN:
        assert packed_max_len is not None
        return _varlen(query, key, value, packed_cu_seqlens, packed_max_len, scale), None
    if packed_kernel == FLEX:
        return _flex(query, key, value, packed_block_mask, scale), None
    return _reference(query, key, value, packed_cu_seqlens, scale), None


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float
) -> Any:
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # [L, heads, D]: the packed layout varlen takes
    kw: dict[str, Any] = {}
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in _VARLEN_ARGS:
        kw["enable_gqa"] = True
    elif groups > 1:
        # no GQA flag in this torch: each KV head repeated for its group of query heads, in repeat_kv's order
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in _VARLEN_ARGS:
        kw["window_size"] = (-1, 0)  # no limit to the left, no key to the right: causal within the segment
    else:
        kw["is_causal"] = True
    if "scale" in _VARLEN_ARGS:
        kw["scale"] = scale
    elif scale != q.shape[-1] ** -0.5:  # the kernel's fixed 1/sqrt(D) then gives `scale`
        q = q * (scale * q.shape[-1] ** 0.5)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest, **kw)
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs asked for
    return out.unsqueeze(0)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float) -> torch.Tensor:
    """FlexAttention: compiled on CUDA (its fused kernel exists only compiled: `install` wraps it, and inside
    compiled decoder layers the outer compilation takes it in), eager on the CPU, where it materialises the
    scores and has no backward (only the tests run it there, without gradients)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        fn = _FLEX.get("compiled", flex_attention)
    out = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal SDPA on each segment alone: exact, and what the padded row of each sequence computes."""
    bounds = cu.tolist()
    gqa = q.shape[1] != k.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale, enable_gqa=gqa
        )
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2)


def setup_packed_attention(model: Any, requested: str, model_attn: str) -> str:
    """`resolve_kernel` for `model`'s device and dtype, then `install` it: the kernel its packed rows run on."""
    device = next(model.parameters()).device.type
    kernel = resolve_kernel(requested, device, model.dtype, model_attn)
    install(model, kernel, model_attn)
    return kernel
