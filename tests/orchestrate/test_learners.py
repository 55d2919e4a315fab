"""`LearnerGroup`: each typed method reaches every learner rank with the same arguments, is waited for under one
deadline, and returns rank 0's result; the pending methods hand rank 0's result ref on without waiting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from visionrl.orchestrate import learners
from visionrl.orchestrate.learners import CALL_KEY, LearnerGroup
from visionrl.orchestrate.remote import LEARNER, Call


class _Method:
    def __init__(self, rank: int, name: str) -> None:
        self.rank, self.name = rank, name

    def remote(self, *args: Any) -> tuple:
        return (self.rank, self.name, args)  # stands in for the ObjectRef of the call


class _Rank:
    """A learner actor handle: `handle.method.remote(*args)` gives a ref naming rank, method and arguments."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.rank, name)


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[Call], str, float, str]]:
    """What `gather` was asked to wait for; each ref resolves to "result of <method> on rank <rank>"."""
    seen: list[tuple[list[Call], str, float, str]] = []

    def gather(calls: list[Call], phase: str, timeout_s: float, key: str, interruptible: bool = False):
        seen.append((calls, phase, timeout_s, key))
        return [f"result of {c.ref[1]} on rank {c.ref[0]}" for c in calls]

    monkeypatch.setattr(learners, "gather", gather)
    return seen


def test_every_method_goes_to_every_rank_and_rank_0_answers(waits: list) -> None:
    group = LearnerGroup([_Rank(0), _Rank(1), _Rank(2)], timeout_s=30.0)
    batch: Any = object()
    results = [
        group.train_step(batch),
        group.adapter_payload("export", for_engine=False),
        group.save(),
        group.load(Path("/ckpt/adapter"), b"state"),
        group.logprobs(batch, adapter=False),
        group.probe_parts(),
        group.probe_logprobs("merger", batch),
    ]
    assert results == [
        "result of train_step on rank 0",
        "result of adapter_payload on rank 0",
        "result of save on rank 0",
        None,  # load returns nothing
        "result of logprobs on rank 0",
        "result of probe_parts on rank 0",
        "result of probe_logprobs on rank 0",
    ]
    phases = [(phase, timeout, key) for _, phase, timeout, key in waits]
    expected = (
        "update",
        "export",
        "checkpoint",
        "resume",
        "log-probs",
        "the adapter probe",
        "the adapter probe",
    )
    assert phases == [(p, 30.0, CALL_KEY) for p in expected]
    for calls, *_ in waits:  # every rank, in rank order, with the same arguments
        assert [(c.role, c.index) for c in calls] == [(LEARNER, 0), (LEARNER, 1), (LEARNER, 2)]
        assert len({(c.ref[1], c.ref[2]) for c in calls}) == 1
    assert [waits[i][0][0].ref[2] for i in range(7)] == [
        (batch,),
        (False,),
        (),
        ("/ckpt/adapter", b"state"),
        (batch, False, None),
        (),
        ("merger", batch),
    ]


def test_a_pending_payload_is_rank_0s_ref_and_every_ranks_call_unwaited(waits: list) -> None:
    group = LearnerGroup([_Rank(0), _Rank(1)], timeout_s=30.0)
    payload, probe = group.adapter_payload_pending(), group.probe_payload_pending("language model")
    assert waits == []  # nothing waited for: the engines' calls join these
    assert payload.ref == (0, "adapter_payload", (True,)) and probe.ref == (
        0,
        "probe_payload",
        ("language model",),
    )
    assert [c.ref for c in payload.calls] == [
        (0, "adapter_payload", (True,)),
        (1, "adapter_payload", (True,)),
    ]
    assert [c.index for c in probe.calls] == [0, 1] and len(group) == 2
