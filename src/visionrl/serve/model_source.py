"""Where a served base model comes from: a local checkpoint directory, or an `s3://bucket/prefix` holding one
(`visionrl serve --sagemaker --base s3://...`, `VISIONRL_BASE_MODEL`).

An S3 checkpoint is copied into a cache folder named after its URL; a file `.visionrl-listing.json` written last
records what was copied (every object's name, size and ETag). The next start lists the prefix again and reuses
the copy only when the listing is the same, so a checkpoint replaced under the same prefix is downloaded again
and an interrupted download (no listing file) is never served. SageMaker's own way, the model data it copies to
`/opt/ml/model` before the container starts, needs none of this: that is a local directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from visionrl.adapter.storage import filesystem, is_local, object_store_errors
from visionrl.errors import InputError
from visionrl.files import cache_dir
from visionrl.models.loader import check_model_dir

LISTING_NAME = ".visionrl-listing.json"
CACHE_ENV = "VISIONRL_MODEL_CACHE"


def default_model_cache() -> Path:
    """$VISIONRL_MODEL_CACHE, else $XDG_CACHE_HOME/visionrl/models, else ~/.cache/visionrl/models."""
    return cache_dir("models", CACHE_ENV)


def _listing(fs: Any, root: str) -> dict[str, dict[str, Any]]:
    """{relative name: {bytes, etag}} of every object under `root` (folders' marker objects left out)."""
    found: dict[str, dict[str, Any]] = {}
    for path, info in fs.find(root, detail=True).items():
        name = path[len(root) :].lstrip("/")
        if not name or name.endswith("/") or info.get("type") == "directory":
            continue
        found[name] = {"bytes": int(info.get("size") or 0), "etag": str(info.get("ETag", "")).strip('"')}
    return found


def _download(fs: Any, root: str, listing: dict[str, dict[str, Any]], target: Path) -> None:
    """Every object of `listing` into a fresh folder beside `target`, then the folder renamed into place (a
    killed download leaves only a temporary folder, never a half-filled `target`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=target.name + ".partial-", dir=target.parent))
    try:
        for name in sorted(listing):
            local = partial / name
            local.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{root}/{name}", str(local))
            if local.stat().st_size != listing[name]["bytes"]:
                raise InputError(f"{name} changed while it was downloaded; start the server again")
        (partial / LISTING_NAME).write_text(json.dumps(listing, indent=1, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def local_model_dir(src: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
                    *, progress: Any = None) -> Path:  # fmt: skip
    """A local checkpoint directory for `src` (a folder, or `s3://bucket/prefix` copied into the cache), checked
    as a base model (`config.json`, a supported model type). `progress(text)` hears about a download."""
    text = os.fspath(src)
    fs, root = filesystem(text)
    if is_local(fs):
        check_model_dir(root)
        return Path(root)
    root = root.rstrip("/")
    with object_store_errors(text, "fetching the base model from"):
        listing = _listing(fs, root)
        if "config.json" not in listing:
            raise InputError(
                f"{text} holds no config.json ({len(listing)} objects under it): give the S3 prefix of a "
                "checkpoint directory (config.json, the weights, the tokenizer and processor files)"
            )
        cache = Path(cache_dir) if cache_dir is not None else default_model_cache()
        target = cache / hashlib.sha256(fs.unstrip_protocol(root).encode()).hexdigest()[:24]
        if not _same_listing(target, listing):
            if progress is not None:
                size = sum(v["bytes"] for v in listing.values()) / 2**30
                progress(f"downloading the base model from {text} ({len(listing)} files, {size:.2f} GiB)")
            _download(fs, root, listing, target)
    check_model_dir(target)
    return target


def _same_listing(target: Path, listing: dict[str, dict[str, Any]]) -> bool:
    """Whether the copy in `target` is complete and of exactly these objects."""
    try:
        return bool(json.loads((target / LISTING_NAME).read_text()) == listing)
    except (OSError, json.JSONDecodeError):
        return False
