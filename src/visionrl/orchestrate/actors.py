"""Ray actors (thin wrappers of the plain classes) and their start (the Ray they run on: `ray_session`; their
Ray options and placement: `scheduling`).

Actors: `ray.num_learners` learner ranks, `rollout.num_engines` rollout engines, `ray.num_reward_workers`
reward workers; none takes a CPU reservation, so 2 cores can host them all. Where they go is planned by
`visionrl.config_placement` (CPU only: the local node(s); colocated: learner rank i and engine i on GPU i; split:
GPUs of their own) and applied here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import ray

from visionrl import faults
from visionrl.config import JobConfig, RayConfig
from visionrl.data.images import ImageBudget
from visionrl.errors import out_of_memory
from visionrl.models.loader import checkpoint_vision_token_ids
from visionrl.orchestrate import console
from visionrl.orchestrate.remote import ENGINE, LEARNER, REWARD, Call, gather, kill_actors
from visionrl.orchestrate.scheduling import engines_wait_for_learners, scheduling, with_actor_env
from visionrl.rewards import RewardSpec, build_reward_fn
from visionrl.rollout.factory import make_engine, preload_engine
from visionrl.train.learner_state import LearnerState
from visionrl.types import AdapterPayload, Completion, JudgeAsk, ProbeResult, PromptItem, SamplingSpec

if TYPE_CHECKING:
    from visionrl.train.learner import Learner, TrainBatch

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _memory_settings(cfg: JobConfig) -> dict[str, object]:
    """The settings named by the out-of-memory advice (errors.MEMORY_ADVICE)."""
    return {
        "micro_batch_tokens": cfg.train.micro_batch_tokens,
        "logit_chunk_tokens": cfg.train.logit_chunk_tokens,
        "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
        "gpu_memory_gib": "null" if cfg.train.gpu_memory_gib is None else cfg.train.gpu_memory_gib,
        "max_model_len": cfg.rollout.max_model_len,
        "prompts_per_step": cfg.rollout.prompts_per_step,
    }


def use_torch_threads(cfg: JobConfig) -> None:
    """This actor's torch threads: train.torch_threads when set (an engine or judge on a few CPU cores)."""
    if cfg.train.torch_threads:
        import torch

        torch.set_num_threads(cfg.train.torch_threads)


def memory_fraction(gib: float, total_bytes: int) -> float:
    """The share of a device of `total_bytes` that `gib` GiB is (at most all of it): torch's per-process cap."""
    return min(1.0, gib * 2**30 / total_bytes)


def cap_gpu_memory(gib: float) -> None:
    """This process's torch allocator refuses to hold more than `gib` GiB of its current GPU (train.gpu_memory_gib)."""
    import torch

    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(memory_fraction(gib, total), device)


