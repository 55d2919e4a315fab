"""The vision tower's Conv3d patch embedding runs as one matmul (`visionrl.models.patch_embed`) in every model
visionrl loads: Qwen3-VL (with bias) and Qwen2.5-VL (without), same output as the convolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from visionrl.models.loader import load_base_model
from visionrl.models.patch_embed import patch_embed_as_matmul


@pytest.mark.parametrize("which", ["tiny_model", "tiny_qwen25_model"])
def test_loaded_models_embed_patches_by_matmul_with_the_convolutions_result(
    which: str, request: pytest.FixtureRequest
) -> None:
    model = load_base_model(str(request.getfixturevalue(which)), "float32", "cpu", "sdpa")
    embeds = [m for m in model.modules() if type(m).__name__.endswith("PatchEmbed")]
    assert len(embeds) == 1 and "forward" in vars(embeds[0])  # switched on the instance
    embed = embeds[0]
    proj = embed.proj
    with torch.no_grad():  # the tiny models' biases are zero: give the bias (where there is one) a value
        if proj.bias is not None:
            proj.bias.normal_()
        patch = proj.weight[0].numel()  # C * T * P * P values per patch row, as the processor flattens them
        x = torch.randn(37, patch, generator=torch.Generator().manual_seed(0))
        as_conv = type(embed).forward(embed, x)  # the class's own Conv3d forward
        as_matmul = embed(x)
    assert as_matmul.shape == as_conv.shape == (37, proj.out_channels)
    torch.testing.assert_close(as_matmul, as_conv, rtol=1e-5, atol=1e-5)


def test_only_convolutions_that_are_one_patch_dot_products_are_switched() -> None:
    class OverlapPatchEmbed(torch.nn.Module):  # stride below the kernel: a real convolution, left alone
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 2, 2))

    class PlainPatchEmbed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4))

    model = torch.nn.Sequential(OverlapPatchEmbed(), PlainPatchEmbed(), torch.nn.Conv3d(3, 8, 2, 2))
    assert patch_embed_as_matmul(model) == 1
    assert "forward" not in vars(model[0]) and "forward" in vars(model[1])


def test_gradients_reach_the_input_through_the_matmul(tiny_model: Path) -> None:
    """The learner needs no gradient of the frozen embedding, but one of the input must flow (e.g. LoRA on the
    tower someday): the matmul path is differentiable like the convolution."""
    model = load_base_model(str(tiny_model), "float32", "cpu", "sdpa")
    embed = next(m for m in model.modules() if type(m).__name__.endswith("PatchEmbed"))
    x = torch.randn(5, embed.proj.weight[0].numel(), requires_grad=True)
    embed(x).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    type(embed).forward(embed, x2).sum().backward()
    assert x.grad is not None and x2.grad is not None
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
