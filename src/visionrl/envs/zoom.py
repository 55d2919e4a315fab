"""The `zoom` environment's tool: `crop` returns a region of the question's picture at full resolution.

Coordinates follow Qwen3-VL's grounding convention: integers from 0 to 1000, relative to the picture's width and
height (x1, y1 the top-left corner, x2, y2 the bottom-right one). The crop is returned at the picture's own pixels
(the pixel budget then applies to it as to any image), so a detail too small to read in the whole picture at the
budget becomes readable in a crop."""

from __future__ import annotations

from typing import Any

from PIL import Image

from visionrl.data.zoom import crop_region
from visionrl.envs.tools import ToolEnv


def crop(x1: int, y1: int, x2: int, y2: int, episode: dict[str, Any]) -> Image.Image:
    """Crop the picture to the box (x1, y1)-(x2, y2), coordinates 0-1000 of its width and height."""
    images = episode["images"]
    if not images:
        raise ValueError("there is no picture to crop")
    return crop_region(images[0], x1, y1, x2, y2)


class ZoomEnv(ToolEnv):
    """The `zoom` environment: the record's question and picture, and the `crop` tool. `tool: whole` makes the
    tool answer every crop with the whole picture (the control of the zoom demo: the tool is called as usual but
    shows nothing new)."""

    def __init__(self, tool: str = "crop") -> None:
        if tool not in ("crop", "whole"):
            raise ValueError(f"zoom env: tool must be crop or whole, not {tool!r}")
        super().__init__({"crop": crop if tool == "crop" else _whole})


def _whole(x1: int, y1: int, x2: int, y2: int, episode: dict[str, Any]) -> Image.Image:
    """Crop the picture to the box (x1, y1)-(x2, y2), coordinates 0-1000 (control: returns the whole picture)."""
    crop(x1, y1, x2, y2, episode)  # the same errors for a bad box
    return episode["images"][0]
