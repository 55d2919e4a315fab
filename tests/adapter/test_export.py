"""Tests of visionrl.export (manifest contents, export to a folder, manifest-last ordering, verification)
and of the vLLM serving check it runs (visionrl.servable)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from visionrl.adapter import export, manifest
from visionrl.adapter.export import export_adapter
from visionrl.adapter.files import MANIFEST_NAME, read_safetensors_header
from visionrl.adapter.manifest import chat_template_sha256, processor_settings, verify_adapter
from visionrl.adapter.servable import adapter_module_names, check_servable
from visionrl.checkpoint import CheckpointError, save_checkpoint
from visionrl.config import LM_PROJECTIONS, MERGER_PROJECTIONS, LoraConfig, config_from_dict, dump_config
from visionrl.errors import ExportError, InputError, StorageError
from visionrl.models.loader import lora_target_regex

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _make_adapter(base: Path, out: Path, lora: LoraConfig) -> Path:
    from visionrl.models.loader import apply_lora, load_base_model

    apply_lora(load_base_model(base), lora).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny base model and three real peft adapters of it (built once: ~5 s)."""
    from visionrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    base = root / "base"
    build_tiny_model(base, seed=0)
    return {
        "base": base,
        "lm": _make_adapter(base, root / "lm", LoraConfig(rank=8)),
        "merger": _make_adapter(
            base, root / "merger", LoraConfig(rank=8, train_merger=True, train_lm_head=True)
        ),
        "blocks": _make_adapter(
            base,
            root / "blocks",
            LoraConfig(rank=8, target_modules=r".*visual\.blocks\.\d+\.mlp\.linear_fc1"),
        ),
    }


def _job_dict(base: Path, output_dir: Path) -> dict[str, Any]:
    return config_from_dict(
        {
            "output_dir": str(output_dir),
            "model": {"path": str(base)},
            "data": {"train": "train.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "lora": {"rank": 8},
        }
    ).model_dump(mode="json")


def _make_run(tmp_path: Path, models: dict[str, Path], *, final_adapter: bool = True) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(config_from_dict(_job_dict(models["base"], run))))
    (run / "eval").mkdir()
    final = {"accuracy": 0.75, "num_samples": 4, "num_failed": 0, "samples": [{"id": 1}, {"id": 2}]}
    (run / "eval" / "final.json").write_text(json.dumps(final))
    if final_adapter:
        shutil.copytree(models["lm"], run / "adapter")
    return run


# --------------------------------------------------------------------------------------------------
# Export to a folder


def test_export_writes_files_and_a_correct_manifest(tmp_path: Path, models: dict[str, Path]) -> None:
    run = _make_run(tmp_path, models)
    dest = tmp_path / "exported"
    manifest = export_adapter(run, str(dest))

    assert json.loads((dest / MANIFEST_NAME).read_text()) == manifest
    for name in PEFT_FILES:
        assert (dest / name).read_bytes() == (models["lm"] / name).read_bytes()
    exported = {p.name for p in dest.iterdir() if p.name != MANIFEST_NAME}
    assert set(manifest["files"]) == exported
    for name in exported:
        assert manifest["files"][name] == {"sha256": _sha(dest / name), "bytes": (dest / name).stat().st_size}

    base = models["base"]
    assert manifest["format_version"] == 1
    assert manifest["created"].endswith("+00:00")
    assert manifest["base_model"] == {
        "path_or_name": str(base),
        "config_sha256": _sha(base / "config.json"),
        "model_type": "qwen3_vl",
    }
    # The tiny processor: patch 16, merge 2, mean = std = 0.5, pixel limits 32*32 .. 448*448.
    processor = manifest["processor"]
    assert (processor["patch_size"], processor["merge_size"]) == (16, 2)
    assert (processor["min_pixels"], processor["max_pixels"]) == (32 * 32, 448 * 448)
    assert processor["image_mean"] == processor["image_std"] == [0.5, 0.5, 0.5]
    assert manifest["chat_template_sha256"] == _sha(base / "chat_template.jinja")
    peft_regex = lora_target_regex(LoraConfig(rank=8))  # peft saves the regex the adapter was made with
    assert manifest["lora"] == {"r": 8, "lora_alpha": 32.0, "target_modules": peft_regex, "lora_dropout": 0.0}
    assert manifest["training"] == _job_dict(base, run)
    # Per-sample records stay in eval/final.json; the manifest keeps the numbers.
    assert manifest["eval"] == {"accuracy": 0.75, "num_samples": 4, "num_failed": 0}
    serving = manifest["serving"]
    assert serving["ok"] and serving["max_lora_rank"] == 8 and not serving["tower_connector_lora"]
    assert verify_adapter(str(dest)) == manifest


