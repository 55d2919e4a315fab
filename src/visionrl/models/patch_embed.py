"""The vision tower's patch embedding as one matmul.

Qwen3-VL and Qwen2.5-VL embed each patch with a `Conv3d` whose kernel equals its stride ([2, 16, 16] on
Qwen3-VL) applied to inputs that are exactly one patch each: the convolution then computes one dot product per
output channel, i.e. `x.reshape(N, C*T*P*P) @ W.reshape(E, C*T*P*P).T + b`. On the H200 that matmul took 0.25 ms
for 64 images at 448x448 against 8.65 ms for the Conv3d (docs/ENGINE_NOTES.md, "Baselines on the H200"). Same weights
(a view, no copy), same result up to floating-point summation order.
"""

from __future__ import annotations

import types

import torch


def _one_patch_conv(proj: object) -> bool:
    return (
        isinstance(proj, torch.nn.Conv3d)
        and tuple(proj.kernel_size) == tuple(proj.stride)
        and tuple(proj.padding) == (0, 0, 0)
        and tuple(proj.dilation) == (1, 1, 1)
        and proj.groups == 1
    )


def _matmul_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    proj: torch.nn.Conv3d = self.proj  # type: ignore[assignment]
    weight = proj.weight  # [E, C, T, P, P]; each row of hidden_states flattens one patch as C, T, P, P
    x = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return torch.nn.functional.linear(x, weight.reshape(weight.shape[0], -1), proj.bias)


def patch_embed_as_matmul(model: torch.nn.Module) -> int:
    """Run every Conv3d patch embedding of `model` (modules named `*PatchEmbed` whose `proj` is a Conv3d with
    kernel = stride, no padding) as a matmul; returns how many were switched."""
    switched = 0
    for module in model.modules():
        if type(module).__name__.endswith("PatchEmbed") and _one_patch_conv(getattr(module, "proj", None)):
            module.forward = types.MethodType(_matmul_forward, module)
            switched += 1
    return switched
