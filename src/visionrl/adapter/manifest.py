"""`visionrl_manifest.json`: what an adapter is (base model, processor settings, the image budget it was
trained with, chat template hash, LoRA settings, training config, eval results, the serving check) and the
sha256 and size of every file.

The manifest is written last (after every file it lists is in place and checked), so a reader that
requires it never takes a half-written adapter; `verify_adapter` checks a folder or URL against it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec

from visionrl import __version__
from visionrl.adapter.files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST_NAME,
    read_adapter_config,
    read_json_object,
    read_safetensors_header,
)
from visionrl.adapter.servable import check_servable
from visionrl.adapter.storage import filesystem, is_local
from visionrl.data.images import ImageBudget
from visionrl.errors import ExportError, storage_errors
from visionrl.files import atomic_write, sha256_bytes, sha256_stream

FORMAT_VERSION = 1
_PROCESSOR_KEYS = (
    "image_processor_type",
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "image_mean",
    "image_std",
)


def join(root: str, name: str) -> str:
    """`root/name` for fsspec paths (no os.path: object-store keys always use '/')."""
    return f"{root.rstrip('/')}/{name}"


def _adapter_files(adapter_dir: Path) -> list[Path]:
    """The files an export carries: every regular file at the top of the adapter dir but the manifest."""
    return sorted(p for p in adapter_dir.iterdir() if p.is_file() and p.name != MANIFEST_NAME)


def _base_model_info(base_model: str) -> dict[str, Any]:
    info: dict[str, Any] = {"path_or_name": base_model, "config_sha256": None, "model_type": None}
    config_path = Path(base_model) / "config.json"
    if config_path.is_file():
        data = config_path.read_bytes()
        info["config_sha256"] = sha256_bytes(data)
        try:
            config = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            config = None  # the hash still pins the file; a broken config is for the model loader to report
        info["model_type"] = config.get("model_type") if isinstance(config, dict) else None
    return info


def processor_settings(base_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Image-processor settings that change what the model sees (None if the base dir has none).

    Reads `processor_config.json` (nested `image_processor`, transformers 5) or `preprocessor_config.json`
    (flat). Pixel limits come from `min_pixels`/`max_pixels` or, in newer files, `size.shortest_edge` /
    `size.longest_edge` (which hold pixel counts for Qwen-VL processors).
    """
    base = Path(base_dir)
    settings: dict[str, Any] | None = None
    if (base / "processor_config.json").is_file():
        nested = read_json_object(base / "processor_config.json", "processor config").get("image_processor")
        settings = nested if isinstance(nested, dict) else None
    if settings is None and (base / "preprocessor_config.json").is_file():
        settings = read_json_object(base / "preprocessor_config.json", "preprocessor config")
    if settings is None:
        return None
    size_field = settings.get("size")
    size: dict[str, Any] = size_field if isinstance(size_field, dict) else {}
    out = {key: settings.get(key) for key in _PROCESSOR_KEYS}
    out["min_pixels"] = settings.get("min_pixels", size.get("shortest_edge"))
    out["max_pixels"] = settings.get("max_pixels", size.get("longest_edge"))
    return out


def _image_settings(job_config: dict[str, Any] | None) -> dict[str, int] | None:
    """The image budget of the training job (`data.min_pixels`, `max_pixels`, `max_images_per_prompt`)."""
    data = (job_config or {}).get("data")
    if not isinstance(data, dict) or "max_pixels" not in data:
        return None
    return ImageBudget(data["min_pixels"], data["max_pixels"], data["max_images_per_prompt"]).as_dict()


def manifest_budget(manifest: Mapping[str, Any]) -> ImageBudget | None:
    """The image budget a manifest records (None for an adapter exported without its training config)."""
    images = manifest.get("images")
    return ImageBudget.from_dict(images) if isinstance(images, dict) else None


def read_local_budget(adapter_dir: str | os.PathLike[str]) -> ImageBudget | None:
    """The image budget in the manifest of a local adapter folder (None without a manifest or a budget)."""
    path = Path(adapter_dir) / MANIFEST_NAME
    return manifest_budget(read_json_object(path, "adapter manifest")) if path.is_file() else None


def chat_template_sha256(base_dir: str | os.PathLike[str]) -> str | None:
    """sha256 of the chat template: `chat_template.jinja`, else the template in `tokenizer_config.json`."""
    base = Path(base_dir)
    jinja = base / "chat_template.jinja"
    if jinja.is_file():
        return sha256_bytes(jinja.read_bytes())
    tok_config = base / "tokenizer_config.json"
    if tok_config.is_file():
        template = read_json_object(tok_config, "tokenizer config").get("chat_template")
        if isinstance(template, str):
            return sha256_bytes(template.encode())
        if template is not None:  # a list of named templates: hash its canonical JSON
            return sha256_bytes(json.dumps(template, sort_keys=True).encode())
    return None


