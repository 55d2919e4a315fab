"""The engines' scratch folders: vLLM loads LoRA from a path, so each engine writes the adapter version it
serves (hundreds of MB at 8B) to a folder of its own, in memory-backed /dev/shm where the OS has it.

A folder is named after the process that owns it (`visionrl-vllm-adapters-<pid>-<random>`). An engine removes
its folder when closed; one killed with its run (SIGKILL, a dead actor, Ray torn down on an error) cannot, so
the driver removes the folders of dead processes at the end of every run, on every exit path, and every new
engine does so at start (for a driver that was killed itself).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

PREFIX = "visionrl-vllm-adapters-"


def scratch_root() -> Path:
    """Where scratch folders go: /dev/shm when writable, else the system temp dir."""
    return Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


def make_scratch_dir(root: Path | None = None) -> Path:
    """A new scratch folder owned by this process."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root or scratch_root()))


def process_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed engine not yet reaped by its parent owns nothing)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's live process
        return True


def remove_orphaned_scratch(root: Path | None = None) -> list[Path]:
    """Remove scratch folders whose owning process is gone; returns what was removed."""
    removed = []
    folder = root or scratch_root()
    for child in folder.glob(f"{PREFIX}*"):
        pid = child.name[len(PREFIX) :].split("-", 1)[0]
        if child.is_dir() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    if removed:
        logger.info("removed %d scratch folder(s) of engines that did not close: %s", len(removed), removed)
    return removed
