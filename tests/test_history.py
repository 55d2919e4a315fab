"""Tests of visionrl.history (history.jsonl) and of the atomic write it and the reports use: torn last lines,
damaged lines, full and read-only disks."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from visionrl import files, history
from visionrl.errors import InputError, StorageError, storage_errors


def _three_steps(path: Path) -> None:
    for step in (1, 2, 3):
        history.append(path, {"step": step, "reward/mean": step / 10})


def test_trim_keeps_the_steps_of_the_checkpoint_and_drops_a_torn_last_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "history.jsonl"
    _three_steps(path)
    with path.open("a") as f:
        f.write('{"step": 4, "rew')  # a run killed in the middle of appending step 4
    with caplog.at_level(logging.WARNING, logger="visionrl.history"):
        kept = history.trim(path, 2)
    assert [r["step"] for r in kept] == [1, 2]
    assert path.read_text() == '{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean": 0.2}\n'
    # '{"step": 4, "rew' is 16 bytes, on line 4
    assert f"{path}: dropped its torn last line 4 (16 bytes" in caplog.text
    history.append(path, {"step": 3, "reward/mean": 0.5})
    assert [r["step"] for r in history.read(path)] == [1, 2, 3]


def test_a_damaged_line_before_the_end_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, oops}\n{"step": 3}\n')
    with pytest.raises(InputError, match=r"history\.jsonl, line 2: not a step record"):
        history.trim(path, 3)
    path.write_text('{"step": 1}\n[1, 2]\n')  # complete (newline-terminated) but not a record
    with pytest.raises(InputError, match="line 2"):
        history.read(path)


def test_a_full_disk_on_append_names_the_file_and_keeps_earlier_steps(tmp_path: Path, small_disk) -> None:
    disk = small_disk(8192)
    path = disk / "history.jsonl"
    _three_steps(path)
    record = {"step": 4, "blob": "x" * 20_000}
    with pytest.raises(StorageError) as err:
        history.append(path, record)
    text = str(err.value)
    # needed: the JSON line, '{"step": 4, "blob": "' (21) + 20000 x + '"}' (2) + newline = 20024 bytes
    assert f"the disk is full: writing {path} needs 20,024 bytes" in text
    assert "holds every step before this one" in text
    # tmpfs may take part of the line before it is full; every complete line before it is intact
    assert [r["step"] for r in history.read(path)] == [1, 2, 3]


def test_atomic_write_on_a_read_only_disk_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "report.json"
    target.write_text("old")

    def read_only(fd: int, data: memoryview) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(files, "_write_fd", read_only)
    with pytest.raises(OSError, match="Read-only"):
        files.atomic_write(target, "new")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temporary file left
    # What its callers show (reports, manifests, the run's config.yaml):
    message = r"report\.json cannot be written \(Read-only file system\); 3 bytes were to be written"
    with pytest.raises(StorageError, match=message), storage_errors(target, 3):
        files.atomic_write(target, "new")
