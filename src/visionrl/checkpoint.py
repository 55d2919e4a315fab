"""Atomic training checkpoints in `<output_dir>/checkpoints/step_N/`, and finding the newest usable one.

A checkpoint is a directory:

    step_N/
      adapter/               PEFT adapter files (adapter_config.json, adapter_model.safetensors)
      trainer_state.pt       optimizer, scheduler, adapter version, RNG (opaque bytes from the learner)
      sampler_state.json     data position of the prompt sampler
      checkpoint.json        step, time, sha256 + size of every file above, extra; written LAST

Atomicity: everything is written and fsynced under a temporary name (`.tmp-step_N-<random>/`), the
manifest last, and the directory is then renamed to `step_N` in one `os.rename`. A run killed at any
moment therefore leaves either no `step_N` or a complete one; temporary leftovers are ignored by readers
and removed by the next save. Readers still verify every checksum, because disks, copies and people can
damage a directory after it was written: a damaged checkpoint is skipped (with a warning naming it) in
favour of the previous one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from visionrl.errors import ExportError, InputError, NonFiniteError, storage_error
from visionrl.files import fsync_dir, sha256_bytes, sha256_file, write_synced
from visionrl.finite import describe, nonfinite_in_file, nonfinite_tensors
from visionrl.run_layout import ADAPTER_DIR, CHECKPOINTS_DIR, STEP_PREFIX, step_dir_name
from visionrl.types import ADAPTER_WEIGHTS

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"
TRAINER_STATE = "trainer_state.pt"
SAMPLER_STATE = "sampler_state.json"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"  # a replaced step_N waits under this name until the new one is in place
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")


class CheckpointError(InputError):
    """A checkpoint is missing, incomplete or damaged; the message says which file and what to do."""


@dataclass
class Checkpoint:
    """A loaded checkpoint. `adapter_dir` is a PEFT adapter directory inside the checkpoint."""

    step: int
    adapter_dir: Path
    trainer_state: bytes
    sampler_state: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


# --------------------------------------------------------------------------------------------------
# Small file helpers


def _check_file_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"adapter file name {name!r} must be a plain file name (no directories)")


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """`step_N` directories under `root`, newest (largest N) first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found, key=lambda item: item[0], reverse=True)


# --------------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(
    output_dir: str | os.PathLike[str],
    step: int,
    *,
    adapter_files: dict[str, bytes],
    trainer_state: bytes,
    sampler_state: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write `checkpoints/step_<step>/` atomically, then keep only the newest `keep` complete checkpoints.

    An existing `step_<step>` (a step re-run after a resume) is replaced: the old directory is renamed
    aside, the new one renamed in, then the old one deleted. Returns the checkpoint directory.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if not adapter_files:
        raise ValueError("adapter_files is empty: a checkpoint needs the adapter")
    for name in adapter_files:
        _check_file_name(name)
    # Serialise before touching the disk, so unserialisable state fails without leaving anything behind.
    sampler_bytes = json.dumps(sampler_state, sort_keys=True).encode()
    extra = dict(extra or {})
    json.dumps(extra)
    root = Path(output_dir) / CHECKPOINTS_DIR
    if ADAPTER_WEIGHTS in adapter_files:
        bad = nonfinite_tensors(adapter_files[ADAPTER_WEIGHTS], f"the adapter of step {step}")
        if bad:
            raise NonFiniteError(
                f"not saving the checkpoint of step {step}: its adapter has {describe(bad)}; a NaN adapter is "
                f"never checkpointed. {_kept(root)}"
            )
    payload = {f"{ADAPTER_DIR}/{name}": data for name, data in adapter_files.items()}
    payload[TRAINER_STATE] = trainer_state
    payload[SAMPLER_STATE] = sampler_bytes
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "time": datetime.now(UTC).isoformat(),
        "files": {rel: {"sha256": sha256_bytes(data), "bytes": len(data)} for rel, data in payload.items()},
        "extra": extra,
    }
    manifest_bytes = json.dumps(manifest, indent=2, sort_keys=True).encode()
    needed = sum(len(d) for d in payload.values()) + len(manifest_bytes)
    final = root / step_dir_name(step)
    tmp: Path | None = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step_dir_name(step)}-", dir=root))
        _write_dir(tmp, payload, manifest_bytes)
        _rename_into_place(tmp, final)
    except OSError as err:  # a full disk, a read-only mount, a lost permission
        raise storage_error(err, final, needed, kept=_kept(root)) from None
    finally:  # on every way out (an error, Ctrl-C) nothing half-written stays; only a kill leaves a leftover
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, keep, just_saved=final)
    logger.info("checkpoint saved: %s", final)
    return final


def _kept(root: Path) -> str:
    newest = latest_checkpoint(root.parent)
    return f"The newest checkpoint {newest} is intact." if newest else "No earlier checkpoint exists."


def _write_dir(tmp: Path, payload: dict[str, bytes], manifest_bytes: bytes) -> None:
    """Every file of the checkpoint into `tmp`, fsynced, the manifest last."""
    (tmp / ADAPTER_DIR).mkdir()
    for rel, data in payload.items():
        write_synced(tmp / rel, data)
    fsync_dir(tmp / ADAPTER_DIR)
    write_synced(tmp / MANIFEST, manifest_bytes)
    fsync_dir(tmp)


