"""Tests of visionrl.rollout.scratch: the engines' adapter copies of dead processes are removed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from visionrl.rollout.scratch import PREFIX, make_scratch_dir, remove_orphaned_scratch


def test_only_folders_of_dead_processes_are_removed(tmp_path: Path) -> None:
    mine = make_scratch_dir(tmp_path)
    assert mine.name.startswith(f"{PREFIX}{os.getpid()}-")
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(child.stdout)  # that process has exited
    dead = tmp_path / f"{PREFIX}{dead_pid}-abc"
    (dead / "visionrl-v3-4").mkdir(parents=True)
    (dead / "visionrl-v3-4" / "adapter_model.safetensors").write_bytes(b"x" * 1000)
    other = tmp_path / "someone-elses-folder"
    other.mkdir()
    assert remove_orphaned_scratch(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


def test_the_folder_of_a_killed_process_not_yet_reaped_is_removed(tmp_path: Path) -> None:
    """A killed engine stays a zombie until its parent reaps it: it owns nothing any more."""
    import psutil

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped (no wait yet)
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.05)
        folder = tmp_path / f"{PREFIX}{child.pid}-xyz"
        folder.mkdir()
        assert remove_orphaned_scratch(tmp_path) == [folder]
    finally:
        child.wait()
