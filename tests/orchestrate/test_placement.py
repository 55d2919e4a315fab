"""The placement plan (`visionrl.config_placement`, no Ray): which bundle each learner rank and engine goes
to, and the combinations refused before anything starts (also through the job config)."""

from __future__ import annotations

import pytest

from visionrl.config_placement import plan_placement
from visionrl.config_yaml import ConfigError, apply_overrides
from visionrl.train.ranks import use_fsdp

GPU = {"GPU": 1.0, "CPU": 0.001}


def test_cpu_only_reserves_nothing_whatever_the_counts() -> None:
    plan = plan_placement("colocated", 2, 0.0, 3, 0.0)
    assert plan.bundles == [] and plan.learners == [None, None] and plan.engines == [None, None, None]
    assert plan.spread and plan.describe() == (
        "CPU only: 2 learner rank(s) spread over the nodes, 3 engine(s) spread over the nodes"
    )
    assert not plan_placement("colocated", 2, 0.5, 2, 0.4).spread


def test_one_colocated_learner_shares_gpu_0_with_engine_0_and_further_engines_get_their_own() -> None:
    plan = plan_placement("colocated", 1, 0.5, 1, 0.5)
    assert (plan.bundles, plan.learners, plan.engines) == ([GPU], [0], [0])
    plan = plan_placement("colocated", 1, 0.5, 2, 0.5)
    assert (plan.bundles, plan.learners, plan.engines) == ([GPU], [0], [0, None])


def test_two_colocated_learners_pair_rank_i_with_engine_i_on_gpu_i() -> None:
    plan = plan_placement("colocated", 2, 0.5, 2, 0.4)
    assert (plan.bundles, plan.learners, plan.engines) == ([GPU, GPU], [0, 1], [0, 1])
    assert plan.describe() == (
        "colocated, 2 bundle(s): learner 0 -> bundle 0, learner 1 -> bundle 1, engine 0 -> bundle 0, "
        "engine 1 -> bundle 1"
    )


@pytest.mark.parametrize(("learners", "engines"), [(1, 1), (2, 1), (2, 2), (1, 2)])
def test_split_gives_every_actor_its_own_gpus_without_a_group(learners: int, engines: int) -> None:
    plan = plan_placement("split", learners, 1.0, engines, 1.0)
    assert plan.bundles == [] and plan.learners == [None] * learners and plan.engines == [None] * engines
    assert plan.describe().startswith("split, 0 bundle(s): learner 0 -> own resources")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # 2 ranks on 2 GPUs, 1 engine: GPU 1 would hold a rank without its engine (or the engine a second rank)
        (
            ("colocated", 2, 0.5, 1, 0.5),
            ["ray.num_learners=2", "rollout.num_engines=1", "rollout.num_engines=2"],
        ),
        (("colocated", 2, 0.5, 3, 0.5), ["rollout.num_engines=3", "ray.placement=split"]),
        # 0.7 + 0.5 = 1.2 GPUs cannot share one GPU
        (("colocated", 1, 0.7, 1, 0.5), ["= 1.2 GPUs", "at most 1", "ray.placement=split"]),
        # NCCL refuses two ranks on one GPU: split ranks need a whole GPU each
        (("split", 2, 0.5, 1, 1.0), ["ray.num_learners=2", "ray.learner_gpus=0.5", "ray.learner_gpus=1"]),
        (("split", 1, 0.0, 1, 0.0), ["no GPUs are requested", "ray.placement=colocated"]),
    ],
)
def test_combinations_that_cannot_be_placed_are_refused(args: tuple, says: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        plan_placement(*args)
    for text in says:
        assert text in str(err.value)


MINIMAL = {
    "output_dir": "runs/x",
    "model": {"path": "m"},
    "data": {"train": "t.jsonl"},
    "rewards": [{"name": "exact_match"}],
}


def test_the_job_config_refuses_an_unplaceable_job_before_anything_starts() -> None:
    from visionrl.config import config_from_dict

    over = ["ray.num_learners=2", "ray.learner_gpus=0.5", "rollout.gpus_per_engine=0.5"]
    with pytest.raises(ConfigError, match=r"ray.num_learners=2 and rollout.num_engines=1"):
        config_from_dict(apply_overrides(MINIMAL, over))
    cfg = config_from_dict(apply_overrides(MINIMAL, [*over, "rollout.num_engines=2"]))
    assert cfg.ray.num_learners == 2 and cfg.train.fsdp == "auto"
    with pytest.raises(ConfigError, match=r"ray.num_learners: Input should be greater than or equal to 1"):
        config_from_dict(apply_overrides(MINIMAL, ["ray.num_learners=0"]))


@pytest.mark.parametrize(
    ("mode", "cuda", "world", "sharded"),
    [
        ("auto", True, 2, True),
        ("auto", True, 1, False),  # one GPU rank: nothing to shard over
        ("auto", False, 2, False),  # CPU ranks: plain data parallel
        ("on", False, 1, True),  # forced (the one-GPU test of the FSDP path)
        ("off", True, 4, False),
    ],
)
def test_train_fsdp_chooses_the_sharding(mode: str, cuda: bool, world: int, sharded: bool) -> None:
    assert use_fsdp(mode, cuda, world) is sharded
