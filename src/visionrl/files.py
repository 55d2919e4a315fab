"""File helpers shared by checkpoints, adapters, fetched copies and reports: sha256, synced and atomic writes,
and the error a full or unwritable disk gives.

One sha256 reader streams in chunks (checkpoints hold GB-sized optimizer states, adapters of large models
are hundreds of MB) and can copy while it hashes; one atomic write puts bytes beside the target and renames
them over it, so a reader never sees half a file, even if the writer is killed. Every write of a run's files
goes through `write_synced`; its callers turn the OSError of a full disk (ENOSPC), a read-only mount or a missing
permission into a `visionrl.errors.StorageError` naming the path and the bytes needed (`errors.storage_errors`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20
_write_fd = os.write  # the one call that puts bytes on disk (tests stand a full disk in for it)


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def sha256_stream(source: BinaryIO, copy_to: BinaryIO | None = None) -> tuple[str, int]:
    """(hex sha256, size in bytes) of everything left in `source`, read in chunks; each chunk is also
    written to `copy_to` when given (a download verified on the way)."""
    digest, size = hashlib.sha256(), 0
    for chunk in iter(lambda: source.read(CHUNK), b""):
        digest.update(chunk)
        size += len(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
    return digest.hexdigest(), size


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file."""
    with Path(path).open("rb") as f:
        return sha256_stream(f)[0]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in `path` durable (POSIX: only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str | os.PathLike[str], data: bytes, *, append: bool = False) -> None:
    """Write (or append) `data` to `path` and fsync it. OSError (a full disk...) propagates to the caller, who
    knows what to clean up; `visionrl.errors.storage_error` turns it into the user's message."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[_write_fd(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write `data` (str as UTF-8) to `path` atomically: to a temporary file beside it, fsynced, then renamed.
    On a full or unwritable disk: OSError, the old file untouched and no temporary file left."""
    target = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write_synced(tmp, payload)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cache_dir(kind: str, variable: str) -> Path:
    """Where visionrl caches `kind` (adapters, models): $`variable`, else $XDG_CACHE_HOME/visionrl/`kind`, else
    ~/.cache/visionrl/`kind`."""
    if os.environ.get(variable):
        return Path(os.environ[variable]).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "visionrl" / kind
