"""The GRPO loop with the real components: vLLM (CPU build) rollouts, adapter sync, Ray actors, TensorBoard."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from visionrl.config import JobConfig, config_from_dict
from visionrl.data import load_dataset
from visionrl.data.prompts import build_prompt
from visionrl.metrics import REQUIRED_HISTOGRAMS, REQUIRED_SCALARS, SAMPLES_IMAGE, read_scalars, read_tags
from visionrl.models.sequences import Sequence
from visionrl.train.learner import Learner, TrainBatch
from visionrl.types import SamplingSpec

pytestmark = pytest.mark.slow


def _cfg(model: Path, data_dir: Path, out: Path, **over: dict) -> JobConfig:
    raw = {
        "output_dir": str(out),
        "model": {"path": str(model), "dtype": "float32"},
        "data": {
            "train": str(data_dir / "train.jsonl"),
            "eval": str(data_dir / "eval.jsonl"),
            "balance_key": "answer",
            "max_eval_samples": 32,
        },
        "rewards": [{"name": "exact_match", "kwargs": {"first_word": True}}],
        "lora": {"rank": 16, "alpha": 16, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 8},
        "rollout": {"prompts_per_step": 16, "max_new_tokens": 2, "max_model_len": 256},
        "train": {"lr": 3e-3, "lr_schedule": "constant", "torch_threads": 1, "steps": 2},
        "logging": {"eval_every": 1, "save_every": 1, "images_every": 1},
        "ray": {"num_cpus": 2},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


@pytest.fixture(scope="module")
def engine_and_learner(tiny_model: Path, color_data: Path, tmp_path_factory: pytest.TempPathFactory):
    from visionrl.rollout.vllm_engine import VLLMEngine

    cfg = _cfg(tiny_model, color_data, tmp_path_factory.mktemp("run"), rollout={"temperature": 1.0})
    learner = Learner(cfg, device="cpu")
    engine = VLLMEngine(
        str(tiny_model),
        lora_rank=16,
        tower_lora=True,
        forbidden_token_ids=learner.forbidden.tolist(),
        dtype="float32",
        max_model_len=256,
    )
    ds = load_dataset(color_data / "eval.jsonl")
    prompts = [build_prompt(ds[i], learner.processor) for i in range(8)]
    yield engine, learner, prompts
    engine.close()


def test_adapter_sync_serves_the_new_version(engine_and_learner) -> None:
    engine, learner, prompts = engine_and_learner
    greedy = SamplingSpec(n=1, greedy=True, max_tokens=4)
    before = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    assert engine.adapter_version() == 0
    with torch.no_grad():  # a clearly different policy: large random LoRA B everywhere
        gen = torch.Generator().manual_seed(0)
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    learner.version = 7
    assert engine.load_adapter(learner.adapter_payload()) == 7
    assert engine.adapter_version() == 7
    out = engine.generate(prompts, greedy)
    assert all(g[0].adapter_version == 7 for g in out)
    after = [g[0].token_ids for g in out]
    assert after != before, "the engine still answers like the base model after the adapter sync"
    # The same images again (encoder cache reset on sync, docs/ENGINE_NOTES.md): no crash, same answers.
    assert [g[0].token_ids for g in engine.generate(prompts, greedy)] == after


def test_learner_logprobs_match_vllm_sampling_logprobs(engine_and_learner) -> None:
    """For vLLM-sampled completions (adapter on LM, merger and lm_head), learner log-probs of the sampling distribution
    (temperature 1, vision tokens removed) match the engine's within 1e-3."""
    engine, learner, prompts = engine_and_learner
    if engine.adapter_version() == 0:
        engine.load_adapter(learner.adapter_payload())
    groups = engine.generate(prompts, SamplingSpec(n=4, temperature=1.0, max_tokens=4))
    seqs = [
        Sequence(prompt=i, completion_ids=c.token_ids, advantage=0.0, sampling_logprobs=c.logprobs)
        for i, g in enumerate(groups)
        for c in g
    ]
    ours = learner.logprobs(TrainBatch(prompts, seqs))
    diffs = [
        abs(a - b)
        for s, row in zip(seqs, ours, strict=True)
        for a, b in zip(row, s.sampling_logprobs, strict=True)
    ]
    assert len(diffs) >= 32
    assert max(diffs) < 1e-3, f"max |learner - vLLM| log-prob difference {max(diffs):.2e}"
    vision = set(learner.forbidden.tolist())
    assert not any(t in vision for s in seqs for t in s.completion_ids)


