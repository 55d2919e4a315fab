"""Methods visionrl adds to vLLM's workers (vLLM's `worker_extension_cls`), called by name through
`LLM.collective_rpc`: a named method crosses vLLM's process boundary without pickling code."""

from __future__ import annotations


class VisionRLWorkerExtension:
    """Mixed into each vLLM worker class by vLLM itself (so no `__init__`, no state of its own)."""

    def visionrl_reseed(self, seed: int) -> None:
        """Reseed the generator the worker's sampler draws from (requests carry no seeds of their own)."""
        import torch

        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)
