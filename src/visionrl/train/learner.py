"""The learner: a VLM with a peft LoRA adapter, its log-probs, the GRPO loss step and the optimizer.

A plain class (no Ray), wrapped by a thin Ray actor in `orchestrate/actors.py`. One `train_step` takes a
rollout batch (prompts, completions, advantages) and performs `updates_per_batch` optimizer steps, each
over a mini-batch accumulated from token-budget micro-batches whose losses use the mini-batch's global
normalisers, so the gradient equals that of one large batch. Its parts, in order: plan the mini-batches and
each rank's shard (`_plan_mini_batches`), the old and reference log-probs (`_old_logprobs`, `_precompute`),
then per mini-batch (`_update`) the forward and backward of each micro-batch (`_backward`; its loss is
`train.objective`), the gradients summed and clipped (`_reduce_and_clip_grads`) and the step applied unless
it is non-finite (`_apply`), and the step's metrics.

The policy is the *sampling* distribution: logits / temperature with vision tokens removed (they can never
be sampled), which is also what the engines report log-probs of, so ratios and the reported
train/inference mismatch compare like with like.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from visionrl import faults
from visionrl import metrics as tags
from visionrl.config import JobConfig
from visionrl.data.images import ImageBudget
from visionrl.models.loader import (
    apply_lora,
    checkpoint_layers,
    load_base_model,
    load_processor,
    lora_param_groups,
    vision_token_ids,
)
from visionrl.models.packed_attention import packed_attention_kwargs, setup_packed_attention
from visionrl.models.packing import collate_packed, packed_position_ids
from visionrl.models.sequences import EncodedPrompt, MicroBatch, Sequence, collate, without_tokens
from visionrl.train import learner_state
from visionrl.train.batching import (
    NO_GRAD_BATCH_TOKENS,
    plan_micro_batches,
    plan_packed_rows,
    with_packing_resolved,
)
from visionrl.train.encoding import encode_prompts, episodes_expanded
from visionrl.train.forward import SharedImages, compile_decoder_layers, compiled_graphs, completion_stats
from visionrl.train.masking import loss_tokens, masks_before_update, with_correction_masks
from visionrl.train.mismatch import (
    AdapterSnapshot,
    abs_diff_sums,
    engine_mismatch,
    rows_by_version,
    snapshot,
    staleness,
    swapped,
)
from visionrl.train.objective import NO_PEAKS, metric_keys, micro_batch_loss
from visionrl.train.probe import PROBE_VERSION, probe_parts, probe_weights
from visionrl.train.ranks import RankGroup, clip_grads, register_shards, shard_model
from visionrl.train.schedule import lr_lambda, set_rate, step_if_finite
from visionrl.types import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterPayload, PromptItem

# step metrics that are extremes over the updates, not means
PEAK_KEYS = {tags.RATIO_MAX: max, tags.RATIO_MIN: min}


@dataclass
class TrainBatch:
    """One step's rollouts: `prompts[i]` with its completions in `sequences` (each names its prompt)."""

    prompts: list[PromptItem]
    sequences: list[Sequence]


