"""Which adapter a user's path names, checked: the one rule by which `visionrl export`, `visionrl eval` and
`visionrl serve` / `fetch` read an adapter path.

- an export folder (it holds `visionrl_manifest.json`, as a run's final `adapter/` does): every file is checked
  against the manifest;
- a checkpoint (`RUN/checkpoints/step_N`, or its `adapter/`): every file is checked against `checkpoint.json`;
- a run directory: its final `adapter/`, read by the two rules above; a run without one (it stopped before its
  end) gives the adapter of its newest intact checkpoint, and the log says so;
- a bare PEFT folder (`adapter_config.json` + `adapter_model.safetensors`, no manifest) is taken as it is: there
  is no manifest to check it against.

A file that differs from its manifest is refused with an error that names it and says what to do. Serving
takes exports only (`export_folder`), and checks every file against the manifest while it copies it
(`visionrl.adapter.fetch`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from visionrl.adapter.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST_NAME, has_adapter_files
from visionrl.adapter.manifest import verify_adapter
from visionrl.checkpoint import MANIFEST as CHECKPOINT_MANIFEST
from visionrl.checkpoint import latest_checkpoint, verify_checkpoint
from visionrl.errors import ExportError
from visionrl.run_layout import ADAPTER_DIR, CHECKPOINTS_DIR

logger = logging.getLogger(__name__)

AdapterKind = Literal["export", "checkpoint", "folder"]
EXPECTED = (
    f"a run directory (with {ADAPTER_DIR}/ or {CHECKPOINTS_DIR}/step_N/), a checkpoint directory "
    f"({CHECKPOINTS_DIR}/step_N), an exported adapter folder, or a PEFT adapter folder ({ADAPTER_CONFIG} + "
    f"{ADAPTER_WEIGHTS})"
)


@dataclass(frozen=True)
class ResolvedAdapter:
    """An adapter folder found from a user's path.

    `path` holds the PEFT files; `kind` says what was checked: "export" (against its visionrl manifest),
    "checkpoint" (against the checkpoint's manifest) or "folder" (a bare PEFT folder, nothing to check against);
    `run_dir` is the run it belongs to (its config.yaml and eval results), when known."""

    path: Path
    kind: AdapterKind
    run_dir: Path | None

    def describe(self) -> str:
        """What the adapter is, for messages: e.g. `checkpoint /runs/a/checkpoints/step_4`."""
        if self.kind == "checkpoint":
            return f"checkpoint {self.path.parent}"
        if self.kind == "export":
            final = self.run_dir is not None and self.path == self.run_dir / ADAPTER_DIR
            return f"the final adapter of run {self.run_dir}" if final else f"the export {self.path}"
        return f"the PEFT folder {self.path} (no {MANIFEST_NAME}: nothing to check it against)"


def _locate(src: Path) -> ResolvedAdapter | None:
    """The adapter folder `src` names by the module's rule, unchecked; None for a run directory without a final
    adapter (or a folder that holds no adapter at all)."""
    next_to_run = src.parent if src.name == ADAPTER_DIR else None
    if (src / MANIFEST_NAME).is_file():
        return ResolvedAdapter(src, "export", next_to_run)
    if (
        has_adapter_files(src) and (src.parent / CHECKPOINT_MANIFEST).is_file()
    ):  # RUN/checkpoints/step_N/adapter
        return ResolvedAdapter(src, "checkpoint", src.parent.parent.parent)
    if (src / CHECKPOINT_MANIFEST).is_file():  # RUN/checkpoints/step_N
        return ResolvedAdapter(src / ADAPTER_DIR, "checkpoint", src.parent.parent)
    if has_adapter_files(src):
        return ResolvedAdapter(src, "folder", next_to_run)
    final = src / ADAPTER_DIR
    if (final / MANIFEST_NAME).is_file() or has_adapter_files(final):  # a run with its final adapter
        found = _locate(final)
        return None if found is None else ResolvedAdapter(found.path, found.kind, src)
    return None


def _check_directory(src: Path) -> None:
    if not src.is_dir():
        what = "it does not exist" if not src.exists() else "it is a file"
        raise ExportError(f"adapter source {src} is not a directory ({what}); pass {EXPECTED}")


def _newest_checkpoint(src: Path) -> ResolvedAdapter:
    """The adapter of the newest intact checkpoint of run `src` (it has no final adapter), said in the log."""
    newest = latest_checkpoint(src)  # checked against its manifest; damaged ones are skipped with a warning
    if newest is None:
        none_intact = (
            f" ({src / CHECKPOINTS_DIR} holds no intact checkpoint: see the warnings above)"
            if (src / CHECKPOINTS_DIR).is_dir()
            else ""
        )
        raise ExportError(
            f"no adapter in {src}{none_intact}: expected {EXPECTED}; train first, or pass the directory that "
            "holds the adapter"
        )
    logger.warning(
        "run %s has no final %s/ (it stopped before its end): using its newest intact checkpoint %s",
        src,
        ADAPTER_DIR,
        newest,
    )
    return ResolvedAdapter(newest / ADAPTER_DIR, "checkpoint", src)


def resolve_adapter(path: str | os.PathLike[str]) -> ResolvedAdapter:
    """The adapter that `path` (a run directory, a checkpoint, an export or a PEFT folder) names, every file
    checked against its manifest (see the module docstring).

    Raises ExportError when `path` holds no adapter or an export's file differs from its manifest, and
    CheckpointError when a checkpoint's file differs from `checkpoint.json`; each names the file and what to do.
    """
    src = Path(path)
    _check_directory(src)
    found = _locate(src)
    if found is None:
        return _newest_checkpoint(src)
    if found.kind == "export":
        verify_adapter(str(found.path))
    elif found.kind == "checkpoint":
        verify_checkpoint(found.path.parent)
    return found


def export_folder(path: str | os.PathLike[str]) -> Path:
    """The local export that `path` names for serving: an export folder, or a run directory's final adapter.

    A checkpoint, a bare PEFT folder or a run without a final adapter is refused (ExportError): serving needs
    the manifest an export writes. The files are not read here: the verified copy checks each against the
    manifest (`visionrl.adapter.fetch`)."""
    src = Path(path)
    _check_directory(src)
    found = _locate(src)
    if found is not None and found.kind == "export":
        return found.path
    what = found.describe() if found is not None else f"{src}, which holds no final {ADAPTER_DIR}/"
    raise ExportError(
        f"{src} is not a complete export: it is {what}, without {MANIFEST_NAME}. Serving takes exports only: "
        f"run `visionrl export {src} DEST` and serve DEST"
    )
