"""Two data-parallel learner ranks (gloo, two processes) and one learner, on the same batch, give the same adapter
and the same step metrics: the loss normalisers count the whole mini-batch and the gradients are summed. With
FSDP2 (the GPU path, here on gloo) too, including its gathered adapter and a checkpoint state round trip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

# One rank's run: the tiny model, a fixed batch of 4 prompts x 2 hand-made completions (lengths 1 to 4), one
# train_step of 2 optimizer updates (mini-batch 2 needs old log-probs) with a KL term (reference log-probs).
RANK = r"""
import json, os, sys
import torch
from safetensors.torch import save_file
from torch.distributed.tensor import distribute_tensor
from visionrl.config import config_from_dict
from visionrl.data import load_dataset
from visionrl.data.prompts import build_prompt
from visionrl.train.batching import Sequence
from visionrl.train.learner import Learner, TrainBatch
from visionrl.train.ranks import full_tensor, join

raw, rank, world, address, out = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
fsdp, steps = sys.argv[6] == "fsdp", int(sys.argv[7])
torch.set_num_threads(1)
learner = Learner(config_from_dict(raw), device="cpu", ranks=join(rank, world, address, "gloo", fsdp=fsdp))
with torch.no_grad():  # a non-zero B, the same on every rank (whole, then sharded), so that every LoRA weight moves
    for n, p in learner.model.named_parameters():
        if "lora_B" in n:
            full = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05
            mesh = getattr(p, "device_mesh", None)
            p.copy_(distribute_tensor(full, mesh, p.placements) if mesh is not None else full)
ds = load_dataset(raw["data"]["train"])
prompts = [build_prompt(ds[i], learner.processor) for i in range(4)]
vocab = learner.processor.tokenizer.get_vocab()
words = [["red", "<|im_end|>"], ["blue"], ["green", "shape", "?", "<|im_end|>"], ["yellow", "<|im_end|>"],
         ["left", "right", "top"], ["one", "<|im_end|>"], ["red"], ["blue", "green", "<|im_end|>"]]
seqs = [Sequence(prompt=i // 2, completion_ids=[vocab[w] for w in ws], advantage=[1.0, -0.5, 0.7][i % 3],
                 sampling_logprobs=[-1.0] * len(ws)) for i, ws in enumerate(words)]
for step in range(steps):
    metrics = learner.train_step(TrainBatch(prompts, seqs))
    if step == 0 and steps > 1:  # a checkpoint's state round trip between the steps (collectives with FSDP)
        payload, state = learner.adapter_payload(for_engine=False), learner.state_dict()
        if world > 1:  # the checkpoint is rank 0's (whole optimizer state); every rank resumes from it
            box = [state]
            torch.distributed.broadcast_object_list(box, src=0)
            state = box[0]
        tmp = f"{out}-ckpt-{rank}"
        os.makedirs(tmp, exist_ok=True)
        for name, data in payload.files.items():
            open(os.path.join(tmp, name), "wb").write(data)
        learner.load_state(tmp, state["trainer_state"])
state = {n: full_tensor(p.detach()).clone() for n, p in learner.model.named_parameters() if p.requires_grad}
if rank == 0:
    save_file(state, out + ".safetensors")
    json.dump(metrics, open(out + ".json", "w"))
"""


def _run(
    raw: dict, world: int, out: Path, fsdp: bool = False, steps: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from safetensors.torch import load_file

    from visionrl.train.ranks import free_address

    address, mode = free_address("127.0.0.1"), "fsdp" if fsdp else "plain"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK,
                json.dumps(raw),
                str(r),
                str(world),
                address,
                str(out),
                mode,
                str(steps),
            ]
        )
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world
    return load_file(str(out) + ".safetensors"), json.loads(Path(str(out) + ".json").read_text())


def test_two_ranks_train_the_same_adapter_as_one(tiny_model: Path, color_data: Path, tmp_path: Path) -> None:
    raw = {
        "output_dir": "unused",
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "data": {"train": str(color_data / "train.jsonl")},
        "rewards": [{"name": "exact_match"}],
        "lora": {"rank": 8, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 2, "updates_per_batch": 2, "kl_coef": 0.05},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 4, "temperature": 0.7},
        # lr 1e-4: Adam's first steps move every weight by about lr, and where a gradient is as small as Adam's eps
        # (1e-8) summation-order rounding is amplified to ~1e-3 of lr; at lr 1e-4 that stays well below 1e-6.
        "train": {"lr": 1e-4, "lr_schedule": "constant", "micro_batch_tokens": 64},
    }
    one, m1 = _run(raw, 1, tmp_path / "one")
    two, m2 = _run(raw, 2, tmp_path / "two")
    before = _run({**raw, "train": {**raw["train"], "lr": 1e-12}}, 1, tmp_path / "still")[0]
    assert one.keys() == two.keys() and len(one) > 0
    moved = max((one[k] - before[k]).abs().max().item() for k in one)
    assert moved > 5e-5  # the step changed the adapter, so agreement below is not trivial
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)
    for key in ("loss/policy", "loss/kl", "policy/grad_norm", "policy/entropy", "learner/tokens"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert m2["learner/micro_batches"] == m1["learner/micro_batches"]  # the same work, split over two ranks


def test_fsdp_ranks_train_the_same_adapter_as_one_plain_learner(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    raw = {
        "output_dir": "unused",
        "model": {"path": str(tiny_model), "dtype": "float32", "gradient_checkpointing": True},
        "data": {"train": str(color_data / "train.jsonl")},
        "rewards": [{"name": "exact_match"}],
        "lora": {"rank": 8, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 2, "updates_per_batch": 2, "kl_coef": 0.05},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 4, "temperature": 0.7},
        "train": {"lr": 1e-4, "lr_schedule": "constant", "micro_batch_tokens": 64},
    }
    # Two steps with a checkpoint-state round trip between them; rank 1 of FSDP gets fewer micro-batches than
    # rank 0 (token-balanced shards of 8 sequences), so its filler passes are exercised too.
    one, m1 = _run(raw, 1, tmp_path / "one", steps=2)
    two, m2 = _run(raw, 2, tmp_path / "fsdp", fsdp=True, steps=2)
    assert one.keys() == two.keys() and len(one) > 0
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)
    for key in ("loss/policy", "loss/kl", "policy/grad_norm", "learner/tokens"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
