"""How adapter versions reach a vLLM engine: as LoRA adapters in its slots, or merged into its base weights.

- `adapter` (the default): each version is written to a memory-backed folder and added under a LoRA id never
  used before (a reused id or name serves stale image embeddings: docs/ENGINE_NOTES.md); vLLM's LoRA kernels
  apply it to every request that names it.
- `merged` (`rollout.lora_serving: merged`): the engine is built without LoRA, and each version is merged into
  the weights it adapts, W0 + scale * B @ A, by the engine's worker (`vllm_worker.visionrl_merge_adapter`,
  `lora_merge`). Generation then runs no LoRA kernel at all (22% of the 8B job's generation on an H100); the
  engine serves one version at a time, so a probe or a judge's base model is merged in and the served version
  merged back after.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any, get_args

from visionrl import faults
from visionrl.config_rollout import LoraServing
from visionrl.rollout.probe import as_a_faulty_engine_applies
from visionrl.rollout.scratch import make_scratch_dir, remove_orphaned_scratch
from visionrl.types import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterPayload

SERVINGS: tuple[str, ...] = get_args(LoraServing)
BASE = object()  # merged: what `base()` hands out, the checkpoint's own weights in the engine


@contextlib.contextmanager
def timed(parts: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to `parts[name]` (the adapter sync's profile)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        parts[name] = parts.get(name, 0.0) + time.perf_counter() - t


class VLLMAdapters:
    """The adapter versions of one engine (`llm()` gives the engine of the moment: a rebuild replaces it)."""

    def __init__(self, llm: Callable[[], Any], model_path: str, merged: bool) -> None:
        remove_orphaned_scratch()
        self.dir = make_scratch_dir()
        self._llm = llm
        self.model_path = model_path
        self.merged = merged
        self.served: Any = None  # the version served (a LoRARequest: its name, id and folder)
        # merged: the adapter the engine's weights hold now (None: the base model)
        self._in_weights: Any = None
        self._next_id = 0  # LoRA ids handed out so far: each adapter version and probe gets a new one
        self._zero: AdapterPayload | None = None

    def request(self, adapter: Any) -> Any:
        """What a vLLM request names for `adapter`: its LoRARequest; nothing when merged (the weights hold it)."""
        return None if self.merged else adapter

    def add(self, payload: AdapterPayload, name: str, parts: dict[str, float] | None = None) -> Any:
        """Write the adapter's files and give it to the engine: added under a new LoRA id, or merged into the
        weights; raises if the engine did not take it."""
        from vllm.lora.request import LoRARequest

        parts = {} if parts is None else parts
        self._next_id += 1
        path = self.dir / f"{name}-{self._next_id}"
        path.mkdir(parents=True, exist_ok=True)
        with timed(parts, "write"):  # the files vLLM loads from, in the scratch folder (/dev/shm)
            for file, data in as_a_faulty_engine_applies(payload).files.items():
                (path / file).write_bytes(data)
        req = LoRARequest(f"{name}-{self._next_id}", self._next_id, str(path))
        if faults.active("ignore_adapters"):
            return None  # generate() then runs the base model: the adapter never reaches the engine
        try:
            with timed(parts, "add"):
                self._give(req, name)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # the engine serves what it served before
            raise
        return req

    def _give(self, req: Any, name: str) -> None:
        if self.merged:
            self._merge(self._llm(), req)
            return
        engine = self._llm().llm_engine  # its core reads the files and places the weights in a LoRA slot
        if not (engine.add_lora(req) and req.lora_int_id in engine.list_loras()):
            raise RuntimeError(
                f"vLLM did not take adapter {name} (LoRA id {req.lora_int_id}): add_lora failed or the id is "
                "not listed; check the engine log for LoRA errors (rank over max_lora_rank, unknown targets)"
            )

    def base(self) -> Any:
        """The base model for a judge, to `remove` after: merged, the checkpoint's weights back in the engine (no
        adapter to build or merge); otherwise the served adapter with every B zeroed in a slot of its own, since a
        request without a LoRA can still see one held before (docs/ENGINE_NOTES.md). None while nothing is
        served (the engine is the base model)."""
        if self.served is None:
            return None
        if self.merged:
            self._merge(self._llm(), None)
            return BASE
        return self.add(self.zero_adapter(), "visionrl-base")

    def remove(self, adapter: Any) -> None:
        """`adapter` out of the engine and its files deleted; when merged and the weights hold something other than
        the served version (a probe, the judge's base model), the served version is merged back first."""
        if adapter is None:
            return
        if self.merged:
            if self._in_weights is not self.served:
                self._merge(self._llm(), self.served)
        else:
            self._llm().llm_engine.remove_lora(adapter.lora_int_id)
        if adapter is not BASE:
            shutil.rmtree(adapter.lora_path, ignore_errors=True)

    def restore(self, llm: Any) -> None:
        """The served version into a newly built engine (a rebuild after an internal error)."""
        if self.served is None:
            return
        if self.merged:
            self._merge(llm, self.served)
        else:
            llm.llm_engine.add_lora(self.served)

    def _merge(self, llm: Any, adapter: Any) -> None:
        from visionrl.rollout.lora_merge import MergeError

        path = None if adapter is None else adapter.lora_path
        loaded = llm.collective_rpc("visionrl_merge_adapter", args=(path, self.model_path))
        refused = next((why for why in loaded if isinstance(why, str)), None)
        if refused is not None:
            raise MergeError(refused)
        if adapter is not None and not all(loaded):
            raise RuntimeError(
                f"the engine merged no weights from adapter {adapter.lora_name}: it adapts nothing the "
                "checkpoint holds; check the adapter's target modules"
            )
        self._in_weights = adapter
        # Cached image embeddings and prefixes were computed with the weights before; a LoRA request's new id
        # keeps them apart, a merge does not (a probe compares the outputs before and after it).
        llm.llm_engine.reset_encoder_cache()
        llm.reset_prefix_cache()

    def zero_adapter(self) -> AdapterPayload:
        """The served adapter's files with every B zeroed (made once: the layout never changes in a run): the base
        model, for a judge, under the same LoRA layout."""
        if self._zero is None:
            import torch
            from safetensors.torch import load_file, save

            path = self.served.lora_path
            tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
            zeroed = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()}
            with open(os.path.join(path, ADAPTER_CONFIG), "rb") as f:
                config = f.read()
            self._zero = AdapterPayload(-1, {ADAPTER_CONFIG: config, ADAPTER_WEIGHTS: save(zeroed)})
        return self._zero

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
