"""Loading the user's prompt data (JSONL or Parquet records with image paths).

A record is one prompt: `images` (paths, relative to the data file or absolute), the chat `messages` that
refer to them by `{"type": "image"}` placeholders (or a plain `prompt` string), and the reference `answer`
the rewards compare against. Every record is validated when the file is loaded, so a bad line fails in
seconds with its file, line and field instead of hours into a run. Images are checked at load time
(existence, and optionally a cheap decode check) but only opened when a sample is accessed.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from visionrl.errors import InputError

logger = logging.getLogger(__name__)

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
BadImagePolicy = Literal["error", "skip"]
# What PIL raises for files it cannot identify or decode (UnidentifiedImageError is an OSError).
IMAGE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError)


class DatasetError(InputError):
    """A data file or record is malformed; the message names the file, line, field and the fix."""


class DataFileNotFound(DatasetError, FileNotFoundError):
    """The data file does not exist (both a user-input error and a FileNotFoundError)."""


@dataclass(frozen=True)
class Sample:
    """One prompt, ready for encoding.

    `images` are RGB PIL images opened when the sample was accessed. `messages` are normalised: every
    `content` is a list of parts, each `{"type": "image"}` or `{"type": "text", "text": str}`, with exactly
    one image part per entry of `images`, in order. `record` is the raw record as read (unknown fields kept).
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
    """A validated record whose images have not been opened yet."""

    id: str
    line: int
    where: str  # "<file> line N" (JSONL) or "<file> row N" (Parquet), for error messages
    image_paths: list[str]
    messages: list[dict[str, Any]]
    answer: Any
    metadata: dict[str, Any]
    record: dict[str, Any]
    # (width, height) of each image, read from its header at load time (the image budget needs them).
    image_sizes: list[tuple[int, int]] = field(default_factory=list)


