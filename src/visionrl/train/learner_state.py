"""The learner's state as bytes: the adapter files it sends to engines and checkpoints, and the trainer state
(optimizer, schedule, version, RNG) a checkpoint keeps (`LearnerState`, both together); and loading them back.
With FSDP every rank calls these together (whole tensors are gathered from the shards, and scattered back on
load)."""

from __future__ import annotations

import io
import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from visionrl.adapter.packed import pack_safetensors
from visionrl.errors import InputError
from visionrl.models.loader import lora_param_groups
from visionrl.train.ranks import adapter_file_key, full_optimizer_state, full_tensor, load_sharded_state
from visionrl.types import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterPayload, FileData

# `learner` below is a visionrl.train.learner.Learner (not imported: that module imports this one).
Learner = Any
_PT = {"format": "pt"}  # the metadata torch's safetensors files carry


@dataclass(frozen=True)
class LearnerState:
    """What a checkpoint keeps of the learner: the adapter in full precision (with its version) and the trainer
    state (`trainer_state_bytes`)."""

    adapter: AdapterPayload
    trainer_state: bytes


def adapter_config_bytes(model: Any) -> bytes:
    """peft's adapter_config.json of `model`, as peft's own save_pretrained writes it."""
    with tempfile.TemporaryDirectory(prefix="visionrl-adapter-") as tmp:
        model.peft_config["default"].save_pretrained(tmp)
        config = json.loads((Path(tmp) / ADAPTER_CONFIG).read_text())
    config["inference_mode"] = True
    return json.dumps(config, indent=2, sort_keys=True).encode()


def adapter_weights_bytes(model: Any, for_engine: bool) -> FileData:
    """The LoRA weights as a safetensors file (for the engines a numpy buffer: `pack_safetensors`). peft keeps
    them in float32; engines compute in the model's dtype anyway, so the per-step sync sends that dtype: half the
    bytes (an 8B model's r64 adapter: 666 -> 333 MiB), cast on the device before the copy to the host. Checkpoints
    and the exported adapter keep float32."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    dtype = model.dtype if for_engine else torch.float32
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    if for_engine:  # the per-step sync: one copy to the host, a buffer Ray moves without pickling it
        return pack_safetensors({k: full_tensor(v.detach()).to(dtype) for k, v in state.items()}, _PT)
    weights = {k: full_tensor(v.detach()).to(dtype).cpu().contiguous() for k, v in state.items()}
    return save(weights, metadata=_PT)


def trainer_state_bytes(learner: Learner) -> bytes:
    buf = io.BytesIO()
    torch.save(
        {
            # with FSDP gathered whole: a checkpoint resumes on any number of ranks
            "optimizer": full_optimizer_state(learner.model, learner.optimizer)
            if learner.ranks.fsdp
            else learner.optimizer.state_dict(),
            "scheduler": learner.scheduler.state_dict(),
            "version": learner.version,
            "steps_trained": learner.steps_trained,
            "rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
        buf,
    )
    return buf.getvalue()


def load_trainer_state(learner: Learner, adapter_dir: Path, trainer_state: bytes) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    state = torch.load(io.BytesIO(trainer_state), weights_only=False)
    check_adapter_fits(learner.model, weights, adapter_dir)
    if learner.ranks.fsdp:
        load_sharded_state(learner.model, learner.optimizer, weights, state["optimizer"])
    else:
        set_peft_model_state_dict(learner.model, weights)
        learner.optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    learner.version = int(state["version"])
    # checkpoints written before the schedule ran on steps: their scheduler counted applied updates
    updates = learner.cfg.algorithm.updates_per_batch
    learner.steps_trained = int(state.get("steps_trained", state["scheduler"]["last_epoch"] // updates))
    torch.set_rng_state(state["rng"])
    if state.get("python_rng") is not None:  # absent in checkpoints written before it was kept
        random.setstate(state["python_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    apply_optimizer_settings(learner)


def check_adapter_fits(model: torch.nn.Module, weights: dict[str, torch.Tensor], adapter_dir: Path) -> None:
    """Raise InputError unless `weights` (peft's file names) are exactly the model's trainable LoRA weights: a
    checkpoint of another LoRA layout would otherwise load partly and train on from half-initialised weights."""
    expected = {adapter_file_key(name) for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise InputError(
            f"the checkpoint's adapter {adapter_dir} does not fit this job's LoRA layout: {len(missing)} of the "
            f"model's LoRA weights are not in it (e.g. {missing[:2]}) and {len(unexpected)} of its weights are "
            f"not in the model (e.g. {unexpected[:2]}); resume with the lora settings (rank, target_modules, "
            "train_merger, train_lm_head) the run was started with"
        )


def apply_optimizer_settings(learner: Learner) -> None:
    """After loading a checkpoint: this job's rates, betas and weight decay replace the saved ones (a resume
    may change them on purpose; orchestrate.resume reports every change), the moments are kept."""
    t, optimizer, scheduler = learner.cfg.train, learner.optimizer, learner.scheduler
    rates = {g["name"]: g["lr"] for g in lora_param_groups(learner.model, t.lr, t.merger_lr, t.lm_head_lr)}
    scheduler.base_lrs = [rates[g["name"]] for g in optimizer.param_groups]
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group.update(initial_lr=base, lr=base * factor, betas=t.betas, weight_decay=t.weight_decay)