def _rename_into_place(tmp: Path, final: Path) -> None:
    old: Path | None = None
    if final.exists():
        # Never delete the old step_N before the new one is in place: a crash in between would lose both.
        old = final.with_name(f"{OLD_PREFIX}{final.name}-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old)


def _remove_leftovers(root: Path) -> None:
    """Delete temporary directories of saves that were killed (they are never read)."""
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            logger.info("removing leftover of an interrupted checkpoint save: %s", child)
            shutil.rmtree(child)


def _prune(root: Path, keep: int, just_saved: Path) -> None:
    """Keep the newest `keep` complete checkpoints (by step); delete every other step_N directory.

    Damaged, incomplete and non-finite (NaN adapter) directories are deleted too: they can never be resumed from, and a damaged
    one must not count towards `keep`, or a single bad disk block could leave no usable checkpoint.
    """
    kept: list[Path] = []
    for _, path in _step_dirs(root):
        if len(kept) >= keep:
            break
        if path == just_saved:  # its checksums were computed from the bytes just written
            kept.append(path)
            continue
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            logger.warning("not keeping damaged checkpoint %s: %s", path, err)
            continue
        kept.append(path)
    for _, path in _step_dirs(root):
        if path not in kept:
            logger.info("removing old checkpoint %s (keep=%d)", path, keep)
            shutil.rmtree(path)


# --------------------------------------------------------------------------------------------------
# Reading


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {MANIFEST}: it is incomplete (not written by visionrl, or copied "
            "partially); resume from another checkpoint or start the run afresh"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{manifest_path} is not valid JSON ({err}): the checkpoint is damaged; resume from another checkpoint"
        ) from None
    if (
        not isinstance(manifest, dict)
        or not isinstance(manifest.get("files"), dict)
        or "step" not in manifest
    ):
        raise CheckpointError(f"{manifest_path} lacks 'step' or 'files': the checkpoint is damaged")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path} has format_version {manifest.get('format_version')!r}; this visionrl reads "
            f"version {FORMAT_VERSION}: resume with the visionrl version that wrote it"
        )
    return manifest


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a checkpoint directory against its manifest (presence, size and sha256 of every file).

    Returns the manifest; raises CheckpointError naming the first bad file.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    match = _STEP_RE.match(path.name)
    if match and int(match.group(1)) != manifest["step"]:
        raise CheckpointError(
            f"checkpoint {path} records step {manifest['step']}, not the step in its name: it was renamed "
            "or copied over; resume from another checkpoint"
        )
    for rel, info in manifest["files"].items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {path} lacks its file {rel}: it is incomplete; resume from another one"
            )
        if file.stat().st_size != info["bytes"] or sha256_file(file) != info["sha256"]:
            raise CheckpointError(
                f"file {rel} of checkpoint {path} does not match its checksum in {MANIFEST}: it was modified or "
                "damaged after saving; resume from an earlier checkpoint (or delete this one)"
            )
    weights = path / ADAPTER_DIR / ADAPTER_WEIGHTS
    try:
        bad = nonfinite_in_file(weights) if weights.is_file() else []
    except ExportError as err:  # not a safetensors file at all: damaged like any other
        raise CheckpointError(f"checkpoint {path}: {err}; resume from an earlier checkpoint") from None
    if bad:  # written by a run without the non-finite guard: never resumed from, never counted as kept
        raise CheckpointError(
            f"checkpoint {path} holds a non-finite adapter ({describe(bad)}); resume from an earlier checkpoint"
        )
    return manifest


def latest_checkpoint(output_dir: str | os.PathLike[str], at_most: int | None = None) -> Path | None:
    """The newest complete, undamaged checkpoint of a run (of a step <= `at_most` when given), or None.

    Incomplete or damaged ones are skipped with a warning naming them (falling back to older ones);
    temporary directories of interrupted saves are never considered.
    """
    for step, path in _step_dirs(Path(output_dir) / CHECKPOINTS_DIR):
        if at_most is not None and step > at_most:
            continue
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            logger.warning("skipping checkpoint %s: %s", path, err)
            continue
        return path
    return None


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step of a `step_N` checkpoint directory."""
    match = _STEP_RE.match(Path(path).name)
    if match is None:
        raise CheckpointError(f"{path} is not a step_N checkpoint directory")
    return int(match.group(1))


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Verify and read a checkpoint directory. Raises CheckpointError if it is incomplete or damaged."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is not a directory; pass a checkpoints/step_N directory of a run"
        )
    manifest = verify_checkpoint(path)
    try:
        sampler_state = json.loads((path / SAMPLER_STATE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{path / SAMPLER_STATE} is not valid JSON ({err}); the checkpoint is damaged"
        ) from None
    return Checkpoint(
        step=int(manifest["step"]),
        adapter_dir=path / ADAPTER_DIR,
        trainer_state=(path / TRAINER_STATE).read_bytes(),
        sampler_state=sampler_state,
        extra=dict(manifest.get("extra") or {}),
        path=path,
    )