class VisionDataset:
    """Validated records of one data file; images are opened on access (`dataset[i].images`)."""

    def __init__(self, path: str, entries: list[_Entry], skipped: list[tuple[int, str]]) -> None:
        self.path = path
        self._entries = entries
        # (line or row, reason) of each record dropped for a bad image under on_bad_image="skip".
        self.skipped = skipped

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The raw records that were kept, in file order."""
        return [e.record for e in self._entries]

    @property
    def ids(self) -> list[str]:
        """Record ids (given, or "<file stem>-<line>"), in file order."""
        return [e.id for e in self._entries]

    def messages(self, index: int) -> list[dict[str, Any]]:
        """The normalised chat messages of record `index` (as `Sample.messages`), without opening its images."""
        return self._entries[index].messages

    def image_sizes(self, index: int) -> list[tuple[int, int]]:
        """(width, height) of each image of record `index`, as stored (read at load, nothing decoded)."""
        return list(self._entries[index].image_sizes)

    def without(self, indices: set[int], reasons: dict[int, str]) -> VisionDataset:
        """A dataset without the records at `indices`; each is added to `skipped` with `reasons[index]`."""
        kept = [e for i, e in enumerate(self._entries) if i not in indices]
        dropped = [(e.line, reasons[i]) for i, e in enumerate(self._entries) if i in indices]
        return VisionDataset(self.path, kept, self.skipped + dropped)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> Sample:
        e = self._entries[index]
        images = [_open_image(p, e.where) for p in e.image_paths]
        return Sample(e.id, images, e.messages, e.answer, e.metadata, e.record, e.line, list(e.image_paths))

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"VisionDataset({self.path!r}, {len(self)} records, {self.num_skipped} skipped)"


def _open_image(path: str, where: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # convert() decodes now, so the file can be closed
    except IMAGE_ERRORS as e:
        raise DatasetError(
            f"{where}: cannot open image {path!r} ({type(e).__name__}: {e}); fix or replace the file"
        ) from e


def _check_image(path: str, verify: bool) -> tuple[str | None, tuple[int, int]]:
    """(why the image at `path` is unusable or None if it looks fine, its (width, height) from the header;
    (0, 0) when unknown: without `verify` an unreadable header is left for the access to report)."""
    if not os.path.isfile(path):
        return "file not found", (0, 0)
    try:
        with Image.open(path) as image:  # reads the header only
            size = image.size
            if verify:
                image.verify()  # header and checksums only: cheap, no full decode
    except IMAGE_ERRORS as e:
        return (f"not a readable image ({type(e).__name__}: {e})" if verify else None), (0, 0)
    return None, size


# --- Reading rows ---


def _iter_jsonl(path: str) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(location, line number, object) of each non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path} line {lineno}"
            try:
                text = raw.decode("utf-8-sig")  # tolerate the byte-order mark some editors write
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not valid UTF-8 ({e.reason}); save the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text.rstrip("\r\n"))  # so that the error column is on this line
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must hold one JSON object"
                ) from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object {{...}}, got {_type_name(obj)}")
            yield where, lineno, obj


def _iter_parquet(path: str) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(location, row number, row) of each row; columns that are null in a row are treated as absent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{path}: cannot read as Parquet ({e})") from e
    for rownum, row in enumerate(table.to_pylist(), 1):
        # A column missing from some records is stored as null in those rows.
        yield f"{path} row {rownum}", rownum, {k: v for k, v in row.items() if v is not None}


# --- Validating one record ---


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_images_field(record: dict[str, Any], where: str) -> list[str]:
    if "images" not in record:
        raise DatasetError(
            f"{where}: field 'images' is missing; every record needs a list of image paths ([] for text only)"
        )
    images = record["images"]
    if not isinstance(images, list):
        hint = '; wrap a single path in a list: ["a.png"]' if isinstance(images, str) else ""
        raise DatasetError(
            f"{where}: field 'images' must be a list of image paths, got {_type_name(images)}{hint}"
        )
    for i, p in enumerate(images):
        if not isinstance(p, str) or not p:
            raise DatasetError(f"{where}: field 'images' item {i} must be a non-empty path string, got {p!r}")
    return images


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
            parts.append({"type": "image"})  # the image itself comes from 'images', in order
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


def _check_messages(record: dict[str, Any], where: str, num_images: int) -> list[dict[str, Any]]:
    """Normalised messages from `messages` or `prompt`; placeholders must match the images one to one."""
    has_messages, has_prompt = "messages" in record, "prompt" in record
    if has_messages and has_prompt:
        raise DatasetError(f"{where}: has both 'messages' and 'prompt'; give only one of them")
    if has_prompt:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise DatasetError(f"{where}: field 'prompt' must be a string, got {_type_name(prompt)}")
        content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": prompt}]
        return [{"role": "user", "content": content}]
    if not has_messages:
        raise DatasetError(
            f"{where}: field 'messages' is missing; every record needs chat 'messages' or a 'prompt' string"
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
            f"'images' lists {num_images} path(s); they must match one to one, in order"
        )
    return out


def _check_record(record: dict[str, Any], where: str, line: int, default_id: str, base_dir: str) -> _Entry:
    images = _check_images_field(record, where)
    messages = _check_messages(record, where, len(images))
    if record.get("answer") is None:
        raise DatasetError(f"{where}: field 'answer' is missing; every record needs the reference answer")
    record_id = record.get("id", default_id)
    if isinstance(record_id, int) and not isinstance(record_id, bool):
        record_id = str(record_id)
    if not isinstance(record_id, str) or not record_id:
        raise DatasetError(f"{where}: field 'id' must be a non-empty string, got {record_id!r}")
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DatasetError(f"{where}: field 'metadata' must be an object, got {_type_name(metadata)}")
    paths = [os.path.normpath(os.path.join(base_dir, os.path.expanduser(p))) for p in images]
    return _Entry(record_id, line, where, paths, messages, record["answer"], metadata, record)


# --- Public entry point ---


def load_dataset(
    path: str | Path,
    *,
    on_bad_image: BadImagePolicy = "error",
    max_samples: int | None = None,
    verify_images: bool = True,
) -> VisionDataset:
    """Load and validate a JSONL (`.jsonl`, `.ndjson`) or Parquet (`.parquet`, `.pq`) prompt file.

    on_bad_image: a missing or undecodable image raises DatasetError ("error") or drops the record, which
        is counted in `dataset.skipped` and reported in one warning ("skip").
    max_samples: keep at most this many records (the first ones); reading stops there.
    verify_images: check at load time that each image decodes (PIL verify: headers and checksums) rather
        than only that it exists.
    Raises DatasetError for malformed records or files, FileNotFoundError if `path` does not exist.
    """
    path_str = str(path)
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
    is_jsonl = FORMATS[suffix] == "jsonl"
    rows, unit = (_iter_jsonl(path_str), "line") if is_jsonl else (_iter_parquet(path_str), "row")
    base_dir = os.path.dirname(os.path.abspath(path_str))
    stem = Path(path_str).stem
    entries: list[_Entry] = []
    skipped: list[tuple[int, str]] = []
    first_line_of_id: dict[str, int] = {}
    for where, lineno, record in rows:
        entry = _check_record(record, where, lineno, f"{stem}-{lineno}", base_dir)
        if entry.id in first_line_of_id:
            raise DatasetError(
                f"{where}: field 'id' {entry.id!r} is already used on {unit} {first_line_of_id[entry.id]}; "
                "ids must be unique"
            )
        first_line_of_id[entry.id] = lineno
        reason = _first_bad_image(entry, verify_images)
        if reason is None:
            entries.append(entry)
            if len(entries) == max_samples:
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
    if not entries:
        raise DatasetError(f"{path_str}: no usable records ({len(skipped)} skipped for bad images)")
    return VisionDataset(path_str, entries, skipped)


def _first_bad_image(entry: _Entry, verify: bool) -> str | None:
    """Why the first bad image of `entry` is unusable, or None; fills `entry.image_sizes` on the way."""
    for raw, resolved in zip(entry.record["images"], entry.image_paths, strict=True):
        reason, size = _check_image(resolved, verify)
        if reason is not None:
            return f"image {raw!r} ({resolved}): {reason}"
        entry.image_sizes.append(size)
    return None


# --- Sampling batches of prompts ---