def test_explicit_eval_results_win_over_the_run(tmp_path: Path, models: dict[str, Path]) -> None:
    run = _make_run(tmp_path, models)
    manifest = export_adapter(run, str(tmp_path / "out"), eval_results={"accuracy": 0.9})
    assert manifest["eval"] == {"accuracy": 0.9}


def test_export_from_checkpoints(tmp_path: Path, models: dict[str, Path]) -> None:
    run = _make_run(tmp_path, models, final_adapter=False)
    merger_files = {name: (models["merger"] / name).read_bytes() for name in PEFT_FILES}
    lm_files = {name: (models["lm"] / name).read_bytes() for name in PEFT_FILES}
    common = {"trainer_state": b"state", "sampler_state": {"position": 0}}
    save_checkpoint(run, 1, adapter_files=lm_files, **common)
    newest = save_checkpoint(run, 2, adapter_files=merger_files, **common)

    # A run without a final adapter: the newest checkpoint's adapter is exported.
    manifest = export_adapter(run, str(tmp_path / "from_run"))
    assert manifest["files"]["adapter_model.safetensors"]["sha256"] == _sha(models["merger"] / PEFT_FILES[1])
    assert manifest["serving"]["tower_connector_lora"]
    assert manifest["training"]["model"]["path"] == str(models["base"])

    for src in (newest, newest / "adapter"):
        again = export_adapter(src, str(tmp_path / f"from_{src.name}"))
        assert again["files"] == manifest["files"]
        assert again["training"] == manifest["training"]


