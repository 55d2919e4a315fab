"""The image budget: the processor's resize rule under data.min_pixels / data.max_pixels, token counts, and
the resize the endpoint client applies before sending."""

from __future__ import annotations

import pytest
from PIL import Image

from visionrl.data.images import DEFAULT_MAX_PIXELS, ImageBudget, budget_size, fit_image, image_tokens

QWEN3_GRID = 32  # patch 16 x merge 2: one image token per 32 x 32 pixels


def test_a_photo_is_shrunk_into_the_budget_keeping_its_aspect_ratio() -> None:
    # 4000 x 3000 at factor 32: rounded to 4000 x 3008 = 12,032,000 px > 1,048,576, so
    # beta = sqrt(4000 * 3000 / 1,048,576) = 3.3830; width floor(4000 / 3.383 / 32) = floor(36.95) = 36 cells
    # (1152 px), height floor(3000 / 3.383 / 32) = floor(27.71) = 27 cells (864 px): 36 * 27 = 972 tokens.
    budget = ImageBudget()
    assert budget_size(4000, 3000, budget, QWEN3_GRID) == (1152, 864)
    assert image_tokens(4000, 3000, budget, QWEN3_GRID) == 972
    assert 1152 * 864 <= DEFAULT_MAX_PIXELS
    # Portrait: the same rule with the sides swapped.
    assert budget_size(3000, 4000, budget, QWEN3_GRID) == (864, 1152)


def test_qwen3_vl_own_bound_lets_a_phone_photo_overflow_a_4096_context() -> None:
    # The case, at Qwen3-VL's processor default of 16,777,216 px: 4032 x 3024 rounds to
    # 126 x 94 cells (3024 / 32 = 94.5 rounds to even 94) = 11,844 tokens, under the bound: kept as is.
    assert image_tokens(4032, 3024, ImageBudget(max_pixels=16_777_216), QWEN3_GRID) == 11_844
    # Under the default budget: beta = sqrt(4032 * 3024 / 1,048,576) = 3.410; width floor(4032 / 3.410 / 32) =
    # floor(36.95) = 36 cells, height floor(3024 / 3.410 / 32) = floor(27.71) = 27 cells: 972 tokens.
    assert budget_size(4032, 3024, ImageBudget(), QWEN3_GRID) == (1152, 864)
    assert image_tokens(4032, 3024, ImageBudget(), QWEN3_GRID) == 972


@pytest.mark.parametrize(
    ("size", "expected", "tokens"),
    [
        ((64, 64), (64, 64), 4),  # the demo's images: on the grid and inside the bounds, unchanged (4 tokens)
        ((448, 448), (448, 448), 196),  # the 8B job's count task: 14 x 14 cells
        # 10 x 10 rounds to 0 x 0 < 1024 px: enlarged by sqrt(1024 / 100) = 3.2 to ceil(32 / 32) = 1 cell a side.
        ((10, 10), (32, 32), 1),
        ((100, 50), (96, 64), 6),  # round(100 / 32) = 3 cells, round(50 / 32) = 2 cells: 96 x 64 = 6144 px
    ],
)
def test_small_and_grid_sized_images(size: tuple[int, int], expected: tuple[int, int], tokens: int) -> None:
    assert budget_size(*size, ImageBudget(), QWEN3_GRID) == expected
    assert image_tokens(*size, ImageBudget(), QWEN3_GRID) == tokens


def test_min_pixels_enlarges_small_images() -> None:
    # 64 x 64 = 4096 px < 65,536: beta = sqrt(65536 / 4096) = 4, so 256 x 256 = 8 x 8 cells = 64 tokens.
    assert budget_size(64, 64, ImageBudget(min_pixels=65_536), QWEN3_GRID) == (256, 256)
    assert image_tokens(64, 64, ImageBudget(min_pixels=65_536), QWEN3_GRID) == 64


def test_fit_image_resizes_once_and_then_keeps_the_image() -> None:
    photo = Image.new("RGB", (4000, 3000), (200, 30, 30))
    fitted = fit_image(photo, ImageBudget(), QWEN3_GRID)
    assert fitted.size == (1152, 864) and fitted.getpixel((500, 400)) == (200, 30, 30)
    # Already at its budget size: the same object (a processor, like this rule, leaves it as it is).
    assert fit_image(fitted, ImageBudget(), QWEN3_GRID) is fitted


def test_budget_round_trips_and_feeds_vllm() -> None:
    budget = ImageBudget(min_pixels=4096, max_pixels=200_704, max_images=2)
    assert ImageBudget.from_dict(budget.as_dict()) == budget
    assert budget.as_dict() == {"min_pixels": 4096, "max_pixels": 200_704, "max_images_per_prompt": 2}
    assert budget.vllm_processor_kwargs() == {"size": {"shortest_edge": 4096, "longest_edge": 200_704}}
    assert budget.vllm_mm_limit() == {"image": 2, "video": 0}


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"min_pixels": 2048, "max_pixels": 1024}, "1 <= min_pixels <= max_pixels"),
        ({"min_pixels": 0}, "1 <= min_pixels <= max_pixels"),
        ({"max_images": 0}, "max_images must be >= 1"),
    ],
)
def test_inconsistent_budgets_are_refused(kwargs: dict[str, int], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ImageBudget(**kwargs)


def test_extreme_aspect_ratios_are_refused_like_the_processor_does() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        image_tokens(10_000, 40, ImageBudget(), QWEN3_GRID)
