"""Methods visionrl adds to vLLM's workers (vLLM's `worker_extension_cls`), called by name through
`LLM.collective_rpc`: a named method crosses vLLM's process boundary without pickling code."""

from __future__ import annotations


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
