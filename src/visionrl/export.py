"""Export a trained LoRA adapter with a manifest, refuse ones vLLM cannot serve, and verify an export.

An export is a folder (local, or an object-store prefix through fsspec) holding the PEFT files
(`adapter_config.json`, `adapter_model.safetensors`) and `visionrl_manifest.json`: base model, processor
settings, chat template hash, LoRA settings, training config, eval results, the sha256 and size of every
file, and the result of the serving check. The manifest is written LAST, after every uploaded file was
read back and checked, so a reader that requires the manifest never takes a half-uploaded adapter.

All destination I/O goes through fsspec's filesystem API, so the same code writes local folders and
`s3://bucket/prefix` alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec

from visionrl import __version__
from visionrl.checkpoint import ADAPTER_DIR, CHECKPOINTS_DIR, latest_checkpoint, verify_checkpoint
from visionrl.checkpoint import MANIFEST as CHECKPOINT_MANIFEST
from visionrl.errors import InputError
from visionrl.rollout.types import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from visionrl.servable import check_servable
from visionrl.storage import filesystem
from visionrl.storage import is_local as _is_local

MANIFEST_NAME = "visionrl_manifest.json"
FORMAT_VERSION = 1
RUN_CONFIG = "config.yaml"
FINAL_EVAL = Path("eval") / "final.json"
_CHUNK = 1 << 20
_PROCESSOR_KEYS = (
    "image_processor_type",
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "image_mean",
    "image_std",
)
_MAX_SAFETENSORS_HEADER = 100 << 20  # real headers are KBs; a larger length means a damaged file


class ExportError(InputError):
    """An adapter cannot be exported or does not verify; the message says what, why and what to do."""


# --------------------------------------------------------------------------------------------------
# Manifest


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, str]:
    """{tensor name: dtype} from a safetensors file's JSON header, without loading any tensor."""
    path = Path(path)
    with path.open("rb") as f:
        raw_len = f.read(8)
        size = struct.unpack("<Q", raw_len)[0] if len(raw_len) == 8 else -1
        if not 0 < size <= min(_MAX_SAFETENSORS_HEADER, path.stat().st_size - 8):
            raise ExportError(
                f"{path} is not a valid safetensors file (bad header length); re-save the adapter"
            )
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ExportError(
                f"{path} has a damaged safetensors header ({err}); re-save the adapter"
            ) from None
    if not isinstance(header, dict):
        raise ExportError(f"{path} has a damaged safetensors header (not a mapping); re-save the adapter")
    return {name: str(info.get("dtype")) for name, info in header.items() if name != "__metadata__"}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_stream(f: Any) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    for chunk in iter(lambda: f.read(_CHUNK), b""):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{what} {path} is not valid JSON ({err}); re-create it") from None
    if not isinstance(data, dict):
        raise ExportError(f"{what} {path} must hold a JSON object, got {type(data).__name__}; re-create it")
    return data


def _adapter_files(adapter_dir: Path) -> list[Path]:
    """The files an export carries: every regular file at the top of the adapter dir but the manifest."""
    return sorted(p for p in adapter_dir.iterdir() if p.is_file() and p.name != MANIFEST_NAME)


def _base_model_info(base_model: str) -> dict[str, Any]:
    info: dict[str, Any] = {"path_or_name": base_model, "config_sha256": None, "model_type": None}
    config_path = Path(base_model) / "config.json"
    if config_path.is_file():
        data = config_path.read_bytes()
        info["config_sha256"] = _sha256(data)
        try:
            config = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            config = (
                None  # the hash still pins the file; a broken config is for the base model's loader to report
            )
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
        nested = _read_json(base / "processor_config.json", "processor config").get("image_processor")
        settings = nested if isinstance(nested, dict) else None
    if settings is None and (base / "preprocessor_config.json").is_file():
        settings = _read_json(base / "preprocessor_config.json", "preprocessor config")
    if settings is None:
        return None
    size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
    out = {key: settings.get(key) for key in _PROCESSOR_KEYS}
    out["min_pixels"] = settings.get("min_pixels", size.get("shortest_edge"))
    out["max_pixels"] = settings.get("max_pixels", size.get("longest_edge"))
    return out


