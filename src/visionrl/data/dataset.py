"""Validating the user's prompt records (JSONL or Parquet, in any layout of `visionrl.data.layouts`).

A record is one prompt: its images (files, bytes or data URIs), the chat `messages` that refer to them by
`{"type": "image"}` placeholders (or a plain prompt string, optionally with `<image>` markers), and the
reference answer the rewards compare against. Every record is validated when the file is loaded, so a bad
line fails in seconds with its file, line and field instead of hours into a run. Every image is fully
decoded at load (a header check passes truncated files) and decoded again when a sample is accessed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from visionrl.data.layouts import (
    FORMATS,
    IMAGE_ERRORS,
    DataFileNotFound,
    DatasetError,
    ImageRef,
    Layout,
    image_refs,
    iter_rows,
    prompt_content,
    slim_record,
)
from visionrl.data.layouts import type_name as _type_name

logger = logging.getLogger(__name__)

BadImagePolicy = Literal["error", "skip"]
__all__ = [
    "FORMATS",
    "IMAGE_ERRORS",
    "DataFileNotFound",
    "DatasetError",
    "Layout",
    "Sample",
    "VisionDataset",
    "load_dataset",
]


@dataclass(frozen=True)
class Sample:
    """One prompt, ready for encoding.

    `images` are RGB PIL images decoded when the sample was accessed. `messages` are normalised: every
    `content` is a list of parts, each `{"type": "image"}` or `{"type": "text", "text": str}`, with exactly
    one image part per entry of `images`, in order. `record` is the record as read (unknown fields kept;
    image bytes replaced by labels). `image_paths`: each image's resolved path, or its label if it came
    as bytes.
    """

    id: str
    images: list[Image.Image]
    messages: list[dict[str, Any]]
    answer: Any
    metadata: dict[str, Any]
    record: dict[str, Any]
    line: int
    image_paths: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Entry:
    """A validated record whose images have not been decoded yet."""

    id: str
    line: int
    where: str  # "<file> line N" (JSONL) or "<file> row N" (Parquet), for error messages
    images: list[ImageRef]
    messages: list[dict[str, Any]]
    answer: Any
    metadata: dict[str, Any]
    record: dict[str, Any]
    # (width, height) of each image, read from its header at load time (the image budget needs them).
    image_sizes: list[tuple[int, int]] = field(default_factory=list)


class VisionDataset:
    """Validated records of one data file; images are decoded on access (`dataset[i].images`).

    Indices count the usable records. Records skipped for a bad image at load stay known as rows (every
    valid record of the file, in order), so that the prompt sampler's data position means the same records
    when an image goes bad between a run and its resume.
    """

    def __init__(
        self, path: str, rows: list[_Entry], usable: list[int], skipped: list[tuple[int, str]]
    ) -> None:
        self.path = path
        self._rows = rows
        self._usable = usable  # row of each usable record
        # (line or row, reason) of each record dropped for a bad image under on_bad_image="skip".
        self.skipped = skipped

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The records that were kept, in file order."""
        return [self._rows[r].record for r in self._usable]

    @property
    def ids(self) -> list[str]:
        """Record ids (given, or "<file stem>-<line>"), in file order."""
        return [self._rows[r].id for r in self._usable]

    @property
    def row_records(self) -> list[dict[str, Any]]:
        """The records of every row (usable or skipped), in file order."""
        return [e.record for e in self._rows]

    @property
    def row_ids(self) -> list[str]:
        """The ids of every row (usable or skipped), in file order."""
        return [e.id for e in self._rows]

    @property
    def usable_rows(self) -> list[int]:
        """The row of each usable record: `dataset[i]` is row `usable_rows[i]`."""
        return list(self._usable)

    def messages(self, index: int) -> list[dict[str, Any]]:
        """The normalised chat messages of record `index` (as `Sample.messages`), without opening its images."""
        return self._rows[self._usable[index]].messages

    def image_sizes(self, index: int) -> list[tuple[int, int]]:
        """(width, height) of each image of record `index`, as stored (read at load; (0, 0): unknown)."""
        return list(self._rows[self._usable[index]].image_sizes)

    def without(self, indices: set[int], reasons: dict[int, str]) -> VisionDataset:
        """A dataset without the records at `indices`; each is added to `skipped` with `reasons[index]` (its row
        stays known, like any skipped one)."""
        drop = {self._usable[i] for i in indices}
        usable = [r for r in self._usable if r not in drop]
        dropped = [(self._rows[self._usable[i]].line, reasons[i]) for i in sorted(indices)]
        return VisionDataset(self.path, self._rows, usable, self.skipped + dropped)

    def __len__(self) -> int:
        return len(self._usable)

    def __getitem__(self, index: int) -> Sample:
        """The sample with its images decoded; DatasetError if one no longer decodes."""
        e = self._rows[self._usable[index]]
        images = [_decode(ref, e.where) for ref in e.images]
        labels = [ref.path or ref.label for ref in e.images]
        return Sample(e.id, images, e.messages, e.answer, e.metadata, e.record, e.line, labels)

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"VisionDataset({self.path!r}, {len(self)} records, {self.num_skipped} skipped)"


