"""An exported adapter (folder or `s3://bucket/prefix`) -> a local copy whose every file matched the export's
manifest (`visionrl fetch`). vLLM only ever reads such copies.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fsspec

from visionrl.adapter.files import MANIFEST_NAME
from visionrl.adapter.manifest import join, read_manifest
from visionrl.adapter.resolve import export_folder
from visionrl.adapter.storage import filesystem, is_local, object_store_errors, require_bucket
from visionrl.errors import ExportError
from visionrl.files import cache_dir, sha256_file, sha256_stream

logger = logging.getLogger(__name__)

CACHE_ENV = "VISIONRL_ADAPTER_CACHE"


def default_cache_dir() -> Path:
    """$VISIONRL_ADAPTER_CACHE, else $XDG_CACHE_HOME/visionrl/adapters, else ~/.cache/visionrl/adapters."""
    return cache_dir("adapters", CACHE_ENV)


def _cache_key(fs: fsspec.AbstractFileSystem, root: str, manifest_raw: bytes) -> str:
    """A folder name unique to (where the export lives, which manifest it has)."""
    where = str(Path(root).resolve()) if is_local(fs) else fs.unstrip_protocol(root.rstrip("/"))
    digest = hashlib.sha256(where.encode() + b"\n" + hashlib.sha256(manifest_raw).digest())
    return digest.hexdigest()[:24]


def _local_mismatch(folder: Path, files: Mapping[str, Any]) -> str | None:
    """The first file of `folder` that differs from the manifest's `files`, or None."""
    for name, expected in files.items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != expected["sha256"]:
            return name
    return None


def _download_verified(fs: fsspec.AbstractFileSystem, remote: str, local: Path, expected: Mapping[str, Any],
                       src: str) -> None:  # fmt: skip
    """Copy `remote` to `local`, hashing on the way; a file that differs from the manifest is refused."""
    name = local.name
    if not fs.exists(remote):
        raise ExportError(
            f"adapter file {name} listed in the manifest of {src} is missing: the export is damaged; re-export it"
        )
    with fs.open(remote, "rb") as fin, local.open("wb") as fout:
        digest, size = sha256_stream(fin, copy_to=fout)
    if digest != expected["sha256"] or size != expected["bytes"]:
        raise ExportError(
            f"adapter file {name} in {src} does not match the sha256 in its manifest ({size} bytes, sha256 "
            f"{digest[:16]}...; the manifest says {expected['bytes']} bytes, "
            f"{str(expected['sha256'])[:16]}...): it was modified or damaged after the export. Refusing to "
            "serve it; re-export the adapter"
        )


def fetch_adapter(src: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A verified local copy of the exported adapter at `src` (a folder, a run directory whose final adapter
    was exported, or `s3://bucket/prefix`; `visionrl.adapter.resolve.export_folder`).

    The export must have its manifest (written last by `visionrl export`: without it the export is not
    complete and is refused). Every file the manifest lists is downloaded into
    `cache_dir/<sha of src + manifest>/` (default `default_cache_dir()`) and checked against its sha256;
    a file that differs raises ExportError naming it. A cached copy is re-hashed before it is reused, so
    it is always what the manifest describes (a later change at `src` without a new manifest is refused
    by the next fresh fetch, and a re-export gets a new cache folder).
    """
    with object_store_errors(src, "fetching the adapter from"):
        return _fetch(os.fspath(src), cache_dir)


def _fetch(src_text: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    """`fetch_adapter`'s body: the manifest read, then every file downloaded and verified into the cache."""
    fs, root = filesystem(src_text)
    require_bucket(fs, src_text)
    if is_local(fs):  # a local path by the one rule: an export folder, or a run directory's final adapter
        root = str(export_folder(root))
    manifest, raw = read_manifest(fs, root, src_text)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / _cache_key(fs, root, raw)
    if target.is_dir():
        bad = _local_mismatch(target, manifest["files"])
        if bad is None:
            return target
        logger.warning("cached copy %s of %s differs in %s; downloading it again", target, src_text, bad)
        shutil.rmtree(target)
    cache.mkdir(parents=True, exist_ok=True)
    # Download into a temporary folder and rename: a reader never sees a half-downloaded copy.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
    try:
        for name, expected in manifest["files"].items():
            _download_verified(fs, join(root, name), tmp / name, expected, src_text)
        (tmp / MANIFEST_NAME).write_bytes(raw)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not the race of two fetches of the same export
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
