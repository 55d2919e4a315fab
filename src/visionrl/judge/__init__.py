"""Judges: a model that scores completions (the `judge` reward). The spec, templates and verdicts are in
`rewards.judge`; here are the judges that run a model: a judge model's own engine (`model`), a reward model with a
score head (`classifier`), an OpenAI-compatible endpoint (`endpoint`), and one entry's scoring (`scoring`). The
run's judging (deadlines, judge actors) is `orchestrate.judging`; `visionrl eval --judge` is `eval.judged`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from visionrl.rewards.judge import JudgeSpec


def own_judge(spec: JudgeSpec, *, seed: int = 0, kv_cache_gib: float = 1.0, device: str | None = None) -> Any:
    """The judge of a `judge` entry that is not the rollout engine, loaded here: an endpoint client, a reward model
    (classifier, on `device`: default CUDA when there is one) or a judge model's own vLLM engine. It has
    `judge(requests)` and `close()`."""
    if spec.backend == "endpoint":
        from visionrl.judge.endpoint import EndpointJudge

        return EndpointJudge(spec)
    if spec.backend == "classifier":
        from visionrl.judge.classifier import ClassifierJudge

        return ClassifierJudge(spec, device=device)
    from visionrl.judge.model import ModelJudge

    return ModelJudge(spec, seed=seed, kv_cache_gib=kv_cache_gib)
