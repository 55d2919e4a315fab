"""Export a trained LoRA adapter with its manifest to a folder or an object-store prefix (`visionrl export`).

Order: the serving check (an adapter vLLM cannot serve as trained is refused before any upload), the PEFT
files, a read-back check of every upload, and the manifest LAST, so a reader that requires the manifest
never takes a half-uploaded adapter. All destination I/O goes through fsspec's filesystem API, so the same
code writes local folders and `s3://bucket/prefix` alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec

from visionrl.adapter.files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST_NAME,
    read_adapter_config,
    read_json_object,
)
from visionrl.adapter.manifest import build_manifest, first_bad_file, join, write_manifest
from visionrl.adapter.resolve import resolve_adapter
from visionrl.adapter.storage import filesystem, is_local, object_store_errors, require_bucket
from visionrl.errors import ExportError, storage_error, storage_errors
from visionrl.finite import describe, nonfinite_in_file
from visionrl.run_layout import RUN_CONFIG, RunDir


def _eval_summary(results: dict[str, Any]) -> dict[str, Any]:
    # Per-sample records can be large; they stay in the run's eval/*.json, the manifest keeps the numbers.
    return {k: v for k, v in results.items() if not isinstance(v, list)}


def _run_context(
    adapter_dir: Path, run_dir: Path | None
) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(base model, job config dict, eval results of the run) for an adapter."""
    from visionrl.config import load_config

    run = RunDir(run_dir) if run_dir is not None else None
    job_config = None
    if run is not None and run.config.is_file():
        job_config = load_config(run.config).model_dump(mode="json")
    eval_results = None
    if run is not None and run.final_eval.is_file():
        eval_results = read_json_object(run.final_eval, "eval results")
    base_model = (job_config or {}).get("model", {}).get("path")
    if not base_model:
        base_model = read_adapter_config(adapter_dir).get("base_model_name_or_path")
    if not base_model:
        raise ExportError(
            f"cannot tell the base model of {adapter_dir}: no run {RUN_CONFIG} next to it and no "
            f"base_model_name_or_path in its {ADAPTER_CONFIG}; export from the run directory"
        )
    return str(base_model), job_config, eval_results


def _upload_file(fs: fsspec.AbstractFileSystem, local: Path, remote: str) -> None:
    fs.put_file(str(local), remote)  # streams; adapters of large models are hundreds of MB


def _refuse_foreign_files(fs: fsspec.AbstractFileSystem, root: str, ours: set[str], dest: str) -> None:
    """A destination holding files that are not an earlier export's would get ours mixed into it: refuse."""
    if not fs.exists(root):
        return
    names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    foreign = sorted(names - ours - {MANIFEST_NAME})
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ExportError(
            f"export destination {dest} is not empty and holds files that are not an adapter export: {shown}. "
            "Export to a new or empty folder, or pass --overwrite (overwrite=True) to write the adapter there "
            "anyway (those files are left as they are)"
        )


def export_adapter(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    eval_results: dict[str, Any] | None = None,
    allow_unservable: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Export the adapter of `src` (a run dir, a checkpoint dir or an adapter dir, read and checked by
    `visionrl.adapter.resolve`) to `dest` (a folder or URL).

    Order: the weights must be finite, the serving check (fails before any upload unless `allow_unservable`),
    a destination with foreign files is refused (unless `overwrite`), upload of the PEFT files, read-back check
    of every upload, and the manifest LAST. Returns the manifest.
    """
    found = resolve_adapter(src)
    adapter_dir, run_dir = found.path, found.run_dir
    weights = adapter_dir / ADAPTER_WEIGHTS
    nonfinite = nonfinite_in_file(weights) if weights.is_file() else []
    if nonfinite:
        raise ExportError(
            f"refusing to export {adapter_dir}: its weights have {describe(nonfinite)}, so every answer of the served "
            "model would be garbage; export an earlier checkpoint (checkpoints/step_N) of the run instead"
        )
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

    with object_store_errors(dest, "exporting to"):
        return _write_export(manifest, adapter_dir, dest, overwrite)


def _write_export(
    manifest: dict[str, Any], adapter_dir: Path, dest: str | os.PathLike[str], overwrite: bool
) -> dict[str, Any]:
    """Upload the adapter's files to `dest`, read them back, then write the manifest (export_adapter's order)."""
    fs, root = filesystem(dest)
    require_bucket(fs, os.fspath(dest))
    in_place = is_local(fs) and Path(root).resolve() == adapter_dir.resolve()
    if not overwrite and not in_place:
        _refuse_foreign_files(fs, root, set(manifest["files"]), os.fspath(dest))
    with storage_errors(os.fspath(dest), None):  # a read-only or missing mount, a denied bucket
        fs.makedirs(root, exist_ok=True)
    manifest_path = join(root, MANIFEST_NAME)
    if fs.exists(manifest_path):
        # Re-export over an old one: drop the old manifest first, so nobody reads new files under it.
        fs.rm(manifest_path)
    # Exporting a run's adapter/ in place (to add the manifest) needs no copy.
    if not in_place:
        for name in manifest["files"]:
            try:
                _upload_file(fs, adapter_dir / name, join(root, name))
            except OSError as err:  # a full or read-only disk, a denied bucket
                kept = "No manifest was written, so no reader takes this partial export."
                raise storage_error(
                    err, join(root, name), (adapter_dir / name).stat().st_size, kept
                ) from None
    # Read every upload back before the manifest makes the export visible to readers.
    bad = first_bad_file(fs, root, manifest["files"])
    if bad is not None:
        raise ExportError(
            f"uploaded file {bad[0]} in {dest} does not verify ({bad[1]}): the upload failed or the source "
            "changed during the export; re-run the export"
        )
    write_manifest(fs, root, manifest)
    return manifest
