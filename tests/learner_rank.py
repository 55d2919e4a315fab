"""One learner rank's run, started as a process by the learner-rank tests (CPU with gloo, GPU with nccl).

The tiny model, a fixed batch of 4 prompts x 2 hand-made completions (lengths 1 to 4), `steps` train_steps of 2
optimizer updates each (mini-batch 2 needs old log-probs) with a KL term (reference log-probs), and a checkpoint's
state round trip after the first step. Rank 0 writes the trained LoRA weights (`OUT.safetensors`) and the last
step's metrics (`OUT.json`).

Arguments: job (JSON), rank, world, address, OUT, plain|fsdp, steps, device (cpu or cuda).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

from visionrl.config import config_from_dict
from visionrl.data import load_dataset
from visionrl.data.prompts import build_prompt
from visionrl.models.sequences import Sequence
from visionrl.train.learner import Learner, TrainBatch
from visionrl.train.ranks import full_tensor, join, laid_out_like

WORDS = [
    ["red", "<|im_end|>"],
    ["blue"],
    ["green", "shape", "?", "<|im_end|>"],
    ["yellow", "<|im_end|>"],
    ["left", "right", "top"],
    ["one", "<|im_end|>"],
    ["red"],
    ["blue", "green", "<|im_end|>"],
]


def main(argv: list[str]) -> None:
    raw, rank, world, address, out = json.loads(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    fsdp, steps, device = argv[5] == "fsdp", int(argv[6]), argv[7]
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if device == "cuda" else "gloo"
    learner = Learner(
        config_from_dict(raw), device=device, ranks=join(rank, world, address, backend, fsdp=fsdp)
    )
    with (
        torch.no_grad()
    ):  # a non-zero B, the same on every rank (whole, then sharded): every LoRA weight moves
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                full = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05
                p.copy_(laid_out_like(full, p))
    ds = load_dataset(raw["data"]["train"])
    prompts = [build_prompt(ds[i], learner.processor) for i in range(4)]
    vocab = learner.processor.tokenizer.get_vocab()
    seqs = [
        Sequence(
            prompt=i // 2,
            completion_ids=[vocab[w] for w in ws],
            advantage=[1.0, -0.5, 0.7][i % 3],
            sampling_logprobs=[-1.0] * len(ws),
        )
        for i, ws in enumerate(WORDS)
    ]
    metrics: dict[str, float] = {}
    for step in range(steps):
        metrics = learner.train_step(TrainBatch(prompts, seqs))
        if (
            step == 0 and steps > 1
        ):  # a checkpoint's state round trip between the steps (collectives with FSDP)
            payload, state = learner.adapter_payload(for_engine=False), learner.state_dict()
            if world > 1:  # the checkpoint is rank 0's (whole optimizer state); every rank resumes from it
                box = [state]
                torch.distributed.broadcast_object_list(box, src=0)
                state = box[0]
            tmp = f"{out}-ckpt-{rank}"
            os.makedirs(tmp, exist_ok=True)
            for name, data in payload.files.items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            learner.load_state(tmp, state["trainer_state"])
    weights = {
        n: full_tensor(p.detach()).float().cpu().clone()
        for n, p in learner.model.named_parameters()
        if p.requires_grad
    }
    if rank == 0:
        save_file(weights, out + ".safetensors")
        with open(out + ".json", "w") as f:
            json.dump(metrics, f)
    if torch.distributed.is_initialized():
        # Leave together: a rank that exits while the group's threads still run (its peer mid-collective, or the
        # store's) can abort in C++ ("terminate called without an active exception", exit -6), seen under load.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