class Learner:
    def __init__(self, cfg: JobConfig, device: str | None = None, ranks: RankGroup | None = None) -> None:
        self.ranks = ranks or RankGroup()  # data-parallel learner ranks (train.ranks); one by default
        if cfg.train.torch_threads:
            torch.set_num_threads(cfg.train.torch_threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cfg = cfg = with_packing_resolved(cfg, self.device.type)  # train.packing: auto, decided here
        self.processor = load_processor(cfg.model.path, ImageBudget.of(cfg.data))
        base = load_base_model(cfg.model.path, cfg.model.dtype, self.device, cfg.model.attn_implementation)
        self.model = apply_lora(base, cfg.lora, seed=cfg.train.seed)
        # the attention kernel of packed rows (models.packed_attention); sdpa_mask: transformers' dense mask
        wanted = cfg.train.packed_attention if cfg.train.packing else "sdpa_mask"
        self.packed_kernel = setup_packed_attention(base, wanted, cfg.model.attn_implementation)
        if cfg.model.gradient_checkpointing:
            checkpoint_layers(self.model, cfg.model.checkpoint_layers)
        if self.ranks.fsdp:
            shard_model(base, self.device.type, self.ranks.world)
        self.compiled = cfg.train.compile and compile_decoder_layers(self.model, sharded=self.ranks.fsdp) > 0
        self._shared = SharedImages(base.model.visual)
        self._merge_size = int(getattr(self.processor.image_processor, "merge_size", 2))
        self.forbidden = torch.tensor(vision_token_ids(base.config, self.processor), dtype=torch.long)
        self.pad_id = self._pad_id()
        groups = lora_param_groups(self.model, cfg.train.lr, cfg.train.merger_lr, cfg.train.lm_head_lr)
        self.optimizer = torch.optim.AdamW(
            groups, lr=cfg.train.lr, betas=cfg.train.betas, weight_decay=cfg.train.weight_decay
        )
        total = cfg.train.steps * cfg.algorithm.updates_per_batch
        t = cfg.train
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, t.warmup_steps, total, t.lr_schedule, t.min_lr_ratio)
        )
        self.version = 0
        self.steps_trained = 0  # train_step calls that trained: the learning-rate schedule's clock
        # rollout.async_steps: the version before `version`, which the engines may still sample with (train.mismatch)
        self._previous: AdapterSnapshot | None = None
        self._adapter_config: bytes | None = None

    def _pad_id(self) -> int:
        tok = self.processor.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    # ------------------------------------------------------------------ encoding and log-probs
    def encode_prompts(self, prompts: list[PromptItem]) -> list[EncodedPrompt]:
        return encode_prompts(self.processor, self.model.get_base_model().config, prompts)

    def _stats(
        self, mb: MicroBatch, temperature: float | None = None, raw: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies [B, T] of the micro-batch's completion tokens under the sampling distribution
        (0 at padding; `temperature` None: the sampling temperature; `raw`: no vision token removed); with
        autograd when grad is enabled (`train.forward` keeps the logits in chunks)."""
        dev = self.device
        # No attention mask: every row's padding is at its end, so causal attention alone is exact at the real
        # tokens and keeps SDPA on its fused causal kernel (models.sequences).
        kwargs: dict[str, Any] = {
            "input_ids": mb.input_ids.to(dev),
            "mm_token_type_ids": mb.mm_token_type_ids.to(dev),
            "use_cache": False,
        }
        if mb.pixel_values is not None and mb.image_grid_thw is not None:
            kwargs["pixel_values"] = mb.pixel_values.to(dev, dtype=self.model.dtype)
            kwargs["image_grid_thw"] = mb.image_grid_thw.to(dev)
        inner = self.model.get_base_model()  # the VLM with LoRA layers injected (peft toggles them)
        if mb.segments is not None:  # packed: each sequence's own positions, which also bound its attention
            kwargs["position_ids"] = packed_position_ids(inner.model.get_rope_index, mb).to(dev)
            kwargs.update(packed_attention_kwargs(mb.segments.bounds, self.packed_kernel, dev))
        with self._shared.use(mb.image_share):
            hidden = inner.model(**kwargs).last_hidden_state
        return completion_stats(
            hidden,
            inner.lm_head,
            mb.completion_ids.to(dev),
            mb.completion_mask.to(dev),
            mb.starts,
            temperature=temperature or self.cfg.rollout.temperature,
            forbidden=self.forbidden[:0] if raw else self.forbidden.to(dev),
            chunk_tokens=self.cfg.train.logit_chunk_tokens,
            entropy_grad=self.cfg.algorithm.entropy_coef > 0,  # else only reported
            hidden_rows=mb.hidden_rows,
        )

    def logprobs(
        self, batch: TrainBatch, adapter: bool = True, temperature: float | None = None, raw: bool = False
    ) -> list[list[float]]:
        """Log-probs of every sequence's completion tokens (with the adapter, or the base model), at the sampling
        temperature unless `temperature` is given; `raw`: over the whole vocabulary (vision tokens kept)."""
        encoded = self.encode_prompts(batch.prompts)
        seqs, positions = episodes_expanded(self.processor, encoded, batch.sequences)
        store = self._precompute(encoded, seqs, range(len(seqs)), adapter, temperature, raw)
        out = []
        for row, (seq, where) in enumerate(zip(seqs, positions, strict=True)):
            values = store[row][: len(seq.completion_ids)]
            out.append((values if where is None else values[torch.tensor(where, dtype=torch.long)]).tolist())
        return out  # per token of each sequence as sent (an episode's placeholders not expanded)

    def _micro_batches(
        self, encoded: list[EncodedPrompt], seqs: list[Sequence], rows: Any, budget: int | None = None
    ) -> list[MicroBatch]:
        rows = list(rows)
        lengths = [(len(encoded[seqs[r].prompt].input_ids), len(seqs[r].completion_ids)) for r in rows]
        budget = budget or self.cfg.train.micro_batch_tokens
        if self.cfg.train.packing:  # sequences end to end in one row each (models.packing)
            plan, make = plan_packed_rows([n + k for n, k in lengths], budget), collate_packed
        else:
            plan, make = plan_micro_batches(lengths, budget), collate
        share, merge = self.cfg.train.share_images, self._merge_size
        return [
            make(encoded, seqs, [rows[i] for i in g], self.pad_id, share_images=share, merge_size=merge)
            for g in plan
        ]

    def warm_up(self, lengths: tuple[int, ...] = (48, 80)) -> float:
        """`train.compile`: one forward and backward on a small text-only batch (completions of `lengths` tokens),
        so that the decoder layers are compiled for training before step 1; nothing is applied and the
        gradients are dropped. Returns the seconds taken (0: nothing compiled to warm up)."""
        if not self.compiled:
            return 0.0
        t = time.perf_counter()
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": "Warm up."}]}], tokenize=False
        )
        words = self.processor.tokenizer("one two three four five six seven eight", add_special_tokens=False)
        ids = (list(words.input_ids) * max(lengths))[: max(lengths)]
        seqs = [Sequence(0, ids[:n], 0.0, [0.0] * n) for n in lengths]
        self.model.train()
        for mb in self._micro_batches(self.encode_prompts([PromptItem(text, [])]), seqs, range(len(seqs))):
            (self._stats(mb)[0].sum() * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    # ------------------------------------------------------------------ the update
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """`updates_per_batch` optimizer steps over the batch; returns metrics (means over the steps)."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        seqs, vision = without_tokens(batch.sequences, set(self.forbidden.tolist()))
        if not seqs:  # nothing left to train on: no update, the adapter version stays
            return {tags.VISION_TOKENS_SAMPLED: float(vision), "updates": 0.0, tags.SKIPPED_UPDATES: 0.0}
        encoded = self.encode_prompts(batch.prompts)
        seqs, _ = episodes_expanded(self.processor, encoded, seqs)
        minis, shards = self._plan_mini_batches(encoded, seqs)
        t1 = time.perf_counter()
        later = [r for rows in shards[1:] for r in rows]  # this rank's, of the mini-batches after the first
        mine = [r for rows in shards for r in rows]
        masking = masks_before_update(self.cfg.algorithm)  # correction_mode mask (train.masking): all rows
        old = self._old_logprobs(encoded, seqs, mine if masking else later, len(minis), masking)
        if masking and old is not None:
            seqs, masked = with_correction_masks(seqs, mine, old, self.cfg.algorithm)
            masked = self.ranks.sum_(masked)
        t2 = time.perf_counter()
        ref = self._precompute(encoded, seqs, mine, adapter=False) if self.cfg.algorithm.kl_coef > 0 else None
        t3 = time.perf_counter()
        # Async batches were sampled with an older version: the guard scores them under it (train.mismatch).
        stale = any(s.adapter_version not in (None, self.version) for s in seqs)
        diff_at_sampling = self._mismatch_at_sampling_versions(encoded, seqs, mine) if stale else None
        # kept when this update makes a new version: the engines sample the next batch with this one
        before = snapshot(self._trainable(), self.version) if self.cfg.rollout.async_steps else None
        totals: dict[str, float] = {tags.SKIPPED_UPDATES: 0.0, tags.STALENESS: staleness(seqs, self.version)}
        totals[tags.VISION_TOKENS_SAMPLED] = float(vision)
        n_updates, first = len(minis), {tags.LOGPROB_DIFF: 0.0, tags.LEARNER_TOKENS: 0.0}
        n_slots = self.cfg.algorithm.updates_per_batch  # of the schedule, per step (`schedule.set_rate`)
        for u, rows in enumerate(minis):
            set_rate(self.scheduler, (self.steps_trained * n_slots) + (u * n_slots) // n_updates)
            metrics = self._update(encoded, seqs, rows, shards[u], old if u > 0 or masking else None, ref)
            first = metrics if u == 0 else first  # before this step's first optimizer update, like `old`
            for k, v in metrics.items():
                if k in PEAK_KEYS:  # the extremes of the step, not a mean over its updates
                    totals[k] = PEAK_KEYS[k](totals.get(k, v), v)
                else:
                    totals[k] = totals.get(k, 0.0) + v / n_updates
        self.steps_trained += 1
        totals[tags.SKIPPED_UPDATES] *= n_updates  # a count, not a mean
        totals["updates"] = float(n_updates)
        if totals[tags.SKIPPED_UPDATES] < n_updates:  # the adapter changed: a new version for the engines
            self.version += 1
            self._previous = before
        if diff_at_sampling is None:
            diff_at_sampling = engine_mismatch(
                seqs, later, old, first[tags.LOGPROB_DIFF], first[tags.LEARNER_TOKENS], self.ranks
            )
        totals[tags.LOGPROB_DIFF] = diff_at_sampling
        if masking:  # the tokens masked before the update (the loss saw none of them)
            totals[tags.CORRECTION_CLIPPED] = float(masked[0] / masked[1]) if masked[1] else 0.0
        totals[tags.LEARNER_TOKENS] *= n_updates  # a sum over the mini-batches, not a mean
        totals[tags.LEARNER_SEQUENCE_TOKENS] *= n_updates
        totals[tags.LEARNER_OLD_LOGPROB_S] = t2 - t1
        totals[tags.LEARNER_REF_LOGPROB_S] = t3 - t2
        if self.device.type == "cuda":
            totals[tags.LEARNER_PEAK_MEM] = torch.cuda.max_memory_reserved(self.device) / 2**30
            if self.cfg.rollout.sleep_during_update:  # the waking engine needs the memory this update cached
                torch.cuda.empty_cache()
        if self.cfg.train.compile:
            totals[tags.LEARNER_COMPILED_GRAPHS] = float(compiled_graphs())
        totals["update_s"] = time.perf_counter() - t0
        totals["adapter_version"] = float(self.version)
        return totals

    def _plan_mini_batches(
        self, encoded: list[EncodedPrompt], seqs: list[Sequence]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """The step's mini-batches (rows of `seqs`) and this rank's shard of each. Mini-batches are of whole
        groups (the sequences of one prompt stay together), in rollout order; with several learner ranks each
        computes and trains on its shard of every mini-batch (train.ranks)."""
        by_prompt: dict[int, list[int]] = {}
        for row, seq in enumerate(seqs):
            by_prompt.setdefault(seq.prompt, []).append(row)
        groups = list(by_prompt.values())
        n_updates = min(self.cfg.algorithm.updates_per_batch, len(groups))
        minis = [[r for g in groups[u::n_updates] for r in g] for u in range(n_updates)]
        lengths = [len(encoded[s.prompt].input_ids) + len(s.completion_ids) for s in seqs]
        return minis, [self.ranks.mine(rows, lengths) for rows in minis]

    def _old_logprobs(
        self, encoded: list[EncodedPrompt], seqs: list[Sequence], rows: list[int], n_minis: int, masking: bool
    ) -> dict[int, torch.Tensor] | None:
        """Old log-probs of this rank's `rows` only where the policy has moved: the first mini-batch is trained
        on-policy (old = the detached current log-probs, ratio exactly 1); later ones need the log-probs from
        before any update (and with `masking`, every row: the mask is decided before the update). None with one
        mini-batch and no masking, or with algorithm.old_logprobs=engine (the engine's sampling log-probs are
        the old policy of every mini-batch: no pass)."""
        if (n_minis > 1 or masking) and self.cfg.algorithm.old_logprobs == "learner":
            return self._precompute(encoded, seqs, rows, adapter=True)
        return None

    @torch.no_grad()
    def _precompute(
        self,
        encoded: list[EncodedPrompt],
        seqs: list[Sequence],
        rows: Any,
        adapter: bool,
        temperature: float | None = None,
        raw: bool = False,
    ) -> dict[int, torch.Tensor]:
        """No-grad log-probs of the sequences `rows` (padded to their micro-batch): old policy or, adapter off,
        the reference model (`temperature` None: the sampling temperature; `raw`: see `logprobs`)."""
        self.model.eval()
        out: dict[int, torch.Tensor] = {}
        train = self.cfg.train
        # No activations are kept, so larger batches fit; 16384 tokens measured faster than 4096 on the H200.
        budget = train.logprob_batch_tokens or max(train.micro_batch_tokens, NO_GRAD_BATCH_TOKENS)
        mbs = self._micro_batches(encoded, seqs, rows, budget) if rows else []
        self._even_out(mbs, encoded, seqs)
        for mb in mbs:
            with contextlib.nullcontext() if adapter else self.model.disable_adapter():
                lp, _ = self._stats(mb, temperature, raw)
            if not mb.rows:  # a filler: nothing to keep
                continue
            lp = lp.cpu()
            for b, row in enumerate(mb.rows):
                out[row] = lp[b]
        if not adapter:
            # peft's disable_adapter turns requires_grad off and back on, but under FSDP2 not for the root unit's
            # parameters (the merger's LoRA), which would silently stop training: the optimizer's are all trained.
            for p in [p for group in self.optimizer.param_groups for p in group["params"]]:
                p.requires_grad_(True)
        if self.ranks.fsdp:  # the root unit stays unsharded after a forward: its shards registered again
            register_shards(self.model)
        return out

    def _trainable(self) -> list[torch.Tensor]:
        return [p for _, p in self._named_trainable()]

    def _named_trainable(self) -> list[tuple[str, torch.Tensor]]:
        """The trainable parameters; with FSDP the sharded ones (every pass ends with them registered)."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _mismatch_at_sampling_versions(
        self, encoded: list[EncodedPrompt], seqs: list[Sequence], rows: list[int]
    ) -> float:
        """Mean |learner - engine| log-prob per token, each of this rank's `rows` scored (no grad, before the
        update) under the adapter version that sampled it: the previous version's weights swapped in for stale
        sequences, the current ones for the rest."""
        local = torch.zeros(2, dtype=torch.float64)
        for snap, version_rows in rows_by_version(seqs, rows, self.version, self._previous):
            with swapped(self._trainable(), snap):
                store = self._precompute(encoded, seqs, version_rows, adapter=True)
            local += abs_diff_sums(seqs, version_rows, store)
        total, count = self.ranks.sum_(local).tolist()
        return total / count if count else 0.0

    def _even_out(self, mbs: list[MicroBatch], encoded: list[EncodedPrompt], seqs: list[Sequence]) -> None:
        """With FSDP every rank must run as many passes as the busiest one (each pass is a collective): append
        micro-batches of one sequence that take part in the collectives and in nothing else (`rows` empty)."""
        if not self.ranks.fsdp:
            return
        for _ in range(self.ranks.most(len(mbs)) - len(mbs)):
            filler = collate(encoded, seqs, [0], self.pad_id)
            filler.rows = []
            mbs.append(filler)

    def _update(
        self,
        encoded: list[EncodedPrompt],
        seqs: list[Sequence],
        rows: list[int],
        mine: list[int],
        old: dict[int, torch.Tensor] | None,
        ref: dict[int, torch.Tensor] | None,
    ) -> dict[str, float]:
        """One optimizer step over the mini-batch `rows` (this rank trains on `mine` of them), accumulated over
        its micro-batches; the normalisers count the whole mini-batch, across ranks."""
        self.model.train()
        mbs = self._micro_batches(encoded, seqs, mine) if mine else []
        self._even_out(mbs, encoded, seqs)
        norms = {
            "num_tokens": loss_tokens(seqs, rows, mine, masks_before_update(self.cfg.algorithm), self.ranks),
            "num_sequences": float(sum(1 for r in rows if seqs[r].completion_ids)),
            "norm_length": float(self.cfg.rollout.max_new_tokens),
        }
        # Metrics stay on the device until the end of the step: one host sync instead of several per micro-batch.
        # Every rank holds the same keys, even one without sequences: they are summed over the ranks.
        acc = {k: torch.zeros((), device=self.device) for k in metric_keys(self.cfg.algorithm)}
        acc[tags.LEARNER_MICRO_BATCHES] += sum(1 for mb in mbs if mb.rows)
        peaks = NO_PEAKS.to(self.device)  # [largest ratio, -smallest ratio], reduced by max
        self.optimizer.zero_grad(set_to_none=True)
        for mb in mbs:
            peaks = torch.maximum(peaks, self._backward(mb, old, ref, norms, acc))
        grad_norm = self._reduce_and_clip_grads()
        summed = self.ranks.sum_(torch.stack([v.float() for v in acc.values()]))
        out = dict(zip(acc, summed.tolist(), strict=True))
        highest, neg_lowest = self.ranks.max_(peaks).tolist()
        if math.isfinite(highest):  # some rank had a token
            out[tags.RATIO_MAX], out[tags.RATIO_MIN] = highest, -neg_lowest
        prompt_tokens = float(sum(len(encoded[seqs[r].prompt].input_ids) for r in rows))
        out[tags.GRAD_NORM] = grad_norm
        out[tags.LR] = float(self.optimizer.param_groups[0]["lr"])
        out[tags.LEARNER_TOKENS] = norms["num_tokens"]
        out[tags.LEARNER_SEQUENCE_TOKENS] = prompt_tokens + norms["num_tokens"]
        applied = step_if_finite(self.optimizer, out[tags.LOSS_TOTAL], grad_norm, self.cfg.train.on_nonfinite)
        out[tags.SKIPPED_UPDATES] = 0.0 if applied else 1.0
        return out

    def _backward(
        self,
        mb: MicroBatch,
        old: dict[int, torch.Tensor] | None,
        ref: dict[int, torch.Tensor] | None,
        norms: dict[str, float],
        acc: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Forward and backward of the micro-batch `mb`: its gradient added to the mini-batch's, its metrics to
        `acc` (the loss terms as they are, already normalised for the mini-batch; the per-token means weighted
        by the micro-batch's share of the mini-batch's tokens); returns its ratio peaks (`MicroBatchLoss`)."""
        dev = self.device
        lp, entropy = self._stats(mb)
        # A filler takes part in FSDP's collectives and in nothing else: no loss terms, no gathers.
        if not mb.rows:
            (lp.sum() * 0.0).backward()
            acc[tags.LEARNER_FILLER_PASSES] += 1
            return NO_PEAKS.to(dev)
        loss = micro_batch_loss(
            self.cfg.algorithm,
            lp,
            entropy,
            mb.sampling_logprobs.to(dev),
            mb.advantages.to(dev),
            mb.completion_mask.to(dev),
            norms,
            old_lp=None if old is None else mb.rows_of(old).to(dev),
            ref_lp=None if ref is None else mb.rows_of(ref).to(dev),
        )
        total = loss.total
        if faults.active("nonfinite_loss"):
            total = total * float("nan")  # what a diverged step produces: NaN loss, NaN gradients
        total.backward()
        w = mb.num_tokens / max(norms["num_tokens"], 1.0)
        with torch.no_grad():
            for k, v in {**loss.terms, tags.LOSS_TOTAL: total.detach()}.items():
                acc[k] = acc[k] + v
            for k, v in loss.means.items():
                acc[k] = acc[k] + v * w
        return loss.peaks

    def _reduce_and_clip_grads(self) -> float:
        """The gradients summed over the ranks and clipped to train.max_grad_norm; their norm before clipping."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.ranks.sum_grads(trainable)
        if self.ranks.fsdp:
            return float(clip_grads(trainable, self.cfg.train.max_grad_norm))
        return float(torch.nn.utils.clip_grad_norm_(trainable, self.cfg.train.max_grad_norm))

    # ------------------------------------------------------------------ adapter out
    def adapter_payload(self, for_engine: bool = True) -> AdapterPayload:
        """The current adapter's files: for engines (possibly on other nodes; the weights in one host buffer that
        Ray moves without pickling, `adapter.packed`), or in full precision (`for_engine=False`) for checkpoints.
        Built in memory, no disk: the per-step sync is on the hot path.
        With FSDP every rank must call it (the whole weights are gathered); rank 0's is sent."""
        if self._adapter_config is None:  # the config never changes during a run: written once
            self._adapter_config = learner_state.adapter_config_bytes(self.model)
        weights = learner_state.adapter_weights_bytes(self.model, for_engine)
        files = {ADAPTER_CONFIG: self._adapter_config, ADAPTER_WEIGHTS: weights}
        return AdapterPayload(version=self.version, files=files)

    # ------------------------------------------------------------------ the delivery probe (train.probe)
    def probe_parts(self) -> list[str]:
        return probe_parts(self._named_trainable())

    def probe_payload(self, part: str) -> AdapterPayload:
        """The probe adapter of `part` as file bytes (version -1); the learner's own weights stay as they are."""
        with swapped(self._trainable(), probe_weights(self._named_trainable(), part, self.cfg.train.seed)):
            return AdapterPayload(version=PROBE_VERSION, files=self.adapter_payload().files)

    def probe_logprobs(self, part: str, batch: TrainBatch) -> tuple[list[list[float]], list[list[float]]]:
        """Log-probs of an engine's greedy probe completions at temperature 1 (what engines report for greedy
        requests): under the probe adapter of `part`, and under the learner's own weights (the probe's effect)."""
        with swapped(self._trainable(), probe_weights(self._named_trainable(), part, self.cfg.train.seed)):
            probed = self.logprobs(batch, temperature=1.0)
        return probed, self.logprobs(batch, temperature=1.0)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {"trainer_state": learner_state.trainer_state_bytes(self)}

    def load_state(self, adapter_dir: str | Path, trainer_state: bytes) -> None:
        learner_state.load_trainer_state(self, Path(adapter_dir), trainer_state)
