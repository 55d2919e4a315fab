"""The delivery checks' arithmetic and messages (orchestrate.delivery), on hand-made numbers."""

from __future__ import annotations

import logging
import math

import pytest

from visionrl.errors import RunError
from visionrl.orchestrate.delivery import (
    REFRESH_CHECKS,
    DiffWatch,
    FingerprintPrompt,
    FingerprintWatch,
    MismatchWatch,
    PartProbe,
    check_probes,
    diffs_by_engine,
    scoring_batch,
)
from visionrl.types import Completion, ProbeResult, PromptItem


def _c(ids: list[int], lps: list[float]) -> Completion:
    return Completion(prompt_index=0, token_ids=ids, text="", logprobs=lps, finish_reason="stop")


def test_the_fingerprint_continuation_is_fixed_by_a_greedy_check_and_refreshed_every_so_many() -> None:
    """No continuation until a greedy check fixes one: engine 0 rejected the prompt (None), engine 1 returned no
    tokens, engine 2's tokens become it. Then REFRESH_CHECKS teacher-forced checks, each the same one sequence for
    the learner, after which the next check is greedy; its tokens replace the continuation and the count restarts
    (a greedy check without tokens keeps the old one)."""
    check = FingerprintPrompt(PromptItem("a", []))
    assert check.forced_batch() is None
    check.fix([None, _c([], []), _c([7, 8, 9], [-1.0, -2.0, -3.0])])
    batches = [check.forced_batch() for _ in range(REFRESH_CHECKS)]
    assert all(b is not None for b in batches) and check.forced_batch() is None
    batch = batches[0]
    assert batch is not None and batch.prompts == [check.prompt] and len(batch.sequences) == 1
    seq = batch.sequences[0]
    assert (seq.prompt, seq.completion_ids, seq.advantage) == (0, [7, 8, 9], 0.0)
    assert seq.scored().tolist() == [True, True, True]  # every token scored
    check.fix([None])
    assert check.continuation == [7, 8, 9] and check.forced_batch() is None
    check.fix([_c([4], [-0.5])])
    refreshed = check.forced_batch()
    assert refreshed is not None and refreshed.sequences[0].completion_ids == [4] and check.forced == 1


def test_scoring_batch_keeps_each_engines_first_completion_and_its_owner() -> None:
    prompts = [PromptItem("a", []), PromptItem("b", [])]
    per_engine = [
        [[_c([1, 2], [-1.0, -2.0])], []],  # engine 0 rejected prompt 1
        [[_c([3], [-0.5])], [_c([4, 5], [-0.1, float("nan")]), _c([9], [0.0])]],
    ]
    batch, owners = scoring_batch(prompts, per_engine)
    assert [(s.prompt, s.completion_ids) for s in batch.sequences] == [(0, [1, 2]), (0, [3]), (1, [4, 5])]
    assert owners == [0, 1, 1]
    learner = [[-1.5, -2.0], [-0.25], [-0.2, -7.0]]
    # engine 0: (0.5 + 0) / 2; engine 1: (0.25 + 0.1) / 2, the NaN token has nothing to compare
    engine = [s.sampling_logprobs for s in batch.sequences]
    assert diffs_by_engine(owners, engine, learner, 3) == pytest.approx([0.25, 0.175, 0.0])
    own = [[-1.0, -1.0], [-0.25], [-0.2, -6.0]]
    # engine 0: (0.5 + 1.0) / 2; engine 1: (0 + 0 + 1.0) / 3
    assert diffs_by_engine(owners, learner, own, 2) == pytest.approx([0.75, 1 / 3])  # the probe's effect


def _probe(changed: int, largest: float, diff: float, effect: float, part: str = "merger") -> PartProbe:
    return PartProbe(0, part, ProbeResult(changed, largest, [[_c([1], [0.0])]] * 4), diff, effect)


