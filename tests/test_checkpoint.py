"""Tests of visionrl.checkpoint: round trip, atomicity under crashes, corruption detection, pruning."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from visionrl.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from visionrl.errors import InputError, NonFiniteError, StorageError

ADAPTER_CONFIG = b'{"r": 8, "lora_alpha": 16}'


def _weights(step: int, fill: float | None = None) -> bytes:
    # A real safetensors file, different per step, so a test can tell which step's adapter it got back.
    from safetensors.numpy import save

    values = np.arange(1024, dtype=np.float32) * (step + 1)
    if fill is not None:
        values[5] = fill
    return save({"lora_A": values})


def _save(out: Path, step: int, keep: int = 2, trainer_state: bytes | None = None) -> Path:
    return save_checkpoint(
        out,
        step,
        adapter_files={"adapter_config.json": ADAPTER_CONFIG, "adapter_model.safetensors": _weights(step)},
        trainer_state=trainer_state if trainer_state is not None else f"optimizer-{step}".encode() * 100,
        sampler_state={"epoch": 1, "position": step * 32, "order_seed": 7},
        extra={"reward_mean": 0.5, "step": step},
        keep=keep,
    )


def _children(out: Path) -> set[str]:
    return {p.name for p in (out / "checkpoints").iterdir()}


def _flip_byte(path: Path, offset: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip_returns_the_saved_bytes(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    assert path == tmp_path / "checkpoints" / "step_3"
    ckpt = load_checkpoint(path)
    assert ckpt.step == 3
    assert ckpt.trainer_state == b"optimizer-3" * 100
    assert ckpt.sampler_state == {"epoch": 1, "position": 96, "order_seed": 7}
    assert ckpt.extra == {"reward_mean": 0.5, "step": 3}
    assert (ckpt.adapter_dir / "adapter_config.json").read_bytes() == ADAPTER_CONFIG
    assert (ckpt.adapter_dir / "adapter_model.safetensors").read_bytes() == _weights(3)
    assert latest_checkpoint(tmp_path) == path


def test_manifest_records_independent_checksums(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert manifest["step"] == 1
    assert set(manifest["files"]) == {
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "trainer_state.pt",
        "sampler_state.json",
    }
    for rel, info in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert manifest["time"].endswith("+00:00")  # UTC


def test_new_run_has_no_checkpoint(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    assert latest_checkpoint(tmp_path) is None


def test_leftover_tmp_and_incomplete_step_are_ignored_then_cleaned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    # A killed save: a complete-looking temp dir (never renamed) and a step dir without its manifest.
    shutil.copytree(first, root / ".tmp-step_2-dead")
    incomplete = root / "step_3"
    shutil.copytree(first, incomplete)
    (incomplete / "checkpoint.json").unlink()

    with caplog.at_level(logging.WARNING, logger="visionrl.checkpoint"):
        assert latest_checkpoint(tmp_path) == first
    assert "step_3" in caplog.text

    _save(tmp_path, 2)
    assert _children(tmp_path) == {"step_1", "step_2"}


def test_full_disk_names_path_and_bytes_and_keeps_the_previous_checkpoint(tmp_path: Path, small_disk) -> None:
    """A checkpoint that does not fit: StorageError naming the step dir and the bytes it needs, the previous
    checkpoint intact and resumable, no temporary directory left; once there is room the save succeeds."""
    disk = small_disk(64 * 1024)  # step 1 (about 10 KB) fits, a step with a 200 KB optimizer state does not
    first = _save(disk, 1)
    with pytest.raises(StorageError) as err:
        _save(disk, 2, trainer_state=b"x" * 200_000)
    text = str(err.value)
    # needed = adapter config 26 + weights (8 + header + 4096) + trainer state 200000 + sampler state + manifest
    needed = int(text.split(" needs ")[1].split(" bytes")[0].replace(",", ""))
    assert 204_000 < needed < 206_000, text
    assert "the disk is full: writing " + str(disk / "checkpoints" / "step_2") in text
    assert f"The newest checkpoint {first} is intact." in text and "To fix: free space there" in text
    assert _children(disk) == {"step_1"}  # no .tmp-step_2-* left behind
    assert load_checkpoint(latest_checkpoint(disk)).step == 1
    _save(disk, 2)  # a small one fits
    assert _children(disk) == {"step_1", "step_2"}


def test_unwritable_storage_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from visionrl import files

    _save(tmp_path, 1)

    def read_only(fd: int, data: memoryview) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(files, "_write_fd", read_only)
    with pytest.raises(StorageError, match=r"step_2 cannot be written \(Read-only file system\).*bytes were"):
        _save(tmp_path, 2)
    assert _children(tmp_path) == {"step_1"}


def test_a_nan_adapter_is_never_checkpointed_and_pruning_keeps_the_healthy_one(tmp_path: Path) -> None:
    healthy = _save(tmp_path, 1, keep=1)
    with pytest.raises(
        NonFiniteError, match=r"not saving the checkpoint of step 2: .*1 tensor\(s\) with NaN"
    ):
        save_checkpoint(
            tmp_path, 2, adapter_files={"adapter_model.safetensors": _weights(2, fill=float("nan"))},
            trainer_state=b"s", sampler_state={}, keep=1,
        )  # fmt: skip
    assert _children(tmp_path) == {"step_1"}
    # A NaN checkpoint written by a run without the guard (checksums consistent): never resumed from, and with
    # keep=1 the next save keeps the new healthy one rather than counting the NaN one.
    old = tmp_path / "checkpoints" / "step_2"
    shutil.copytree(healthy, old)
    nan = _weights(2, fill=float("inf"))
    (old / "adapter" / "adapter_model.safetensors").write_bytes(nan)
    manifest = json.loads((old / "checkpoint.json").read_text())
    manifest["step"] = 2
    manifest["files"]["adapter/adapter_model.safetensors"] = {"sha256": hashlib.sha256(nan).hexdigest(),
                                                              "bytes": len(nan)}  # fmt: skip
    (old / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="non-finite adapter"):
        verify_checkpoint(old)
    assert latest_checkpoint(tmp_path) == healthy
    _save(tmp_path, 3, keep=1)
    assert _children(tmp_path) == {"step_3"}


def test_corrupted_file_falls_back_to_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    _flip_byte(second / "trainer_state.pt")

    with caplog.at_level(logging.WARNING, logger="visionrl.checkpoint"):
        assert latest_checkpoint(tmp_path) == first
    assert "step_2" in caplog.text
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt.*checksum"):
        load_checkpoint(second)


def test_corrupted_adapter_and_manifest_are_detected(tmp_path: Path) -> None:
    first = _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    _flip_byte(second / "adapter" / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match="adapter_model.safetensors"):
        load_checkpoint(second)
    (first / "checkpoint.json").write_text('{"step": 1, "files": ')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(first)
    assert latest_checkpoint(tmp_path) is None


def test_missing_file_and_truncation_are_detected(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    state = path / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        verify_checkpoint(path)
    state.unlink()
    with pytest.raises(CheckpointError, match="lacks its file trainer_state.pt"):
        verify_checkpoint(path)


def test_renamed_checkpoint_is_not_trusted(tmp_path: Path) -> None:
    first = _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    second.rename(second.with_name("step_9"))
    assert latest_checkpoint(tmp_path) == first


def test_pruning_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert _children(tmp_path) == {"step_3", "step_4"}
    _save(tmp_path, 5, keep=1)
    assert _children(tmp_path) == {"step_5"}


def test_pruning_sorts_steps_numerically(tmp_path: Path) -> None:
    for step in (9, 10, 11):
        _save(tmp_path, step, keep=2)
    assert _children(tmp_path) == {"step_10", "step_11"}


def test_damaged_checkpoint_does_not_count_towards_keep(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    _flip_byte(second / "sampler_state.json", offset=2)
    _save(tmp_path, 3, keep=2)
    # step_2 can never be resumed from, so step_1 stays as the fallback.
    assert _children(tmp_path) == {"step_1", "step_3"}


def test_replacing_an_existing_step(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2, trainer_state=b"before resume")
    path = _save(tmp_path, 2, trainer_state=b"after resume")
    assert load_checkpoint(path).trainer_state == b"after resume"
    assert _children(tmp_path) == {"step_1", "step_2"}  # no .old-/.tmp- leftovers


def test_bad_arguments_write_nothing(tmp_path: Path) -> None:
    files = {"adapter_config.json": ADAPTER_CONFIG}
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 1, adapter_files=files, trainer_state=b"", sampler_state={}, keep=0)
    with pytest.raises(ValueError, match="plain file name"):
        save_checkpoint(tmp_path, 1, adapter_files={"../x": b""}, trainer_state=b"", sampler_state={})
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, adapter_files=files, trainer_state=b"", sampler_state={"rng": object()})
    assert not (tmp_path / "checkpoints").exists()


def test_load_of_a_missing_dir_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory") as info:
        load_checkpoint(tmp_path / "checkpoints" / "step_7")
    assert isinstance(info.value, InputError)
