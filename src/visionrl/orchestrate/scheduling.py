"""Where the actors run and with what: the Ray options of each learner rank and engine (placement groups, GPU
shares, the environment every actor gets), whether the engines wait for the learners, and the GPU requests
checked against the Ray before anything starts. The actors themselves: `actors`."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from visionrl import faults
from visionrl.config import JobConfig
from visionrl.config_placement import PlacementPlan
from visionrl.errors import InputError
from visionrl.orchestrate import console

logger = logging.getLogger(__name__)


def engine_options(cfg: JobConfig) -> list[dict[str, Any]]:
    """Ray options of each engine: its GPU share, its restarts, the environment vLLM reads."""
    # max_restarts: Ray rebuilds a dead (or killed, because hung) engine in place, same arguments and placement;
    # `Workers` counts the restarts of the run against the same limit and re-syncs the adapter.
    options: list[dict[str, Any]] = []
    for _ in range(cfg.rollout.num_engines):
        opts: dict[str, Any] = {
            "num_cpus": 0,
            "num_gpus": cfg.rollout.gpus_per_engine,
            "max_restarts": cfg.ray.max_actor_restarts,
        }
        if cfg.rollout.vllm_env:  # the settings vLLM reads from its process's environment
            opts["runtime_env"] = {"env_vars": dict(cfg.rollout.vllm_env)}
        options.append(opts)
    return options


def engines_wait_for_learners(cfg: JobConfig) -> bool:
    """Whether the engines load the model only once the learners have theirs: where an engine may share a GPU with
    a learner rank (it sizes its share from the memory free when it starts). That is colocated placement, and split
    placement with fractional shares on both sides (Ray may pack a learner's and an engine's fractions onto one
    GPU; a whole GPU is never shared). Engines on CPUs, or on whole GPUs of their own, start with the learners and
    load beside them (on the CPU test loop, 2-4 s of a run's start-up; on GPUs, the engine's load and compile)."""
    r, ro = cfg.ray, cfg.rollout
    if ro.gpus_per_engine == 0 or r.learner_gpus == 0:
        return False
    return r.placement == "colocated" or (r.learner_gpus < 1 and ro.gpus_per_engine < 1)


def scheduling(cfg: JobConfig, plan: PlacementPlan) -> tuple[list[dict], list[dict]]:
    """Ray options of each learner rank and each engine for `plan` (reserving its placement group)."""
    learner_opts: list[dict[str, Any]] = [
        {"num_cpus": 0, "num_gpus": cfg.ray.learner_gpus} for _ in range(cfg.ray.num_learners)
    ]
    engine_opts = engine_options(cfg)
    if plan.bundles:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = placement_group(plan.bundles)
        ray.get(pg.ready())
        pairs = [*zip(learner_opts, plan.learners, strict=True), *zip(engine_opts, plan.engines, strict=True)]
        for opts, bundle in pairs:
            if bundle is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle
                )
    if plan.spread:
        _spread(learner_opts)
        _spread(engine_opts)
    if cfg.ray.learner_gpus > 0 and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # Expandable segments: the learner's activations change size every micro-batch, and fixed segments
        # fragment. Learner only: vLLM's sleep mode refuses them in the engine's process.
        for opts in learner_opts:
            opts["runtime_env"] = {"env_vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    with_actor_env(learner_opts + engine_opts)
    return learner_opts, engine_opts


def with_actor_env(options: list[dict[str, Any]]) -> None:
    """Faults armed in the driver (visionrl.faults) and the log file of the actors' output (`console`) go to every
    actor's environment: a Ray started before them (a cluster, or one Ray for several runs) would not pass them on
    otherwise."""
    env = {**faults.actor_env(), **console.actor_env()}
    if not env:
        return
    for opts in options:
        runtime = opts.setdefault("runtime_env", {})
        runtime["env_vars"] = {**runtime.get("env_vars", {}), **env}


def _spread(options: list[dict[str, Any]]) -> None:
    """CPU only: one tiny bundle per actor in a placement group of strategy SPREAD, so that on a cluster the
    actors of one kind (the learner ranks; the engines) go to different nodes (reserving nothing, Ray would start
    them all on the driver's node); on one node they all land there, as before. One group per kind: a single
    group of 2 ranks and 2 engines on 3 nodes may put both engines on one node. GPU actors are placed by their
    GPUs instead: packing learner ranks onto one node keeps their all-reduce on NVLink."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 0.001} for _ in options], strategy="SPREAD")
    ray.get(pg.ready())
    for i, opts in enumerate(options):
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i
        )


def check_gpu_requests(cfg: JobConfig, session_mode: str) -> None:
    """The job's GPUs against the Ray it runs on, before any actor starts: a request no node can meet would
    wait up to ray.startup_timeout_s (30 min by default) with only Ray's autoscaler lines to show for it. A
    local Ray cannot grow, so there it is an InputError; an attached cluster may still add nodes: a warning."""
    r, ro = cfg.ray, cfg.rollout
    need = r.num_learners * r.learner_gpus + ro.num_engines * ro.gpus_per_engine
    have = float(ray.cluster_resources().get("GPU", 0.0))
    if need <= have + 1e-9:
        return
    what = (
        f"the job asks for {need:g} GPU(s) (ray.num_learners={r.num_learners} x ray.learner_gpus={r.learner_gpus:g}"
        f" + rollout.num_engines={ro.num_engines} x rollout.gpus_per_engine={ro.gpus_per_engine:g}) and this Ray "
        f"has {have:g}"
    )
    fix = (
        "to run on CPUs set ray.learner_gpus=0 rollout.gpus_per_engine=0 (with model.dtype=float32 and "
        "rollout.sleep_during_update=false, as configs/demo.yaml)"
        if have == 0
        else "lower the GPU shares or the counts to fit, or attach to a larger cluster (ray.address)"
    )
    if session_mode == "attached":
        logger.warning("%s: actors will wait up to ray.startup_timeout_s for nodes to join; %s", what, fix)
        return
    raise InputError(f"{what}, so the run would wait for GPUs that never come; {fix}")
