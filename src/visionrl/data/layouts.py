"""Reading the data layouts users bring: files to rows, mapped columns, image values and `<image>` markers.

Layouts read here, all into the fields `visionrl.data.dataset` validates:
- our own: `images` (paths), `messages` or `prompt`, `answer` (JSONL or Parquet);
- Geometry3K / EasyR1-style Parquet: an `images` column of `{bytes, path}` structs or raw bytes and a
  `problem` / `answer` pair whose text marks where each image goes with `<image>`;
- Hugging Face-style Parquet with a single `image` column (one struct per row);
- JSONL with image paths or base64 `data:` URIs.
The job file names the columns (`data.prompt_key`, `data.answer_key`, `data.image_key`). Image bytes stay
in the dataset (the driver); a sample carries decoded images, and the record it carries names its images
instead of holding their bytes, so prompts stay small between processes.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from PIL import Image

from visionrl.errors import InputError

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
IMAGE_MARKER = "<image>"
# What PIL raises for files it cannot identify or decode (UnidentifiedImageError is an OSError).
IMAGE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError)


class DatasetError(InputError):
    """A data file or record is malformed; the message names the file, line, field and the fix."""


class DataFileNotFound(DatasetError, FileNotFoundError):
    """The data file does not exist (both a user-input error and a FileNotFoundError)."""


@dataclass(frozen=True)
class Layout:
    """Which fields of a row hold the prompt text, the reference answer and the images."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_key: str = "images"

    @classmethod
    def of(cls, data: Any) -> Layout:
        """The layout a job's `data:` section names (data.prompt_key, answer_key, image_key): every command that
        reads the job's data (training, `validate --check-data`) reads it by the same keys."""
        return cls(prompt_key=data.prompt_key, answer_key=data.answer_key, image_key=data.image_key)


@dataclass(frozen=True)
class ImageRef:
    """One image of a record: a file on disk (`path`) or encoded file bytes (`data`), never both.

    `label` is how messages and the kept record name it: the path as written, or `<image k: N bytes>`.
    """

    label: str
    path: str | None = None
    data: bytes | None = None

    def decode(self) -> Image.Image:
        """The image fully decoded, as RGB; raises one of IMAGE_ERRORS (FileNotFoundError included)."""
        source: Any = self.path if self.data is None else io.BytesIO(self.data)
        with Image.open(source) as image:
            return image.convert("RGB")  # convert() decodes every pixel: truncated files fail here

    def size(self) -> tuple[int, int]:
        """(width, height) from the header, nothing decoded; (0, 0) when it cannot be read."""
        source: Any = self.path if self.data is None else io.BytesIO(self.data)
        try:
            with Image.open(source) as image:
                return image.size
        except IMAGE_ERRORS:
            return (0, 0)

    def problem(self) -> str | None:
        """Why this image cannot be used (missing, empty, undecodable), or None after a full decode (a header
        check such as PIL's verify() passes truncated JPEGs: docs/ENGINE_NOTES.md)."""
        if self.path is not None and not os.path.isfile(self.path):
            return "file not found"
        if (self.data is not None and not self.data) or (
            self.path is not None and not os.path.getsize(self.path)
        ):
            return "empty (0 bytes)"
        try:
            self.decode()
        except IMAGE_ERRORS as e:
            return f"not a readable image ({type(e).__name__}: {e})"
        return None


# --- Files to rows ---


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def iter_rows(path: str) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(location for messages, line or row number, row) of each record of a JSONL or Parquet file."""
    return _iter_jsonl(path) if FORMATS[os.path.splitext(path)[1].lower()] == "jsonl" else _iter_parquet(path)


def _iter_jsonl(path: str) -> Iterator[tuple[str, int, dict[str, Any]]]:
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
                raise DatasetError(f"{where}: expected a JSON object {{...}}, got {type_name(obj)}")
            yield where, lineno, obj


def _iter_parquet(path: str) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """Rows in batches (not the whole table as Python objects at once); null columns count as absent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        rownum = 0
        for batch in parquet.iter_batches(batch_size=256):
            for row in batch.to_pylist():
                rownum += 1
                # A column missing from some records is stored as null in those rows.
                yield f"{path} row {rownum}", rownum, {k: v for k, v in row.items() if v is not None}
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{path}: cannot read as Parquet ({e})") from e