def test_export_from_a_bare_adapter_dir_reads_the_base_from_peft(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    manifest = export_adapter(models["lm"], str(tmp_path / "out"))
    assert manifest["base_model"]["path_or_name"] == str(models["base"])
    assert manifest["base_model"]["model_type"] == "qwen3_vl"
    assert manifest["training"] is None and manifest["eval"] is None


def test_export_without_an_adapter_says_what_to_pass(tmp_path: Path) -> None:
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(ExportError, match="no adapter in") as info:
        export_adapter(tmp_path / "empty_run", str(tmp_path / "out"))
    assert isinstance(info.value, InputError)
    with pytest.raises(ExportError, match="not a directory"):
        export_adapter(tmp_path / "missing", str(tmp_path / "out"))


def test_export_into_the_adapter_dir_adds_the_manifest(tmp_path: Path, models: dict[str, Path]) -> None:
    run = _make_run(tmp_path, models)
    before = {name: _sha(run / "adapter" / name) for name in PEFT_FILES}
    manifest = export_adapter(run, str(run / "adapter"))
    assert {name: _sha(run / "adapter" / name) for name in PEFT_FILES} == before
    assert MANIFEST_NAME not in manifest["files"]
    assert verify_adapter(str(run / "adapter")) == manifest
    # The run's adapter dir now holds a manifest; exporting the run again still works.
    assert export_adapter(run, str(tmp_path / "out"))["files"] == manifest["files"]


def test_export_checks_the_source_against_its_manifest(tmp_path: Path, models: dict[str, Path]) -> None:
    """The source is read by `visionrl.adapter.resolve`: a run's exported final adapter that was changed since is
    refused (no export of it, no fallback to a checkpoint), and so is a changed checkpoint file."""
    run = _make_run(tmp_path, models)
    export_adapter(run, str(run / "adapter"))  # the final adapter now has its manifest
    save_checkpoint(run, 1, adapter_files={n: (models["lm"] / n).read_bytes() for n in PEFT_FILES},
                    trainer_state=b"state", sampler_state={})  # fmt: skip
    (run / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ExportError, match=r"adapter_config\.json in .*does not match its manifest"):
        export_adapter(run, str(tmp_path / "out"))
    (run / "checkpoints" / "step_1" / "trainer_state.pt").write_bytes(b"other")
    with pytest.raises(CheckpointError, match="file trainer_state.pt of checkpoint"):
        export_adapter(run / "checkpoints" / "step_1", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_processor_and_template_of_older_checkpoint_layouts(tmp_path: Path) -> None:
    # Qwen2.5-VL style: a processor_config.json without image settings, a flat preprocessor_config.json
    # with explicit pixel limits, and the chat template inside tokenizer_config.json.
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    pre = {
        "patch_size": 14,
        "merge_size": 2,
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "image_mean": [0.48],
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre | {"size": {"shortest_edge": 1}}))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))

    settings = processor_settings(tmp_path)
    assert settings is not None
    assert (settings["patch_size"], settings["min_pixels"], settings["max_pixels"]) == (14, 3136, 12845056)
    assert settings["image_mean"] == [0.48] and settings["image_std"] is None
    assert chat_template_sha256(tmp_path) == hashlib.sha256(template.encode()).hexdigest()
    assert (
        processor_settings(tmp_path / "nothing") is None
        and chat_template_sha256(tmp_path / "nothing") is None
    )


# --------------------------------------------------------------------------------------------------
# The manifest is written last


def test_a_destination_that_cannot_be_created_is_named(tmp_path: Path, models: dict[str, Path]) -> None:
    run = _make_run(tmp_path, models)
    with pytest.raises(StorageError, match=r"/proc/visionrl-export-test cannot be created there"):
        export_adapter(run, "/proc/visionrl-export-test")  # no folder can be made under /proc, even as root


