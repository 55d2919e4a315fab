"""The learner: a VLM with a peft LoRA adapter, its log-probs, the GRPO loss step and the optimizer.

A plain class (no Ray), wrapped by a thin Ray actor in `orchestrate/actors.py`. One `train_step` takes a
rollout batch (prompts, completions, advantages) and performs `updates_per_batch` optimizer steps, each
over a mini-batch accumulated from token-budget micro-batches whose losses use the mini-batch's global
normalisers, so the gradient equals that of one large batch.

The policy is the *sampling* distribution: logits / temperature with vision tokens removed (they can never
be sampled), which is also what the engines report log-probs of, so ratios and the reported
train/inference mismatch compare like with like.
"""

from __future__ import annotations

import io
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from visionrl.algo import aggregate, entropy_from_logits, kl_penalty, masked_mean, policy_loss, token_logprobs
from visionrl.config import JobConfig
from visionrl.models.loader import (
    apply_lora,
    load_base_model,
    load_processor,
    lora_param_groups,
    vision_token_ids,
)
from visionrl.train.batching import EncodedPrompt, MicroBatch, Sequence, collate, plan_micro_batches
from visionrl.types import ADAPTER_FILES, ADAPTER_WEIGHTS, AdapterPayload, PromptItem

SUPPRESSED_LOGIT = -1e9


