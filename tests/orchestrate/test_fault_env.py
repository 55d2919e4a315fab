"""Faults armed in the driver reach the actors through their Ray runtime environment (`faults.actor_env`), so a
Ray started before they were armed (a cluster, one Ray shared by several runs) runs them too."""

from __future__ import annotations

import pytest

from visionrl import faults
from visionrl.orchestrate.scheduling import with_actor_env


def test_only_the_armed_fault_variables_are_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VISIONRL_FAULTS", raising=False)
    monkeypatch.delenv("VISIONRL_FAULTS_DIR", raising=False)
    assert faults.actor_env() == {}
    options = [{"num_cpus": 0}]
    with_actor_env(options)
    assert options == [{"num_cpus": 0}]  # nothing armed: the actors' options are unchanged

    monkeypatch.setenv("VISIONRL_FAULTS", "kill_engine")
    monkeypatch.setenv("VISIONRL_FAULTS_DIR", "/tmp/fired")
    monkeypatch.setenv("VISIONRL_OTHER", "not a fault")
    assert faults.actor_env() == {"VISIONRL_FAULTS": "kill_engine", "VISIONRL_FAULTS_DIR": "/tmp/fired"}


def test_the_fault_variables_join_an_actors_own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VISIONRL_FAULTS", "kill_learner")
    monkeypatch.delenv("VISIONRL_FAULTS_DIR", raising=False)
    gpu_learner = {
        "num_gpus": 1,
        "runtime_env": {"env_vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
    }
    engine: dict = {"num_gpus": 0}
    with_actor_env([gpu_learner, engine])
    assert gpu_learner["runtime_env"] == {
        "env_vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "VISIONRL_FAULTS": "kill_learner"}
    }
    assert engine["runtime_env"] == {"env_vars": {"VISIONRL_FAULTS": "kill_learner"}}


def test_rollout_vllm_env_reaches_each_engine_beside_the_fault_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from visionrl.config import config_from_dict
    from visionrl.orchestrate.scheduling import engine_options

    monkeypatch.setenv("VISIONRL_FAULTS", "kill_engine")
    monkeypatch.delenv("VISIONRL_FAULTS_DIR", raising=False)
    cfg = config_from_dict(
        {
            "output_dir": "run",
            "model": {"path": "m"},
            "data": {"train": "t.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "rollout": {"num_engines": 2, "vllm_env": {"VLLM_LORA_ENABLE_DUAL_STREAM": 1}},
        }
    )
    engines = engine_options(cfg)
    with_actor_env(engines)
    want = {"VLLM_LORA_ENABLE_DUAL_STREAM": "1", "VISIONRL_FAULTS": "kill_engine"}
    assert [e["runtime_env"]["env_vars"] for e in engines] == [want, want]
    assert engines[0]["runtime_env"] is not engines[1]["runtime_env"]  # each engine its own