def test_two_steps_through_ray_write_the_tensorboard_tags_and_resume(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, capfd: pytest.CaptureFixture[str]
) -> None:
    from visionrl.orchestrate.loop import train

    small: dict[str, Any] = {
        "rollout": {"prompts_per_step": 4},
        "data": {"max_eval_samples": 8},
    }  # 4 x 8 a step
    small["logging"] = {"trackers": ["tensorboard", "mlflow", "wandb"]}  # the same tags in each
    cfg = _cfg(tiny_model, color_data, tmp_path / "run", **small)
    started = time.perf_counter()
    result = train(cfg)
    # A quiet console: the libraries' output (vLLM's warnings and bars, the actors' stderr) is in libraries.log
    console = capfd.readouterr()
    noise = [line for line in (console.out + console.err).splitlines() if _library_line(line)]
    assert noise == [], noise[:5]
    libraries = (tmp_path / "run" / "libraries.log").read_text()
    assert "WARNING" in libraries and "vllm" in libraries.lower()  # vLLM's own warnings went there
    assert "WARNING" not in (tmp_path / "run" / "visionrl.log").read_text().replace("WARNING visionrl", "")
    assert result.steps == 2 and [h["step"] for h in result.history] == [1, 2]
    # the start-up, with the first step only: its two parts within it, the whole within the run's wall time
    first = result.history[0]
    parts = first["timing/start_actors_s"] + first["timing/delivery_check_s"]
    assert 0 < parts <= first["timing/startup_s"] < time.perf_counter() - started
    assert not any(k in result.history[1] for k in ("timing/startup_s", "timing/start_actors_s"))
    # the sync's profile: the learner's build, the way to the engine, the engine's own parts, in turn within it
    names = ("build", "transfer", "write", "add", "remove", "reset")
    parts = [first[f"timing/sync_{name}_s"] for name in names]
    assert min(parts) >= 0 and first["timing/sync_add_s"] > 0
    assert sum(parts) <= first["timing/sync_load_s"] + 0.01
    # the fingerprint: the continuation fixed at start-up is teacher-forced by the engines, and the learner scored
    # it during the load, so none of the check is the learner's
    assert 0 < first["timing/sync_check_engine_s"] <= first["timing/sync_check_s"]
    assert first["timing/sync_check_learner_s"] == 0.0 and first["rollout/fingerprint_diff"] < 1e-3
    tags = read_tags(tmp_path / "run" / "tensorboard")
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    missing = [t for t in REQUIRED_SCALARS if t not in scalars]
    assert not missing, f"missing scalar tags {missing}"
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2]
    assert 0.0 <= scalars["eval/accuracy"][-1][1] <= 1.0
    assert all(h in tags["histograms"] for h in REQUIRED_HISTOGRAMS)
    assert any(t.startswith("samples/") for t in tags["images"])
    assert scalars["rollout/adapter_version"] == [
        (1, 0.0),
        (2, 1.0),
    ]  # step 2 sampled with the adapter of step 1
    assert scalars["rollout/logprob_diff"][-1][1] < 1e-3
    _the_same_in_mlflow_and_wandb(tmp_path / "run", scalars, steps=[1, 2])
    adapter = result.adapter_dir
    manifest = json.loads((adapter / "visionrl_manifest.json").read_text())
    assert set(manifest["files"]) >= {"adapter_config.json", "adapter_model.safetensors"}
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "checkpoint.json").is_file()
    # Resume: continues after step 2 with learner, sampler and engines restored.
    resumed = train(_cfg(tiny_model, color_data, tmp_path / "run", train={"steps": 3}, **small), resume=True)
    assert [h["step"] for h in resumed.history] == [3]
    assert resumed.history[0]["rollout/adapter_version"] == 2.0
    _the_same_in_mlflow_and_wandb(
        tmp_path / "run", read_scalars(tmp_path / "run" / "tensorboard"), steps=[1, 2, 3]
    )