def chat_template_sha256(base_dir: str | os.PathLike[str]) -> str | None:
    """sha256 of the chat template: `chat_template.jinja`, else the template in `tokenizer_config.json`."""
    base = Path(base_dir)
    jinja = base / "chat_template.jinja"
    if jinja.is_file():
        return _sha256(jinja.read_bytes())
    tok_config = base / "tokenizer_config.json"
    if tok_config.is_file():
        template = _read_json(tok_config, "tokenizer config").get("chat_template")
        if isinstance(template, str):
            return _sha256(template.encode())
        if template is not None:  # a list of named templates: hash its canonical JSON
            return _sha256(json.dumps(template, sort_keys=True).encode())
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
    config_path = adapter_dir / ADAPTER_CONFIG
    if not config_path.is_file():
        raise ExportError(f"{adapter_dir} has no {ADAPTER_CONFIG}: it is not a PEFT adapter directory")
    adapter_config = _read_json(config_path, "adapter config")
    weights = adapter_dir / ADAPTER_WEIGHTS
    tensors = read_safetensors_header(weights) if weights.is_file() else None
    files: dict[str, dict[str, Any]] = {}
    for path in _adapter_files(adapter_dir):
        with path.open("rb") as f:
            digest, size = _sha256_stream(f)
        files[path.name] = {"sha256": digest, "bytes": size}
    base_dir = Path(base_model)
    return {
        "format_version": FORMAT_VERSION,
        "created": datetime.now(UTC).isoformat(),
        "visionrl_version": __version__,
        "base_model": _base_model_info(base_model),
        "processor": processor_settings(base_dir) if base_dir.is_dir() else None,
        "chat_template_sha256": chat_template_sha256(base_dir) if base_dir.is_dir() else None,
        "lora": {
            key: adapter_config.get(key) for key in ("r", "lora_alpha", "target_modules", "lora_dropout")
        },
        "training": job_config,
        "eval": eval_results,
        "files": files,
        "serving": check_servable(adapter_config, tensors),
    }


# --------------------------------------------------------------------------------------------------
# Export and verification