def test_failed_upload_leaves_no_manifest(
    tmp_path: Path, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _make_run(tmp_path, models)
    dest = tmp_path / "out"
    export_adapter(run, str(dest))  # an earlier, complete export at the same place
    assert (dest / MANIFEST_NAME).is_file()
    real_upload = export._upload_file

    def failing_upload(fs: Any, local: Path, remote: str) -> None:
        if local.name == "adapter_model.safetensors":
            raise OSError("connection reset")
        real_upload(fs, local, remote)

    monkeypatch.setattr(export, "_upload_file", failing_upload)
    # the storage's own error, named with the file and bytes (visionrl.errors.storage_error)
    with pytest.raises(StorageError, match="adapter_model.safetensors failed: connection reset"):
        export_adapter(run, str(dest))
    # Also the old manifest is gone: it must not vouch for a mix of old and new files.
    assert not (dest / MANIFEST_NAME).exists()
    with pytest.raises(ExportError, match="has no visionrl_manifest.json"):
        verify_adapter(str(dest))


def test_half_written_upload_is_caught_before_the_manifest(
    tmp_path: Path, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def truncating_upload(fs: Any, local: Path, remote: str) -> None:
        fs.pipe_file(remote, local.read_bytes()[:-3])

    monkeypatch.setattr(export, "_upload_file", truncating_upload)
    dest = tmp_path / "out"
    with pytest.raises(ExportError, match="does not verify"):
        export_adapter(_make_run(tmp_path, models), str(dest))
    assert not (dest / MANIFEST_NAME).exists()


def test_manifest_is_written_after_every_file_is_checked(
    tmp_path: Path, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_upload, real_check, real_write = (
        export._upload_file,
        manifest.check_remote_file,
        export.write_manifest,
    )

    def upload(fs: Any, local: Path, remote: str) -> None:
        events.append(f"upload {local.name}")
        real_upload(fs, local, remote)

    def check(fs: Any, remote: str, expected: Any) -> str | None:
        events.append(f"check {Path(remote).name}")
        return real_check(fs, remote, expected)

    def write(fs: Any, root: str, manifest: dict[str, Any]) -> None:
        events.append("manifest")
        real_write(fs, root, manifest)

    monkeypatch.setattr(export, "_upload_file", upload)
    monkeypatch.setattr(manifest, "check_remote_file", check)
    monkeypatch.setattr(export, "write_manifest", write)
    written = export_adapter(_make_run(tmp_path, models), str(tmp_path / "out"))
    assert events[-1] == "manifest" and events.count("manifest") == 1
    assert {e for e in events if e.startswith("check")} == {f"check {name}" for name in written["files"]}


# --------------------------------------------------------------------------------------------------
# Verification


def test_verify_detects_a_tampered_file(tmp_path: Path, models: dict[str, Path]) -> None:
    dest = tmp_path / "out"
    export_adapter(models["lm"], str(dest))
    weights = dest / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # same size, different content
    weights.write_bytes(bytes(data))
    with pytest.raises(
        ExportError, match=r"adapter_model\.safetensors .*does not match its manifest checksum"
    ):
        verify_adapter(str(dest))


def test_verify_detects_a_missing_file_and_a_broken_manifest(tmp_path: Path, models: dict[str, Path]) -> None:
    dest = tmp_path / "out"
    export_adapter(models["lm"], str(dest))
    (dest / "adapter_config.json").unlink()
    with pytest.raises(ExportError, match="adapter_config.json .*missing"):
        verify_adapter(str(dest))
    (dest / MANIFEST_NAME).write_text('{"format_version": 1, "files": {')
    with pytest.raises(ExportError, match="not valid JSON"):
        verify_adapter(str(dest))


# --------------------------------------------------------------------------------------------------
# Serving check


def _cfg(**overrides: Any) -> dict[str, Any]:
    return {"r": 16, "lora_alpha": 32, "target_modules": LM_PROJECTIONS, "modules_to_save": None} | overrides


@pytest.mark.parametrize(("rank", "expected"), [(1, 1), (8, 8), (9, 16), (24, 32), (300, 320), (512, 512)])
def test_rank_maps_to_the_smallest_vllm_max_lora_rank(rank: int, expected: int) -> None:
    result = check_servable(_cfg(r=rank))
    assert result["ok"], result["problems"]
    assert result["max_lora_rank"] == expected
    assert any(f"--max-lora-rank {expected}" in note for note in result["notes"])


def test_rank_above_vllm_limit_is_a_problem() -> None:
    result = check_servable(_cfg(r=600))
    assert not result["ok"]
    assert result["max_lora_rank"] == 0
    assert any("600" in p and "512" in p for p in result["problems"])
    # rank_pattern ranks count too: vLLM sizes its slots by the largest.
    assert check_servable(_cfg(r=8, rank_pattern={"q_proj": 40}))["max_lora_rank"] == 64


def test_vision_block_targets_are_a_problem() -> None:
    result = check_servable(_cfg(target_modules=r".*visual\.blocks\.\d+\.(attn\.qkv|mlp\.linear_fc1)"))
    assert not result["ok"]
    assert any("vLLM ignores LoRA on the vision tower blocks" in p for p in result["problems"])
    # A bare suffix list also reaches into the blocks (they have mlp.linear_fc1 too).
    suffixes = check_servable(_cfg(target_modules=["linear_fc1"]))
    assert not suffixes["ok"] and suffixes["tower_connector_lora"]


def test_merger_targets_need_the_tower_connector_flag() -> None:
    result = check_servable(_cfg(target_modules=f"(?:{LM_PROJECTIONS})|(?:{MERGER_PROJECTIONS})"))
    assert result["ok"], result["problems"]
    assert result["tower_connector_lora"]
    assert any("--enable-tower-connector-lora" in note for note in result["notes"])
    # The representative names: Qwen3-VL's merger and deepstack merger (2 linears each) + Qwen2.5-VL's mlp.0/2.
    assert result["targets"] == {"language_model": 7, "connector": 6}
    assert not check_servable(_cfg())["tower_connector_lora"]


def test_qwen2_5_vl_merger_names_are_the_connector_not_the_tower() -> None:
    """Qwen2.5-VL's merger is `visual.merger.mlp.0/2`; its vision blocks' `mlp.gate_proj` stays the tower."""
    tensors = {
        f"base_model.model.model.visual.merger.mlp.{i}.lora_{ab}.weight": "F32" for i in (0, 2) for ab in "AB"
    }
    merger = check_servable(_cfg(), tensors)
    assert merger["ok"] and merger["tower_connector_lora"] and merger["targets"] == {"connector": 2}
    blocks = check_servable(
        _cfg(), {"base_model.model.model.visual.blocks.0.mlp.gate_proj.lora_A.weight": "F32"}
    )
    assert not blocks["ok"] and blocks["targets"] == {"vision_tower": 1}


def test_lm_head_lora_is_a_problem_on_a_qwen2_5_vl_base_only() -> None:
    """vLLM 0.32 loads no LoRA on Qwen2.5-VL's lm_head (docs/ENGINE_NOTES.md); on Qwen3-VL it does."""
    config = _cfg(target_modules=f"(?:{LM_PROJECTIONS})|(?:lm_head)")
    for model_type in (None, "qwen3_vl"):
        assert check_servable(config, model_type=model_type)["ok"], model_type
    result = check_servable(config, model_type="qwen2_5_vl")
    assert not result["ok"]
    assert any(
        "lm_head of a qwen2_5_vl base" in p and "lora.train_lm_head: false" in p for p in result["problems"]
    )
    assert check_servable(_cfg(), model_type="qwen2_5_vl")["ok"]  # without lm_head: fine


def test_list_targets_on_the_language_model_are_servable() -> None:
    result = check_servable(_cfg(target_modules=["q_proj", "v_proj"]))
    assert result["ok"] and result["targets"] == {"language_model": 2}


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "bias"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"target_modules": r".*embed_tokens"}, "does not apply LoRA to"),
        ({"target_modules": r"nothing_matches"}, "no module"),
    ],
)
def test_unsupported_adapter_settings_are_problems(overrides: dict[str, Any], fragment: str) -> None:
    result = check_servable(_cfg(**overrides))
    assert not result["ok"]
    assert any(fragment in p for p in result["problems"]), result["problems"]


