"""Tests of visionrl.algo.overlong_penalty (DAPO's soft overlong punishment), numbers by hand."""

from __future__ import annotations

import pytest
import torch

from visionrl.algo import overlong_penalty

F64 = torch.float64


def test_overlong_penalty_boundaries() -> None:
    # max_length 10, buffer 4 -> the ramp starts after 6 tokens: 0 up to 6, then -(L - 6) / 4:
    # L = 7 -> -0.25, 8 -> -0.5, 10 -> -1 (= -factor at max_length), beyond -> -1.
    lengths = torch.tensor([0, 5, 6, 7, 8, 10, 12])
    out = overlong_penalty(lengths, 10, 4)
    assert out.dtype == torch.get_default_dtype()
    assert out.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0], abs=1e-12)
    # factor scales the ramp: factor 0.5 at L = 8 -> -0.25, at 10 -> -0.5.
    assert overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == pytest.approx(
        [0.0, 0.0, 0.0, -0.125, -0.25, -0.5, -0.5], abs=1e-12
    )
    # buffer == max_length: the ramp covers every length, L = 5 of 10 -> -0.5; float64 lengths stay float64.
    full = overlong_penalty(torch.tensor([0.0, 5.0, 10.0], dtype=F64), 10, 10)
    assert full.dtype == F64 and full.tolist() == pytest.approx([0.0, -0.5, -1.0], abs=1e-12)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((10, 0), "buffer must be > 0"),
        ((10, 11), "buffer must be <= max_length=10, got buffer=11"),
        ((10, 4, -1.0), "factor must be >= 0"),
    ],
)
def test_overlong_penalty_bad_inputs(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        overlong_penalty(torch.tensor([1, 2]), *args)