@contextlib.contextmanager
def memory_guard(actor: str, phase: str, cfg: JobConfig) -> Iterator[None]:
    """Turn an out-of-memory error inside an actor into one that says where, how much and what to change."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as err:
        raise out_of_memory(actor, phase, err, _memory_settings(cfg)) from None


@ray.remote
class LearnerActor:
    """Learner rank `rank` of `world`. The model is loaded in `setup`, once the driver knows rank 0's address:
    every rank must join the group before any of them builds its (possibly sharded) model.

    Every rank runs each method (with several ranks it holds collectives); rank 0 speaks for the group, the
    others return None (their results are equal or partial, never needed). The driver calls them through
    `orchestrate.learners.LearnerGroup`."""

    def __init__(self, cfg: JobConfig, rank: int = 0, world: int = 1) -> None:
        console.quiet_actor()
        self.cfg, self.rank, self.world, self.calls = cfg, rank, world, 0
        self.learner: Learner | None = None

    def address(self) -> str:
        """Where the group meets (asked of rank 0): a free port of this node."""
        from visionrl.train.ranks import free_address

        return free_address(ray.util.get_node_ip_address())

    def setup(self, address: str) -> None:
        """Join the learners' group (nccl where this actor sees a GPU, else gloo) and load the model. (The engines
        take the vision token ids they must never sample from the checkpoint's config, before this is done.)"""
        import torch

        from visionrl.train.learner import Learner
        from visionrl.train.ranks import join, use_fsdp

        if self.rank == 1 and faults.active("fail_learner_setup"):
            raise RuntimeError("injected fault fail_learner_setup: this learner rank could not start")
        cuda = torch.cuda.is_available()
        if cuda and self.cfg.train.gpu_memory_gib is not None:
            cap_gpu_memory(self.cfg.train.gpu_memory_gib)
        fsdp = use_fsdp(self.cfg.train.fsdp, cuda, self.world)
        # Every later collective is inside one remote call, whose deadline is ray.call_timeout_s.
        timeout = max(self.cfg.ray.startup_timeout_s, self.cfg.ray.call_timeout_s)
        ranks = join(self.rank, self.world, address, "nccl" if cuda else "gloo", fsdp=fsdp, timeout_s=timeout)
        with memory_guard("learner", "loading the model", self.cfg):
            self.learner = Learner(self.cfg, ranks=ranks)

    def warm_up(self) -> float:
        """`train.compile`: the decoder layers compiled for training now, beside the engines' start, not in step
        1 (`Learner.warm_up`); the seconds it took."""
        with memory_guard("learner", "the compile warm-up", self.cfg):
            return self.learner.warm_up() if self.learner is not None else 0.0

    def train_step(self, batch: TrainBatch) -> dict[str, float] | None:
        """The update on this rank's share of `batch`; the metrics, summed over the ranks."""
        self.calls += 1
        faults.at_call("kill_learner", self.rank, self.calls)
        return self._rank0("train_step", lambda learner: learner.train_step(batch))

    def adapter_payload(self, for_engine: bool = True) -> AdapterPayload | None:
        """The current adapter: in the engines' dtype, or (`for_engine=False`) in full precision; stamped with
        its build time and the wall clock it was sent at (the sync's profile)."""
        t = time.perf_counter()
        got = self._rank0("adapter_payload", lambda learner: learner.adapter_payload(for_engine))
        built_s = time.perf_counter() - t
        return dataclasses.replace(got, built_s=built_s, sent_at=time.time()) if got else None

    def probe_parts(self) -> list[str] | None:
        return self._rank0("the adapter probe", lambda learner: learner.probe_parts())

    def probe_payload(self, part: str) -> AdapterPayload | None:
        """The probe adapter of `part` (random B on that part's LoRA only), for the engines' probe."""
        return self._rank0("the adapter probe", lambda learner: learner.probe_payload(part))

    def probe_logprobs(
        self, part: str, batch: TrainBatch
    ) -> tuple[list[list[float]], list[list[float]]] | None:
        """Log-probs of the engines' greedy probe completions under the probe adapter of `part`, and under the
        learner's own weights."""
        return self._rank0("the adapter probe", lambda learner: learner.probe_logprobs(part, batch))

    def save(self) -> LearnerState | None:
        """What a checkpoint keeps: the adapter in full precision and the trainer state."""
        return self._rank0(
            "save",
            lambda learner: LearnerState(
                adapter=learner.adapter_payload(for_engine=False),
                trainer_state=learner.state_dict()["trainer_state"],
            ),
        )

    def load(self, adapter_dir: str, trainer_state: bytes) -> None:
        """Restore the adapter in `adapter_dir` (a checkpoint's) and the trainer state saved with it."""
        self._rank0("load", lambda learner: learner.load_state(adapter_dir, trainer_state))

    def logprobs(
        self, batch: TrainBatch, adapter: bool = True, temperature: float | None = None, raw: bool = False
    ) -> list[list[float]] | None:
        """Log-probs of every sequence's completion tokens, with the adapter or the base model."""
        return self._rank0("logprobs", lambda learner: learner.logprobs(batch, adapter, temperature, raw))

    def placement(self) -> dict[str, Any]:
        return placement()

    def _rank0(self, phase: str, run: Callable[[Learner], T]) -> T | None:
        """`run(learner)` on this rank, an out-of-memory error turned into one that says what to change; rank 0's
        result (None on the other ranks)."""
        if self.learner is None:
            raise RuntimeError(f"learner rank {self.rank}: {phase} before setup")
        with memory_guard("learner", phase, self.cfg):
            out = run(self.learner)
        return out if self.rank == 0 else None


