"""Judged evaluation (`visionrl eval ... --judge SPEC`): held-out answers scored by a judge beside the rewards.

SPEC is a job file (its `judge` rewards), a YAML file holding one judge entry (`{name: judge, kwargs: {...}}`) or
its kwargs, or such a mapping inline (`'{backend: endpoint, base_url: ..., model: ..., template: ...}'`). Each
judge scores every answered sample through `judge.scoring.Judging` (the same questions, cache and verdicts as in
training); the report gets each sample's `judge` scores and verdicts and, per judge, the mean score, the share
scored at least 0.5 (`accepted`), the failures and the time. A judgement that failed is None, counted, and left
out of the mean (not scored `on_error`: the report measures the answers, not the run's reward).

Backends here: `engine` is the evaluated model's own local engine with the adapter switched off (local
evaluation only); `vllm` and `classifier` load the judge model in this process once the evaluated engine is
closed; `endpoint` calls the server. Timeouts apply to endpoint requests; in-process judges run to the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from visionrl.config_yaml import UniqueKeyLoader
from visionrl.errors import InputError
from visionrl.judge import own_judge
from visionrl.judge.scoring import Backend, Judging
from visionrl.rewards.combined import component_keys
from visionrl.rewards.judge import JUDGE, JudgeSpec, judge_ask, judge_template
from visionrl.rewards.registry import RewardSpec
from visionrl.types import Completion, PromptItem

Judges = list[tuple[str, JudgeSpec]]
USAGE = (
    "--judge takes a job file (its judge rewards), a YAML file of one judge entry, or an inline mapping such as "
    "'{backend: endpoint, base_url: http://127.0.0.1:8000/v1, model: judge, template: configs/judges/answer_match.txt}'"
)


def _load(arg: str) -> Any:
    try:
        if Path(arg).is_file():
            return yaml.load(Path(arg).read_text(encoding="utf-8"), Loader=UniqueKeyLoader)
        return yaml.load(arg, Loader=UniqueKeyLoader)
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as err:
        raise InputError(f"--judge {arg!r} cannot be read: {err}\n{USAGE}") from None


def parse_judges(arg: str) -> Judges:
    """The judges SPEC names, each with its report key (as in training: `judge`, or `judge#i` of several)."""
    data = _load(arg)
    if not isinstance(data, dict):
        raise InputError(f"--judge {arg!r} is neither a file nor a mapping.\n{USAGE}")
    if "rewards" in data:
        rewards = data["rewards"] if isinstance(data["rewards"], list) else []
        entries = [r for r in rewards if isinstance(r, dict) and r.get("name") == JUDGE]
        if not entries:
            raise InputError(f"--judge {arg}: the job file has no `judge` reward in its rewards.\n{USAGE}")
    elif "kwargs" in data:
        entries = [data]
    else:
        entries = [{"name": JUDGE, "kwargs": data}]
    judges: Judges = []
    keys = component_keys([RewardSpec(JUDGE) for _ in entries])
    for key, entry in zip(keys, entries, strict=True):
        try:
            spec = JudgeSpec.from_kwargs(entry.get("kwargs") or {})
            judge_template(spec)
        except (ValueError, TypeError) as err:
            raise InputError(f"--judge ({key}): {err}") from None
        # evaluation measures: a failed judgement is counted and left out, never a reason to stop
        judges.append((key, replace(spec, max_failed_steps=0)))
    return judges


def check_judges_for(judges: Judges, local: bool) -> None:
    """Refuse before any model loads a judge the evaluation cannot run (engine on a served model)."""
    for key, spec in judges:
        if spec.backend == "engine" and not local:
            raise InputError(
                f"--judge ({key}): backend engine judges with the evaluated model's own local engine; with "
                "--endpoint use backend endpoint (the same server, its base model's name) or vllm"
            )


def engine_judge(engine: Any, processor: Any, spec: JudgeSpec) -> Backend:
    """The evaluated engine as the judge (backend engine): its base model, the adapter switched off."""
    from visionrl.data.prompts import user_prompt

    ask = judge_ask(spec, processor.tokenizer)
    return lambda requests: engine.judge([user_prompt(processor, r.text, r.images) for r in requests], ask)


def judge_records(
    records: list[dict[str, Any]],
    prompts: list[PromptItem],
    key: str,
    spec: JudgeSpec,
    backend: Backend,
    prompt_key: str,
) -> dict[str, Any]:
    """Score the answered samples of `records` with one judge: each record gets `judge[key]` (None where the
    judgement failed or the sample has no answer) and `judge_verdict[key]`; returns the judge's summary."""
    answered = [i for i, r in enumerate(records) if r["error"] is None]
    judging = Judging(key, spec, backend, prompt_key, [])
    groups = [[Completion(0, [], records[i]["completion"] or "", [], "stop")] for i in answered]
    scored = judging.score([prompts[i] for i in answered], groups)
    for r in records:
        r.setdefault("judge", {})[key] = None
        r.setdefault("judge_verdict", {})[key] = None
    for j, i in enumerate(answered):
        verdict = scored.verdicts[j]
        failed = verdict in ("error", "timeout")
        records[i]["judge"][key] = None if failed else scored.scores[j]
        records[i]["judge_verdict"][key] = verdict
    values = [records[i]["judge"][key] for i in answered if records[i]["judge"][key] is not None]
    return {
        "backend": spec.backend,
        "model": spec.model,
        "template": spec.template or None,
        "num_judged": len(values),
        "mean": sum(values) / len(values) if values else None,
        "accepted": sum(v >= 0.5 for v in values) / len(values) if values else None,
        "errors": scored.errors,
        "timeouts": scored.timeouts,
        "first_error": scored.first_error or None,
        "seconds": round(scored.seconds, 3),
    }


def run_judges(
    records: list[dict[str, Any]],
    prompts: list[PromptItem],
    judges: Judges,
    prompt_key: str,
    engine_backend: Callable[[JudgeSpec], Backend] | None = None,
    release_engine: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every judge over `records`: first those on the evaluated engine (`engine_backend`), then, once the engine
    is released (`release_engine`: its memory is the judge model's), the others, each closed after its scoring."""
    out: dict[str, dict[str, Any]] = {}
    for key, spec in judges:
        if spec.backend == "engine":
            assert engine_backend is not None  # check_judges_for refused it before
            out[key] = judge_records(records, prompts, key, spec, engine_backend(spec), prompt_key)
    others = [(k, s) for k, s in judges if s.backend != "engine"]
    if others and release_engine is not None:
        release_engine()
    for key, spec in others:
        judge = own_judge(spec)
        try:
            out[key] = judge_records(records, prompts, key, spec, judge.judge, prompt_key)
        finally:
            judge.close()
    return {key: out[key] for key, _ in judges}


def judge_step(
    judges: Judges | None,
    prompt_key: str,
    engine_backend: Callable[[JudgeSpec], Backend] | None = None,
    release_engine: Callable[[], None] | None = None,
) -> Callable[[list[PromptItem], list[dict[str, Any]]], dict[str, dict[str, Any]]] | None:
    """The report's judge step (`EvalSettings.report`'s `judge`) for `judges`: None when there are none."""
    if not judges:
        return None
    return lambda prompts, records: run_judges(
        records, prompts, judges, prompt_key, engine_backend, release_engine
    )


def failed_judges(report: dict[str, Any]) -> list[str]:
    """The judges of `report` that failed on every answered sample (with their first error)."""
    return [
        f"{key}: {j['first_error']}"
        for key, j in (report.get("judges") or {}).items()
        if j["num_judged"] == 0 and (j["errors"] or j["timeouts"])
    ]
