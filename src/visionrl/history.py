"""`history.jsonl` of a run: one JSON line of metrics per step, appended (and fsynced) as each step ends.

A run killed in the middle of an append leaves a torn last line. On resume that line is dropped and reported,
instead of every later `--resume` failing on it, and the run continues from a checkpoint no newer than the last
step recorded (`orchestrate.resume`), so the lost step runs again and no step is missing from the file; a damaged
line before the last one was not written by an append that got killed, so it is an error naming the line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from visionrl.errors import InputError, storage_error, storage_errors
from visionrl.files import atomic_write, write_synced

logger = logging.getLogger(__name__)


def append(path: Path, record: dict[str, Any]) -> None:
    """Append one step's record. A full or unwritable disk raises StorageError naming the file."""
    line = (json.dumps(record) + "\n").encode()
    try:
        write_synced(path, line, append=True)
    except OSError as err:
        raise storage_error(err, path, len(line), kept=f"{path} holds every step before this one.") from None


def _parse(path: Path, text: str, warn: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of every complete line; a torn last line is dropped (with a warning if `warn`)."""
    lines = text.split("\n")
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a step record")
        except ValueError as err:  # JSONDecodeError is a ValueError
            if number < len(lines):  # a complete line (a newline follows it): not a torn append
                raise InputError(
                    f"{path}, line {number}: not a step record ({err}); the file was edited or damaged. Fix or "
                    "delete that line (the metrics in TensorBoard are unaffected), then resume"
                ) from None
            if warn:
                logger.warning(
                    "%s: dropped its torn last line %d (%d bytes, a run killed while writing it)",
                    path,
                    number,
                    len(line.encode()),
                )
            continue
        out.append((line, record))
    return out


def trim(path: Path, last_step: int) -> list[dict[str, Any]]:
    """Keep the records of steps up to `last_step` (the checkpoint resumed from: later steps run again) and
    drop a torn last line; returns the records kept."""
    if not path.exists():
        return []
    kept = [(line, r) for line, r in _parse(path, path.read_text()) if r["step"] <= last_step]
    text = "".join(line + "\n" for line, _ in kept)
    with storage_errors(path, len(text.encode()), kept=f"{path} was left as it was."):
        atomic_write(path, text)
    return [r for _, r in kept]


def read(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a history file (a torn last line is left out, without a warning)."""
    return [r for _, r in _parse(path, path.read_text(), warn=False)] if path.exists() else []


def recorded_through(path: Path) -> int:
    """The last step S such that steps 1..S all have a complete record (0 when step 1 has none)."""
    steps = {r["step"] for r in read(path)}
    last = 0
    while last + 1 in steps:
        last += 1
    return last
