"""Whether an adapter reaches an engine: greedy generations with and without it (the start-up probe)."""

from __future__ import annotations

from dataclasses import replace

from visionrl import faults
from visionrl.models.loader import in_vision_tower
from visionrl.types import ADAPTER_WEIGHTS, AdapterPayload, Completion, ProbeResult

PROBE_TOKENS = 4  # greedy tokens per probe prompt: enough to compare with the learner, cheap at start-up


def probe_result(before: list[list[Completion]], after: list[list[Completion]], version: int) -> ProbeResult:
    """How the first greedy token of each prompt moved from `before` (the version served) to `after` (the probe
    adapter, labelled with its `version`): the prompts whose token changed, and the largest |log-prob change| of
    the tokens that stayed."""
    changed, largest = 0, 0.0
    for b, a in zip(before, after, strict=True):
        if not b or not a or not b[0].token_ids or not a[0].token_ids:
            continue  # a prompt the engine rejected has no completion to compare
        if b[0].token_ids[0] != a[0].token_ids[0]:
            changed += 1
        else:
            largest = max(largest, abs(b[0].logprobs[0] - a[0].logprobs[0]))
    labelled = [[replace(c, adapter_version=version) for c in g] for g in after]
    return ProbeResult(tokens_changed=changed, largest_change=largest, completions=labelled)


def as_a_faulty_engine_applies(payload: AdapterPayload) -> AdapterPayload:
    """`payload` as an engine with an injected fault would apply it (`skip_merger_lora`, `misscale_adapters`):
    the cases the probe must catch. Unchanged when neither fault is set."""
    skip, twice = faults.active("skip_merger_lora"), faults.active("misscale_adapters")
    if not (skip or twice):
        return payload
    from safetensors.torch import load, save

    weights = load(payload.file_bytes(ADAPTER_WEIGHTS))
    for key, w in weights.items():
        if "lora_B" in key:
            weights[key] = w * 0 if skip and in_vision_tower(key) else w * 2 if twice else w
    return replace(
        payload, files={**payload.files, ADAPTER_WEIGHTS: save(weights, metadata={"format": "pt"})}
    )
