"""Methods visionrl adds to vLLM's workers (vLLM's `worker_extension_cls`), called by name through
`LLM.collective_rpc`: a named method crosses vLLM's process boundary without pickling code."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class VisionRLWorkerExtension:
    """Mixed into each vLLM worker class by vLLM itself (so no `__init__`, no state of its own)."""

    def visionrl_reseed(self, seed: int) -> None:
        """Reseed the generators the worker's sampler draws from (requests carry no seeds of their own): torch's
        for vLLM's V1 model runner (the CPU build), NumPy's for the V2 model runner (vLLM 0.26 on GPUs), which
        gives each unseeded request a seed of its own from `np.random` when the request is added, and feeds it
        to its Gumbel sampling kernel (docs/ENGINE_NOTES.md, "Sampling seeds")."""
        import random

        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)

    def visionrl_merge_adapter(self, adapter_dir: str | None, model_path: str) -> int | str:
        """Serve the adapter in `adapter_dir` merged into the base weights (None: the base model again): each layer
        it adapts, or an earlier merge changed, gets the checkpoint's weights plus the adapter's update, written
        into the tensors the engine computes with (their CUDA graphs stay valid). Returns the tensors loaded, or
        why the adapter cannot be merged (raised by the caller: an error raised here would take the engine core
        down with it); a refused adapter leaves the weights as they were."""
        from visionrl.rollout.lora_merge import MergedWeights, MergeError, read_adapter

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        merged = getattr(self, "_visionrl_merged", None)
        if merged is None:
            merged = MergedWeights(model_path, getattr(model, "packed_modules_mapping", {}))
            self._visionrl_merged = merged
        try:
            adapter = read_adapter(adapter_dir) if adapter_dir is not None else {}
            tensors = merged.tensors_for(adapter, runner.device, runner.model_config.dtype)
        except MergeError as err:
            return str(err)
        count = [0]

        def counted() -> Any:
            for item in tensors:
                count[0] += 1
                yield item

        reload_in_place(model, counted(), runner.model_config)
        return count[0]


def reload_in_place(model: Any, weights: Iterator[tuple[str, Any]], model_config: Any) -> None:
    """vLLM's layer-by-layer reload of the checkpoint-named `weights` into the loaded `model`: each layer is
    rebuilt from the tensors it gets, processed as at load (the CPU build repacks its weights here) and copied into
    its original storage. Layers that get nothing keep their tensors; vLLM's warning for each of those is dropped
    (a merge sends only the layers it changes)."""
    import logging

    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def not_loaded(record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()

    quiet.addFilter(not_loaded)
    try:
        initialize_layerwise_reload(model)
        model.load_weights(weights)
        finalize_layerwise_reload(model, model_config)
    finally:
        quiet.removeFilter(not_loaded)
