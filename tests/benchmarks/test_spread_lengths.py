"""The spread rows' lengths (benchmarks/lengths.py): the draw stays in [T/8, T] and the histogram counts by hand."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from lengths import draw_length, histogram, histogram_line, read_lengths


def test_draws_cover_t_over_8_to_t_and_nothing_else() -> None:
    rng = random.Random(0)
    drawn = {draw_length(rng, 16) for _ in range(2000)}
    assert drawn == set(range(2, 17))  # 16 // 8 = 2 .. 16, each reached
    assert {draw_length(rng, 3) for _ in range(200)} == {1, 2, 3}  # T < 8: from 1


def test_histogram_by_hand(tmp_path: Path) -> None:
    # T = 512, 8 bins of 64: 1 and 64 in the first, 65 in the second, 512 in the last
    bins = histogram([1, 64, 65, 512], 512)
    assert [b["count"] for b in bins] == [2, 1, 0, 0, 0, 0, 0, 1]
    assert (bins[0]["from"], bins[0]["to"], bins[-1]["from"], bins[-1]["to"]) == (1, 64, 449, 512)
    assert histogram_line(bins[:2]) == "1-64: 2  65-128: 1"
    log = tmp_path / "lengths.txt"
    assert read_lengths(log) == []  # no log yet: no lengths
    log.write_text("5\n7\n\n9\n")
    assert read_lengths(log) == [5, 7, 9]