def _has_adapter(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def _resolve_source(src: Path) -> tuple[Path, Path | None]:
    """(adapter dir, run dir or None) of a run dir, a checkpoint dir or an adapter dir."""
    if not src.is_dir():
        raise ExportError(
            f"export source {src} is not a directory; pass a run directory, a checkpoint or an adapter"
        )
    if _has_adapter(src):
        if (src.parent / CHECKPOINT_MANIFEST).is_file():  # <run>/checkpoints/step_N/adapter
            verify_checkpoint(src.parent)
            return src, src.parent.parent.parent
        return src, src.parent if src.name == ADAPTER_DIR else None
    if (src / CHECKPOINT_MANIFEST).is_file():  # <run>/checkpoints/step_N
        verify_checkpoint(src)
        return src / ADAPTER_DIR, src.parent.parent
    if _has_adapter(src / ADAPTER_DIR):  # a finished run
        return src / ADAPTER_DIR, src
    newest = latest_checkpoint(src)
    if newest is not None:  # a run without a final adapter (stopped early)
        return newest / ADAPTER_DIR, src
    raise ExportError(
        f"no adapter in {src}: expected a run directory (with {ADAPTER_DIR}/ or {CHECKPOINTS_DIR}/step_N/), a "
        f"checkpoint directory, or a PEFT adapter directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}); "
        "train first, or pass the directory that holds the adapter"
    )


def _eval_summary(results: dict[str, Any]) -> dict[str, Any]:
    # Per-sample records can be large; they stay in the run's eval/*.json, the manifest keeps the numbers.
    return {k: v for k, v in results.items() if not isinstance(v, list)}


def _run_context(
    adapter_dir: Path, run_dir: Path | None
) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(base model, job config dict, eval results of the run) for an adapter."""
    from visionrl.config import load_config

    job_config = None
    if run_dir is not None and (run_dir / RUN_CONFIG).is_file():
        job_config = load_config(run_dir / RUN_CONFIG).model_dump(mode="json")
    eval_results = None
    if run_dir is not None and (run_dir / FINAL_EVAL).is_file():
        eval_results = _read_json(run_dir / FINAL_EVAL, "eval results")
    base_model = (job_config or {}).get("model", {}).get("path")
    if not base_model:
        base_model = _read_json(adapter_dir / ADAPTER_CONFIG, "adapter config").get("base_model_name_or_path")
    if not base_model:
        raise ExportError(
            f"cannot tell the base model of {adapter_dir}: no run {RUN_CONFIG} next to it and no "
            f"base_model_name_or_path in its {ADAPTER_CONFIG}; export from the run directory"
        )
    return str(base_model), job_config, eval_results


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def _upload_file(fs: fsspec.AbstractFileSystem, local: Path, remote: str) -> None:
    fs.put_file(str(local), remote)  # streams; adapters of large models are hundreds of MB


def _check_remote_file(fs: fsspec.AbstractFileSystem, remote: str, expected: Mapping[str, Any]) -> str | None:
    """None if `remote` has the expected size and sha256, else why not."""
    if not fs.exists(remote):
        return "it is missing"
    if fs.size(remote) != expected["bytes"]:
        return f"it has {fs.size(remote)} bytes, the manifest says {expected['bytes']}"
    with fs.open(remote, "rb") as f:
        digest, _ = _sha256_stream(f)
    return None if digest == expected["sha256"] else "its sha256 differs"


def _first_bad_file(
    fs: fsspec.AbstractFileSystem, root: str, files: Mapping[str, Any]
) -> tuple[str, str] | None:
    """(name, why) of the first file under `root` that differs from `files` (name -> sha256, bytes), or None."""
    for name, expected in files.items():
        why = _check_remote_file(fs, _join(root, name), expected)
        if why is not None:
            return name, why
    return None


def _write_manifest(fs: fsspec.AbstractFileSystem, root: str, manifest: dict[str, Any]) -> None:
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    target = _join(root, MANIFEST_NAME)
    if _is_local(fs):
        # A local write is not atomic: write aside, then rename, so a reader never sees half a manifest.
        # Object stores make a single PUT visible at once.
        tmp = _join(root, f".{MANIFEST_NAME}.tmp")
        fs.pipe_file(tmp, data)
        fs.mv(tmp, target)
    else:
        fs.pipe_file(target, data)


def export_adapter(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    eval_results: dict[str, Any] | None = None,
    allow_unservable: bool = False,
) -> dict[str, Any]:
    """Export the adapter of `src` (a run dir, a checkpoint dir or an adapter dir) to `dest` (a folder or URL).

    Order: serving check (fails before any upload unless `allow_unservable`), upload of the PEFT files,
    read-back check of every upload, and the manifest LAST. Returns the manifest.
    """
    adapter_dir, run_dir = _resolve_source(Path(src))
    base_model, job_config, run_eval = _run_context(adapter_dir, run_dir)
    results = eval_results if eval_results is not None else run_eval
    manifest = build_manifest(
        adapter_dir,
        base_model=base_model,
        job_config=job_config,
        eval_results=_eval_summary(results) if results is not None else None,
    )
    serving = manifest["serving"]
    if not serving["ok"] and not allow_unservable:
        raise ExportError(
            f"vLLM cannot serve the adapter in {adapter_dir} as trained:\n  - "
            + "\n  - ".join(serving["problems"])
            + "\nchange that and retrain, or export anyway with allow_unservable=True"
        )

    fs, root = filesystem(dest)
    fs.makedirs(root, exist_ok=True)
    manifest_path = _join(root, MANIFEST_NAME)
    if fs.exists(manifest_path):
        # Re-export over an old one: drop the old manifest first, so nobody reads new files under it.
        fs.rm(manifest_path)
    # Exporting a run's adapter/ in place (to add the manifest) needs no copy.
    if not (_is_local(fs) and Path(root).resolve() == adapter_dir.resolve()):
        for name in manifest["files"]:
            _upload_file(fs, adapter_dir / name, _join(root, name))
    # Read every upload back before the manifest makes the export visible to readers.
    bad = _first_bad_file(fs, root, manifest["files"])
    if bad is not None:
        raise ExportError(
            f"uploaded file {bad[0]} in {dest} does not verify ({bad[1]}): the upload failed or the source "
            "changed during the export; re-run the export"
        )
    _write_manifest(fs, root, manifest)
    return manifest


def read_manifest(
    fs: fsspec.AbstractFileSystem, root: str, src: str | os.PathLike[str]
) -> tuple[dict[str, Any], bytes]:
    """(manifest, its raw bytes) of the export at `root` in `fs`; `src` names it in error messages.

    Raises ExportError if the manifest is missing (the export is not complete: the manifest is written
    last), unreadable, of another format version, or lists no adapter config or a file name that is not a
    plain name in the export folder (a reader writes the files under these names).
    """
    manifest_path = _join(root, MANIFEST_NAME)
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
    return manifest, raw


def verify_adapter(src: str | os.PathLike[str]) -> dict[str, Any]:
    """Check an exported adapter (folder or URL) against its manifest; returns the manifest.

    Raises ExportError if the manifest is missing or unreadable, or a file is missing or differs.
    """
    fs, root = filesystem(src)
    manifest, _ = read_manifest(fs, root, src)
    bad = _first_bad_file(fs, root, manifest["files"])
    if bad is not None:
        raise ExportError(
            f"adapter file {bad[0]} in {src} does not match its manifest checksum ({bad[1]}): it was modified "
            "or half-written; re-export it"
        )
    return manifest