def _the_same_in_mlflow_and_wandb(run: Path, scalars: dict[str, list], steps: list[int]) -> None:
    """MLflow's run and W&B's offline run hold TensorBoard's scalar tags at the same steps, and the pictures."""
    from mlflow import MlflowClient
    from tests.wandb_records import run_ids, written_history

    ids = json.loads((run / "trackers.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{(run / 'mlflow' / 'mlflow.db').resolve()}")
    mlflow_run = client.get_run(ids["mlflow"]["run_id"])
    assert mlflow_run.info.status == "FINISHED"
    assert set(scalars) <= set(mlflow_run.data.metrics)
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "reward/mean")] == steps
    assert client.list_artifacts(mlflow_run.info.run_id, "images")
    rows = written_history(run)
    assert set(scalars) <= {key for row in rows for key in row}
    assert [r["step"] for r in rows if "reward/mean" in r] == steps
    assert [r["reward/mean"] for r in rows if "reward/mean" in r] == pytest.approx(
        [v for _, v in scalars["reward/mean"]]
    )
    assert any(SAMPLES_IMAGE in r for r in rows) and run_ids(run) == {ids["wandb"]["id"]}


def _library_line(line: str) -> bool:
    """A console line that a library wrote (vLLM's or Ray's warnings, a forwarded actor's output, a load bar)."""
    marks = ("WARNING", "Warning", "it/s]", "(RolloutActor", "(LearnerActor", "(RewardActor", "Loading")
    return any(m in line for m in marks)


@pytest.mark.parametrize(
    ("loss", "algorithm", "rollout"),
    [
        ("ppo", {}, {}),
        # the other kinds with 2 updates per batch, so the second mini-batch is off-policy and the kinds differ
        ("gspo", {"updates_per_batch": 2, "clip_low": 3e-4, "clip_high": 4e-4}, {}),
        ("cispo", {"updates_per_batch": 2, "clip_high": 4.0}, {}),  # CISPO bounds the weight from above only
        # sapo also runs the engine sleep/wake path of the loop (a no-op in the CPU engines)
        ("sapo", {"updates_per_batch": 2}, {"sleep_during_update": True}),
    ],
)
def test_each_loss_kind_trains_three_steps_through_the_loop(
    pretrained_tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    shared_ray,
    loss: str,
    algorithm: dict,
    rollout: dict,
) -> None:
    """A 3-step smoke run per policy-loss kind (the kinds' math is pinned by tests/algo, learning by the demo
    recipe's test): every step updates the adapter with finite losses and gradients, the correction weights stay
    in range, and each kind's own mark is in the metrics (on-policy PPO: ratio 1, nothing clipped; GSPO's narrow
    sequence range clips the off-policy mini-batch; CISPO and SAPO train an off-policy mini-batch, SAPO's gate
    never clips)."""
    import math

    from visionrl.orchestrate.loop import train

    cfg = _cfg(
        pretrained_tiny_model,
        color_data,
        tmp_path / "run",
        algorithm={"group_size": 8, "loss": loss, **algorithm},
        rollout={"engine": "hf", "prompts_per_step": 8, **rollout},
        data={"eval": None},
        train={"steps": 3},
        logging={"eval_every": 100, "save_every": 100, "images_every": 100},
    )
    history = train(cfg).history
    assert [h["step"] for h in history] == [1, 2, 3]
    # the base answers colours (mean reward near chance): groups differ, and every step makes a new version
    assert [h["rollout/adapter_version"] for h in history] == [0.0, 1.0, 2.0]
    for h in history:
        assert 0.0 < h["reward/mean"] < 1.0 and h["faults/skipped_updates"] == 0.0, h
        assert all(math.isfinite(h[k]) for k in ("loss/policy", "loss/total", "policy/entropy")), h
        assert math.isfinite(h["policy/grad_norm"]) and h["policy/grad_norm"] > 0.0, h
        assert 0.5 < h["rollout/correction_weight_mean"] <= 2.0  # on by default
        assert h["rollout/logprob_diff"] < 1e-3  # the engine sampled the policy being trained
    clipped = [h["policy/clip_fraction"] for h in history]
    if loss == "ppo":  # one on-policy update per batch: ratio exactly 1, so no approx_kl curve of zeros
        assert clipped == [0.0] * 3 and not any("policy/approx_kl" in h for h in history), clipped
    else:  # the second mini-batch is scored against the log-probs before the first update
        kl = [h["policy/approx_kl"] for h in history]
        assert all(k != 0.0 for k in kl), kl
    if loss == "gspo":
        assert any(c > 0.0 for c in clipped), clipped  # sequence ratios outside [1 - 3e-4, 1 + 4e-4]
    if loss == "sapo":
        assert clipped == [0.0] * 3, clipped  # a smooth gate instead of a clip
        assert all(h["timing/engine_sleep_s"] >= 0.0 and h["timing/engine_wake_s"] >= 0.0 for h in history)
    else:
        assert not any("timing/engine_sleep_s" in h for h in history)