def test_real_adapter_weights_decide_the_targets(models: dict[str, Path]) -> None:
    tensors = read_safetensors_header(models["merger"] / "adapter_model.safetensors")
    modules = adapter_module_names(tensors)
    assert "model.language_model.layers.0.self_attn.q_proj" in modules
    assert "model.visual.deepstack_merger_list.0.linear_fc2" in modules
    assert "lm_head" in modules
    config = json.loads((models["merger"] / "adapter_config.json").read_text())
    result = check_servable(config, tensors)
    assert result["ok"], result["problems"]
    assert result["tower_connector_lora"]
    assert result["targets"] == {"language_model": 14, "lm_head": 1, "connector": 4}  # 2 layers x 7
    assert any("F32" in note for note in result["notes"])  # the dtype note


def test_unservable_export_is_refused_unless_allowed(tmp_path: Path, models: dict[str, Path]) -> None:
    dest = tmp_path / "out"
    with pytest.raises(ExportError, match="vision tower blocks"):
        export_adapter(models["blocks"], str(dest))
    assert not dest.exists()  # refused before any upload
    manifest = export_adapter(models["blocks"], str(dest), allow_unservable=True)
    assert not manifest["serving"]["ok"]
    assert verify_adapter(str(dest))["serving"] == manifest["serving"]


