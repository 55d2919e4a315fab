"""The `zoom` environment's tool: `crop` returns a region of the question's picture at full resolution.

Coordinates follow Qwen3-VL's grounding convention: integers from 0 to 1000, relative to the picture's width and
height (x1, y1 the top-left corner, x2, y2 the bottom-right one). The crop is returned at the picture's own pixels
(the pixel budget then applies to it as to any image), so a detail too small to read in the whole picture at the
budget becomes readable in a crop."""

from __future__ import annotations

from typing import Any

from PIL import Image

SCALE = 1000  # coordinates are 0..SCALE of the width and height
MIN_SIDE = 4  # pixels: a crop smaller than this is refused (nothing to see)


def crop(x1: int, y1: int, x2: int, y2: int, episode: dict[str, Any]) -> Image.Image:
    """Crop the picture to the box (x1, y1)-(x2, y2), coordinates 0-1000 of its width and height."""
    images = episode["images"]
    if not images:
        raise ValueError("there is no picture to crop")
    picture = images[0]
    coords = [float(v) for v in (x1, y1, x2, y2)]
    if not all(0 <= v <= SCALE for v in coords):
        raise ValueError(f"coordinates run from 0 to {SCALE}")
    a, b, c, d = coords
    if c <= a or d <= b:
        raise ValueError("x2 must exceed x1 and y2 must exceed y1")
    w, h = picture.size
    box = (round(a * w / SCALE), round(b * h / SCALE), round(c * w / SCALE), round(d * h / SCALE))
    if box[2] - box[0] < MIN_SIDE or box[3] - box[1] < MIN_SIDE:
        raise ValueError(f"the box is smaller than {MIN_SIDE} pixels")
    return picture.crop(box)