def test_hf_engine_behind_the_same_protocol(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """`rollout.engine: hf` runs the same loop (transformers generate), adapter sync included."""
    from visionrl.orchestrate.loop import train

    cfg = _cfg(
        tiny_model,
        color_data,
        tmp_path / "run",
        rollout={"engine": "hf", "prompts_per_step": 4},
        data={"max_eval_samples": 8},
    )
    result = train(cfg)
    assert [h["rollout/adapter_version"] for h in result.history] == [0.0, 1.0]
    # HF generate reports the processed (sampling) log-probs too: the learner agrees with them.
    assert all(h["rollout/logprob_diff"] < 1e-3 for h in result.history)
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()


def test_dynamic_sampling_runs_and_skips_steps_without_signal(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """The random tiny model almost never says a colour: every group is all-zero, so dynamic sampling keeps none,
    samples the maximum rounds, and no update (and no sync) happens; the run still completes and logs."""
    from visionrl.orchestrate.loop import train

    cfg = _cfg(
        tiny_model,
        color_data,
        tmp_path / "run",
        rollout={"engine": "hf", "prompts_per_step": 4},
        algorithm={"dynamic_sampling": True, "max_sampling_rounds": 2},
        data={"eval": None},
    )
    result = train(cfg)
    for h in result.history:
        if h["reward/zero_std_fraction"] == 1.0:
            assert h["rollout/groups_kept"] == 0.0 and h["rollout/sampling_rounds"] == 2.0
    versions = [h["rollout/adapter_version"] for h in result.history]
    updates = [h["rollout/groups_kept"] > 0 for h in result.history]
    assert versions[1] == (1.0 if updates[0] else 0.0)  # the engine moves on only after an update


def test_attaches_to_an_existing_ray_cluster(
    tiny_model: Path, color_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ray.address` attaches to a running cluster (here one this test starts and stops) and leaves it running."""
    import ray
    from ray.cluster_utils import Cluster

    from visionrl.orchestrate.loop import train

    # A short temp dir of its own (Ray's socket paths must stay short), removed with the cluster.
    temp_dir = tempfile.mkdtemp(prefix="vrl-ray-test-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cfg = _cfg(
            tiny_model,
            color_data,
            tmp_path / "run",
            rollout={"engine": "hf", "prompts_per_step": 2},
            data={"eval": None},
            train={"steps": 1},
            ray={"address": cluster.address},
        )
        assert train(cfg).steps == 1
        assert not ray.is_initialized()  # the driver disconnected ...
        ray.init(address=cluster.address)  # ... and the cluster is still there
        assert ray.cluster_resources().get("CPU") == 2
        ray.shutdown()
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_gpu_requests_on_a_ray_without_gpus_are_refused_before_any_actor_starts(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """The GPU job's shares on the CPU machine: refused at once naming the keys and the CPU values; before, every
    actor waited for ray.startup_timeout_s (30 minutes) with only Ray's autoscaler lines."""
    import time

    from visionrl.errors import InputError
    from visionrl.orchestrate.loop import train

    cfg = _cfg(
        tiny_model, color_data, tmp_path / "run", ray={"learner_gpus": 0.5}, rollout={"gpus_per_engine": 0.5}
    )
    t0 = time.monotonic()
    with pytest.raises(InputError) as err:
        train(cfg)
    text = str(err.value)
    assert text.startswith(
        "the job asks for 1 GPU(s) (ray.num_learners=1 x ray.learner_gpus=0.5 + rollout.num_engines=1 x "
        "rollout.gpus_per_engine=0.5) and this Ray has 0"
    )
    assert "set ray.learner_gpus=0 rollout.gpus_per_engine=0" in text
    assert time.monotonic() - t0 < 60 and shared_ray.live_actors() == []  # no actor was started


def test_an_output_dir_that_cannot_be_a_run_folder_is_named_before_ray(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    from visionrl.errors import InputError, StorageError
    from visionrl.orchestrate.loop import train

    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    with pytest.raises(InputError, match=rf"output_dir {a_file} is a file, not a folder"):
        train(_cfg(tiny_model, color_data, a_file))
    under_proc = Path(
        "/proc/visionrl-test-run"
    )  # no file system lets a folder be created here, not even root's
    with pytest.raises(StorageError, match=r"cannot be created there \(No such file or directory\)"):
        train(_cfg(tiny_model, color_data, under_proc))


def test_a_dead_worker_stops_the_run_with_a_clear_error(
    tiny_model: Path, color_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout engine dying mid-run, with no restarts allowed, ends the run with RunError naming the engine,
    the phase and the checkpoint to resume from."""
    import ray

    from visionrl.errors import RunError
    from visionrl.orchestrate import workers
    from visionrl.orchestrate.loop import train

    real_update = workers.Workers.update

    def update_then_kill_engine(self, batch):
        stats = real_update(self, batch)
        if stats["adapter_version"] == 2.0:
            ray.kill(self.engines[0])  # the engine dies before the sync of step 2
        return stats

    monkeypatch.setattr(workers.Workers, "update", update_then_kill_engine)
    cfg = _cfg(
        tiny_model,
        color_data,
        tmp_path / "run",
        rollout={"engine": "hf", "prompts_per_step": 2},
        data={"eval": None},
        train={"steps": 3},
        ray={"max_actor_restarts": 0},  # restarts are tested in test_faults.py
    )
    with pytest.raises(RunError, match=r"(?s)^the rollout engine 0 died during sync .*step_1.*--resume"):
        train(cfg)
    assert not ray.is_initialized()
    lines = (tmp_path / "run" / "history.jsonl").read_text().splitlines()
    assert len(lines) == 1  # step 1 was logged and checkpointed before the failure; nothing was lost


def test_ctrl_c_stops_cleanly_and_the_run_resumes(tiny_model: Path, color_data: Path, tmp_path: Path) -> None:
    """SIGINT mid-run: exit 130, every process of the run gone, checkpoints intact; --resume continues after them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    visionrl = str(Path(sys.executable).parent / "visionrl")
    args = [
        str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"),
        f"output_dir={run}", f"model.path={tiny_model}", f"data.train={color_data / 'train.jsonl'}",
        "data.eval=null", "train.target_accuracy=null", "rollout.engine=hf", "rollout.prompts_per_step=2",
        "logging.save_every=1",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [visionrl, "train", *args, "train.steps=500"],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    history = run / "history.jsonl"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if history.exists() and len(history.read_text().splitlines()) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-2000:]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends to the foreground group
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted" in out
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the run still alive: {left}"
    from visionrl.checkpoint import latest_checkpoint, load_checkpoint

    ckpt = load_checkpoint(latest_checkpoint(run))
    steps_done = len(history.read_text().splitlines())
    assert ckpt.step >= 2 and ckpt.step <= steps_done
    resumed = subprocess.run(
        [visionrl, "train", *args, f"train.steps={ckpt.step + 1}", "--resume"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in history.read_text().splitlines()]
    assert steps == list(range(1, ckpt.step + 2))  # no step twice, none missing
