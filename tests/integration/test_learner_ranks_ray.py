"""Learner ranks as Ray actors (`ray.num_learners`) and several engines, through the real loop: real Ray, the
tiny model, HF engines (seeded, so a run's rollouts repeat exactly), gloo ranks on the CPU."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from visionrl.config import JobConfig, config_from_dict
from visionrl.errors import RunError

pytestmark = pytest.mark.slow

# The random tiny model never names a colour, so exact match would score every completion 0 and train nothing.
# A reward that differs within each group (the completion's length in characters) gives every group a signal.
LENGTH_REWARD = "def length(completion, answer, record):\n    return float(len(completion))\n"


@pytest.fixture
def length_reward(shared_ray) -> str:
    """The reward above as `rank_rewards:length`, importable here (validation) and in the Ray workers."""
    (shared_ray.modules / "rank_rewards.py").write_text(LENGTH_REWARD)
    return "rank_rewards:length"


def _cfg(model: Path, data_dir: Path, out: Path, reward: str = "exact_match", **over: dict) -> JobConfig:
    raw = {
        "output_dir": str(out),
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train": str(data_dir / "train.jsonl")},
        "rewards": [{"name": reward}],
        "lora": {"rank": 8, "alpha": 16, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 4, "kl_coef": 0.05},
        "rollout": {"engine": "hf", "prompts_per_step": 4, "max_new_tokens": 3, "max_model_len": 256},
        # lr 1e-4: see tests/integration/test_learner_ranks.py (summation order stays far below the tolerance)
        "train": {"lr": 1e-4, "lr_schedule": "constant", "torch_threads": 1, "steps": 1},
        "logging": {"eval_every": 100, "save_every": 1, "images_every": 100},
        "ray": {"num_cpus": 2},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    # copies: load_file maps the file, and a later export to the same folder would show through
    return {k: v.clone() for k, v in load_file(str(run / "adapter" / "adapter_model.safetensors")).items()}


def test_two_learner_ranks_train_the_adapter_one_learner_trains_and_resume(
    tiny_model: Path, color_data: Path, tmp_path: Path, length_reward: str
) -> None:
    """Same seed, same rollouts (one seeded engine in every run; several engines: the test below and
    tests/integration/test_multinode.py): one step with 2 learner ranks, plain data
    parallel and sharded with FSDP2 (`train.fsdp: on`, here on gloo), gives the adapter of one learner (float32,
    within 1e-5), and logs learner/ranks = 2. The sharded run resumes from its checkpoint to a second step; its
    exported adapter loads into the base model with peft."""
    from peft import PeftModel

    from visionrl.models.loader import load_base_model
    from visionrl.orchestrate.loop import train

    def run(name: str, learners: int, fsdp: str = "auto", steps: int = 1, resume: bool = False) -> Any:
        cfg = _cfg(
            tiny_model,
            color_data,
            tmp_path / name,
            length_reward,
            ray={"num_learners": learners},
            train={"fsdp": fsdp, "steps": steps},
        )
        return train(cfg, resume=resume)

    one, two, sharded = run("one", 1), run("two", 2), run("sharded", 2, "on")
    assert [h["learner/ranks"] for h in (one.history + two.history + sharded.history)] == [1.0, 2.0, 2.0]
    # the same rollouts: the reward of every completion (its length) is the same in every run
    for other in (two, sharded):
        assert other.history[0]["reward/mean"] == one.history[0]["reward/mean"] > 0
        assert other.history[0]["reward/std"] == one.history[0]["reward/std"] > 0  # a signal to train on
    a = _adapter(tmp_path / "one")
    assert any("lora_B" in k for k in a)
    # B starts at zero: one Adam step moves each B entry by about lr (1e-4) where its gradient is not ~0
    assert max(a[k].abs().max().item() for k in a if "lora_B" in k) > 5e-5
    for name, other in (("two", two), ("sharded", sharded)):
        b = _adapter(tmp_path / name)
        assert b.keys() == a.keys()
        for k in a:
            torch.testing.assert_close(
                b[k], a[k], rtol=0, atol=1e-5, msg=lambda m, k=k, n=name: f"{n} {k}: {m}"
            )
        for key in ("loss/policy", "loss/kl", "policy/grad_norm", "learner/tokens"):
            assert other.history[0][key] == pytest.approx(one.history[0][key], rel=1e-5, abs=1e-7), (
                name,
                key,
            )

    step1 = _adapter(tmp_path / "sharded")
    resumed = run("sharded", 2, "on", steps=2, resume=True)
    assert [h["step"] for h in resumed.history] == [2]
    assert resumed.history[0]["learner/ranks"] == 2.0
    assert resumed.history[0]["rollout/adapter_version"] == 1.0  # step 2 sampled the adapter of step 1
    assert (tmp_path / "sharded" / "checkpoints" / "step_2" / "checkpoint.json").is_file()
    final = _adapter(tmp_path / "sharded")
    assert max((final[k] - step1[k]).abs().max().item() for k in final) > 0  # step 2 trained on
    base = load_base_model(str(tiny_model), "float32", torch.device("cpu"), "sdpa")
    model = PeftModel.from_pretrained(base, str(tmp_path / "sharded" / "adapter"))
    loaded = {n.replace(".default", ""): p.detach() for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(final)
    for name, weight in final.items():
        torch.testing.assert_close(loaded[name], weight, rtol=0, atol=0)


def test_two_engines_take_whole_groups_and_serve_every_adapter_version(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, caplog: pytest.LogCaptureFixture
) -> None:
    """`Workers.rollout` gives engine 0 the first half of the prompts and engine 1 the rest, each prompt's n
    completions from one engine: the same groups as asking each engine for its half directly (same seeds). The
    start-up probe reaches both engines, and both serve each new adapter version."""
    import ray

    from visionrl.orchestrate.actors import start_actors
    from visionrl.orchestrate.engine_lanes import engine_spec as _engine_spec
    from visionrl.orchestrate.prompt_stream import PromptStream
    from visionrl.orchestrate.ray_session import ray_session
    from visionrl.orchestrate.workers import Workers
    from visionrl.types import SamplingSpec

    caplog.set_level(logging.INFO, logger="visionrl")
    cfg = _cfg(tiny_model, color_data, tmp_path / "run", rollout={"num_engines": 2})
    prompts = PromptStream(cfg).probe_prompts(3)
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=3, seed=7)
    with ray_session(cfg.ray):
        workers = Workers(*start_actors(cfg), cfg)
        try:
            probes = workers.verify_delivery(prompts)
            groups = workers.rollout(prompts, spec)
            # 3 prompts over 2 engines: prompts 0-1 to engine 0, prompt 2 to engine 1
            direct = ray.get(
                [
                    workers.engines[0].generate.remote(prompts[:2], _engine_spec(spec, 0)),
                    workers.engines[1].generate.remote(prompts[2:], _engine_spec(spec, 1)),
                ]
            )
            synced = workers.sync_adapter()
            versions = [synced.version, *ray.get([e.adapter_version.remote() for e in workers.engines])]
        finally:
            workers.close()
    # each engine, each adapter part: moved by the probe, and scored alike by the learner (float32)
    assert [(p.engine, p.part) for p in probes] == [
        (0, "language model"),
        (1, "language model"),
        (0, "merger"),
        (1, "merger"),
    ]
    assert all(p.moved and p.diff < 1e-4 < p.effect for p in probes), [p.describe() for p in probes]
    assert len(synced.fingerprint_diffs) == 2 and max(synced.fingerprint_diffs) < 1e-4
    assert [len(g) for g in groups] == [2, 2, 2]
    assert [[c.token_ids for c in g] for g in groups] == [
        [c.token_ids for c in g] for g in direct[0] + direct[1]
    ]
    assert versions == [0, 0, 0]
    # one start-up line: the plan (CPU: spread, nothing reserved), then where each learner rank and engine runs
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("placement ")]
    assert line.startswith(
        "placement CPU only: 1 learner rank(s) spread over the nodes, 2 engine(s) spread over the nodes; "
        "running: learner 0 {'node': "
    ), line
    assert "; engine 0 {'node': " in line and "; engine 1 {'node': " in line and "'gpus': []" in line


def test_an_error_in_one_learner_ranks_setup_names_the_rank(
    tiny_model: Path, color_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 fails while rank 0 waits for it to join: the run stops at start-up, naming learner 1 and its error."""
    import ray

    from visionrl.orchestrate.loop import train

    monkeypatch.setenv("VISIONRL_FAULTS", "fail_learner_setup")
    with pytest.raises(RunError) as err:
        train(_cfg(tiny_model, color_data, tmp_path / "run", ray={"num_learners": 2}))
    first = str(err.value).splitlines()[0]
    assert first == (
        "the learner 1 failed during start-up: RuntimeError: injected fault fail_learner_setup: this learner "
        "rank could not start"
    )
    assert "no checkpoint was written yet" in str(err.value)
    assert not ray.is_initialized()


def test_the_payload_of_any_rank_holds_the_adapter_files_peft_reads(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    """Every rank builds the full-precision payload (a gather under FSDP); the driver writes rank 0's with
    `write_adapter_files` (checkpoints, export), and peft's own loader reads exactly those files back."""
    from peft import PeftModel

    from visionrl.adapter.files import write_adapter_files
    from visionrl.models.loader import load_base_model
    from visionrl.train.learner import Learner
    from visionrl.train.ranks import RankGroup

    cfg = _cfg(tiny_model, color_data, tmp_path / "run")
    with torch.no_grad():  # plain data parallel needs no process group for this: no collective is involved
        learner = Learner(cfg, device="cpu", ranks=RankGroup(rank=1, world=2))
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.25)
    payload = learner.adapter_payload(for_engine=False)
    folder = write_adapter_files(tmp_path / "adapter", payload.files)
    assert (
        sorted(p.name for p in folder.iterdir())
        == sorted(payload.files)
        == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    )
    base = load_base_model(str(tiny_model), "float32", torch.device("cpu"), "sdpa")
    model = PeftModel.from_pretrained(base, str(folder))
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert b and all(bool((p == 0.25).all()) for p in b)
