"""Completions of spread lengths from a model with random weights, for the GPU benchmarks (`--lengths spread`).

Random weights never sample the end-of-turn token, so every completion runs to max_tokens and no learner
micro-batch ever holds padding. `SpreadLengths` is a vLLM logits processor (vLLM's v1 interface; an engine
argument, `logits_processors: ["length_spread:SpreadLengths"]`, through `rollout.vllm_engine_args`) that gives
each completion its own length: when a request is added it draws a length uniformly from [T/8, T] (T: its
max_tokens) and, at that length, leaves the end token the only choice. Every member of a GRPO group is its own
request in vLLM, so lengths differ within a group too. Greedy requests (the adapter delivery check, probes,
held-out evaluation) are left alone: only sampled completions are cut.

Set by the benchmark before the engines start (Ray workers and vLLM's engine process inherit the environment):
SPREAD_EOS (the end token's id), SPREAD_SEED, SPREAD_LOG (a file the drawn lengths are appended to, for the
histogram), and PYTHONPATH with this folder. What it changes besides the lengths: the forced end token's
engine log-prob is 0 (one token per completion), so its importance ratio is clipped; throughput is unaffected.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch
from lengths import draw_length
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

EOS_ENV, SEED_ENV, LOG_ENV = "SPREAD_EOS", "SPREAD_SEED", "SPREAD_LOG"


class SpreadLengths(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.eos = int(os.environ[EOS_ENV])
        self.rng = random.Random(int(os.environ.get(SEED_ENV, "0")))
        self.log = os.environ.get(LOG_ENV)
        self.rows: dict[int, tuple[int, list[int]]] = {}  # batch row -> (its length, its output ids so far)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token greedy decoding picks

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.rows.pop(row, None)
        drawn = []
        for row, params, _prompt, output in batch_update.added:
            if not params.temperature:  # greedy: the delivery check, probes, evaluation: left as they are
                self.rows.pop(row, None)
                continue
            length = draw_length(self.rng, int(params.max_tokens or 1))
            self.rows[row] = (length, output)
            drawn.append(length)
        for a, b, how in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if how == MoveDirectionality.SWAP and second is not None:
                self.rows[a] = second
        if drawn and self.log:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write("".join(f"{n}\n" for n in drawn))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        ending = [row for row, (length, output) in self.rows.items() if len(output) + 1 >= length]
        if ending:
            index = torch.tensor(ending, device=logits.device)
            logits[index] = float("-inf")
            logits[index, self.eos] = 0.0
        return logits


def spread_environment(model: Any, log: Any, seed: int = 0) -> dict[str, str]:
    """The environment `SpreadLengths` reads, for the model folder `model`: its end-of-turn token (`<|im_end|>`,
    Qwen's chat turns end there), the seed, the log file, and PYTHONPATH with this folder (vLLM imports the class
    by name in its engine process)."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(model)).convert_tokens_to_ids("<|im_end|>")
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return {EOS_ENV: str(eos), SEED_ENV: str(seed), LOG_ENV: str(log), "PYTHONPATH": path}


def use_in_vllm() -> None:
    """Every `vllm.LLM` built later in this process gets `SpreadLengths` (for a trainer that builds its own engine,
    TRL's colocated one)."""
    import vllm

    original = vllm.LLM.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("logits_processors", []).append(SpreadLengths)
        original(self, *args, **kwargs)

    vllm.LLM.__init__ = init  # type: ignore[method-assign]