def build_manifest(
    adapter_dir: str | os.PathLike[str],
    *,
    base_model: str,
    job_config: dict[str, Any] | None,
    eval_results: dict[str, Any] | None,
) -> dict[str, Any]:
    """The manifest of a PEFT adapter directory (see the module docstring for what it records)."""
    adapter_dir = Path(adapter_dir)
    adapter_config = read_adapter_config(adapter_dir)
    weights = adapter_dir / ADAPTER_WEIGHTS
    tensors = read_safetensors_header(weights) if weights.is_file() else None
    files: dict[str, dict[str, Any]] = {}
    for path in _adapter_files(adapter_dir):
        with path.open("rb") as f:
            digest, size = sha256_stream(f)
        files[path.name] = {"sha256": digest, "bytes": size}
    base_dir = Path(base_model)
    base_info = _base_model_info(base_model)
    return {
        "format_version": FORMAT_VERSION,
        "created": datetime.now(UTC).isoformat(),
        "visionrl_version": __version__,
        "base_model": base_info,
        "processor": processor_settings(base_dir) if base_dir.is_dir() else None,
        # Every image is resized into these bounds in training; serving and evaluation apply the same ones.
        "images": _image_settings(job_config),
        "chat_template_sha256": chat_template_sha256(base_dir) if base_dir.is_dir() else None,
        "lora": {
            key: adapter_config.get(key) for key in ("r", "lora_alpha", "target_modules", "lora_dropout")
        },
        "training": job_config,
        "eval": eval_results,
        "files": files,
        "serving": check_servable(adapter_config, tensors, base_info["model_type"]),
    }


def write_manifest(fs: fsspec.AbstractFileSystem, root: str, manifest: dict[str, Any]) -> None:
    """Write the manifest into the export at `root`: atomically on a local disk (written aside, then
    renamed), as one PUT on an object store (which makes it visible at once)."""
    data = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    target = join(root, MANIFEST_NAME)
    if is_local(fs):
        with storage_errors(
            target, len(data), kept="No manifest was written, so no reader takes this export."
        ):
            atomic_write(target, data)
    else:
        fs.pipe_file(target, data)


def check_remote_file(fs: fsspec.AbstractFileSystem, remote: str, expected: Mapping[str, Any]) -> str | None:
    """None if `remote` has the expected size and sha256, else why not."""
    if not fs.exists(remote):
        return "it is missing"
    if fs.size(remote) != expected["bytes"]:
        return f"it has {fs.size(remote)} bytes, the manifest says {expected['bytes']}"
    with fs.open(remote, "rb") as f:
        digest, _ = sha256_stream(f)
    return None if digest == expected["sha256"] else "its sha256 differs"


def first_bad_file(
    fs: fsspec.AbstractFileSystem, root: str, files: Mapping[str, Any]
) -> tuple[str, str] | None:
    """(name, why) of the first file under `root` that differs from `files` (name -> sha256, bytes), or None."""
    for name, expected in files.items():
        why = check_remote_file(fs, join(root, name), expected)
        if why is not None:
            return name, why
    return None


def read_manifest(
    fs: fsspec.AbstractFileSystem, root: str, src: str | os.PathLike[str]
) -> tuple[dict[str, Any], bytes]:
    """(manifest, its raw bytes) of the export at `root` in `fs`; `src` names it in error messages.

    Raises ExportError if the manifest is missing (the export is not complete: the manifest is written
    last), unreadable, of another format version, or lists no adapter config or a file name that is not a
    plain name in the export folder (a reader writes the files under these names).
    """
    manifest_path = join(root, MANIFEST_NAME)
    if not fs.exists(manifest_path):
        raise ExportError(
            f"{src} has no {MANIFEST_NAME}: it is not a complete export (not an exported adapter, or its "
            "export did not finish); (re-)export it with `visionrl export`"
        )
    raw = fs.cat_file(manifest_path)
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{manifest_path} is not valid JSON ({err}); re-export the adapter") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ExportError(
            f"{manifest_path} has format_version {version!r}; this visionrl reads version {FORMAT_VERSION}: "
            "re-export the adapter with this version"
        )
    _check_file_entries(manifest, manifest_path)
    return manifest, raw


def _check_file_entries(manifest: dict[str, Any], manifest_path: str) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict) or ADAPTER_CONFIG not in files:
        raise ExportError(
            f"{manifest_path} lists no {ADAPTER_CONFIG}: the manifest is damaged; re-export the adapter"
        )
    for name, entry in files.items():
        plain = name not in ("", ".", "..") and "/" not in name and "\\" not in name
        if not plain or not isinstance(entry, dict) or not {"sha256", "bytes"} <= set(entry):
            raise ExportError(
                f"{manifest_path} has a bad entry for file {name!r} (a plain file name with sha256 and bytes "
                "is expected): the manifest is damaged; re-export the adapter"
            )


def verify_adapter(src: str | os.PathLike[str]) -> dict[str, Any]:
    """Check an exported adapter (folder or URL) against its manifest; returns the manifest.

    Raises ExportError if the manifest is missing or unreadable, or a file is missing or differs.
    """
    fs, root = filesystem(src)
    manifest, _ = read_manifest(fs, root, src)
    bad = first_bad_file(fs, root, manifest["files"])
    if bad is not None:
        raise ExportError(
            f"adapter file {bad[0]} in {src} does not match its manifest checksum ({bad[1]}): it was modified "
            "or half-written; re-export it"
        )
    return manifest
