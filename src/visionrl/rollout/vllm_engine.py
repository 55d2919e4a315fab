"""The production rollout engine: an in-process vLLM `LLM` with LoRA, fed a new adapter version every step (as a
LoRA adapter, or merged into its weights: `rollout.vllm_adapters`).

Facts this engine is built on (docs/ENGINE_NOTES.md, measured on vLLM 0.32):
- each adapter version gets a new LoRA id and name; reusing one returns stale image embeddings;
- after any adapter change the encoder and prefix caches are reset, else a cached image crashes the engine;
- LoRA on the vision merger is applied only with `enable_tower_connector_lora=True`;
- after an exception inside an in-process engine it is unusable, so it is rebuilt and the call retried once;
- a prompt vLLM refuses at validation (too long for `max_model_len`, more images than `limit_mm_per_prompt`)
  raises before anything runs and leaves the engine usable: that prompt is skipped (an empty group), the
  rest of the batch is generated (`visionrl.rollout.rejects`).
Log-probs are returned in `processed_logprobs` mode: the sampling distribution (temperature applied, forbidden
vision tokens biased away), the same distribution the learner computes.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from typing import Any

from visionrl import faults
from visionrl.adapter.servable import vllm_max_lora_rank
from visionrl.data.images import ImageBudget
from visionrl.rollout.probe import PROBE_TOKENS, probe_result
from visionrl.rollout.rejects import generate_skipping, vllm_rejections
from visionrl.rollout.vllm_adapters import SERVINGS, VLLMAdapters, timed
from visionrl.rollout.vllm_platform import cpu_only, set_cpu_env
from visionrl.rollout.vllm_stepping import VLLMStepper
from visionrl.types import (
    AdapterPayload,
    Completion,
    JudgeAsk,
    ProbeResult,
    PromptItem,
    SamplingSpec,
)

logger = logging.getLogger(__name__)


FORBIDDEN_BIAS = -100.0  # vLLM adds logit_bias; -100 makes a token's probability ~e^-100


def _quiet_vllm() -> None:
    """vLLM's INFO lines (one per cache reset, i.e. per step) bury the progress bar: default to WARNING, and drop
    the CPU worker's warning repeated on every `torch.set_num_threads` call (it replaces that function)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(
        lambda record: "set_num_threads" not in record.getMessage()
    )


