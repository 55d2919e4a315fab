"""Ray actors (thin wrappers of the plain classes) and their placement, plus the embedded Ray session.

Actors: one learner, `rollout.num_engines` rollout engines, `ray.num_reward_workers` reward workers.
Placement:
- CPU only: everything on the local node; actors take no CPU reservation so 2 cores can host them all.
- colocated (GPUs): each engine shares a GPU bundle with the learner (fractional GPUs in one placement group).
- split (GPUs): engines and learner get their own GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import ray

from visionrl.config import JobConfig, RayConfig
from visionrl.data.images import ImageBudget
from visionrl.errors import out_of_memory
from visionrl.rewards import RewardSpec, build_reward_fn
from visionrl.rollout.factory import make_engine
from visionrl.types import AdapterPayload, Completion, PromptItem, SamplingSpec

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def ray_session(cfg: RayConfig) -> Iterator[dict[str, Any]]:
    """Attach to `ray.address` / RAY_ADDRESS, or start an embedded local Ray in a temp dir, torn down at exit
    (also on error or Ctrl-C). Yields a description of the session."""
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        yield {"mode": "existing"}
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        try:
            yield {"mode": "attached", "address": address}
        finally:
            ray.shutdown()  # disconnects only; the cluster keeps running
        return
    # A short path: Ray's Unix sockets live under the temp dir and paths over ~107 bytes fail.
    tmp = tempfile.mkdtemp(prefix="vrl-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        ray.init(
            num_cpus=cfg.num_cpus or os.cpu_count(),
            include_dashboard=False,
            _temp_dir=tmp,
            log_to_driver=True,
            configure_logging=True,
            logging_level=logging.WARNING,
        )
        yield {"mode": "embedded", "temp_dir": tmp}
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- actors


def _memory_settings(cfg: JobConfig) -> dict[str, object]:
    """The settings named by the out-of-memory advice (errors.MEMORY_ADVICE)."""
    return {
        "micro_batch_tokens": cfg.train.micro_batch_tokens,
        "logit_chunk_tokens": cfg.train.logit_chunk_tokens,
        "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
        "max_model_len": cfg.rollout.max_model_len,
        "prompts_per_step": cfg.rollout.prompts_per_step,
    }


@contextlib.contextmanager
def _memory_guard(actor: str, phase: str, cfg: JobConfig) -> Iterator[None]:
    """Turn an out-of-memory error inside an actor into one that says where, how much and what to change."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as err:
        raise out_of_memory(actor, phase, err, _memory_settings(cfg)) from None


@ray.remote
class LearnerActor:
    def __init__(self, cfg: JobConfig) -> None:
        from visionrl.train.learner import Learner

        self.cfg = cfg
        with _memory_guard("learner", "loading the model", cfg):
            self.learner = Learner(cfg)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with _memory_guard("learner", method, self.cfg):
            return getattr(self.learner, method)(*args, **kwargs)

    def forbidden_token_ids(self) -> list[int]:
        return self.learner.forbidden.tolist()

    def placement(self) -> dict[str, Any]:
        return _placement()


@ray.remote
class RolloutActor:
    def __init__(self, cfg: JobConfig, forbidden: list[int], seed: int) -> None:
        if cfg.train.torch_threads:
            import torch

            torch.set_num_threads(cfg.train.torch_threads)
        self.cfg = cfg
        with _memory_guard("rollout engine", "start-up", cfg):
            self.engine = make_engine(
                cfg.model.path,
                lora=cfg.lora,
                rollout=cfg.rollout,
                forbidden_token_ids=forbidden,
                dtype=cfg.model.dtype,
                seed=seed,
                budget=ImageBudget.of(cfg.data),
            )

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        with _memory_guard("rollout engine", "generation", self.cfg):
            return self.engine.generate(prompts, spec)

    def load_adapter(self, payload: AdapterPayload) -> int:
        with _memory_guard("rollout engine", "the adapter sync", self.cfg):
            return self.engine.load_adapter(payload)

    def probe(self, payload: AdapterPayload, prompts: list[PromptItem]) -> float:
        with _memory_guard("rollout engine", "the adapter probe", self.cfg):
            return self.engine.probe(payload, prompts)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        with _memory_guard("rollout engine", "wake-up after the update", self.cfg):
            self.engine.wake_up()

    def adapter_version(self) -> int:
        return self.engine.adapter_version()

    def placement(self) -> dict[str, Any]:
        return _placement()

    def close(self) -> None:
        self.engine.close()


@ray.remote
class RewardActor:
    def __init__(self, specs: list[RewardSpec], timeout_s: float) -> None:
        self.fn = build_reward_fn(specs, timeout_s=timeout_s)

    def score(self, completions: list[str], records: list[dict]) -> Any:
        return self.fn.score(completions, records)


def _placement() -> dict[str, Any]:
    """Where this actor runs: node and the GPU ids Ray gave it (logged at start, checked by the GPU tests)."""
    ctx = ray.get_runtime_context()
    return {"node": ctx.get_node_id()[:8], "gpus": [str(g) for g in ray.get_gpu_ids()]}


def reward_specs(cfg: JobConfig) -> list[RewardSpec]:
    return [RewardSpec(name=r.name, weight=r.weight, kwargs=dict(r.kwargs)) for r in cfg.rewards]


def start_actors(cfg: JobConfig) -> tuple[Any, list[Any], list[Any]]:
    """Create learner, engines and reward workers with the configured placement."""
    use_gpu = cfg.ray.learner_gpus > 0 or cfg.rollout.gpus_per_engine > 0
    learner_opts: dict[str, Any] = {"num_cpus": 0, "num_gpus": cfg.ray.learner_gpus}
    engine_opts: list[dict[str, Any]] = [
        {"num_cpus": 0, "num_gpus": cfg.rollout.gpus_per_engine} for _ in range(cfg.rollout.num_engines)
    ]
    if use_gpu and cfg.ray.placement == "colocated":
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # One GPU bundle holds the learner's and the first engine's share.
        share = cfg.ray.learner_gpus + cfg.rollout.gpus_per_engine
        pg = placement_group([{"GPU": max(1.0, share), "CPU": 0.001}])
        ray.get(pg.ready())
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
        learner_opts["scheduling_strategy"] = strategy
        engine_opts[0]["scheduling_strategy"] = strategy
    if use_gpu and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # Expandable segments: the learner's activations change size every micro-batch, and fixed segments
        # fragment. Learner only: vLLM's sleep mode refuses them in the engine's process.
        learner_opts["runtime_env"] = {"env_vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    # mypy keeps a class's own type under a class decorator; `@ray.remote` adds `.options` at run time.
    learner = LearnerActor.options(**learner_opts).remote(cfg)  # type: ignore[attr-defined]
    forbidden = ray.get(learner.forbidden_token_ids.remote())
    engines = [
        RolloutActor.options(**opts).remote(cfg, forbidden, cfg.train.seed + i)  # type: ignore[attr-defined]
        for i, opts in enumerate(engine_opts)
    ]
    specs = reward_specs(cfg)
    rewards = [
        RewardActor.options(num_cpus=0).remote(specs, cfg.ray.reward_timeout_s)  # type: ignore[attr-defined]
        for _ in range(cfg.ray.num_reward_workers)
    ]
    # Fail early, with the actor's own error, if any of them cannot start; say where each one runs.
    places = ray.get([learner.placement.remote(), *[e.placement.remote() for e in engines]])
    logger.info(
        "placement (%s): learner %s; %s",
        cfg.ray.placement,
        places[0],
        "; ".join(f"engine {i} {p}" for i, p in enumerate(places[1:])),
    )
    return learner, engines, rewards
