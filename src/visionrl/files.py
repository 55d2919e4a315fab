"""File helpers shared by checkpoints, adapters, fetched copies and reports: sha256, synced and atomic writes,
and the error a full or unwritable disk gives.

One sha256 reader streams in chunks (checkpoints hold GB-sized optimizer states, adapters of large models
are hundreds of MB) and can copy while it hashes; one atomic write puts bytes beside the target and renames
them over it, so a reader never sees half a file, even if the writer is killed. Every write of a run's files
goes through `write_synced`, so a full disk (ENOSPC), a read-only mount or a missing permission becomes one
`StorageError` that names the path and the bytes needed, never a raw traceback.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

from visionrl.errors import StorageError

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


def storage_error(err: OSError, path: str | os.PathLike[str], needed: int, kept: str = "") -> StorageError:
    """The StorageError for `err` raised while writing `needed` bytes to `path`: what, how much, what to do."""
    where = Path(path)
    free = ""
    for parent in (where, *where.parents):
        if parent.exists():
            free = f", {shutil.disk_usage(parent).free:,} bytes free there"
            break
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        why = f"the disk is full: writing {where} needs {needed:,} bytes{free}"
        fix = "free space there, or point output_dir at a larger disk"
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = (
            f"{where} cannot be written ({os.strerror(err.errno or 0)}); {needed:,} bytes were to be written"
        )
        fix = "give the run write access there, or choose another output_dir"
    else:
        why = f"writing {needed:,} bytes to {where} failed: {err.strerror or err}"
        fix = "check the storage"
    return StorageError(f"{why}. {kept + ' ' if kept else ''}To fix: {fix}.")


def write_synced(path: str | os.PathLike[str], data: bytes, *, append: bool = False) -> None:
    """Write (or append) `data` to `path` and fsync it. OSError (a full disk...) propagates to the caller, who
    knows what to clean up; `storage_error` turns it into the user's message."""
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
    On a full or unwritable disk: StorageError, the old file untouched and no temporary file left."""
    target = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as err:
        raise storage_error(err, target, len(payload)) from None
    os.close(fd)
    try:
        write_synced(tmp, payload)
        os.replace(tmp, target)
    except OSError as err:
        raise storage_error(err, target, len(payload), kept=f"{target} was left as it was.") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