class VLLMEngine:
    """Rollouts with vLLM. `forbidden_token_ids` can never be sampled (vision tokens)."""

    def __init__(
        self,
        model_path: str,
        *,
        lora_rank: int,
        tower_lora: bool,
        forbidden_token_ids: list[int],
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        kv_cache_gib: float = 1.0,
        seed: int = 0,
        budget: ImageBudget | None = None,
        sleep_mode: bool = False,
        engine_args: dict[str, Any] | None = None,
        lora_serving: str = "adapter",
    ) -> None:
        if lora_serving not in SERVINGS:
            raise ValueError(f"lora_serving={lora_serving!r}: use one of {', '.join(SERVINGS)}")
        merged = lora_serving == "merged"
        budget = budget or ImageBudget()
        self._llm_kwargs: dict[str, Any] = {
            "model": model_path,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "seed": seed,
            "logprobs_mode": "processed_logprobs",
            # The learner's processor resizes into the same bounds, so both count the same image tokens.
            "mm_processor_kwargs": budget.vllm_processor_kwargs(),
            "limit_mm_per_prompt": budget.vllm_mm_limit(),
            "enforce_eager": enforce_eager,
            "worker_extension_cls": "visionrl.rollout.vllm_worker.VisionRLWorkerExtension",
        }
        # rank 0: a judge model's own engine, which serves no adapter; merged: the adapter goes into the weights
        if lora_rank > 0 and not merged:
            self._llm_kwargs.update(
                enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1
            )
        if tower_lora and lora_rank > 0 and not merged:
            self._llm_kwargs["enable_tower_connector_lora"] = True
        self._cpu = cpu_only()
        if self._cpu:
            set_cpu_env(kv_cache_gib)
            if "enable_lora" not in self._llm_kwargs:
                # the CPU build compiles an engine that serves no LoRA: the tiny model 42 s to start, eager 20 s
                self._llm_kwargs["enforce_eager"] = True
        else:
            self._llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        # Sleep mode exists on GPUs only (a no-op on the CPU build): it frees the KV cache and moves the weights
        # to host memory while the colocated learner updates.
        self._sleep_mode = sleep_mode and not self._cpu
        if self._sleep_mode:
            self._llm_kwargs["enable_sleep_mode"] = True
        self._llm_kwargs.update(engine_args or {})  # rollout.vllm_engine_args: none of the keys set above
        self._asleep = False
        _quiet_vllm()
        self.forbidden = list(forbidden_token_ids)
        # Adapter versions go through memory-backed files where the OS has them: vLLM loads LoRA from a path.
        self._adapters = VLLMAdapters(lambda: self._llm, model_path, merged)
        self._version = 0
        self._rebuilds = 0
        self._sampling_calls, self._fail_next = 0, False  # for the fault injection (fail_engine_batch)
        self._llm: Any = self._build()
        self._stepper: VLLMStepper | None = None  # continuous episodes' running batch, made on first use

    def _build(self) -> Any:
        from vllm import LLM

        llm = LLM(**self._llm_kwargs)
        if self._sleep_mode:
            # The first sleep pins host memory for the weights (8 s at 8B on an H100; 0.4 s every time after):
            # paid here, while the learners compile beside the engines' start, not in step 1's update.
            t = time.perf_counter()
            llm.sleep(level=1)
            llm.wake_up()
            logger.info(
                "vLLM's sleep mode warmed up (a sleep and a wake-up): %.1f s", time.perf_counter() - t
            )
        self._adapters.restore(llm)
        return llm

    # ------------------------------------------------------------------ protocol
    def adapter_version(self) -> int:
        return self._version

    def load_adapter(self, payload: AdapterPayload) -> int:
        self._exclusive("loading an adapter")
        self.wake_up()
        self.load_parts: dict[str, float] = {}  # the sync's profile (timing/sync_<part>_s), seconds
        if self._adapters.served is not None and payload.version == self._version:
            return self._version  # already served (a LoRA id must never be reused for other weights)
        if payload.version > 1 and faults.active("drop_adapter_syncs"):
            self._version = payload.version  # acknowledged, not loaded: what the per-step check must catch
            return self._version
        parts = self.load_parts
        new = self._adapters.add(payload, f"visionrl-v{payload.version}", parts)
        old = self._adapters.served
        self._adapters.served, self._version = new, payload.version
        with timed(parts, "remove"):  # the version before, out of vLLM and its files
            self._adapters.remove(old)
        with timed(parts, "reset"):
            self._reset_caches()
        return self._version

    def probe(self, payload: AdapterPayload, prompts: list[PromptItem]) -> ProbeResult:
        """Greedy completions of `prompts` with adapter `payload` and how far they moved from the version served
        now (not at all: the engine ignores the adapter). Load an adapter afterwards: once a LoRA was held,
        requests without one can still see its weights (vLLM 0.32 CPU, tower-connector LoRA)."""
        spec = SamplingSpec(n=1, greedy=True, max_tokens=PROBE_TOKENS)
        before = self.generate(prompts, spec)
        req = self._adapters.add(payload, "visionrl-probe")
        try:
            after = self._generate(prompts, spec, req)
        finally:
            self._adapters.remove(req)
            self._reset_caches()
        return probe_result(before, after, payload.version)

    def fingerprint(
        self, prompt: PromptItem, max_tokens: int, continuation: list[int] | None = None
    ) -> Completion | None:
        if continuation is None:
            groups = self.generate([prompt], SamplingSpec(n=1, greedy=True, max_tokens=max_tokens))
            got = groups[0][0] if groups and groups[0] else None
        else:
            got = self._teacher_forced(prompt, continuation)
        # A prompt served from the prefix or encoder cache is computed by other kernels, with logits a little
        # different: a later rollout of the same prompt must not depend on whether it was fingerprinted.
        self._reset_caches()
        return got

    def _teacher_forced(self, prompt: PromptItem, continuation: list[int]) -> Completion | None:
        """`continuation`'s raw log-probs after `prompt` under the version served: one prefill with vLLM's prompt
        log-probs (which skip the sampling processors: no token biased away), nothing sampled."""
        from vllm import SamplingParams

        self._exclusive("the adapter fingerprint")
        self.wake_up()
        ids = prompt.token_ids
        if ids is None:  # tokenised as vLLM tokenises a text prompt of this chat template
            ids = self._llm.get_tokenizer()(prompt.text, add_special_tokens=False)["input_ids"]
        forced = PromptItem(text=prompt.text, images=prompt.images, token_ids=[*ids, *continuation])
        params = SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0)
        try:
            out = self._run(self.inputs([forced]), params, self._adapters.served)[0]
        except vllm_rejections() as err:
            logger.warning("vLLM rejected the fingerprint prompt: %s", err)
            return None
        tail = (out.prompt_logprobs or [])[-len(continuation) :]
        lps = [
            float(e[t].logprob) if e and t in e else math.nan
            for t, e in zip(continuation, tail, strict=False)
        ]
        return Completion(0, list(continuation), "", lps, "length", adapter_version=self._version)

    def judge(self, prompts: list[PromptItem], ask: JudgeAsk) -> list[float | str | None]:
        """The base model's verdicts (`VLLMAdapters.base`: the checkpoint's weights merged back, or a zero adapter
        in a LoRA slot); the caches are reset before and after, so no image embedding or prefix crosses between the
        policy and the judge."""
        from vllm import SamplingParams

        self._exclusive("judging")
        self.wake_up()
        if ask.wants_text:
            params = SamplingParams(
                n=1,
                temperature=0.0,
                max_tokens=ask.max_tokens,
                logit_bias={t: FORBIDDEN_BIAS for t in self.forbidden} or None,
                skip_special_tokens=True,
            )
        else:
            # Every other token is masked before the processed log-probs are taken, so they are normalised over
            # the yes and no tokens; which one is sampled does not matter.
            ids = [*ask.yes_ids, *ask.no_ids]
            params = SamplingParams(
                n=1, temperature=1.0, max_tokens=1, logprobs=len(ids), allowed_token_ids=ids
            )

        def skip(index: int, err: BaseException) -> None:
            logger.warning("vLLM rejected judge prompt %d; skipping it: %s", index, err)

        base = self._adapters.base()
        self._reset_caches()
        try:
            outputs = generate_skipping(
                lambda batch: self._run(batch, params, base), self.inputs(prompts), vllm_rejections(), skip
            )
        finally:
            self._adapters.remove(base)
            self._reset_caches()
        return [None if out is None else _verdict(out.outputs[0], ask) for out in outputs]

    def rebuilds(self) -> int:
        return self._rebuilds

    def _reset_caches(self) -> None:
        # After any adapter change: a cached image embedding or prefix of the old weights must not be reused.
        self._llm.llm_engine.reset_encoder_cache()
        self._llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Level-1 sleep (GPU, `sleep_mode`): KV cache discarded, weights offloaded to host memory."""
        if self._sleep_mode and not self._asleep:
            self._llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False
            self._llm.llm_engine.reset_encoder_cache()  # the caches' contents went with the KV memory
            self._llm.reset_prefix_cache()

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        self._exclusive("generate")
        self.wake_up()  # a caller that forgot to wake the engine gets a working one, not an error
        self._sampling_calls += not spec.greedy
        self._fail_next = self._sampling_calls == faults.AT_CALL and faults.active("fail_engine_batch")
        return self._generate(prompts, spec, self._adapters.served)

    def _generate(self, prompts: list[PromptItem], spec: SamplingSpec, lora: Any) -> list[list[Completion]]:
        if spec.seed is not None:
            self.reseed(spec.seed)
        params = self.sampling_params(spec)

        def skip(index: int, err: BaseException) -> None:
            logger.warning("vLLM rejected prompt %r; skipping it: %s", prompts[index].sample_id, err)

        outputs = generate_skipping(
            lambda batch: self._run(batch, params, lora), self.inputs(prompts), vllm_rejections(), skip
        )
        return [
            [] if out is None else [self.completion(i, c) for c in out.outputs]
            for i, out in enumerate(outputs)
        ]

    def reseed(self, seed: int) -> None:
        # One seed per step for the engine's own generator instead of per-request seeds: per-request seeds
        # give sample j of every prompt the same noise and take vLLM's slow sampling path (and fail on the
        # CPU build); reseeding the engine keeps every sample's noise distinct and a step reproducible.
        self._llm.collective_rpc("visionrl_reseed", args=(seed,))

    def sampling_params(self, spec: SamplingSpec) -> Any:
        """vLLM's sampling parameters for `spec`: processed log-probs, forbidden tokens biased away."""
        from vllm import SamplingParams

        return SamplingParams(
            n=spec.n,
            temperature=0.0 if spec.greedy else spec.temperature,
            top_p=1.0 if spec.greedy else spec.top_p,
            max_tokens=spec.max_tokens,
            logprobs=0,
            logit_bias={t: FORBIDDEN_BIAS for t in self.forbidden} or None,
            skip_special_tokens=True,
        )

    @staticmethod
    def inputs(prompts: list[PromptItem]) -> list[dict[str, Any]]:
        """vLLM's inputs: the text, or an episode's token ids (one placeholder per image: vLLM expands them as it
        does a text prompt's, docs/ENGINE_NOTES.md), with the images."""
        out = []
        for p in prompts:
            item: dict[str, Any] = (
                {"prompt": p.text} if p.token_ids is None else {"prompt_token_ids": p.token_ids}
            )
            if p.images:
                item["multi_modal_data"] = {"image": p.images}
            out.append(item)
        return out

    def _run(self, inputs: list[dict[str, Any]], params: Any, lora: Any) -> list[Any]:
        try:
            if self._fail_next:
                self._fail_next = False
                raise RuntimeError("injected fault fail_engine_batch: the engine core failed in this batch")
            request = self._adapters.request(lora)
            return list(self._llm.generate(inputs, params, lora_request=request, use_tqdm=False))
        except (RuntimeError, AssertionError) as err:
            if lora is not self._adapters.served:
                raise  # a probe: the rebuilt engine would not hold its adapter
            # An in-process engine is unusable after an internal error (docs/ENGINE_NOTES.md): rebuild, retry once.
            # The old engine is shut down first: two at once would need twice its memory. The loop probes a
            # rebuilt engine again before its next rollout (`rebuilds`).
            logger.warning("vLLM engine failed (%s); rebuilding it and retrying the batch once", err)
            self.rebuild()
            request = self._adapters.request(self._adapters.served)
            return list(self._llm.generate(inputs, params, lora_request=request, use_tqdm=False))

    def rebuild(self) -> None:
        """A new engine in place of one broken by an internal error; the old one shut down first (two at once
        would need twice its memory). The loop probes a rebuilt engine again before its next rollout."""
        self._shutdown()
        self._llm = self._build()
        self._rebuilds += 1

    def completion(self, index: int, c: Any) -> Completion:
        ids = list(c.token_ids)
        lps = []
        for tok, entry in zip(ids, c.logprobs or [], strict=False):
            lps.append(float(entry[tok].logprob) if entry and tok in entry else float("nan"))
        return Completion(
            prompt_index=index,
            token_ids=ids,
            text=c.text,
            logprobs=lps,
            finish_reason="length" if c.finish_reason == "length" else "stop",
            adapter_version=self._version,
        )

    def _shutdown(self) -> None:
        """Stop the engine's core (its worker process and memory, on GPUs): before another is built, or on close."""
        llm, self._llm = self._llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            try:
                core.shutdown()
            except Exception as err:  # a broken engine may fail to stop cleanly; its memory goes with `llm`
                logger.warning("the failed vLLM engine did not shut down cleanly: %s", err)
        del llm
        gc.collect()
        if not self._cpu:
            import torch

            torch.cuda.empty_cache()

    def close(self) -> None:
        """The engine stopped, its core process and GPU memory released now (not when the LLM is collected: an
        engine built next in this process, or an actor's on this GPU, sizes its share from the memory free)."""
        if self._stepper is not None:
            self._stepper.close()
        self._adapters.close()
        self._shutdown()

    # ------------------------------------------------------------------ stepping (continuous episodes)
    def submit(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[str]:
        """`types.SteppingEngine.submit`: the prompts join the running batch (`rollout.vllm_stepping`)."""
        if not self.in_flight():
            self.wake_up()  # vLLM is ours while nothing is in flight (a lane's first turns)
        if self._stepper is None:
            self._stepper = VLLMStepper(self)
        return self._stepper.submit(prompts, spec)

    def collect(self, timeout_s: float) -> dict[str, list[Completion]]:
        return self._stepper.collect(timeout_s) if self._stepper is not None else {}

    def abort(self) -> int:
        return self._stepper.abort() if self._stepper is not None else 0

    def wake(self) -> None:
        if self._stepper is not None:
            self._stepper.wake()

    def in_flight(self) -> bool:
        return self._stepper is not None and self._stepper.busy()

    def served_lora(self) -> Any:
        """What a request names to get the version served (None when it is merged into the weights)."""
        return self._adapters.request(self._adapters.served)

    def llm_engine(self) -> Any:
        return self._llm.llm_engine

    def _exclusive(self, what: str) -> None:
        """Nothing else may touch vLLM while the stepping thread has requests in it (an adapter change under a
        request, or `LLM.generate` collecting the thread's outputs)."""
        if self.in_flight():
            raise RuntimeError(f"{what} while continuous requests are in flight: collect or abort them first")


def _verdict(c: Any, ask: JudgeAsk) -> float | str | None:
    """A judge answer: its text, or the yes share of its first position's log-probs (None when none is there)."""
    if ask.wants_text:
        return str(c.text)
    from visionrl.rewards.judge import yes_share

    entry = (c.logprobs or [None])[0] or {}
    found = [[float(entry[t].logprob) for t in ids if t in entry] for ids in (ask.yes_ids, ask.no_ids)]
    return yes_share(*found)
