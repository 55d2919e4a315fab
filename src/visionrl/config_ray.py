"""The `ray:` section of a job: where the run's actors run, how many, their deadlines and restarts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from visionrl.config_yaml import Section


class RayConfig(Section):
    address: str | None = Field(
        None,
        description="Attach to this Ray cluster ('auto' or host:port); default: RAY_ADDRESS or an embedded local Ray.",
    )
    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="colocated: learner rank i and engine i share GPU i; split: learner ranks and engines get "
        "GPUs of their own. Without GPUs everything runs on the local node(s), nothing reserved.",
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the embedded local Ray (default: all).")
    learner_gpus: float = Field(0.0, ge=0.0, description="GPUs of each learner rank's actor (0 on CPU).")
    num_learners: int = Field(
        1,
        ge=1,
        le=4096,
        description="Learner ranks: one Ray actor each, a torch.distributed group (nccl on GPUs, gloo on CPUs) "
        "that splits each step's sequences by tokens and sums the gradients (train.fsdp: sharded on GPUs). "
        "ray.placement=colocated on GPUs pairs rank i with engine i on GPU i (rollout.num_engines = this).",
    )
    num_reward_workers: int = Field(1, ge=1, le=4096, description="Reward worker actors.")
    reward_timeout_s: float = Field(
        10.0, gt=0.0, description="Per-sample reward timeout; over it scores 0, counted."
    )
    reward_isolation: Literal["thread", "process"] = Field(
        "thread",
        description="How a reward worker runs reward calls: 'thread' (cheap; an overdue call is abandoned, but a "
        "function that holds the GIL stalls the worker until ray.max_actor_restarts replaces it) or 'process' "
        "(a child process killed on timeout or crash; for rewards that may hang or crash the interpreter).",
    )
    call_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        description="Deadline of one remote call of the loop (rollout batch, learner update, adapter sync, "
        "checkpoint state, evaluation batch). Past it the stuck actor is named and stopped; an engine is "
        "restarted (ray.max_actor_restarts), a stuck learner stops the run. Reward calls get "
        "reward_timeout_s per call instead.",
    )
    startup_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        description="Deadline for an actor to start (model load, engine build), also when one is restarted.",
    )
    max_actor_restarts: int = Field(
        3,
        ge=0,
        description="Rollout engines and reward workers that died or hung are restarted (the adapter re-synced "
        "and verified, the call retried) at most this many times in a run; then the run stops. 0: never.",
    )