def _decode(ref: ImageRef, where: str) -> Image.Image:
    try:
        return ref.decode()
    except IMAGE_ERRORS as e:
        raise DatasetError(
            f"{where}: cannot open image {ref.path or ref.label!r} ({type(e).__name__}: {e}); "
            "fix or replace the file"
        ) from e


# --- Validating one record ---


def _normalise_content(content: Any, where: str, name: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise DatasetError(
            f"{where}: field '{name}' must be a string or a list of parts, got {_type_name(content)}"
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        pname = f"{name}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            parts.append({"type": "image"})  # the image itself comes from the image field, in order
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "text":
            raise DatasetError(f"{where}: field '{pname}' is a text part without a string 'text'")
        else:
            raise DatasetError(
                f'{where}: field \'{pname}\' must be {{"type": "image"}} or '
                f'{{"type": "text", "text": ...}}, got {part!r}'
            )
    return parts


def _check_messages(
    record: dict[str, Any], where: str, num_images: int, layout: Layout
) -> list[dict[str, Any]]:
    """Normalised messages from `messages` or the prompt string; placeholders match the images one to one."""
    key = layout.prompt_key
    has_messages, has_prompt = "messages" in record, key in record
    if has_messages and has_prompt:
        raise DatasetError(f"{where}: has both 'messages' and {key!r}; give only one of them")
    if has_prompt:
        prompt = record[key]
        if not isinstance(prompt, str):
            raise DatasetError(f"{where}: field {key!r} must be a string, got {_type_name(prompt)}")
        return [{"role": "user", "content": prompt_content(prompt, num_images, where, key)}]
    if not has_messages:
        raise DatasetError(
            f"{where}: field 'messages' is missing; every record needs chat 'messages' or a {key!r} string "
            "(set data.prompt_key to the column that holds the question)"
        )
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(
            f'{where}: field \'messages\' must be a non-empty list of {{"role", "content"}} objects, '
            f"got {messages!r}"
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DatasetError(f"{where}: field 'messages[{i}]' must be an object with a string 'role'")
        if "content" not in message:
            raise DatasetError(f"{where}: field 'messages[{i}].content' is missing")
        content = _normalise_content(message["content"], where, f"messages[{i}].content")
        out.append({"role": message["role"], "content": content})
    placeholders = sum(p["type"] == "image" for m in out for p in m["content"])
    if placeholders != num_images:
        raise DatasetError(
            f'{where}: field \'messages\' has {placeholders} image placeholder(s) ({{"type": "image"}}) but '
            f"{layout.image_key!r} lists {num_images} image(s); they must match one to one, in order"
        )
    return out


def _check_record(
    record: dict[str, Any], where: str, line: int, default_id: str, base_dir: str, layout: Layout
) -> _Entry:
    images = image_refs(record, layout, where, base_dir)
    messages = _check_messages(record, where, len(images), layout)
    if record.get(layout.answer_key) is None:
        raise DatasetError(
            f"{where}: field {layout.answer_key!r} is missing; every record needs the reference answer "
            "(set data.answer_key to the column that holds it)"
        )
    record_id = record.get("id", default_id)
    if isinstance(record_id, int) and not isinstance(record_id, bool):
        record_id = str(record_id)
    if not isinstance(record_id, str) or not record_id:
        raise DatasetError(f"{where}: field 'id' must be a non-empty string, got {record_id!r}")
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DatasetError(f"{where}: field 'metadata' must be an object, got {_type_name(metadata)}")
    kept = slim_record(record, layout, images)
    return _Entry(record_id, line, where, images, messages, record[layout.answer_key], metadata, kept)


# --- Public entry point ---


def load_dataset(
    path: str | Path,
    *,
    on_bad_image: BadImagePolicy = "error",
    max_samples: int | None = None,
    verify_images: bool = True,
    layout: Layout | None = None,
) -> VisionDataset:
    """Load and validate a JSONL (`.jsonl`, `.ndjson`) or Parquet (`.parquet`, `.pq`) prompt file.

    on_bad_image: a missing, empty or undecodable image raises DatasetError ("error") or drops the record,
        which is counted in `dataset.skipped` and reported in one warning ("skip").
    max_samples: keep at most this many records (the first usable ones); reading stops there.
    verify_images: decode every image fully at load (truncated files fail here, not mid-run) rather than
        only check that files exist.
    layout: which fields hold the prompt, the answer and the images (default: our own field names).
    Raises DatasetError for malformed records or files, FileNotFoundError if `path` does not exist.
    """
    path_str, layout = str(path), layout or Layout()
    suffix = Path(path_str).suffix.lower()
    if suffix not in FORMATS:
        raise DatasetError(
            f"{path_str}: unsupported file type {suffix or '(none)'!r}; use one of {', '.join(FORMATS)}"
        )
    if on_bad_image not in ("error", "skip"):
        raise ValueError(f"on_bad_image must be 'error' or 'skip', got {on_bad_image!r}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    if not os.path.isfile(path_str):
        raise DataFileNotFound(
            f"data file not found: {path_str}; check the path (data.train / data.eval in a job file, "
            "relative to the directory you run from), or create data with `visionrl make-data`"
        )
    unit = "line" if FORMATS[suffix] == "jsonl" else "row"
    base_dir = os.path.dirname(os.path.abspath(path_str))
    stem = Path(path_str).stem
    rows: list[_Entry] = []
    usable: list[int] = []
    skipped: list[tuple[int, str]] = []
    first_line_of_id: dict[str, int] = {}
    for where, lineno, record in iter_rows(path_str):
        entry = _check_record(record, where, lineno, f"{stem}-{lineno}", base_dir, layout)
        if entry.id in first_line_of_id:
            raise DatasetError(
                f"{where}: field 'id' {entry.id!r} is already used on {unit} {first_line_of_id[entry.id]}; "
                "ids must be unique"
            )
        first_line_of_id[entry.id] = lineno
        reason = _first_bad_image(entry, verify_images)
        rows.append(entry)
        if reason is None:
            usable.append(len(rows) - 1)
            if len(usable) == max_samples:
                break  # before the next line is even parsed
        elif on_bad_image == "skip":
            skipped.append((lineno, reason))
        else:
            raise DatasetError(
                f"{where}: {reason}; fix the file or its path, or set data.on_bad_image: skip "
                "to skip records with bad images"
            )
    if skipped:
        logger.warning(
            "%s: skipped %d record(s) with a missing or unreadable image (first: %s %d, %s)",
            path_str,
            len(skipped),
            unit,
            *skipped[0],
        )
    if not usable:
        raise DatasetError(f"{path_str}: no usable records ({len(skipped)} skipped for bad images)")
    return VisionDataset(path_str, rows, usable, skipped)


# The Qwen2-VL / Qwen3-VL image processors refuse images whose longer side is over 200 times the shorter
# ("absolute aspect ratio must be smaller than 200", their resize rule).
MAX_ASPECT_RATIO = 200


def _first_bad_image(entry: _Entry, decode: bool) -> str | None:
    """Why the first bad image of `entry` is unusable, or None; fills `entry.image_sizes` on the way."""
    for ref in entry.images:
        if decode:
            reason = ref.problem()
        else:
            reason = None if ref.path is None or os.path.isfile(ref.path) else "file not found"
        size = ref.size() if reason is None else (0, 0)
        if max(size) > MAX_ASPECT_RATIO * max(min(size), 1):
            reason = (
                f"{size[0]}x{size[1]} pixels, an aspect ratio over {MAX_ASPECT_RATIO} that the Qwen-VL processor "
                "refuses (training would stop at its first batch); crop or pad it"
            )
        if reason is not None:
            where = f"image {ref.label!r}" + (f" ({ref.path})" if ref.path else "")
            return f"{where}: {reason}"
        entry.image_sizes.append(size)
    return None