def test_damaged_safetensors_header_is_an_export_error(tmp_path: Path) -> None:
    bad = tmp_path / "adapter_model.safetensors"
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ExportError, match="not a valid safetensors file"):
        read_safetensors_header(bad)


def test_export_through_a_non_local_fsspec_filesystem(tmp_path: Path, models: dict[str, Path]) -> None:
    # fsspec's in-memory filesystem stands in for s3:// here: no local paths, no rename, manifest by one put.
    import fsspec

    url = f"memory://visionrl-test/{tmp_path.name}/adapter"
    fs, root = fsspec.core.url_to_fs(url)
    try:
        manifest = export_adapter(models["lm"], url)
        assert fs.cat_file(f"{root}/adapter_model.safetensors") == (models["lm"] / PEFT_FILES[1]).read_bytes()
        assert json.loads(fs.cat_file(f"{root}/{MANIFEST_NAME}")) == manifest
        assert verify_adapter(url) == manifest
        fs.pipe_file(f"{root}/adapter_config.json", b"{}")
        with pytest.raises(ExportError, match="adapter_config.json"):
            verify_adapter(url)
    finally:
        fs.rm(root, recursive=True)


def test_a_foreign_non_empty_folder_is_refused_unless_overwrite(
    tmp_path: Path, models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from visionrl.cli import main

    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    assert main(["export", str(models["lm"]), str(dest)]) == 2
    err = capsys.readouterr().err
    assert (
        f"export destination {dest} is not empty and holds files that are not an adapter export: notes.txt"
        in err
    )
    assert "--overwrite" in err
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]  # nothing written
    assert main(["export", str(models["lm"]), str(dest), "--overwrite"]) == 0
    assert (dest / "notes.txt").read_text() == "mine"  # the user's file is left alone
    verify_adapter(str(dest))
    # An earlier export is not foreign: exporting over it needs no flag.
    again = tmp_path / "again"
    export_adapter(models["lm"], again)
    export_adapter(models["merger"], again)
    assert verify_adapter(str(again))["files"]["adapter_model.safetensors"]["sha256"] == _sha(
        models["merger"] / "adapter_model.safetensors"
    )


def test_an_adapter_with_nan_weights_is_never_exported(
    tmp_path: Path, models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.numpy import load_file, save_file

    from visionrl.cli import main

    bad = tmp_path / "nan-adapter"
    shutil.copytree(models["lm"], bad)
    weights = load_file(str(bad / "adapter_model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name].copy()
    weights[name].flat[0] = float("nan")
    save_file(weights, str(bad / "adapter_model.safetensors"))
    assert main(["export", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        f"refusing to export {bad}: its weights have 1 tensor(s) with NaN or infinite values, e.g. {name}"
        in err
    )
    assert not (tmp_path / "out").exists()


def test_a_full_disk_during_export_names_the_file_and_leaves_no_manifest(
    models: dict[str, Path], small_disk
) -> None:
    """fsspec's local copy writes through Python's file objects, not visionrl's write call: this needs the real
    small tmpfs (skipped where it cannot be mounted)."""
    disk = small_disk(16 * 1024)  # the adapter's weights are larger than 16 KiB
    if not os.path.ismount(disk):
        pytest.skip("no tmpfs could be mounted: fsspec's copy bypasses the stood-in write call")
    from visionrl.errors import StorageError

    size = (models["lm"] / "adapter_model.safetensors").stat().st_size
    with pytest.raises(StorageError) as err:
        export_adapter(models["lm"], disk / "out")
    text = str(err.value)
    assert (
        f"the disk is full: writing {disk / 'out' / 'adapter_model.safetensors'} needs {size:,} bytes" in text
    )
    assert "No manifest was written" in text
    assert not (disk / "out" / MANIFEST_NAME).exists()
