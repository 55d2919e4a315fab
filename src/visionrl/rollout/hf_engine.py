"""Fallback rollout engine: transformers `generate` with the peft adapter (`rollout.engine: hf`).

Slower than vLLM (docs/ENGINE_NOTES.md: 17x off the bandwidth floor on an H200) but needs nothing beyond transformers,
so it runs where vLLM cannot be installed and serves as the GPU benchmark's engine.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

import torch
from transformers import BatchFeature

from visionrl import faults
from visionrl.config import LoraConfig
from visionrl.data.images import ImageBudget
from visionrl.models.loader import apply_lora, load_base_model, load_processor
from visionrl.models.token_prompts import (
    check_image_count,
    encode_images,
    expand_placeholders,
    image_token_id,
)
from visionrl.rollout.probe import PROBE_TOKENS, as_a_faulty_engine_applies, probe_result
from visionrl.rollout.rejects import generate_skipping
from visionrl.rollout.stepping import BatchingStepper
from visionrl.types import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterPayload,
    Completion,
    JudgeAsk,
    ProbeResult,
    PromptItem,
    SamplingSpec,
)

logger = logging.getLogger(__name__)


def end_of_sequence_ids(generation_eos: int | list[int] | None, tokenizer_eos: int | None) -> list[int]:
    """Every token that ends a completion: real Qwen3-VL checkpoints list two ([151645, 151643])."""
    ids = generation_eos if generation_eos is not None else tokenizer_eos
    if ids is None:
        raise ValueError("the checkpoint names no end-of-sequence token (generation_config or tokenizer)")
    return [int(t) for t in (ids if isinstance(ids, list | tuple) else [ids])]


class HFEngine:
    def __init__(
        self,
        model_path: str,
        *,
        lora: LoraConfig,
        forbidden_token_ids: list[int],
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        budget: ImageBudget | None = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.budget = budget or ImageBudget()
        self.processor = load_processor(model_path, self.budget)
        self.processor.tokenizer.padding_side = "left"
        base = load_base_model(model_path, dtype, self.device)
        self.model = apply_lora(base, lora, seed=seed).eval()
        self.forbidden = list(forbidden_token_ids)
        tok = self.processor.tokenizer
        self.eos_ids = end_of_sequence_ids(base.generation_config.eos_token_id, tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else self.eos_ids[0])
        self._version = 0
        # The adapter is merged into the weights for generation (1.7x faster decoding than unmerged LoRA
        # layers on an H200, benchmarks/gpu_generate.py). Merging and unmerging in bf16 would drift the base
        # weights a little at every sync, so the targeted base weights are kept (on the CPU) and restored exactly.
        self._pristine = {
            name: module.base_layer.weight.detach().to("cpu", copy=True)
            for name, module in self.model.named_modules()
            if hasattr(module, "base_layer") and hasattr(module, "lora_A")
        }
        self.model.merge_adapter()
        self._served: AdapterPayload | None = None  # the payload merged now (None: base model, B = 0)
        self._stepper = BatchingStepper(self.generate)  # continuous episodes: what is queued, one batch

    def adapter_version(self) -> int:
        return self._version

    def load_adapter(self, payload: AdapterPayload) -> int:
        if payload.version > 1 and faults.active("drop_adapter_syncs"):
            self._version = payload.version  # acknowledged, not loaded: what the per-step check must catch
            return self._version
        self._apply(payload)
        self._served = payload
        self._version = payload.version
        return self._version

    def probe(self, payload: AdapterPayload, prompts: list[PromptItem]) -> ProbeResult:
        """Greedy completions of `prompts` with `payload` and how far they moved from the version served now
        (not at all: the adapter does not reach the model); the served version stays as it was."""
        spec = SamplingSpec(n=1, greedy=True, max_tokens=PROBE_TOKENS)
        before = self.generate(prompts, spec)
        self._apply(payload)
        try:
            after = self.generate(prompts, spec)
        finally:
            self._apply(self._served)
        return probe_result(before, after, payload.version)

    def fingerprint(
        self, prompt: PromptItem, max_tokens: int, continuation: list[int] | None = None
    ) -> Completion | None:
        if continuation is not None:
            return self._teacher_forced(prompt, continuation)
        groups = self.generate([prompt], SamplingSpec(n=1, greedy=True, max_tokens=max_tokens))
        return groups[0][0] if groups and groups[0] else None

    @torch.no_grad()
    def _teacher_forced(self, prompt: PromptItem, continuation: list[int]) -> Completion | None:
        """`continuation`'s raw log-probs after `prompt` (no token suppressed), in one forward pass."""
        ids = prompt.token_ids
        if ids is None:
            ids = self.processor.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        try:
            enc = self._encode([replace(prompt, token_ids=[*ids, *continuation])]).to(self.device)
        except ValueError as err:
            logger.warning("the HF engine rejected the fingerprint prompt: %s", err)
            return None
        n = len(continuation)
        logits = self.model(**enc, use_cache=False).logits[0, -n - 1 : -1].float()
        target = torch.tensor(continuation, device=logits.device).unsqueeze(1)
        lps = torch.log_softmax(logits, dim=-1).gather(1, target).squeeze(1).tolist()
        return Completion(0, list(continuation), "", lps, "length", adapter_version=self._version)

    @torch.no_grad()
    def judge(self, prompts: list[PromptItem], ask: JudgeAsk) -> list[float | str | None]:
        """The base model's verdicts (B = 0 merged); the served adapter is merged back afterwards."""
        self._apply(None)
        try:
            if ask.wants_text:
                groups = self.generate(prompts, SamplingSpec(n=1, greedy=True, max_tokens=ask.max_tokens))
                return [g[0].text if g else None for g in groups]

            def skip(index: int, err: BaseException) -> None:
                logger.warning("the HF engine rejected judge prompt %d; skipping it: %s", index, err)

            return generate_skipping(lambda batch: self._yes_shares(batch, ask), prompts, (ValueError,), skip)
        finally:
            self._apply(self._served)

    def _yes_shares(self, prompts: list[PromptItem], ask: JudgeAsk) -> list[float | str | None]:
        """P(yes) / (P(yes) + P(no)) of each prompt's next token: the log-softmax over the yes and no ids only."""
        images = [img for p in prompts for img in p.images] or None
        enc = self.processor(text=[p.text for p in prompts], images=images, return_tensors="pt", padding=True)
        logits = self.model(**enc.to(self.device), use_cache=False).logits[:, -1, :].float()
        ids = torch.tensor([*ask.yes_ids, *ask.no_ids], device=logits.device)
        shares = torch.log_softmax(logits[:, ids], dim=-1)[:, : len(ask.yes_ids)].exp().sum(-1)
        return [float(x) for x in shares.cpu()]

    def rebuilds(self) -> int:
        return 0  # transformers' generate has no engine state to lose

    def _apply(self, payload: AdapterPayload | None) -> None:
        """Merge `payload`'s LoRA weights into exactly-restored base weights (None: the base model)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load as load_safetensors

        self.model.unmerge_adapter()
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for name, weight in self._pristine.items():
                modules[name].base_layer.weight.copy_(weight)
        if payload is None or faults.active("ignore_adapters"):
            with torch.no_grad():  # zero B: the LoRA layers add nothing
                for n, p in self.model.named_parameters():
                    if "lora_B" in n:
                        p.zero_()
        else:
            weights = as_a_faulty_engine_applies(payload).file_bytes(ADAPTER_WEIGHTS)
            result = set_peft_model_state_dict(self.model, load_safetensors(weights))
            if getattr(result, "unexpected_keys", None):
                cfg = json.loads(payload.file_bytes(ADAPTER_CONFIG))
                raise ValueError(
                    f"adapter v{payload.version} does not fit this engine's LoRA layout "
                    f"(unexpected {result.unexpected_keys[:3]}...; adapter targets {cfg.get('target_modules')})"
                )
        self.model.merge_adapter()

    @torch.no_grad()
    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        """`spec.n` completions per prompt; a prompt the processor refuses (ValueError) or with more than
        `budget.max_images` images gets none (skipped), the rest of the batch is generated."""
        if spec.seed is not None:
            torch.manual_seed(spec.seed)

        def skip(index: int, err: BaseException) -> None:
            logger.warning("the HF engine rejected prompt %r; skipping it: %s", prompts[index].sample_id, err)

        groups = generate_skipping(
            lambda batch: self._generate_batch(batch, spec), prompts, (ValueError,), skip
        )
        return [[replace(c, prompt_index=i) for c in g or []] for i, g in enumerate(groups)]

    def _generate_batch(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        for p in prompts:
            if len(p.images) > self.budget.max_images:
                raise ValueError(
                    f"prompt {p.sample_id!r} has {len(p.images)} images, over the limit of {self.budget.max_images}"
                )
        enc = self._encode(prompts).to(self.device)
        gen_kwargs: dict[str, Any] = {
            "max_new_tokens": spec.max_tokens,
            "num_return_sequences": spec.n,
            "output_scores": True,
            "return_dict_in_generate": True,
            "suppress_tokens": self.forbidden or None,
            "eos_token_id": self.eos_ids,
            "pad_token_id": self.pad_id,
        }
        if spec.greedy:
            gen_kwargs.update(do_sample=False)
        else:
            gen_kwargs.update(do_sample=True, temperature=spec.temperature, top_p=spec.top_p, top_k=0)
        out = self.model.generate(**enc, **gen_kwargs)
        prompt_len = enc["input_ids"].shape[1]
        new_tokens = out.sequences[:, prompt_len:]
        # Scores are the processed (temperature, suppression) logits of each step: the sampling distribution.
        # Only the sampled token's log-prob leaves the device ([B, T], not [B, T, vocab]: 10 GB for an 8B
        # model's vocabulary at 64 x 256 tokens).
        logps = torch.stack(
            [
                torch.log_softmax(s.float(), dim=-1).gather(1, new_tokens[:, t : t + 1]).squeeze(1)
                for t, s in enumerate(out.scores)
            ],
            dim=1,
        ).cpu()
        seqs = new_tokens.cpu()
        results: list[list[Completion]] = [[] for _ in prompts]
        for row in range(seqs.shape[0]):
            ids, finish = self._trim(seqs[row].tolist())
            lp = logps[row, : len(ids)].tolist()
            i = row // spec.n
            text = self.processor.tokenizer.decode(ids, skip_special_tokens=True)
            results[i].append(Completion(i, ids, text, lp, finish, adapter_version=self._version))
        return results

    def _encode(self, prompts: list[PromptItem]) -> Any:
        """The batch as the model reads it, left-padded: text prompts through the processor; with an episode's
        token prompt among them, every prompt's tokens with their placeholders expanded (`models.token_prompts`)."""
        if all(p.token_ids is None for p in prompts):
            texts = [p.text for p in prompts]
            images = [img for p in prompts for img in p.images] or None
            return self.processor(text=texts, images=images, return_tensors="pt", padding=True)
        pad_image = image_token_id(self.processor)
        rows, pixels, grids = [], [], []
        for p in prompts:
            ids = p.token_ids
            if ids is None:
                ids = self.processor.tokenizer(p.text, add_special_tokens=False)["input_ids"]
            check_image_count(ids, p.images, pad_image)
            encoded = encode_images(self.processor, p.images)
            rows.append(expand_placeholders(ids, encoded.tokens, pad_image)[0])
            if encoded.pixel_values is not None and encoded.image_grid_thw is not None:
                pixels.append(encoded.pixel_values)
                grids.append(encoded.image_grid_thw)
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
        attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "mm_token_type_ids": (input_ids == pad_image).long() * attention,
        }
        if pixels:
            batch.update(pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids))
        return BatchFeature(batch)

    def _trim(self, ids: list[int]) -> tuple[list[int], str]:
        """Cut at the first end-of-sequence token (kept, as vLLM does); the rest is padding."""
        for i, t in enumerate(ids):
            if t in self.eos_ids:
                return ids[: i + 1], "stop"
        return ids, "length"

    def sleep(self) -> None:
        """Nothing to release: the HF engine holds only the weights."""

    def wake_up(self) -> None:
        """See `sleep`."""

    def submit(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[str]:
        """`types.SteppingEngine`, simple form: queued until `collect` generates the queue as one batch."""
        return self._stepper.submit(prompts, spec)

    def collect(self, timeout_s: float) -> dict[str, list[Completion]]:
        return self._stepper.collect(timeout_s)

    def abort(self) -> int:
        return self._stepper.abort()

    def in_flight(self) -> bool:
        return self._stepper.busy()

    def close(self) -> None:
        self.model = None
