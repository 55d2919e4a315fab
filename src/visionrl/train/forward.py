"""The learner's forward pass: per-token log-probs and entropies of the completions, computed lean.

Two things a plain `model(**batch).logits` would waste on a real VLM (vocab 151,936):
- the logits: [B, T, vocab] float32 for a whole micro-batch is gigabytes, several times over (temperature,
  suppression, softmax). Here the final hidden states of the real completion tokens (padding dropped) go through
  `lm_head` in chunks of `chunk_tokens`; under autograd each chunk is checkpointed, so backward recomputes its
  logits instead of keeping them.
- the images: the completions of one group share their prompt, hence its image. `SharedImages` makes the vision
  tower encode each distinct image of a micro-batch once and hands every row its copy (the gradient into the
  merger's LoRA is the same sum as with one encoding per row).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from visionrl.algo import entropy_from_logits, token_logprobs
from visionrl.models.sequences import ImageShare

logger = logging.getLogger(__name__)
SUPPRESSED_LOGIT = -1e9  # a large finite value, not -inf: keeps entropy and its gradient finite (algo.losses)


class SharedImages:
    """Hooks on the vision tower that apply an `ImageShare` while one is active (`with shared.use(plan)`)."""

    def __init__(self, visual: torch.nn.Module) -> None:
        self._plan: ImageShare | None = None
        visual.register_forward_pre_hook(self._before, with_kwargs=True)
        visual.register_forward_hook(self._after, with_kwargs=True)

    @contextlib.contextmanager
    def use(self, plan: ImageShare | None) -> Iterator[None]:
        self._plan = plan
        try:
            yield
        finally:
            self._plan = None

    def _before(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._plan is None:
            return None
        grid = kwargs.get("grid_thw")
        device = grid.device if isinstance(grid, torch.Tensor) else args[0].device
        return args, {**kwargs, "grid_thw": self._plan.unique_grid_thw.to(device)}

    def _after(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if self._plan is None:
            return None
        index = self._plan.token_index.to(output.pooler_output.device)
        output.pooler_output = output.pooler_output.index_select(0, index)
        # Qwen3-VL's tower also returns deepstack features (one per merged token each); Qwen2.5-VL's has none.
        deepstack = getattr(output, "deepstack_features", None)
        if deepstack is not None:
            output.deepstack_features = [f.index_select(0, index) for f in deepstack]
        return output


def _chunk_stats(
    lm_head: torch.nn.Module,
    temperature: float,
    forbidden: torch.Tensor,
    entropy_grad: bool,
    h: torch.Tensor,
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `ids` and entropy under the sampling distribution for hidden states `h` [N, D]. Without
    `entropy_grad` the entropy is only reported: no autograd graph (its softmax would be saved for a backward
    that never comes, [N, vocab] floats at every recomputation)."""
    logits = lm_head(h).float() / temperature
    if len(forbidden):
        logits = logits.index_fill(-1, forbidden, SUPPRESSED_LOGIT)
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        entropy = entropy_from_logits(logits)
    return token_logprobs(logits, ids), entropy


def completion_stats(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor,
    *,
    temperature: float,
    forbidden: torch.Tensor,
    chunk_tokens: int,
    entropy_grad: bool = True,
    hidden_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies [B, T] of the completion tokens of B sequences (0 where `mask` is 0);
    the entropies carry a gradient only with `entropy_grad` (an entropy bonus is trained).

    `hidden` [R, L, D] are the final hidden states of the micro-batch's rows, laid out as in `models.sequences`
    (R = B, sequence b in row b) or packed as in `models.packing` (`hidden_rows[b]`: the row of sequence b): the
    logit of sequence b's completion token t sits at column starts[b]-1+t. Padding never goes through `lm_head`.
    """
    B, T = completion_ids.shape
    R, L = hidden.shape[:2]
    flat = mask.reshape(-1).nonzero().squeeze(-1)
    rows = torch.arange(B) if hidden_rows is None else hidden_rows
    rows = rows.to(hidden.device).unsqueeze(1)
    positions = (starts.to(hidden.device).unsqueeze(1) - 1 + torch.arange(T, device=hidden.device)).clamp(
        0, L - 1
    )
    h = hidden.reshape(R * L, -1).index_select(0, (rows * L + positions).reshape(-1).index_select(0, flat))
    ids = completion_ids.reshape(-1).index_select(0, flat)
    step = chunk_tokens if chunk_tokens > 0 else max(1, len(flat))
    lps, ents = [], []
    for s in range(0, len(flat), step):
        args = (lm_head, temperature, forbidden, entropy_grad, h[s : s + step], ids[s : s + step])
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*args)
        lps.append(lp)
        ents.append(ent)
    zeros = hidden.new_zeros(B * T, dtype=torch.float32)
    if not lps:
        return zeros.view(B, T), zeros.view(B, T)
    lp = zeros.index_copy(0, flat, torch.cat(lps)).view(B, T)
    ent = zeros.index_copy(0, flat, torch.cat(ents)).view(B, T)
    return lp, ent


RECOMPILE_LIMIT = 64  # guard variants of the shared decoder-layer code before Dynamo gives up on it


def compile_decoder_layers(model: Any, sharded: bool = False) -> int:
    """`train.compile`: torch.compile every decoder layer of the language model in place, with dynamic shapes
    (micro-batches differ in length: one graph, no recompilation per length). The layers share their code, so
    the first layer's compilation serves all (parameters are graph inputs). Skipped, with a warning, when the
    model is sharded by FSDP2: that combination has not been measured. Returns the layers compiled."""
    if sharded:
        logger.warning(
            "train.compile is not applied with FSDP2 sharding (not measured yet); the layers run eagerly"
        )
        return 0
    import torch._dynamo

    # The layers share one code object, so every guard variant (grad mode, adapter on or off, dtypes, a dynamic
    # dimension specialised) counts against Dynamo's per-code limit of 8 for all of them at once; past it, every
    # layer silently runs eager. Measured: 6 variants at 8B. `compiled_graphs` shows a recompilation.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = base.model.language_model.layers
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process: steady after the first steps; a rise is a recompilation."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
