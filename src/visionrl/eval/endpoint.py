"""Evaluation of a served model through its OpenAI-compatible chat endpoint (`visionrl eval --endpoint`).

Requests go through the official `openai` client: chat completions with each image inlined as a base64
PNG `image_url` part, temperature 0, several requests in flight from a thread pool. Every request's
latency is measured on its own; a request that fails (timeout, connection error, HTTP error, an answer
that is not a completion) becomes a failed `Generation` with the error, never an exception, so one bad
sample or a flaky network costs that sample only. Scoring and the report are those of local evaluation
(`visionrl.eval.scoring`, `visionrl.eval.report`), so both reports have one format. Images are resized
into the image budget before they are sent (`visionrl.data.images.fit_image`): the server's processor keeps
that size, so it counts the image tokens local evaluation counts, and a request never carries a full photo.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any

from visionrl.config_env import EnvConfig
from visionrl.data.images import ImageBudget, fit_image, grid_factor
from visionrl.data.layouts import Layout
from visionrl.errors import InputError, RunError
from visionrl.eval.endpoint_episodes import EndpointEpisodes
from visionrl.eval.judged import Judges, check_judges_for, judge_step
from visionrl.eval.report import DEFAULT_REWARDS, EvalSettings
from visionrl.eval.sagemaker_runtime import sagemaker_asker
from visionrl.openai_wire import Ask, chat_messages, completion_generation, openai_base_url
from visionrl.types import Generation, PromptItem

FORBIDDEN_BIAS = -100  # the most negative logit bias the OpenAI API accepts


def _openai_ask(client: Any, clock: Callable[[], float]) -> Ask:
    """One chat completion through the `openai` client; a failure becomes a failed Generation."""
    import openai

    def ask(model: str, messages: list[dict[str, Any]], options: dict[str, Any]) -> Generation:
        start = clock()
        try:
            response = client.chat.completions.create(model=model, messages=messages, **options)
        except openai.APIError as err:  # timeouts, connection errors, HTTP errors, unparsable answers
            return Generation(None, 0, (clock() - start) * 1000.0, None, f"{type(err).__name__}: {err}")
        return completion_generation(response.model_dump(), (clock() - start) * 1000.0)

    return ask


@contextmanager
def openai_asker(
    endpoint: str, *, timeout_s: float, max_retries: int, api_key: str | None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Ask]:  # fmt: skip
    """Answers from the OpenAI-compatible server at `endpoint`. Each request gets `timeout_s` seconds per attempt
    and up to `max_retries` retries (the client's backoff, on connection errors, timeouts, 408/409/429 and 5xx).
    The API key is `api_key`, else $OPENAI_API_KEY, else $VLLM_API_KEY (what `visionrl serve` protects the server
    with), else "EMPTY" (a server without a key accepts any)."""
    from openai import OpenAI

    client = OpenAI(
        base_url=openai_base_url(endpoint),
        api_key=api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLM_API_KEY") or "EMPTY",
        timeout=timeout_s,
        max_retries=max_retries,
    )
    try:
        yield _openai_ask(client, clock)
    finally:
        client.close()


def greedy_options(max_tokens: int, forbidden_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """A greedy chat request's options; the forbidden tokens (vision tokens) get a logit bias of -100."""
    options: dict[str, Any] = {"temperature": 0.0, "max_tokens": max_tokens}
    if forbidden_token_ids:
        options["logit_bias"] = {str(t): FORBIDDEN_BIAS for t in forbidden_token_ids}
    return options


def request_answers(
    ask: Ask,
    model: str,
    requests: Sequence[list[dict[str, Any]]],
    *,
    max_tokens: int,
    concurrency: int = 8,
    forbidden_token_ids: Sequence[int] = (),
) -> list[Generation]:
    """One greedy answer per chat request (`chat_messages` output), in request order, `concurrency` requests in
    flight at once. `forbidden_token_ids` get a logit bias of -100, as local evaluation forbids vision tokens."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    options = greedy_options(max_tokens, forbidden_token_ids)
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eval-request") as pool:
        return list(pool.map(lambda messages: ask(model, messages, options), requests))


# Qwen3-VL's grid (patch 16 x merge 2), used to resize images when no --base names the served model's own.
DEFAULT_GRID_FACTOR = 32


def _base_settings(base: str) -> tuple[list[int], int]:
    """(vision token ids to forbid, image grid factor) of the served base model's checkpoint."""
    from transformers import AutoConfig

    from visionrl.models.loader import check_model_dir, load_processor, vision_token_ids

    check_model_dir(base)
    processor = load_processor(base)
    return vision_token_ids(AutoConfig.from_pretrained(base), processor), grid_factor(processor)


def evaluate_endpoint(
    endpoint: str | None,
    model: str | None,
    data: str,
    out: str,
    concurrency: int = 8,
    ablate_images: bool = False,
    max_samples: int | None = None,
    max_tokens: int = 32,
    rewards: list[str] | None = None,
    timeout_s: float = 60.0,
    *,
    seed: int = 0,
    base: str | None = None,
    max_retries: int = 2,
    budget: ImageBudget | None = None,
    api_key: str | None = None,
    layout: Layout | None = None,
    judges: Judges | None = None,
    sagemaker_endpoint: str | None = None,
    region: str | None = None,
    env: EnvConfig | None = None,
) -> dict[str, Any]:
    """Evaluate the model or adapter `model` served at `endpoint` (OpenAI base URL), or behind the SageMaker
    endpoint `sagemaker_endpoint` (its runtime API, in `region`), on `data`; write and return the report, in the
    format of `evaluate_local`.

    The chat messages are the data's, with every image sent as a base64 PNG; answers are greedy. A failed
    request counts in `num_failed` with its error (see `request_answers`). `base`
    (optional), the served base model's directory, forbids its vision tokens as local evaluation does and
    gives the image grid the images are resized to. `budget` (default: the default budget) must be the one
    the server was started with (`visionrl serve` takes it from the adapter's manifest). `judges` (`eval
    --judge`: an endpoint, a judge model or a classifier in this process) score the answers too. With `env` (a
    job's `env` section) each record is one greedy episode whose tool loop runs here (`eval.endpoint_episodes`).
    """
    from visionrl.data.dataset import load_dataset

    if not model:
        raise InputError("served evaluation needs --model NAME: an adapter or base model name the endpoint "
                         "lists (GET /v1/models)")  # fmt: skip
    if concurrency < 1:
        raise InputError(f"concurrency must be >= 1, got {concurrency}")
    if (endpoint is None) == (sagemaker_endpoint is None):
        raise InputError("give the server as --endpoint URL or --sagemaker-endpoint NAME, one of the two")
    settings = EvalSettings(data, out, tuple(rewards or DEFAULT_REWARDS), max_tokens, seed, ablate_images)
    check_judges_for(judges or [], local=False)
    forbidden, factor = _base_settings(base) if base else ([], DEFAULT_GRID_FACTOR)
    budget = budget or ImageBudget()
    where = endpoint if endpoint is not None else f"sagemaker:{sagemaker_endpoint}"
    asker = (
        sagemaker_asker(sagemaker_endpoint, timeout_s=timeout_s, max_retries=max_retries, region=region)
        if sagemaker_endpoint is not None
        else openai_asker(str(endpoint), timeout_s=timeout_s, max_retries=max_retries, api_key=api_key)
    )  # fmt: skip
    with settings.reward_fn() as reward_fn, asker as ask:
        samples = list(load_dataset(data, max_samples=max_samples, layout=layout))
        # The server applies the chat template; the prompt text stays empty here.
        prompts = settings.prompts([
            PromptItem("", [fit_image(im, budget, factor) for im in s.images], s.answer, dict(s.record), s.id,
                       source_images=list(s.images) if env is not None else [])
            for s in samples
        ])  # fmt: skip
        episodes: dict[str, float] = {}  # the episodes' metrics, with `env`
        answer = _answerer(ask, model, samples, prompts, env=env, max_tokens=max_tokens, concurrency=concurrency,
                           forbidden=forbidden, fit=lambda im: fit_image(im, budget, factor),
                           prompt_key=(layout or Layout()).prompt_key, episodes=episodes)  # fmt: skip
        return settings.report(
            prompts,
            answer,
            reward_fn,
            judge=judge_step(judges, (layout or Layout()).prompt_key),
            model=f"{model} @ {where}",
            extra={"endpoint": where, "served_model": model, "base": base,
                   "engine": "sagemaker" if sagemaker_endpoint is not None else "endpoint",
                   "concurrency": concurrency, "timeout_s": timeout_s, "images": budget.as_dict(),
                   **({"env": env.model_dump(mode="json"), "episodes": episodes} if env is not None else {})},
        )  # fmt: skip


def _answerer(
    ask: Ask, model: str, samples: list[Any], prompts: list[PromptItem], *, env: EnvConfig | None, max_tokens: int,
    concurrency: int, forbidden: list[int], fit: Callable[[Any], Any], prompt_key: str, episodes: dict[str, float],
) -> Callable[[], list[Generation]]:  # fmt: skip
    """What answers the prompts: one request each, or with `env` one greedy episode each (its metrics into
    `episodes`)."""
    from visionrl.data.prompts import prompt_messages

    if env is not None:
        player = EndpointEpisodes(env, ask, model, options=greedy_options(max_tokens, forbidden), fit=fit)
        return partial(player.answers, prompts, concurrency, episodes, prompt_key)
    requests = [chat_messages(prompt_messages(s), p.images) for s, p in zip(samples, prompts, strict=True)]
    return partial(request_answers, ask, model, requests, max_tokens=max_tokens, concurrency=concurrency,
                   forbidden_token_ids=forbidden)  # fmt: skip


def check_failures(report: dict[str, Any], max_failed_fraction: float, out: str) -> None:
    """Raise RunError when more than `max_failed_fraction` of the requests failed: an accuracy over the few
    answers left (or 0.0 with none) is not a measurement. The message shows the first errors."""
    failed, total = int(report["num_failed"]), int(report["num_samples"])
    if total == 0 or failed / total <= max_failed_fraction:
        return
    errors = [f"  - {s['id']}: {s['error']}" for s in report["samples"] if s.get("error")][:3]
    raise RunError(
        f"{failed} of {total} requests to {report.get('endpoint', 'the endpoint')} failed, more than "
        f"--max-failed-fraction={max_failed_fraction}; the report ({out}) is no measurement of the model. First "
        "errors:\n"
        + "\n".join(errors)
        + "\nCheck that the server is up, that --model names one of its models "
        "(GET /v1/models) and the API key (--api-key or VLLM_API_KEY)"
    )
