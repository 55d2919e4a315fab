"""The one rule for reading an adapter path (`visionrl.adapter.resolve`), on hand-made folders: a run directory
(its final adapter, else its newest intact checkpoint), a checkpoint, an export, a bare PEFT folder; every file
checked against its manifest, and the errors that say what to pass."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from visionrl.adapter.fetch import fetch_adapter
from visionrl.adapter.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST_NAME
from visionrl.adapter.manifest import FORMAT_VERSION
from visionrl.adapter.resolve import ResolvedAdapter, export_folder, resolve_adapter
from visionrl.checkpoint import CheckpointError, save_checkpoint
from visionrl.errors import ExportError, InputError


def _files(fill: float = 0.5) -> dict[str, bytes]:
    """The two PEFT files of a small LoRA adapter (`fill` tells adapters apart)."""
    from safetensors.numpy import save

    weights = save({"base_model.model.lm_head.lora_A.weight": np.full((2, 4), fill, dtype=np.float32)})
    config = json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}).encode()
    return {ADAPTER_CONFIG: config, ADAPTER_WEIGHTS: weights}


def _folder(path: Path, fill: float = 0.5) -> Path:
    """A bare PEFT folder (no manifest)."""
    path.mkdir(parents=True)
    for name, data in _files(fill).items():
        (path / name).write_bytes(data)
    return path


def _export(path: Path, fill: float = 0.5) -> Path:
    """An export: the PEFT files and a manifest listing their sha256 and size."""
    _folder(path, fill)
    files = {
        p.name: {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "bytes": p.stat().st_size}
        for p in path.iterdir()
    }
    (path / MANIFEST_NAME).write_text(json.dumps({"format_version": FORMAT_VERSION, "files": files}))
    return path


def _checkpoint(run: Path, step: int, fill: float = 0.5) -> Path:
    return save_checkpoint(
        run, step, adapter_files=_files(fill), trainer_state=b"state", sampler_state={}, keep=5
    )


def _tamper(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------------
# Which folder


def test_a_run_directory_gives_its_final_adapter(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _export(run / "adapter")
    _checkpoint(run, 3)  # a final adapter wins over any checkpoint
    found = resolve_adapter(run)
    assert found == ResolvedAdapter(run / "adapter", "export", run)
    assert found.describe() == f"the final adapter of run {run}"
    assert resolve_adapter(run / "adapter") == found  # the same adapter, named directly


def test_a_run_with_a_bare_final_adapter_gives_it_unchecked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _folder(run / "adapter")
    found = resolve_adapter(run)
    assert found == ResolvedAdapter(run / "adapter", "folder", run)
    assert "nothing to check it against" in found.describe()


def test_a_run_without_a_final_adapter_gives_its_newest_intact_checkpoint_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    _checkpoint(run, 1)
    newest = _checkpoint(run, 2, fill=0.25)
    with caplog.at_level(logging.WARNING, logger="visionrl.adapter.resolve"):
        found = resolve_adapter(run)
    assert found == ResolvedAdapter(newest / "adapter", "checkpoint", run)
    assert found.describe() == f"checkpoint {newest}"
    assert f"run {run} has no final adapter/" in caplog.text and str(newest) in caplog.text

    _tamper(newest / "adapter" / ADAPTER_WEIGHTS)  # a damaged newest one: the previous intact one
    assert resolve_adapter(run).path == run / "checkpoints" / "step_1" / "adapter"


def test_a_checkpoint_and_its_adapter_folder_give_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    step = _checkpoint(run, 4)
    expected = ResolvedAdapter(step / "adapter", "checkpoint", run)
    assert resolve_adapter(step) == expected
    assert resolve_adapter(step / "adapter") == expected


def test_an_export_and_a_bare_folder_stand_alone(tmp_path: Path) -> None:
    assert resolve_adapter(_export(tmp_path / "exp")) == ResolvedAdapter(tmp_path / "exp", "export", None)
    assert resolve_adapter(str(_folder(tmp_path / "peft"))) == ResolvedAdapter(
        tmp_path / "peft", "folder", None
    )


# --------------------------------------------------------------------------------------------------
# Checked against the manifest


def test_a_tampered_export_file_is_refused_naming_it(tmp_path: Path) -> None:
    exported = _export(tmp_path / "exp")
    _tamper(exported / ADAPTER_WEIGHTS)
    with pytest.raises(
        ExportError, match=r"adapter_model\.safetensors in .*does not match its manifest.*re-export"
    ):
        resolve_adapter(exported)


def test_a_tampered_final_adapter_is_refused_not_replaced_by_a_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _export(run / "adapter")
    _checkpoint(run, 1)
    _tamper(run / "adapter" / ADAPTER_CONFIG)
    with pytest.raises(ExportError, match=r"adapter_config\.json in .*does not match its manifest"):
        resolve_adapter(run)


def test_a_tampered_checkpoint_named_directly_is_refused_naming_the_file(tmp_path: Path) -> None:
    step = _checkpoint(tmp_path / "run", 1)
    _tamper(step / "adapter" / ADAPTER_WEIGHTS)
    for path in (step, step / "adapter"):
        with pytest.raises(CheckpointError, match=r"file adapter/adapter_model\.safetensors of checkpoint"):
            resolve_adapter(path)


# --------------------------------------------------------------------------------------------------
# What to pass


def test_a_missing_path_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="is not a directory") as info:
        resolve_adapter(tmp_path / "missing")
    assert isinstance(info.value, InputError)  # the CLI prints it and exits 2
    text = str(info.value)
    assert f"adapter source {tmp_path / 'missing'} is not a directory (it does not exist)" in text
    assert "a run directory" in text and "checkpoints/step_N" in text and ADAPTER_CONFIG in text
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match=r"is not a directory \(it is a file\)"):
        resolve_adapter(tmp_path / "file")


def test_a_folder_without_an_adapter_says_what_to_pass(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"no adapter in .*empty: expected a run directory"):
        resolve_adapter(tmp_path / "empty")
    run = tmp_path / "run"
    _tamper(_checkpoint(run, 1) / "sampler_state.json")
    with pytest.raises(ExportError, match=r"checkpoints holds no intact checkpoint"):
        resolve_adapter(run)


# --------------------------------------------------------------------------------------------------
# Serving: exports only


def test_serving_takes_an_export_or_a_run_whose_final_adapter_was_exported(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _export(run / "adapter")
    assert export_folder(run) == run / "adapter"
    assert export_folder(_export(tmp_path / "exp")) == tmp_path / "exp"
    copy = fetch_adapter(run, tmp_path / "cache")
    assert fetch_adapter(run / "adapter", tmp_path / "cache") == copy  # the same export, the same copy
    assert (copy / ADAPTER_WEIGHTS).read_bytes() == (run / "adapter" / ADAPTER_WEIGHTS).read_bytes()


def test_serving_refuses_what_is_not_an_export_and_says_to_export_it(tmp_path: Path) -> None:
    step = _checkpoint(tmp_path / "run", 1)
    bare = _folder(tmp_path / "peft")
    cases = {
        step: f"checkpoint {step}",
        bare: f"the PEFT folder {bare}",
        tmp_path / "run": "holds no final adapter/",
    }
    for path, what in cases.items():
        with pytest.raises(ExportError, match="not a complete export") as info:
            fetch_adapter(path, tmp_path / "cache")
        assert what in str(info.value) and f"visionrl export {path} DEST" in str(info.value)
    assert not (tmp_path / "cache").exists()


def test_evaluation_reads_an_adapter_path_by_the_same_rule(tmp_path: Path) -> None:
    from visionrl.eval.local import _resolve_adapter

    run = tmp_path / "run"
    newest = _checkpoint(run, 2)
    assert _resolve_adapter(run) == newest / "adapter"  # a run stopped early: its newest checkpoint
    exported = _export(tmp_path / "exp")
    assert _resolve_adapter(exported) == exported
    _tamper(exported / ADAPTER_WEIGHTS)
    with pytest.raises(ExportError, match=r"adapter_model\.safetensors in .*does not match its manifest"):
        _resolve_adapter(exported)
