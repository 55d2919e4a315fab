"""`evaluate_local` on a tiny Qwen3-VL with the HF engine and the real vLLM engine, which must give the same
greedy answers for the base model and for an adapter; bad adapters are refused before any engine starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from visionrl.errors import InputError
from visionrl.eval.local import evaluate_local

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- tiny model, real engines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Qwen3-VL, 8 colour eval records, and a peft adapter (LM + merger) with random non-zero B."""
    import torch

    from visionrl.config import LoraConfig
    from visionrl.data.synthetic import make_dataset
    from visionrl.models.loader import apply_lora, load_base_model
    from visionrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("evaluate")
    model_dir = build_tiny_model(root / "model", seed=0)
    make_dataset(root / "data", "color", num_train=8, num_eval=8, seed=0)
    peft_model = apply_lora(
        load_base_model(model_dir), LoraConfig(rank=8, alpha=16.0, train_merger=True), seed=0
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # B = 0 would make the adapter a no-op
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    peft_model.save_pretrained(root / "adapter")
    return {
        "model": model_dir,
        "data": root / "data" / "eval.jsonl",
        "adapter": root / "adapter",
        "root": root,
    }


@pytest.fixture(scope="module")
def hf_reports(tiny: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """HF-engine reports of the base model and of the adapter (shared by the fast and the slow tests)."""
    out = tiny["root"] / "reports"
    common = {"base": str(tiny["model"]), "data": str(tiny["data"]), "engine": "hf", "max_tokens": 4}
    return {
        "base": evaluate_local(adapter=None, out=str(out / "hf-base.json"), **common),
        "adapter": evaluate_local(adapter=str(tiny["adapter"]), out=str(out / "hf-adapter.json"), **common),
    }


REQUIRED = ("accuracy", "num_samples", "num_failed", "latency_ms_p50", "latency_ms_p95", "tokens_per_s",
            "mean_reward", "model", "data", "ablate_images", "created", "samples")  # fmt: skip


def test_evaluate_local_hf_writes_the_report(
    tiny: dict[str, Path], hf_reports: dict[str, dict[str, Any]]
) -> None:
    report = hf_reports["base"]
    out = tiny["root"] / "reports" / "hf-base.json"
    assert json.loads(out.read_text()) == report
    assert set(REQUIRED) <= set(report)
    assert report["num_samples"] == 8 and report["num_failed"] == 0
    samples = report["samples"]
    assert [s["id"] for s in samples] == [f"color-eval-{i:05d}" for i in range(8)]
    assert 0.0 <= report["accuracy"] <= 1.0
    assert report["accuracy"] == pytest.approx(sum(s["correct"] for s in samples) / 8)
    assert all(1 <= s["num_tokens"] <= 4 for s in samples)
    assert report["latency_ms_p50"] <= report["latency_ms_p95"]
    md = out.with_suffix(".md").read_text()
    assert "| num_samples | 8 |" in md and "color-eval-00000" in md


def test_adapter_changes_hf_answers(hf_reports: dict[str, dict[str, Any]]) -> None:
    base = [s["completion"] for s in hf_reports["base"]["samples"]]
    tuned = [s["completion"] for s in hf_reports["adapter"]["samples"]]
    assert base != tuned
    assert hf_reports["adapter"]["adapter"] is not None and hf_reports["base"]["adapter"] is None


def test_evaluate_local_ablation_keeps_ids_and_answers(tiny: dict[str, Path], tmp_path: Path) -> None:
    report = evaluate_local(base=str(tiny["model"]), adapter=None, data=str(tiny["data"]), out=str(tmp_path / "r.json"),
                            engine="hf", ablate_images=True, max_samples=4, max_tokens=2, seed=3)  # fmt: skip
    assert report["ablate_images"] is True and report["num_samples"] == 4
    records = [json.loads(line) for line in tiny["data"].read_text().splitlines()[:4]]
    assert [(s["id"], s["answer"]) for s in report["samples"]] == [(r["id"], r["answer"]) for r in records]


def test_evaluate_local_rejects_bad_inputs_before_loading(tiny: dict[str, Path], tmp_path: Path) -> None:
    args = {
        "base": str(tiny["model"]),
        "data": str(tiny["data"]),
        "out": str(tmp_path / "r.json"),
        "engine": "hf",
    }
    with pytest.raises(InputError, match="not a directory"):
        evaluate_local(**{**args, "adapter": str(tmp_path / "missing")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="adapter_config.json"):
        evaluate_local(**{**args, "adapter": str(tmp_path / "empty")})
    with pytest.raises(InputError, match="data file"):
        evaluate_local(**{**args, "adapter": None, "data": str(tmp_path / "nope.jsonl")})
    with pytest.raises(InputError, match="unknown engine"):
        evaluate_local(**{**args, "adapter": None, "engine": "tgi"})
    with pytest.raises(InputError, match="no-such-reward"):
        evaluate_local(**{**args, "adapter": None, "rewards": ["no-such-reward"]})
    assert not (tmp_path / "r.json").exists()


def test_evaluate_local_refuses_a_damaged_adapter(tiny: dict[str, Path], tmp_path: Path) -> None:
    """A truncated weights file is refused before any engine starts: by checksum when a manifest is there, by
    the safetensors reader when not."""
    import shutil

    from visionrl.adapter.export import export_adapter

    args = {
        "base": str(tiny["model"]),
        "data": str(tiny["data"]),
        "out": str(tmp_path / "r.json"),
        "engine": "hf",
    }
    exported = tmp_path / "exported"
    export_adapter(str(tiny["adapter"]), str(exported))
    weights = exported / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(InputError, match="adapter_model.safetensors.*manifest"):
        evaluate_local(**{**args, "adapter": str(exported)})
    bare = tmp_path / "bare"
    shutil.copytree(exported, bare)
    (bare / "visionrl_manifest.json").unlink()
    with pytest.raises(InputError, match="cannot be read.*damaged or incomplete"):
        evaluate_local(**{**args, "adapter": str(bare)})
    assert not (tmp_path / "r.json").exists()


def test_evaluate_local_finds_the_adapter_inside_a_run_directory(
    tiny: dict[str, Path], hf_reports: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    # tiny["root"] holds the adapter in adapter/, as a run directory does.
    report = evaluate_local(base=str(tiny["model"]), adapter=str(tiny["root"]), data=str(tiny["data"]),
                            out=str(tmp_path / "r.json"), engine="hf", max_samples=3, max_tokens=4)  # fmt: skip
    assert report["adapter"] == str(tiny["adapter"])
    expected = [s["completion"] for s in hf_reports["adapter"]["samples"][:3]]
    assert [s["completion"] for s in report["samples"]] == expected


def test_evaluate_local_rejects_adapters_it_cannot_rebuild(tiny: dict[str, Path], tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(tiny["adapter"], adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    args = {
        "base": str(tiny["model"]),
        "data": str(tiny["data"]),
        "out": str(tmp_path / "r.json"),
        "engine": "hf",
    }
    with pytest.raises(InputError, match="modules_to_save"):
        evaluate_local(adapter=str(adapter), **args)
    (adapter / "adapter_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "r"}))
    with pytest.raises(InputError, match="lacks r"):
        evaluate_local(adapter=str(adapter), **args)


def test_adapter_with_a_list_of_target_names(tiny: dict[str, Path], tmp_path: Path) -> None:
    """peft saves `target_modules` given as names as a list; the HF engine must rebuild the same layout."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from visionrl.models.loader import load_base_model

    # Wrapped by peft directly with a list of names, as a user's own training script might do.
    config = PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(load_base_model(tiny["model"]), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.full(param.shape, 0.5))
    peft_model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert isinstance(saved, list) and sorted(saved) == ["q_proj", "v_proj"]  # the list form, not a regex
    common = {
        "base": str(tiny["model"]),
        "data": str(tiny["data"]),
        "engine": "hf",
        "max_samples": 4,
        "max_tokens": 4,
    }
    tuned = evaluate_local(adapter=str(tmp_path / "adapter"), out=str(tmp_path / "a.json"), **common)
    base_report = evaluate_local(adapter=None, out=str(tmp_path / "b.json"), **common)
    assert tuned["num_failed"] == 0
    assert [s["completion"] for s in tuned["samples"]] != [s["completion"] for s in base_report["samples"]]


@pytest.mark.slow
def test_vllm_and_hf_give_the_same_greedy_answers(
    tiny: dict[str, Path], hf_reports: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The real vLLM engine and transformers+peft agree token for token (fp32), base and adapter alike."""
    common = {"base": str(tiny["model"]), "data": str(tiny["data"]), "engine": "vllm", "max_tokens": 4}
    for kind, adapter in (("base", None), ("adapter", str(tiny["adapter"]))):
        report = evaluate_local(adapter=adapter, out=str(tmp_path / f"vllm-{kind}.json"), **common)
        assert report["num_failed"] == 0
        # Whitespace is compared loosely: vLLM's incremental detokenizer puts a space before the first word of
        # the tiny word-level tokenizer, transformers' decode does not (rewards normalise whitespace).
        vllm_answers = [(s["id"], s["completion"].split(), s["num_tokens"]) for s in report["samples"]]
        hf_answers = [
            (s["id"], s["completion"].split(), s["num_tokens"]) for s in hf_reports[kind]["samples"]
        ]
        assert vllm_answers == hf_answers, kind
        assert report["accuracy"] == hf_reports[kind]["accuracy"]


def test_eval_judge_scores_beside_exact_match(
    tiny: dict[str, Path], tiny_model: Path, tiny_reward_model: Path, tmp_path: Path, capsys
) -> None:
    """`visionrl eval --judge JOB`: two judges of a job file score the adapter's answers. The engine's base model
    (the adapter switched off) with the words yes and no, and a reward model whose head is that base's lm_head of
    yes minus no: the same number per sample (the classifier's sigmoid is the two-word share)."""
    from visionrl.cli import main

    template = tmp_path / "t.txt"
    template.write_text("{question}\nProposed answer: {completion}\nIs it right? Answer yes or no.\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        "rewards:\n"
        f"  - {{name: judge, kwargs: {{backend: engine, template: {template}, yes: yes, no: no}}}}\n"
        f"  - {{name: judge, kwargs: {{backend: classifier, model: {tiny_reward_model}, score: scalar, "
        f"template: {template}}}}}\n"
    )
    out = tmp_path / "judged.json"
    argv = ["eval", "--base", str(tiny_model), "--adapter", str(tiny["adapter"]), "--engine", "hf",
            "--data", str(tiny["data"]), "--out", str(out), "--max-tokens", "4", "--judge", str(job)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    judges = report["judges"]
    assert list(judges) == ["judge#0", "judge#1"]
    assert [j["backend"] for j in judges.values()] == ["engine", "classifier"]
    assert all(j["num_judged"] == 8 and j["errors"] == j["timeouts"] == 0 for j in judges.values())
    engine = [s["judge"]["judge#0"] for s in report["samples"]]
    classifier = [s["judge"]["judge#1"] for s in report["samples"]]
    assert engine == pytest.approx(classifier, abs=1e-5)
    assert judges["judge#0"]["mean"] == pytest.approx(sum(engine) / 8)
    assert judges["judge#0"]["accepted"] == sum(v >= 0.5 for v in engine) / 8
    assert all(
        s["correct"] == (s["reward"] >= 0.5) for s in report["samples"]
    )  # exact match, as without a judge
    md = out.with_suffix(".md").read_text()
    assert "| judge judge#0 (engine) | mean" in md and "judge judge#1 |" in md
    printed = capsys.readouterr().out
    assert "judge judge#0 (engine): mean" in printed and "judge judge#1 (classifier): mean" in printed


def test_eval_with_a_judge_that_fails_everywhere_exits_1_with_its_error(
    tiny: dict[str, Path], tmp_path: Path, capsys
) -> None:
    """A judge endpoint nobody listens on: every judgement fails (counted, None), the report is still written, and
    `eval` exits 1 naming the judge's error, not 0 with a mean of nothing."""
    from visionrl.cli import main
    from visionrl.serve.process import free_port

    template = tmp_path / "t.txt"
    template.write_text("{question} {completion} yes or no")
    judge = (f"{{backend: endpoint, base_url: 'http://127.0.0.1:{free_port()}/v1', model: j, template: {template}, "
             "retries: 0, timeout_s: 5}")  # fmt: skip
    out = tmp_path / "r.json"
    argv = ["eval", "--base", str(tiny["model"]), "--engine", "hf", "--data", str(tiny["data"]), "--out", str(out),
            "--max-samples", "3", "--max-tokens", "2", "--judge", judge]  # fmt: skip
    assert main(argv) == 1
    report = json.loads(out.read_text())
    assert report["judges"]["judge"]["errors"] == 3 and report["judges"]["judge"]["mean"] is None
    assert [s["judge"]["judge"] for s in report["samples"]] == [None] * 3
    err = capsys.readouterr().err
    assert "error: judge judge: the judge endpoint failed: APIConnectionError" in err