@ray.remote
class RolloutActor:
    def __init__(
        self, cfg: JobConfig, forbidden: list[int], seed: int, index: int = 0, after: list | None = None
    ) -> None:
        """`after`: [the learners' setup calls], nested so that Ray does not wait for them before this runs:
        the engine imports its library meanwhile and loads the model once the learners have theirs on the GPU
        (an engine measures the memory it may take when it starts)."""
        console.quiet_actor()
        use_torch_threads(cfg)
        self.cfg, self.index, self.calls = cfg, index, 0
        preload_engine(cfg.rollout.engine)
        if after:
            _wait_for_learners(after[0])
        with memory_guard("rollout engine", "start-up", cfg):
            self.engine = make_engine(
                cfg.model.path,
                lora=cfg.lora,
                rollout=cfg.rollout,
                forbidden_token_ids=forbidden,
                dtype=cfg.model.dtype,
                seed=seed,
                budget=engine_budget(cfg),
            )

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        self.calls += 1
        for fault in ("kill_engine", "freeze_engine"):
            faults.at_call(fault, self.index, self.calls)
        with memory_guard("rollout engine", "generation", self.cfg):
            return self.engine.generate(prompts, spec)

    def submit(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[str]:
        """Continuous episodes (`types.SteppingEngine`): the prompts join the running batch; returns at once."""
        with memory_guard("rollout engine", "generation", self.cfg):
            return self.engine.submit(prompts, spec)

    def collect(self, timeout_s: float) -> dict[str, list[Completion]]:
        """What finished since the last call, waiting up to `timeout_s` (short: the actor takes no other call
        meanwhile, and the driver submits the next turns in between)."""
        with memory_guard("rollout engine", "generation", self.cfg):
            return self.engine.collect(timeout_s)

    def abort(self) -> int:
        return self.engine.abort()

    def in_flight(self) -> bool:
        return bool(self.engine.in_flight())

    def load_adapter(self, payload: AdapterPayload) -> tuple[int, dict[str, float]]:
        """The version served after loading `payload`, and the sync's parts in seconds: the learner's build, the
        way here (Ray's object store, deserialising, the actor's queue), and the engine's own parts."""
        transfer_s = max(0.0, time.time() - payload.sent_at) if payload.sent_at else 0.0
        with memory_guard("rollout engine", "the adapter sync", self.cfg):
            version = self.engine.load_adapter(payload)
        parts = getattr(self.engine, "load_parts", {})
        return version, {"build": payload.built_s, "transfer": transfer_s, **parts}

    def probe(self, payload: AdapterPayload, prompts: list[PromptItem]) -> ProbeResult:
        with memory_guard("rollout engine", "the adapter probe", self.cfg):
            return self.engine.probe(payload, prompts)

    def fingerprint(
        self, prompt: PromptItem, max_tokens: int, continuation: list[int] | None = None
    ) -> tuple[Completion | None, int]:
        """The greedy completion of `prompt` under the version served, or `continuation` teacher-forced (None if
        the engine rejects it), and the engine's rebuilds so far. Not a `generate` call: the fault injection's
        call counts stay as they were."""
        with memory_guard("rollout engine", "the adapter fingerprint", self.cfg):
            return self.engine.fingerprint(prompt, max_tokens, continuation), self.engine.rebuilds()

    def judge(self, prompts: list[PromptItem], ask: JudgeAsk) -> list[float | str | None]:
        """The base model's verdicts (a `judge` reward with backend engine: `RolloutEngine.judge`)."""
        with memory_guard("rollout engine", "judging", self.cfg):
            return self.engine.judge(prompts, ask)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        with memory_guard("rollout engine", "wake-up after the update", self.cfg):
            self.engine.wake_up()

    def adapter_version(self) -> int:
        return self.engine.adapter_version()

    def placement(self) -> dict[str, Any]:
        return placement()

    def close(self) -> None:
        self.engine.close()


@ray.remote
class RewardActor:
    def __init__(self, specs: list[RewardSpec], cfg: RayConfig, index: int = 0) -> None:
        console.quiet_actor()
        self.fn = build_reward_fn(specs, timeout_s=cfg.reward_timeout_s, isolation=cfg.reward_isolation)
        self.index, self.calls = index, 0

    def score(self, completions: list[str], records: list[dict]) -> Any:
        self.calls += 1
        for fault in ("kill_reward_worker", "hang_reward_worker"):
            faults.at_call(fault, self.index, self.calls)
        return self.fn.score(completions, records)

    def close(self) -> None:
        self.fn.close()  # the reward child process, with process isolation

    def placement(self) -> dict[str, Any]:
        return placement()


def engine_budget(cfg: JobConfig) -> ImageBudget:
    """The engines' image budget: the data's, with room for an episode's images (env.max_images)."""
    budget = ImageBudget.of(cfg.data)
    if cfg.env is not None and cfg.env.max_images > budget.max_images:
        budget = dataclasses.replace(budget, max_images=cfg.env.max_images)
    return budget


def placement() -> dict[str, Any]:
    """Where this actor runs: node and the GPU ids Ray gave it (logged at start, checked by the GPU tests)."""
    ctx = ray.get_runtime_context()
    return {"node": ctx.get_node_id()[:8], "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}


def _start_engine(
    cfg: JobConfig, index: int, forbidden: list[int], opts: dict[str, Any], after: list | None = None
) -> Any:
    # mypy keeps a class's own type under a class decorator; `@ray.remote` adds `.options` at run time.
    return RolloutActor.options(**opts).remote(cfg, forbidden, cfg.train.seed + index, index, after)  # type: ignore[attr-defined]


def _wait_for_learners(setups: list[Any]) -> None:
    """Until the learners' setup calls are done. One that raised stops this engine's start too (the driver
    reports the learner's error); a result no longer held (this engine rebuilt by Ray long after the start) means
    they were done long ago."""
    try:
        ray.get(setups)
    except ray.exceptions.RayTaskError:
        raise
    except ray.exceptions.RayError:
        pass


def _start_reward_worker(cfg: JobConfig, index: int) -> Any:
    opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": cfg.ray.max_actor_restarts}
    with_actor_env([opts])
    return RewardActor.options(**opts).remote(cfg.reward_specs(judges=False), cfg.ray, index)  # type: ignore[attr-defined]


def start_actors(cfg: JobConfig) -> tuple[list[Any], list[Any], list[Any]]:
    """Create the learner ranks, engines and reward workers with the configured placement; each must start
    within ray.startup_timeout_s (a failure or a hang names the actor, a learner by its rank)."""
    r = cfg.ray
    plan = cfg.placement_plan()
    learner_opts, engine_opts = scheduling(cfg, plan)
    world = len(learner_opts)
    learners = [LearnerActor.options(**o).remote(cfg, i, world) for i, o in enumerate(learner_opts)]  # type: ignore[attr-defined]
    engines: list[Any] = []
    rewards: list[Any] = []
    timeout, key = r.startup_timeout_s, "ray.startup_timeout_s"
    wait = engines_wait_for_learners(cfg)
    try:
        forbidden = checkpoint_vision_token_ids(cfg.model.path)  # in the try: a bad config kills the learners
        if not wait:
            engines = [_start_engine(cfg, i, forbidden, opts) for i, opts in enumerate(engine_opts)]
        # a job whose only reward is a judge has no rule rewards to score; the workers start beside the rest
        rewards = [
            _start_reward_worker(cfg, i)
            for i in range(r.num_reward_workers if cfg.reward_specs(judges=False) else 0)
        ]
        address = gather([Call(learners[0].address.remote(), LEARNER, 0)], "start-up", timeout, key, True)[0]
        setups = [
            Call(a.setup.remote(address), LEARNER, i) for i, a in enumerate(learners)
        ]  # all join at once
        if wait:
            # GPU engines start now and import their library while the learners load the model; each loads it
            # once the learners are done (their weights already placed, an engine's memory profile sees them as
            # they will stay). Meanwhile the learners compile their layers for training.
            after = [[c.ref for c in setups]]
            engines = [_start_engine(cfg, i, forbidden, opts, after) for i, opts in enumerate(engine_opts)]
        gather(setups, "start-up", timeout, key, interruptible=True)
        warm = [Call(a.warm_up.remote(), LEARNER, i) for i, a in enumerate(learners)]
        # Fail early, with the actor's own error, if any of them cannot start; say where each one runs.
        calls = [
            *warm,
            *[Call(a.placement.remote(), LEARNER, i) for i, a in enumerate(learners)],
            *[Call(e.placement.remote(), ENGINE, i) for i, e in enumerate(engines)],
            *[Call(w.placement.remote(), REWARD, i) for i, w in enumerate(rewards)],
        ]
        got = gather(calls, "start-up", timeout, key, interruptible=True)
        warm_s, places = got[: len(warm)], got[len(warm) :]
    except BaseException:
        kill_actors([*learners, *engines, *rewards])  # none of them is left on a Ray that outlives the run
        raise
    if any(warm_s):
        logger.info(
            "the learners' layers compiled for training beside the engines' start: %.1f s", max(warm_s)
        )
    logger.info(
        "placement %s; running: %s",
        plan.describe(),
        "; ".join(
            [f"learner {i} {p}" for i, p in enumerate(places[:world])]
            + [f"engine {i} {p}" for i, p in enumerate(places[world : world + len(engines)])]
        ),
    )
    return learners, engines, rewards