# --- Image values ---


def image_refs(row: dict[str, Any], layout: Layout, where: str, base_dir: str) -> list[ImageRef]:
    """The images of `row[layout.image_key]`: a list of (or one) path, data URI, bytes or {bytes, path}."""
    key = layout.image_key
    if key not in row:
        raise DatasetError(
            f"{where}: field {key!r} is missing; every record needs its images ([] for text only), "
            "or set data.image_key to the column that holds them"
        )
    value = row[key]
    items = value if isinstance(value, list) else [value]
    return [_image_ref(item, i, f"{where}: field {key!r} item {i}", base_dir) for i, item in enumerate(items)]


def _image_ref(item: Any, index: int, where: str, base_dir: str) -> ImageRef:
    if isinstance(item, dict):  # Hugging Face `Image` feature / EasyR1 parquet: {"bytes": ..., "path": ...}
        unknown = sorted(set(item) - {"bytes", "path"})
        if unknown:
            raise DatasetError(f"{where}: an image struct has only 'bytes' and 'path', got {unknown}")
        if item.get("bytes") is not None:
            return _bytes_ref(item["bytes"], index, where, item.get("path"))
        if item.get("path") is not None:
            return _image_ref(item["path"], index, where, base_dir)
        raise DatasetError(f"{where}: the image struct has neither 'bytes' nor 'path'")
    if isinstance(item, bytes | bytearray):
        return _bytes_ref(bytes(item), index, where, None)
    if isinstance(item, str) and item.startswith("data:"):
        return _bytes_ref(_data_uri_bytes(item, where), index, where, None)
    if isinstance(item, str) and item:
        path = os.path.normpath(os.path.join(base_dir, os.path.expanduser(item)))
        return ImageRef(label=item, path=path)
    raise DatasetError(
        f"{where}: an image must be a path, a base64 data URI, bytes or a {{bytes, path}} struct, got {item!r:.80}"
    )


def _bytes_ref(data: Any, index: int, where: str, name: Any) -> ImageRef:
    if not isinstance(data, bytes | bytearray):
        raise DatasetError(f"{where}: image 'bytes' must be binary, got {type_name(data)}")
    label = f"<image {index}: {len(data)} bytes{f', {name}' if isinstance(name, str) and name else ''}>"
    return ImageRef(label=label, data=bytes(data))


def _data_uri_bytes(uri: str, where: str) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma or not header.endswith(";base64"):
        raise DatasetError(
            f"{where}: a data URI image must look like 'data:image/png;base64,<payload>', got {uri[:40]!r}..."
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise DatasetError(f"{where}: the data URI's base64 payload does not decode ({e})") from None


# --- Prompt text with <image> markers ---


def prompt_content(text: str, num_images: int, where: str, key: str) -> list[dict[str, Any]]:
    """Message parts of a prompt string: each `<image>` marker becomes an image part, in order; without
    markers the images go before the text (the layout of our own `prompt` field)."""
    pieces = text.split(IMAGE_MARKER)
    markers = len(pieces) - 1
    if markers == 0:
        return [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
    if markers != num_images:
        raise DatasetError(
            f"{where}: field {key!r} has {markers} {IMAGE_MARKER} marker(s) but the record has {num_images} "
            f"image(s); give one marker per image, in order (or none: the images then go before the text)"
        )
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    return parts


def slim_record(row: dict[str, Any], layout: Layout, images: list[ImageRef]) -> dict[str, Any]:
    """The row as kept with each sample (rewards see it): image bytes replaced by their labels."""
    if not any(ref.data is not None for ref in images):
        return row
    return {**row, layout.image_key: [ref.label for ref in images]}
