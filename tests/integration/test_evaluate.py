"""Evaluation: scoring and report numbers checked by hand with a fake engine, image ablation, and
`evaluate_local` on a tiny Qwen3-VL with the HF engine (fast) and the real vLLM engine (slow), which must
give the same greedy answers for the base model and for an adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from visionrl.errors import InputError
from visionrl.evaluate import (
    Generation,
    ablate,
    evaluate_local,
    evaluate_prompts,
    nearest_rank,
    score_generations,
    summarize,
    write_report,
)
from visionrl.rewards import RewardSpec, build_reward_fn
from visionrl.rollout.types import Completion, PromptItem, SamplingSpec

# --------------------------------------------------------------------------- fake engine


class FakeClock:
    """A clock the fake engine advances, so latencies are exact numbers, not wall time."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Answers from a fixed table; a prompt whose text is "boom" makes the whole call raise ValueError.

    Each call takes 0.1 s of fake time per prompt (0.05 s for a call that fails).
    """

    def __init__(self, answers: dict[str, str], clock: FakeClock) -> None:
        self.answers = answers
        self.clock = clock
        self.calls: list[tuple[list[str], SamplingSpec]] = []

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        self.calls.append(([p.text for p in prompts], spec))
        if any(p.text == "boom" for p in prompts):
            self.clock.now += 0.05
            raise ValueError("prompt is too long")
        self.clock.now += 0.1 * len(prompts)
        out = []
        for i, p in enumerate(prompts):
            text = self.answers[p.text]
            ids = list(range(len(text.split()) + 1))  # words + end of sequence
            out.append([Completion(i, ids, text, [0.0] * len(ids), "stop")])
        return out


def _prompt(text: str, answer: str, images: list[Image.Image] | None = None) -> PromptItem:
    return PromptItem(
        text=text, images=images or [], answer=answer, record={"id": text}, sample_id=f"id-{text}"
    )


def test_evaluate_prompts_counts_correct_failed_and_latency_by_hand() -> None:
    clock = FakeClock()
    engine = FakeEngine({"q1": "red", "q2": "blue", "q3": "Green", "q4": "yellow sky"}, clock)
    prompts = [
        _prompt("q1", "red"),  # right
        _prompt("q2", "red"),  # wrong
        _prompt("boom", "red"),  # fails
        _prompt("q3", "green"),  # right (exact_match normalises case)
        _prompt("q4", "yellow"),  # wrong: exact_match compares the whole answer
    ]
    with build_reward_fn([RewardSpec("exact_match")]) as reward_fn:
        records = evaluate_prompts(engine, prompts, reward_fn, max_tokens=7, batch_size=3, clock=clock)

    assert all(spec == SamplingSpec(n=1, greedy=True, max_tokens=7) for _, spec in engine.calls)
    # Batch [q1, q2, boom] fails and is retried prompt by prompt; batch [q3, q4] succeeds.
    assert [texts for texts, _ in engine.calls] == [
        ["q1", "q2", "boom"],
        ["q1"],
        ["q2"],
        ["boom"],
        ["q3", "q4"],
    ]
    assert [r["id"] for r in records] == ["id-q1", "id-q2", "id-boom", "id-q3", "id-q4"]
    assert [r["correct"] for r in records] == [True, False, False, True, False]
    assert [r["reward"] for r in records] == [1.0, 0.0, None, 1.0, 0.0]
    assert [r["num_tokens"] for r in records] == [2, 2, 0, 2, 3]
    failed = records[2]
    assert failed["completion"] is None and failed["error"] == "ValueError: prompt is too long"
    assert all(r["error"] is None for i, r in enumerate(records) if i != 2)
    # Latency: a lone retry is its own time (0.1 s, failure 0.05 s); the batch of two took 0.2 s -> 100 ms each.
    assert [r["latency_ms"] for r in records] == pytest.approx([100.0, 100.0, 50.0, 100.0, 100.0])

    report = summarize(records, model="m", data="d.jsonl", started=0.0, duration_s=2.0, ablate_images=False)
    assert report["num_samples"] == 5
    assert report["num_failed"] == 1
    assert report["accuracy"] == pytest.approx(2 / 4)  # correct / (samples - failed)
    assert report["mean_reward"] == pytest.approx(2 / 4)
    assert report["tokens_per_s"] == pytest.approx((2 + 2 + 2 + 3) / 2.0)
    assert report["created"] == "1970-01-01T00:00:00+00:00"


def test_correct_means_half_of_the_positive_weight() -> None:
    # exact_match + exact_match(first_word), weights 1 and 1: the best total is 2, correct needs >= 1.
    specs = [RewardSpec("exact_match"), RewardSpec("exact_match", kwargs={"first_word": True})]
    prompts = [_prompt(q, "blue") for q in ("a", "b", "c")]
    gens = [Generation("blue"), Generation("blue sky"), Generation("sky blue")]
    with build_reward_fn(specs) as reward_fn:
        records = score_generations(prompts, gens, reward_fn)
    assert [r["reward"] for r in records] == [2.0, 1.0, 0.0]
    assert [r["correct"] for r in records] == [True, True, False]
    assert records[1]["rewards"] == {"exact_match#0": 0.0, "exact_match#1": 1.0}


def test_score_generations_needs_a_positive_weight() -> None:
    with build_reward_fn([RewardSpec("exact_match", weight=-1.0)]) as reward_fn:
        with pytest.raises(ValueError, match="positive weight"):
            score_generations([_prompt("a", "x")], [Generation("x")], reward_fn)


def test_nearest_rank_percentiles_by_hand() -> None:
    # n = 5: p50 rank ceil(2.5) = 3, p95 rank ceil(4.75) = 5.
    assert nearest_rank([50.0, 10.0, 40.0, 20.0, 30.0], 50) == 30.0
    assert nearest_rank([50.0, 10.0, 40.0, 20.0, 30.0], 95) == 50.0
    # n = 20 (values 1..20): p95 rank is exactly 19 (not 20 from a float 19.000...01), p50 rank 10.
    values = [float(v) for v in range(20, 0, -1)]
    assert nearest_rank(values, 95) == 19.0
    assert nearest_rank(values, 50) == 10.0
    assert nearest_rank([7.0], 50) == 7.0
    assert nearest_rank([], 50) is None
    with pytest.raises(ValueError):
        nearest_rank([1.0], 0)


def _record(i: int, latency: float, correct: bool, error: str | None = None) -> dict[str, Any]:
    return {
        "id": f"s{i}", "answer": "red", "completion": None if error else "red", "reward": None if error else float(correct),
        "rewards": None, "correct": correct, "num_tokens": 0 if error else 2, "latency_ms": latency,
        "finish_reason": None if error else "stop", "error": error,
    }  # fmt: skip


def test_summarize_leaves_failed_samples_out_of_latency_and_accuracy() -> None:
    records = [
        _record(0, 40.0, True),
        _record(1, 10.0, False),
        _record(2, 9999.0, False, error="TimeoutError: 60 s"),
        _record(3, 30.0, True),
        _record(4, 20.0, True),
        _record(5, 50.0, False),
    ]
    report = summarize(
        records,
        model="m",
        data="d",
        started=0.0,
        duration_s=1.0,
        ablate_images=True,
        extra={"engine": "fake"},
    )
    assert report["num_failed"] == 1
    assert report["accuracy"] == pytest.approx(3 / 5)
    assert report["latency_ms_p50"] == 30.0  # of [10, 20, 30, 40, 50]: rank 3
    assert report["latency_ms_p95"] == 50.0  # rank 5; the failed 9999 ms is not counted
    assert report["engine"] == "fake" and report["ablate_images"] is True
    assert report["samples"] is records


def test_summarize_when_everything_failed() -> None:
    records = [_record(0, 5.0, False, error="ConnectionError: refused")]
    report = summarize(records, model="m", data="d", started=0.0, duration_s=1.0, ablate_images=False)
    assert report["accuracy"] == 0.0 and report["num_failed"] == 1
    assert report["latency_ms_p50"] is None and report["mean_reward"] is None


def test_write_report_json_and_markdown(tmp_path: Path) -> None:
    records = [_record(i, 10.0 * (i + 1), i % 2 == 0) for i in range(12)]
    records[1]["completion"] = "a | b\nc"
    report = summarize(records, model="m", data="d", started=0.0, duration_s=1.0, ablate_images=False)
    out = tmp_path / "new" / "dir" / "report.json"
    write_report(report, out)

    assert json.loads(out.read_text()) == report
    md = (tmp_path / "new" / "dir" / "report.md").read_text()
    assert "| accuracy | 0.500 |" in md
    assert "| num_samples | 12 |" in md
    assert "a \\| b c" in md  # pipes escaped, line breaks flattened: the table stays a table
    assert "| s9 |" in md and "| s10 |" not in md  # the first 10 samples only
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.json", "report.md"]  # no temp files left
    with pytest.raises(InputError, match=r"\.md"):
        write_report(report, tmp_path / "report.md")


# --------------------------------------------------------------------------- ablation


def _image(shade: int) -> Image.Image:
    return Image.new("RGB", (4, 4), (shade, 0, 0))


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ablate_is_a_derangement_that_keeps_answers(n: int, seed: int) -> None:
    prompts = [_prompt(f"q{i}", f"a{i}", [_image(i)]) for i in range(n)]
    ablated = ablate(prompts, seed)
    shade = [p.images[0].getpixel((0, 0))[0] for p in ablated]
    assert all(shade[i] != i for i in range(n))  # nobody keeps their own image
    assert sorted(shade) == list(range(n))  # every image used exactly once
    assert [(p.text, p.answer, p.sample_id) for p in ablated] == [
        (p.text, p.answer, p.sample_id) for p in prompts
    ]
    assert [p.images[0].getpixel((0, 0))[0] for p in prompts] == list(range(n))  # input left unchanged


def test_ablate_swaps_only_between_equal_image_counts() -> None:
    prompts = [
        _prompt("a", "x", [_image(0)]),
        _prompt("b", "x", [_image(1), _image(2)]),
        _prompt("c", "x", [_image(3)]),
        _prompt("d", "x", []),
        _prompt("e", "x", [_image(4), _image(5)]),
        _prompt("f", "x", [_image(6), _image(7), _image(8)]),  # alone with three images: kept
    ]
    ablated = ablate(prompts, seed=0)
    shades = [[im.getpixel((0, 0))[0] for im in p.images] for p in ablated]
    assert shades == [[3], [4, 5], [0], [], [1, 2], [6, 7, 8]]


def test_ablate_differs_by_seed() -> None:
    prompts = [_prompt(f"q{i}", "x", [_image(i)]) for i in range(8)]
    orders = {tuple(p.images[0].getpixel((0, 0))[0] for p in ablate(prompts, seed)) for seed in range(5)}
    assert len(orders) > 1


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

    from visionrl.export import export_adapter

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
    assert isinstance(
        json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"], list
    )
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