def test_a_probe_must_move_the_output_and_agree_well_inside_its_effect() -> None:
    assert not _probe(0, 0.0, 0.0, 0.0).moved
    assert not _probe(0, 5e-5, 0.0, 0.0).moved
    assert _probe(1, 0.0, 0.0, 0.0).moved and _probe(0, 2e-4, 0.0, 0.0).moved
    assert _probe(1, 0, diff=0.04, effect=0.2).agrees(0.2)  # 0.04 <= 0.25 x 0.2
    assert not _probe(1, 0, diff=0.06, effect=0.2).agrees(0.2)  # a quarter of the effect off: misapplied
    assert not _probe(1, 0, diff=0.3, effect=10.0).agrees(0.2)  # over the absolute bound
    assert _probe(1, 0, diff=0.009, effect=0.0).agrees(0.2)  # below 0.01 nats is noise whatever the effect


def test_check_probes_names_each_engine_and_part_with_its_numbers() -> None:
    check_probes([_probe(2, 0.1, 0.001, 0.3, "language model"), _probe(1, 0.0, 0.0, 0.1)], 0.2, "at start-up")
    with pytest.raises(RunError) as err:
        check_probes(
            [_probe(2, 0.1, 0.2, 0.3, "language model"), _probe(0, 0.0, 0.05, 0.05)], 0.2, "after its restart"
        )
    text = str(err.value)
    assert (
        "rollout engine(s) [0] do not apply the LoRA adapter as the learner does (after its restart)" in text
    )
    assert "- engine 0, merger: first greedy token changed on 0 of 4 prompts" in text
    assert "the engine ignores the merger LoRA" in text and "tower-connector" in text
    assert (
        "- engine 0, language model: first greedy token changed on 2 of 4 prompts, largest log-prob change of "
        "the others 0.1, |engine - learner| 0.2 nats per token (the probe's effect 0.3)" in text
    )
    assert "lora.alpha / lora.rank" in text


def test_the_relative_bound_is_a_multiple_of_the_first_five_values_median() -> None:
    watch = DiffWatch(limit=0.2, ratio=4.0)
    for v in (0.05, 0.04, 0.06, 0.05, 0.3):  # the fifth is over the absolute bound: not part of the median
        watch.add(v)
    assert watch.bound() == 0.2 and watch.early == [0.05, 0.04, 0.06, 0.05]
    assert not watch.add(0.052)
    assert watch.bound() == pytest.approx(0.2)  # 4 x median 0.05 = 0.2: no tighter than the absolute one
    tight = DiffWatch(limit=0.2, ratio=4.0)
    for v in (0.02, 0.01, 0.03, 0.02, 0.02):
        assert not tight.add(v)
    assert tight.bound() == pytest.approx(0.08)  # 4 x 0.02
    assert (
        tight.add(0.1)
        and tight.over == 1
        and "0.08 (rollout.max_logprob_diff_ratio=4 x" in tight.describe_bound()
    )
    assert not tight.add(0.07) and tight.over == 0
    fp32 = DiffWatch(limit=0.2, ratio=4.0)
    for _ in range(5):
        fp32.add(1e-6)
    assert fp32.bound() == 0.01  # never below the floor: float32 noise is no drift
    assert DiffWatch(limit=0.2, ratio=None).bound() == 0.2


def test_mismatch_warns_then_stops_after_the_steps_in_a_row(caplog: pytest.LogCaptureFixture) -> None:
    watch = MismatchWatch(0.1, steps=2)
    with caplog.at_level(logging.WARNING):
        watch.check(1, 0.5)
        watch.check(2, 0.05)  # the row is broken
        watch.check(3, 0.5)
        watch.check(4, None)  # no update: nothing measured, the row stands
    assert sum("1 of 2 steps in a row allowed" in r.message for r in caplog.records) == 2
    with pytest.raises(RunError, match=r"step 5: .* by 0\.5 per token .* for 2 steps in a row"):
        watch.check(5, 0.5)


def test_fingerprints_are_watched_per_engine_and_name_it() -> None:
    watch = FingerprintWatch(2, limit=0.1, steps=2)
    watch.check(1, 1, [0.0, 0.5])
    watch.check(2, 2, [0.5, 0.0])  # engine 1's row is broken, engine 0's starts
    with pytest.raises(RunError) as err:
        watch.check(3, 3, [0.3, 0.0])
    assert str(err.value).startswith(
        "step 3: rollout engine 0 scores the fingerprint prompt under adapter version 3 0.3 nats per token away "
        "from the learner, over rollout.max_logprob_diff=0.1, 2 syncs in a row"
    )
    assert not math.isnan(watch.watches[1].bound())
