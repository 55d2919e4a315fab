"""An adapter merged into the base weights it adapts, for an engine that serves it with no LoRA kernels.

With LoRA on every projection, vLLM's shrink and expand kernels cost the 8B job's engine 22% of its generation
(benchmarks/NOTES-gpu-learner.md: 15.1k against 18.5k generated tokens/s on an H100). An engine built without
LoRA serves the same policy when each adapted weight is replaced by W0 + scale * B @ A. This module computes
those weights from the adapter's files and the checkpoint's: the base tensors W0 are read once from the
checkpoint and kept in host memory, so every merge starts from W0 (never from the last merge, whose rounding
would add up over a run).

vLLM fuses some of a layer's projections into one weight (q, k and v into `qkv_proj`; gate and up into
`gate_up_proj`: its model's `packed_modules_mapping`), and replaces a layer's weights in place only when all of
them arrive (docs/ENGINE_NOTES.md, "Weights in place"): a merge therefore sends every checkpoint tensor of each
fused layer it touches, weights and biases, adapted or not.

The adapter's files are peft's: `adapter_config.json` (r, lora_alpha, use_rslora) and `adapter_model.safetensors`
with `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] per adapted module.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from visionrl.types import ADAPTER_CONFIG, ADAPTER_WEIGHTS

__all__ = ["Delta", "MergeError", "MergedWeights", "checkpoint_keys", "fused_modules", "read_adapter"]

_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


class MergeError(ValueError):
    """An adapter that cannot be served merged into the base weights: what, why, and the setting that serves it."""


@dataclass(frozen=True)
class Delta:
    """One adapted module's update, scale * b @ a."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    def full(self, device: torch.device | str) -> torch.Tensor:
        """scale * b @ a, [out, in], in float32 on `device`."""
        b, a = (t.to(device=device, dtype=torch.float32) for t in (self.b, self.a))
        return self.scale * (b @ a)


def read_adapter(folder: str | Path) -> dict[str, Delta]:
    """The adapted modules of the peft adapter in `folder`, by their path in the base model."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    unsupported = [k for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
    unsupported += [k for k in ("use_dora", "lora_bias") if config.get(k)]
    if unsupported:
        raise MergeError(
            f"the adapter in {folder} sets {unsupported}, which a merge into the base weights does not "
            "reproduce; serve it as an adapter (rollout.lora_serving: adapter)"
        )
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts: dict[str, dict[str, torch.Tensor]] = {}
    other = []
    for key, tensor in load_file(str(folder / ADAPTER_WEIGHTS)).items():
        m = _LORA_KEY.match(key)
        if m is None:
            other.append(key)
            continue
        parts.setdefault(m["module"], {})[m["part"]] = tensor
    if other:
        raise MergeError(
            f"the adapter in {folder} holds tensors other than LoRA's A and B ({other[:3]}...): modules saved "
            "whole or LoRA embeddings are not merged; serve it as an adapter (rollout.lora_serving: adapter)"
        )
    incomplete = sorted(m for m, p in parts.items() if set(p) != {"A", "B"})
    if incomplete:
        raise MergeError(f"the adapter in {folder} lacks lora_A or lora_B for {incomplete[:3]}")
    return {m: Delta(p["A"], p["B"], scale) for m, p in parts.items()}


def fused_modules(modules: Iterable[str], packed: Mapping[str, list[str]]) -> list[list[str]]:
    """`modules` with the projections vLLM fuses with each (`packed`: fused name -> its parts, the model's
    `packed_modules_mapping`), one list per fused layer, in a stable order."""
    groups: dict[str, list[str]] = {}
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        fused = next((name for name, parts in packed.items() if leaf in parts), None)
        if fused is None:
            groups.setdefault(module, [module])
        else:
            prefix = f"{parent}." if parent else ""
            groups.setdefault(prefix + fused, [prefix + p for p in packed[fused]])
    return [groups[k] for k in sorted(groups)]


def checkpoint_keys(model_path: str | Path) -> dict[str, str]:
    """Every tensor of the checkpoint in `model_path`: name -> the safetensors file that holds it."""
    from safetensors import safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: str(folder / file) for name, file in weight_map.items()}
    keys: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys.update(dict.fromkeys(f.keys(), str(file)))
    return keys


class MergedWeights:
    """The checkpoint's tensors of every layer a merge touches, kept in host memory (pinned where a GPU reads
    them), and the weights each adapter version gives those layers."""

    def __init__(self, model_path: str | Path, packed: Mapping[str, list[str]]) -> None:
        self.model_path = str(model_path)
        self.packed = dict(packed)
        self._keys = checkpoint_keys(model_path)
        self._base: dict[str, torch.Tensor] = {}
        self._touched: set[str] = set()  # modules whose weights a merge has changed since the engine loaded

    def tensors_for(
        self, adapter: Mapping[str, Delta], device: torch.device | str, dtype: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) for every tensor of each fused layer that `adapter` adapts or an earlier merge
        changed: W0 + delta where adapted, W0 elsewhere, in `dtype` on `device`; layer by layer. The adapter is
        checked here, before the first tensor is asked for (MergeError): a refusal comes before any weight moves."""
        self.check(adapter)
        groups = fused_modules(self._touched | set(adapter), self.packed)
        self._touched |= set(adapter)
        return self._tensors(groups, adapter, device, dtype)

    def _tensors(
        self,
        groups: list[list[str]],
        adapter: Mapping[str, Delta],
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for group in groups:
            for module in group:
                for suffix in ("weight", "bias"):
                    name = f"{module}.{suffix}"
                    if name not in self._keys:
                        continue
                    base = self._base_tensor(name)
                    if suffix == "weight" and module in adapter:
                        # into the delta's fresh tensor: `base.to` may return the kept W0 itself
                        merged = adapter[module].full(device)
                        merged += base.to(device=device, dtype=torch.float32, non_blocking=True)
                        yield name, merged.to(dtype)
                    else:
                        yield name, base.to(device=device, dtype=dtype, non_blocking=True)

    def check(self, adapter: Mapping[str, Delta]) -> None:
        """Raise MergeError unless every module `adapter` adapts has a checkpoint weight of its update's shape."""
        missing = sorted(m for m in adapter if f"{m}.weight" not in self._keys)
        if missing:
            raise MergeError(
                f"the adapter adapts {missing[:3]}, whose weights the checkpoint in {self.model_path} does not "
                "hold under those names (tied or renamed weights); serve it as an adapter "
                "(rollout.lora_serving: adapter)"
            )
        for module, delta in adapter.items():
            shape = [delta.b.shape[0], delta.a.shape[1]]
            base = self._base_shape(f"{module}.weight")
            if shape != base:
                raise MergeError(
                    f"the adapter's update of {module} is {shape}, the checkpoint's weight {base}: the adapter "
                    "was trained on another model"
                )

    def _base_shape(self, name: str) -> list[int]:
        from safetensors import safe_open

        if name in self._base:
            return list(self._base[name].shape)
        with safe_open(self._keys[name], framework="pt") as f:
            return list(f.get_slice(name).get_shape())

    def _base_tensor(self, name: str) -> torch.Tensor:
        if name not in self._base:
            from safetensors import safe_open

            with safe_open(self._keys[name], framework="pt") as f:
                tensor = f.get_tensor(name)
            if torch.cuda.is_available():
                tensor = tensor.pin_memory()
            self._base[name] = tensor
        return self._base[name]
