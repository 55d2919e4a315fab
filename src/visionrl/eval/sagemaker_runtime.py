"""Answers from a SageMaker endpoint (`visionrl eval --sagemaker-endpoint NAME`): the OpenAI chat request as the
body of the SageMaker runtime's `InvokeEndpoint` (boto3), which the container built by `visionrl serve
--sagemaker` hands to vLLM's `/invocations`; the answer is the chat completion as JSON.

Credentials, region and endpoint come from the standard AWS environment (`AWS_REGION`, profiles, roles;
`AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME` for another endpoint). Each request gets `timeout_s` to read and botocore's
standard retries (throttling, 5xx, connection errors); a request that still fails is a failed Generation with
the error, as with the OpenAI client.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from visionrl.openai_wire import Ask, completion_generation
from visionrl.types import Generation

CONTENT_TYPE = "application/json"


def _error_text(err: Exception) -> str:
    """botocore's error, with the container's own message where the endpoint returned one (ModelError)."""
    response = getattr(err, "response", None) or {}
    original = response.get("OriginalMessage") or ""
    return f"{type(err).__name__}: {err}" + (f" (the container said: {original[:300]})" if original else "")


@contextmanager
def sagemaker_asker(
    endpoint_name: str,
    *,
    timeout_s: float,
    max_retries: int,
    region: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Ask]:
    """An `Ask` (model, chat messages, options) -> Generation through InvokeEndpoint of `endpoint_name`."""
    import boto3  # type: ignore[import-untyped]
    import botocore.config  # type: ignore[import-untyped]
    import botocore.exceptions as bx  # type: ignore[import-untyped]

    config = botocore.config.Config(
        read_timeout=timeout_s,
        connect_timeout=min(timeout_s, 10.0),
        retries={"max_attempts": max_retries + 1, "mode": "standard"},
        max_pool_connections=64,
    )
    client = boto3.client("sagemaker-runtime", region_name=region, config=config)

    def ask(model: str, messages: list[dict[str, Any]], options: dict[str, Any]) -> Generation:
        body = json.dumps({"model": model, "messages": messages, **options})
        start = clock()
        try:
            response = client.invoke_endpoint(
                EndpointName=endpoint_name, ContentType=CONTENT_TYPE, Accept=CONTENT_TYPE, Body=body
            )
            payload = json.loads(response["Body"].read())
        except (bx.BotoCoreError, bx.ClientError) as err:
            return Generation(None, 0, (clock() - start) * 1000.0, None, _error_text(err))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return Generation(None, 0, (clock() - start) * 1000.0, None, f"the answer is not JSON ({err})")
        latency_ms = (clock() - start) * 1000.0
        if not isinstance(payload, dict):
            return Generation(None, 0, latency_ms, None, "the answer is not a chat completion")
        return completion_generation(payload, latency_ms)

    try:
        yield ask
    finally:
        client.close()