@dataclass
class TrainBatch:
    """One step's rollouts: `prompts[i]` with its completions in `sequences` (each names its prompt)."""

    prompts: list[PromptItem]
    sequences: list[Sequence]


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based): linear warm-up, then constant
    or cosine decay to `min_ratio` at `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Learner:
    def __init__(self, cfg: JobConfig, device: str | None = None) -> None:
        self.cfg = cfg
        if cfg.train.torch_threads:
            torch.set_num_threads(cfg.train.torch_threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.processor = load_processor(cfg.model.path)
        base = load_base_model(cfg.model.path, cfg.model.dtype, self.device, cfg.model.attn_implementation)
        self.model = apply_lora(base, cfg.lora, seed=cfg.train.seed)
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
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

    def _pad_id(self) -> int:
        tok = self.processor.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    # ------------------------------------------------------------------ encoding and log-probs
    def encode_prompts(self, prompts: list[PromptItem]) -> list[EncodedPrompt]:
        out = []
        for p in prompts:
            enc = self.processor(text=[p.text], images=p.images or None, return_tensors="pt")
            mm = enc.get("mm_token_type_ids")
            out.append(
                EncodedPrompt(
                    input_ids=enc["input_ids"][0],
                    mm_token_type_ids=mm[0] if mm is not None else torch.zeros_like(enc["input_ids"][0]),
                    pixel_values=enc.get("pixel_values"),
                    image_grid_thw=enc.get("image_grid_thw"),
                )
            )
        return out

    def _logits(self, mb: MicroBatch) -> torch.Tensor:
        """Sampling-distribution logits at the completion positions: [B, T, V] float32."""
        dev = self.device
        T = mb.completion_ids.shape[1]
        keep = torch.arange(mb.prompt_len - 1, mb.prompt_len - 1 + T, device=dev)
        kwargs: dict[str, Any] = {
            "input_ids": mb.input_ids.to(dev),
            "attention_mask": mb.attention_mask.to(dev),
            "mm_token_type_ids": mb.mm_token_type_ids.to(dev),
            "logits_to_keep": keep,
            "use_cache": False,
        }
        if mb.pixel_values is not None and mb.image_grid_thw is not None:
            kwargs["pixel_values"] = mb.pixel_values.to(dev, dtype=self.model.dtype)
            kwargs["image_grid_thw"] = mb.image_grid_thw.to(dev)
        logits = self.model(**kwargs).logits.float()
        logits = logits / self.cfg.rollout.temperature
        if len(self.forbidden):
            # A large finite value, not -inf: keeps entropy and its gradient finite (algo.losses).
            logits = logits.index_fill(-1, self.forbidden.to(dev), SUPPRESSED_LOGIT)
        return logits

    def _token_logprobs(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return token_logprobs(logits, ids)

    def logprobs(self, batch: TrainBatch, adapter: bool = True) -> list[list[float]]:
        """Log-probs of every sequence's completion tokens (with the adapter, or the base model)."""
        store = self._precompute(self.encode_prompts(batch.prompts), batch.sequences, adapter)
        return [store[row][: len(seq.completion_ids)].tolist() for row, seq in enumerate(batch.sequences)]

    def _micro_batches(
        self, encoded: list[EncodedPrompt], seqs: list[Sequence], rows: Any
    ) -> list[MicroBatch]:
        rows = list(rows)
        lengths = [(len(encoded[seqs[r].prompt].input_ids), len(seqs[r].completion_ids)) for r in rows]
        plan = plan_micro_batches(lengths, self.cfg.train.micro_batch_tokens)
        return [collate(encoded, seqs, [rows[i] for i in group], self.pad_id) for group in plan]

    # ------------------------------------------------------------------ the update
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """`updates_per_batch` optimizer steps over the batch; returns metrics (means over the steps)."""
        t0 = time.perf_counter()
        algo = self.cfg.algorithm
        encoded = self.encode_prompts(batch.prompts)
        # Mini-batches of whole groups (sequences of one prompt stay together), in rollout order.
        by_prompt: dict[int, list[int]] = {}
        for row, seq in enumerate(batch.sequences):
            by_prompt.setdefault(seq.prompt, []).append(row)
        groups = list(by_prompt.values())
        n_updates = min(algo.updates_per_batch, len(groups))
        old = self._precompute(encoded, batch.sequences, adapter=True) if n_updates > 1 else None
        ref = self._precompute(encoded, batch.sequences, adapter=False) if algo.kl_coef > 0 else None
        totals: dict[str, float] = {}
        for u in range(n_updates):
            rows = [r for g in groups[u::n_updates] for r in g]
            metrics = self._update(encoded, batch.sequences, rows, old, ref)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v / n_updates
        self.version += 1
        totals["update_s"] = time.perf_counter() - t0
        totals["adapter_version"] = float(self.version)
        return totals

    @torch.no_grad()
    def _precompute(
        self, encoded: list[EncodedPrompt], seqs: list[Sequence], adapter: bool
    ) -> dict[int, torch.Tensor]:
        """No-grad log-probs per sequence row (padded to its micro-batch): old policy or, adapter off, reference."""
        self.model.eval()
        out: dict[int, torch.Tensor] = {}
        for mb in self._micro_batches(encoded, seqs, range(len(seqs))):
            ids = mb.completion_ids.to(self.device)
            if adapter:
                lp = self._token_logprobs(self._logits(mb), ids)
            else:
                with self.model.disable_adapter():
                    lp = self._token_logprobs(self._logits(mb), ids)
            for b, row in enumerate(mb.rows):
                out[row] = lp[b].cpu()
        return out

    def _gather(self, store: dict[int, torch.Tensor] | None, mb: MicroBatch) -> torch.Tensor | None:
        if store is None:
            return None
        T = mb.completion_ids.shape[1]
        rows = [torch.nn.functional.pad(store[r][:T], (0, max(0, T - len(store[r])))) for r in mb.rows]
        return torch.stack(rows).to(self.device)

    def _update(self, encoded, seqs, rows, old, ref) -> dict[str, float]:
        algo, cfg = self.cfg.algorithm, self.cfg
        self.model.train()
        mbs = self._micro_batches(encoded, seqs, rows)
        num_tokens = float(sum(mb.num_tokens for mb in mbs))
        num_seqs = float(sum(int((mb.completion_mask.sum(1) > 0).sum()) for mb in mbs))
        norms = {
            "num_tokens": num_tokens,
            "num_sequences": num_seqs,
            "norm_length": float(cfg.rollout.max_new_tokens),
        }
        acc: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for mb in mbs:
            mask = mb.completion_mask.to(self.device)
            logits = self._logits(mb)
            lp = self._token_logprobs(logits, mb.completion_ids.to(self.device))
            old_lp = self._gather(old, mb)
            old_lp = lp.detach() if old_lp is None else old_lp  # on-policy: ratio 1, gradient of A * lp
            adv = mb.advantages.to(self.device)
            loss, pm = policy_loss(
                lp,
                old_lp,
                adv,
                mask,
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
                dual_clip=algo.dual_clip,
                aggregation=algo.loss_aggregation,
                **norms,
            )
            total = loss
            ref_lp = self._gather(ref, mb)
            kl = torch.zeros((), device=self.device)
            if ref_lp is not None:
                kl = aggregate(kl_penalty(lp, ref_lp, algo.kl_kind), mask, algo.loss_aggregation, **norms)
                total = total + algo.kl_coef * kl
            # Entropy of the sampling policy: in the loss (with gradient) only when it has a coefficient.
            with torch.set_grad_enabled(algo.entropy_coef > 0):
                entropy = entropy_from_logits(logits)
            if algo.entropy_coef > 0:
                total = total - algo.entropy_coef * aggregate(entropy, mask, algo.loss_aggregation, **norms)
            total.backward()
            w = mb.num_tokens / max(num_tokens, 1.0)  # token-weighted averages of per-micro-batch metrics
            with torch.no_grad():
                ent = masked_mean(entropy.detach(), mask)
                diff = masked_mean((lp.detach() - mb.sampling_logprobs.to(self.device)).abs(), mask)
            for k, v in {
                "loss/policy": loss.item(),
                "loss/kl": kl.item(),
                "loss/total": total.item(),
                "policy/clip_fraction": float(pm["clip_fraction"]) * w,
                "policy/approx_kl": float(pm["approx_kl"]) * w,
                "policy/entropy": ent.item() * w,
                "rollout/logprob_diff": diff.item() * w,
            }.items():
                acc[k] = acc.get(k, 0.0) + v
            del logits
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], cfg.train.max_grad_norm
        )
        acc["policy/grad_norm"] = float(grad_norm)
        acc["policy/lr"] = float(self.scheduler.get_last_lr()[0])
        acc["learner/micro_batches"] = float(len(mbs))
        acc["learner/tokens"] = num_tokens
        self.optimizer.step()
        self.scheduler.step()
        return acc

    # ------------------------------------------------------------------ adapter out
    def save_adapter(self, path: str | Path) -> Path:
        path = Path(path)
        # With LoRA on lm_head peft would also save the (frozen, unchanged) base lm_head: 1.2 GB for an 8B model,
        # on every sync. The adapter is the LoRA weights only.
        self.model.save_pretrained(str(path), save_embedding_layers=False)
        return path

    def adapter_payload(self, for_engine: bool = True) -> AdapterPayload:
        """The current adapter as file bytes: for engines (possibly on other nodes), or in full precision
        (`for_engine=False`) for checkpoints."""
        with tempfile.TemporaryDirectory(prefix="visionrl-adapter-") as tmp:
            self.save_adapter(tmp)
            files = {name: (Path(tmp) / name).read_bytes() for name in ADAPTER_FILES}
        if for_engine and self.model.dtype != torch.float32:
            # peft keeps LoRA weights in float32; engines compute in the model's dtype anyway, so the per-step
            # sync sends them in that dtype: half the bytes (an 8B model's r64 adapter: 666 -> 333 MiB).
            # Checkpoints and the exported adapter keep float32.
            from safetensors.torch import load, save

            weights = {k: v.to(self.model.dtype) for k, v in load(files[ADAPTER_WEIGHTS]).items()}
            files[ADAPTER_WEIGHTS] = save(weights)
        return AdapterPayload(version=self.version, files=files)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "version": self.version,
                "rng": torch.get_rng_state(),
            },
            buf,
        )
        return {"trainer_state": buf.getvalue()}

    def load_state(self, adapter_dir: str | Path, trainer_state: bytes) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
        set_peft_model_state_dict(self.model, weights)
        state = torch.load(io.BytesIO(trainer_state), weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        torch.set_rng_state(state["rng"])
