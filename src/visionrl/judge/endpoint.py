"""A judge behind any OpenAI-compatible endpoint (backend `endpoint`): `visionrl serve`, vLLM's server, a hosted API.

Each judgement is one chat request (the images as base64 PNGs, then the rendered template), greedy, through the
official `openai` client: at most `max_concurrency` in flight, each with `timeout_s` per attempt and `retries`
retries (the client's backoff). For `yes_probability` the judge writes one token and the server returns its top
log-probs (`top_logprobs`, at most 20 on vLLM's server); the yes and no words are looked up among them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from visionrl.openai_wire import image_data_url, openai_base_url
from visionrl.rewards.judge import JudgeFailure, JudgeRequest, JudgeSpec, yes_share

TOP_LOGPROBS = 20  # vLLM's server refuses more by default (--max-logprobs 20)


class EndpointJudge:
    """`judge(requests)`: a yes share or the judge's text per request, or a JudgeFailure (error or timeout)."""

    def __init__(self, spec: JudgeSpec) -> None:
        from openai import OpenAI

        assert spec.base_url is not None and spec.model is not None  # JudgeSpec.check
        self.spec = spec
        self.client = OpenAI(
            base_url=openai_base_url(spec.base_url),
            api_key=spec.api_key(),
            timeout=spec.timeout_s,
            max_retries=spec.retries,
        )
        self.options: dict[str, Any] = {"temperature": 0.0}
        if spec.score == "yes_probability":
            self.options.update(max_tokens=1, logprobs=True, top_logprobs=TOP_LOGPROBS)
        else:
            self.options.update(max_tokens=spec.max_tokens)

    def judge(self, requests: list[JudgeRequest]) -> list[float | str | JudgeFailure]:
        if not requests:
            return []
        workers = min(self.spec.max_concurrency, len(requests))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge-request") as pool:
            return list(pool.map(self._one, requests))

    def _one(self, request: JudgeRequest) -> float | str | JudgeFailure:
        import openai

        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in request.images
        ]
        content.append({"type": "text", "text": request.text})
        try:
            response = self.client.chat.completions.create(
                model=str(self.spec.model), messages=[{"role": "user", "content": content}], **self.options
            )
        except openai.APITimeoutError as err:
            return JudgeFailure(
                f"the judge endpoint did not answer within {self.spec.timeout_s:g} s: {err}", True
            )
        except openai.APIError as err:  # connection errors, HTTP errors, unparsable answers
            return JudgeFailure(f"the judge endpoint failed: {type(err).__name__}: {err}")
        if not response.choices:
            return JudgeFailure("the judge endpoint answered without a choice")
        choice = response.choices[0]
        if self.spec.score != "yes_probability":
            return choice.message.content or ""
        return self._yes_share(choice)

    def _yes_share(self, choice: Any) -> float | JudgeFailure:
        entries = choice.logprobs.content if choice.logprobs is not None else None
        if not entries:
            return JudgeFailure(
                "the judge endpoint returned no log-probs (does it support logprobs/top_logprobs?)"
            )
        top = [(t.token.strip(), t.logprob) for t in entries[0].top_logprobs or []]
        share = yes_share(
            [lp for tok, lp in top if tok in self.spec.yes], [lp for tok, lp in top if tok in self.spec.no]
        )
        if share is None:
            seen = [tok for tok, _ in top[:5]]
            return JudgeFailure(
                f"neither a yes {list(self.spec.yes)} nor a no {list(self.spec.no)} word among the judge's "
                f"{len(top)} most likely first tokens (the first: {seen}); list the words as the model writes them"
            )
        return share

    def close(self) -> None:
        self.client.close()
