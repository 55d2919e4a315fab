"""The LoRA kernel tuner: the job's kernel shapes, the search, and a folder that vLLM's own reader resolves to the
tuned configs (the timings on a card are `benchmarks/lora_kernel_tune.py`'s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from visionrl.rollout.lora_kernels import (
    SEARCH_SPACE,
    default_config,
    descend,
    gpu_file_stem,
    job_shapes,
    tune,
    vllm_files,
    write_folder,
)

ROOT = Path(__file__).resolve().parents[1]
QWEN3_VL_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip


def test_the_shapes_of_a_qwen3_vl_8b_layer_at_rank_64() -> None:
    shapes = {(s.op, s.name): (s.slices, s.k, s.n, s.outs) for s in job_shapes(QWEN3_VL_8B, 64)}
    # q = 32 heads x 128 = 4096, k and v = 8 x 128 = 1024; o and down both expand 64 -> 4096 with one slice
    assert shapes == {
        ("shrink", "qkv_proj"): (3, 4096, 64, (64, 64, 64)),
        ("expand", "qkv_proj"): (3, 64, 4096, (4096, 1024, 1024)),
        ("shrink", "o_proj"): (1, 4096, 64, (64,)),
        ("expand", "o_proj+down_proj"): (1, 64, 4096, (4096,)),
        ("shrink", "gate_up_proj"): (2, 4096, 64, (64, 64)),
        ("expand", "gate_up_proj"): (2, 64, 12288, (12288, 12288)),
        ("shrink", "down_proj"): (1, 12288, 64, (64,)),
    }


def test_descend_reaches_the_minimum_and_skips_configs_that_do_not_run() -> None:
    target = {"block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 8, "num_stages": 3}
    calls: list[dict] = []

    def time_fn(config: dict) -> float:
        calls.append(config)
        if config["block_m"] == 128:
            raise RuntimeError("out of resources")  # would be the fastest: must be skipped, not crash
        miss = sum(abs(SEARCH_SPACE["shrink"][k].index(config[k]) - SEARCH_SPACE["shrink"][k].index(v))
                   for k, v in target.items())  # fmt: skip
        return 10.0 + miss - (5.0 if config["block_m"] == 128 else 0.0)

    start = default_config("shrink", 512, 3)
    best, best_t, start_t = descend(time_fn, start, SEARCH_SPACE["shrink"])
    assert {k: best[k] for k in target} == target
    assert best_t == 10.0
    # the default (block_m 32 -> 16: 1 step, block_n 16 -> 64: 2, block_k 32 -> 128: 2, split_k 8 -> 4: 1,
    # warps 4 -> 8: 1, stages 2 -> 3: 1) is 8 steps away
    assert start_t == 18.0
    assert best["num_ctas"] == 1 and best["group_size_m"] == 8  # keys outside the space kept from the default
    assert len({tuple(sorted(c.items())) for c in calls}) == len(calls)  # every config timed once


def test_descend_refuses_a_start_that_does_not_run() -> None:
    def broken(config: dict) -> float:
        raise RuntimeError("no card")

    with pytest.raises(RuntimeError, match="default LoRA kernel config does not run here.*no card"):
        descend(broken, default_config("expand", 16, 1), SEARCH_SPACE["expand"])


def _rows() -> list[dict]:
    shapes = job_shapes(QWEN3_VL_8B, 64)

    def timer(shape, m):  # the fastest block_m grows with m: each m gets its own entry
        return lambda c: abs(c["block_m"] - min(128, max(16, m // 8))) + c["num_stages"] * 0.1

    return tune(shapes, [16, 512, 4096], timer, passes=1)


def test_the_files_hold_every_slice_count_in_vllms_layout() -> None:
    rows = [r for r in _rows() if r["slices"] == 1]  # slices 2 and 3 must be filled from the nearest (1)
    files = vllm_files(rows, max_loras=1)
    assert set(files) == {"SHRINK", "EXPAND_TRUE"}
    shrink = files["SHRINK"]
    assert list(shrink) == ["2"]  # max_loras + 1: vLLM's lora_ids hold the no-LoRA slot too
    assert sorted(shrink["2"]) == ["1", "2", "3"]
    assert shrink["2"]["3"] == shrink["2"]["1"]
    assert shrink["2"]["1"]["512"]["4096"]["64"]["block_m"] == 64
    assert shrink["2"]["1"]["512"]["12288"]["64"]["block_m"] == 64
    assert gpu_file_stem("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"


def test_vllms_reader_resolves_the_written_folder_to_the_tuned_configs(tmp_path, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    utils = pytest.importorskip("vllm.lora.ops.triton_ops.utils")
    rows = _rows()
    write_folder(rows, tmp_path, "NVIDIA H200")
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    try:

        def tuned(op, m, k, n, slices):
            return next(
                r["config"]
                for r in rows
                if (r["op"], r["m"], r["k"], r["n"], r["slices"]) == (op, m, k, n, slices)
            )

        # vLLM's own lookup: max_loras 2 (one slot + no-LoRA), 500 tokens -> the 512 entry, exact k and n
        got = utils.get_lora_op_configs(
            "shrink", max_loras=2, batch=500, hidden_size=4096, rank=64, num_slices=3
        )
        assert got == tuned("shrink", 512, 4096, 64, 3) and got["block_m"] == 64
        got = utils.get_lora_op_configs("expand", max_loras=2, batch=8192, hidden_size=12288, rank=64,
                                        num_slices=2, add_inputs=True)  # fmt: skip
        assert got == tuned("expand", 4096, 64, 12288, 2) and got["block_m"] == 128
        # a shape the job lacks (the merger's 4608 features) takes the nearest k: 4096
        got = utils.get_lora_op_configs(
            "shrink", max_loras=2, batch=16, hidden_size=4608, rank=64, num_slices=1
        )
        assert got == tuned("shrink", 16, 4096, 64, 1) and got["block_m"] == 16
    finally:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()


def test_the_benchmark_writes_its_folder_and_table_on_the_cpu(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/lora_kernel_tune.py", "--smoke", "--folder", str(tmp_path), "--ms", "16,512"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "one forward of 512 tokens" in out.stdout
    report = json.loads((tmp_path / "lora_kernel_tune.json").read_text())
    assert report["rank"] == 64 and len(report["rows"]) == 7 * 2
    step = report["per_decode_step_us"]["512"]
    # 36 layers x the 9 kernel calls of a layer (7 shapes, o+down's expand twice)
    assert step["default"] == pytest.approx(36 * sum(r["default_us"] * len(r["name"].split("+"))
                                                     for r in report["rows"] if r["m"] == 512))  # fmt: skip
    assert step["tuned"] <= step["default"]
    assert sorted(p.name for p in tmp_path.glob("NVIDIA_H200_*.json")) == [
        "NVIDIA_H200_EXPAND_TRUE.json", "NVIDIA_H200_SHRINK.json"]  # fmt: skip


def test_the_command_says_what_it_needs_when_the_job_or_the_machine_lacks_it(tmp_path, capsys) -> None:
    from visionrl.cli import main

    job = str(ROOT / "configs/qwen3vl_8b_grpo_lora.yaml")
    # a model folder without config.json: bad input (exit 2), naming the key to fix
    assert main(["tune-lora-kernels", job, f"model.path={tmp_path}"]) == 2
    assert "model.path" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {**QWEN3_VL_8B, "num_hidden_layers": 36}})
    )
    # this machine has no CUDA GPU: a runtime error that says where to run it, and no folder written
    assert main(["tune-lora-kernels", job, f"model.path={tmp_path}", "--out", str(tmp_path / "k")]) == 1
    assert "CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()


def test_the_language_models_config_is_read_from_a_vlm_or_a_text_checkpoint(tmp_path) -> None:
    from visionrl.rollout.lora_kernels import language_model_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "text_config": QWEN3_VL_8B}))
    assert language_model_config(tmp_path) == QWEN3_VL_8B
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_VL_8B))
    assert language_model_config(tmp_path) == QWEN3_VL_8B
