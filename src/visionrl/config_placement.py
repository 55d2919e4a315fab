"""The placement rules of a job: where the learner ranks and the rollout engines run, a pure plan from the job's
numbers (no Ray). The job config checks it before anything starts; `orchestrate.actors` applies it.

- CPU only (no GPUs requested): nothing reserved; `spread` asks for the learner ranks to go to different nodes
  and the engines to different nodes (on one node they all land there).
- colocated (GPUs): learner rank i and engine i share GPU i: one placement-group bundle per GPU holding
  `ray.learner_gpus + rollout.gpus_per_engine`, so `rollout.num_engines` must equal `ray.num_learners`. With one
  learner, engine 0 shares bundle 0 and further engines take GPUs of their own (as with a single GPU learner).
- split (GPUs): learner ranks and engines each get GPUs of their own (`num_gpus` per actor, no placement group).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlacementPlan:
    """Which placement-group bundle each actor goes to. `bundles` is the group to reserve (empty: none);
    `learners[i]` / `engines[i]` are the bundle index of learner rank i / engine i, None where Ray places the
    actor by its own `num_gpus` outside any group. `spread` (CPU only): the learner ranks are spread over the
    nodes, and the engines too, each kind in a placement group of strategy SPREAD with tiny bundles."""

    placement: str
    bundles: list[dict[str, float]]
    learners: list[int | None]
    engines: list[int | None]
    spread: bool = False

    def describe(self) -> str:
        """One line for the start-up log, e.g. `2 bundles; learner 0 -> bundle 0, engine 0 -> bundle 0, ...`."""
        if self.spread:
            return (
                f"CPU only: {len(self.learners)} learner rank(s) spread over the nodes, "
                f"{len(self.engines)} engine(s) spread over the nodes"
            )
        where = [f"learner {i} -> {_bundle(b)}" for i, b in enumerate(self.learners)]
        where += [f"engine {i} -> {_bundle(b)}" for i, b in enumerate(self.engines)]
        return f"{self.placement}, {len(self.bundles)} bundle(s): " + ", ".join(where)


def _bundle(b: int | None) -> str:
    return "own resources" if b is None else f"bundle {b}"


def plan_placement(
    placement: str, num_learners: int, learner_gpus: float, num_engines: int, gpus_per_engine: float
) -> PlacementPlan:
    """The plan for `ray.placement` with these counts; ValueError (naming the keys and the fix) for a
    combination that cannot be placed."""
    anywhere: list[int | None] = [None] * num_learners
    own: list[int | None] = [None] * num_engines
    if learner_gpus == 0 and gpus_per_engine == 0:
        if placement == "split":
            raise ValueError(
                "ray.placement=split places rollout engines and the learner on different GPUs, but no GPUs are "
                "requested; set rollout.gpus_per_engine and ray.learner_gpus, or use ray.placement=colocated"
            )
        return PlacementPlan(placement, [], anywhere, own, spread=True)
    if placement == "split":
        if num_learners > 1 and learner_gpus < 1:
            raise ValueError(
                f"ray.num_learners={num_learners} with ray.placement=split needs a whole GPU per learner rank "
                f"(NCCL refuses two ranks on one GPU), but ray.learner_gpus={learner_gpus:g}; set "
                "ray.learner_gpus=1"
            )
        return PlacementPlan(placement, [], anywhere, own)
    share = learner_gpus + gpus_per_engine
    if share > 1:
        raise ValueError(
            f"ray.placement=colocated puts a learner rank and an engine on one GPU, but ray.learner_gpus="
            f"{learner_gpus:g} + rollout.gpus_per_engine={gpus_per_engine:g} = {share:g} GPUs; make the two sum "
            "to at most 1 (e.g. 0.5 each), or use ray.placement=split for GPUs of their own"
        )
    if num_learners > 1 and num_engines != num_learners:
        raise ValueError(
            f"ray.placement=colocated pairs learner rank i with engine i on GPU i, but ray.num_learners="
            f"{num_learners} and rollout.num_engines={num_engines}; set rollout.num_engines={num_learners}, or "
            "use ray.placement=split"
        )
    bundles = [{"GPU": 1.0, "CPU": 0.001} for _ in range(num_learners)]
    engines = [i if i < num_learners else None for i in range(num_engines)]
    return PlacementPlan(placement, bundles, list(range(num_learners)), engines)
