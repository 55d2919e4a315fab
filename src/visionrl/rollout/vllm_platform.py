"""What vLLM needs on this platform, in one place for the engine, the server and the tests: whether we run
without a GPU, and the environment of its CPU build. (The LoRA ranks vLLM sizes slots for are an adapter fact:
`visionrl.adapter.servable`.)

The CPU build reserves about 20 GiB of KV cache unless told otherwise, binds OpenMP threads to cores that a
shared machine may not give it, and looks up a routable host address; an in-process engine starts in
seconds where a multiprocess one takes 30-60 s (docs/ENGINE_NOTES.md, "vLLM CPU build").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping


def cpu_only() -> bool:
    """No CUDA device: engines and servers run vLLM's CPU build, in float32 (bf16 is 4-20x slower there)."""
    import torch

    return not torch.cuda.is_available()


def cpu_env(kv_cache_gib: float = 1.0) -> dict[str, str]:
    """The variables vLLM's CPU build needs: a KV cache of `kv_cache_gib` GiB (at least 1), no thread
    binding, the loopback address."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(round(kv_cache_gib)))),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_HOST_IP": "127.0.0.1",
    }


IN_PROCESS_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: starts in seconds
    "HF_HUB_OFFLINE": "1",  # local checkpoints only; startup would otherwise wait on an unreachable hub
}


def fill_env(env: MutableMapping[str, str], values: Mapping[str, str]) -> None:
    """Set each of `values` in `env` unless the user has set it already."""
    for key, value in values.items():
        env.setdefault(key, value)


def set_cpu_env(kv_cache_gib: float) -> None:
    """Prepare this process for an in-process vLLM CPU engine; only fills values the user has not set."""
    fill_env(os.environ, {**cpu_env(kv_cache_gib), **IN_PROCESS_ENV})
