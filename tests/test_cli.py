"""The `visionrl` command line: light to start (no torch, vLLM or Ray before a command runs), bad input gives
exit code 2 and one message on stderr (never a traceback), and `validate` / `make-data` do their job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from visionrl.cli import COMMANDS, EXIT_BAD_INPUT, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
CONSOLE_SCRIPT = Path(sys.executable).with_name("visionrl")
HEAVY = ("torch", "vllm", "ray", "transformers", "PIL")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def visionrl(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script (the package's entry point), or `python -m visionrl.cli` without it."""
    if CONSOLE_SCRIPT.is_file():
        return run(str(CONSOLE_SCRIPT), *args)
    return run(sys.executable, "-m", "visionrl.cli", *args)


# --------------------------------------------------------------------------- light start


def test_building_the_parser_imports_no_heavy_library() -> None:
    code = (
        "import json, sys\n"
        "from visionrl.cli import build_parser\n"
        "build_parser()\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    result = run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_help_as_a_module_lists_every_command() -> None:
    result = run(sys.executable, "-m", "visionrl.cli", "--help")
    assert result.returncode == 0, result.stderr
    for command in ("train", "eval", "export", "serve", "init-tiny-model", "make-data", "validate"):
        assert command in result.stdout


@pytest.mark.skipif(not CONSOLE_SCRIPT.is_file(), reason="the visionrl console script is not installed")
def test_console_script_help() -> None:
    result = run(str(CONSOLE_SCRIPT), "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: visionrl")


# Every subcommand, in the order `visionrl --help` lists them, and the arguments its --help must show.
SUBCOMMAND_OPTIONS = {
    "train": ["config", "overrides", "--resume", "--verbose"],
    "validate": ["config", "--schema", "--check-data"],
    "eval": ["--data", "--out", "--base", "--adapter", "--engine", "--endpoint", "--model", "--concurrency",
             "--timeout", "--max-failed-fraction", "--api-key", "--ablate-images", "--max-samples",
             "--max-tokens", "--reward", "--seed", "--judge", "--min-pixels", "--max-pixels", "--max-images-per-prompt",
             "--sagemaker-endpoint", "--region"],
    "export": ["src", "dest", "--allow-unservable", "--overwrite"],
    "fetch": ["src", "--cache-dir"],
    "serve": ["--base", "--sagemaker", "--adapter", "--host", "--port", "--api-key", "--allow-insecure", "--vllm-arg"],
    "deploy": ["sagemaker"],
    "init-tiny-model": ["dir", "--arch", "--seed", "--no-pretrain", "--recipe", "--score-head"],
    "make-data": ["dir", "--task", "--num-train", "--num-eval", "--seed", "--image-size", "--question-type"],
    "tune-lora-kernels": ["config", "overrides", "--out", "--budget-s"],
}  # fmt: skip


def test_the_command_table_lists_every_subcommand_in_help_order() -> None:
    assert [name for name, *_ in COMMANDS] == list(SUBCOMMAND_OPTIONS)


@pytest.mark.parametrize("command", list(SUBCOMMAND_OPTIONS))
def test_subcommand_help_exits_zero_and_shows_its_options(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: visionrl {command}")
    help_line = next(help_ for name, _, help_, _ in COMMANDS if name == command)
    assert help_line in " ".join(out.split())  # the description, however argparse wraps it
    for option in SUBCOMMAND_OPTIONS[command]:
        assert option in out, option


def test_subcommand_help_shows_the_defaults_an_option_has(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "local evaluation engine (default: vllm)" in out and "(default: 8)" in out
    )  # --engine, --concurrency
    assert "(default: None)" not in out and "(default: False)" not in out and "(default: [])" not in out


def test_every_subcommand_runs_its_own_handler() -> None:
    parser = build_parser()
    minimal = {"train": ["job.yaml"], "export": ["a", "b"], "fetch": ["a"], "serve": ["--base", "m"],
               "deploy": ["sagemaker", "--name", "e"],
               "init-tiny-model": ["d"], "make-data": ["d", "--task", "color"],
               "eval": ["--data", "d", "--out", "o"], "validate": [], "tune-lora-kernels": ["job.yaml"]}  # fmt: skip
    for name, handler, _, _ in COMMANDS:
        assert parser.parse_args([name, *minimal[name]]).func is handler, name


@pytest.fixture
def eval_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Replaces both evaluators with recorders that return a report of one correct sample."""
    import visionrl.eval.endpoint
    import visionrl.eval.local

    calls: dict[str, dict[str, Any]] = {}

    def recorder(name: str) -> Any:
        def record(**kwargs: Any) -> dict[str, Any]:
            calls[name] = kwargs
            return {"accuracy": 1.0, "num_samples": 1, "num_failed": 0, "samples": []}

        return record

    monkeypatch.setattr(visionrl.eval.local, "evaluate_local", recorder("local"))
    monkeypatch.setattr(visionrl.eval.endpoint, "evaluate_endpoint", recorder("endpoint"))
    return calls


EVAL_SHARED = ["--data", "d.jsonl", "--out", "r.json", "--ablate-images", "--max-samples", "5", "--max-tokens",
               "3", "--reward", "numeric", "--seed", "4", "--max-pixels", "65536"]  # fmt: skip


EVAL_SHARED_SETTINGS = {"data": "d.jsonl", "out": "r.json", "ablate_images": True, "max_samples": 5, "max_tokens": 3,
                        "rewards": ["numeric"], "seed": 4, "max_pixels": 65536}  # fmt: skip


def _shared_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The options both evaluators take, as an evaluator was called with them."""
    shared = {k: kwargs[k] for k in EVAL_SHARED_SETTINGS if k != "max_pixels"}
    return {**shared, "max_pixels": kwargs["budget"].max_pixels}


def test_eval_passes_its_options_to_local_evaluation(
    eval_calls: dict[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", "--base", "m", "--adapter", "a", "--engine", "hf", *EVAL_SHARED]) == 0
    kwargs = eval_calls["local"]
    assert (kwargs["base"], kwargs["adapter"], kwargs["engine"]) == ("m", "a", "hf")
    assert _shared_settings(kwargs) == EVAL_SHARED_SETTINGS
    assert "endpoint" not in eval_calls
    assert capsys.readouterr().out == "accuracy 1.000 on 1 samples (0 failed) -> r.json\n"


def test_eval_passes_its_options_to_served_evaluation(eval_calls: dict[str, dict[str, Any]]) -> None:
    argv = ["eval", "--endpoint", "http://h/v1", "--model", "a1", "--concurrency", "2", "--timeout", "9",
            "--api-key", "k", "--base", "m", *EVAL_SHARED]  # fmt: skip
    assert main(argv) == 0
    kwargs = eval_calls["endpoint"]
    assert {k: kwargs[k] for k in ("endpoint", "model", "concurrency", "timeout_s", "base", "api_key")} == {
        "endpoint": "http://h/v1", "model": "a1", "concurrency": 2, "timeout_s": 9.0, "base": "m", "api_key": "k"
    }  # fmt: skip
    assert _shared_settings(kwargs) == EVAL_SHARED_SETTINGS
    assert "local" not in eval_calls


def test_init_tiny_model_arch_choices_are_the_factory_architectures() -> None:
    """`--arch` lists the factory's architectures (spelled out in the CLI so that --help stays instant);
    Qwen3-VL is the default, an unknown name is a usage error (exit 2)."""
    from visionrl.models.tiny import ARCHS, DEFAULT_ARCH

    parser = build_parser()
    assert parser.parse_args(["init-tiny-model", "d"]).arch == DEFAULT_ARCH == "qwen3_vl"
    assert set(ARCHS) == {"qwen3_vl", "qwen2_5_vl"}
    for arch in ARCHS:
        assert parser.parse_args(["init-tiny-model", "d", "--arch", arch]).arch == arch
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["init-tiny-model", "d", "--arch", "llava"])
    assert info.value.code == 2


# --------------------------------------------------------------------------- validate


def test_validate_bad_file_exits_2_with_a_message_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "BAD.yaml"
    bad.write_text("output_dir: x\nmodel:\n  path: [m\n")
    result = visionrl("validate", str(bad))
    assert result.returncode == EXIT_BAD_INPUT == 2
    assert result.stderr.startswith("error: ") and "BAD.yaml: not valid YAML at line" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_validate_unknown_key_exits_2_naming_the_key(tmp_path: Path) -> None:
    result = visionrl("validate", str(DEMO), "train.stepz=7")
    assert result.returncode == 2
    assert "train.stepz: unknown key" in result.stderr and "Traceback" not in result.stderr


def test_validate_prints_the_resolved_config_with_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(DEMO), "train.steps=7", "rollout.temperature=0.5"]) == 0
    out, err = capsys.readouterr()
    resolved = yaml.safe_load(out)
    assert resolved["train"]["steps"] == 7 and resolved["rollout"]["temperature"] == 0.5
    # Every key is printed, defaults included, and the file's own values are kept.
    assert resolved["algorithm"]["updates_per_batch"] == 2 and resolved["lora"]["rank"] == 16
    assert resolved["algorithm"]["kl_kind"] == "k3"  # a default the file leaves out
    assert err.strip().endswith("demo.yaml: valid")


def test_validate_the_production_job_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(ROOT / "configs" / "qwen3vl_8b_grpo_lora.yaml")]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["lora"]["rank"] == 64


def test_validate_schema_lists_the_sections(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"model", "lora", "data", "rewards", "algorithm", "rollout", "train", "ray"} <= set(
        schema["properties"]
    )


def test_validate_without_a_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2
    assert "validate needs a CONFIG path" in capsys.readouterr().err


def test_validate_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml' does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------- make-data


def test_make_data_writes_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "count"
    assert main(["make-data", str(out_dir), "--task", "count", "--num-train", "8", "--num-eval", "4"]) == 0
    train = [json.loads(line) for line in (out_dir / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (out_dir / "eval.jsonl").read_text().splitlines()]
    assert (len(train), len(evals)) == (8, 4)
    for record in train + evals:
        assert record["answer"] in {"1", "2", "3", "4"}
        assert (out_dir / record["images"][0]).is_file()
    assert sorted(p.name for p in (out_dir / "images" / "eval").iterdir()) == [
        f"{i:05d}.png" for i in range(4)
    ]
    printed = capsys.readouterr().out
    assert "train: 8 records" in printed and "eval: 4 records" in printed


def test_make_data_unknown_task_exits_2_with_the_choices(tmp_path: Path) -> None:
    result = visionrl(
        "make-data", str(tmp_path / "d"), "--task", "shade", "--num-train", "2", "--num-eval", "1"
    )
    assert result.returncode == 2
    assert "unknown synthetic task 'shade'" in result.stderr
    assert "color, count, position, sides" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "d").exists()  # nothing written for bad arguments


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--num-train", "-1"], "num_train must be >= 0"), (["--image-size", "8"], "image_size must be in")],
)
def test_make_data_bad_numbers_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["make-data", str(tmp_path / "d"), "--task", "color", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_make_data_needs_a_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["make-data", str(tmp_path / "d")])
    assert info.value.code == 2
    assert "--task" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rewards=[{name: exact_mach}]"], "unknown reward 'exact_mach'"),
        (["rewards=[{name: 'no_such_module_xyz:score'}]"], "importing module 'no_such_module_xyz' failed"),
        (["data.eval=null"], "but data.eval is not set"),
        (["train.betas=[0.9, 1.0]"], "each of train.betas must lie in [0, 1)"),
    ],
)
def test_validate_rejects_bad_rules_with_exit_2(overrides: list[str], message: str) -> None:
    result = visionrl("validate", str(DEMO), *overrides)
    assert result.returncode == EXIT_BAD_INPUT
    assert message in result.stderr and "Traceback" not in result.stderr


def test_eval_with_an_inconsistent_image_budget_exits_2_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "r.json"), "--base", "nowhere",
            "--min-pixels", "4096", "--max-pixels", "1024"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--min-pixels / --max-pixels" in err and "1 <= min_pixels <= max_pixels" in err


def test_train_resume_flag_takes_nothing_or_auto(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["train", "job.yaml"]).resume is None  # the job file's `resume` decides
    assert parse(["train", "job.yaml", "--resume"]).resume is True
    args = parse(["train", "job.yaml", "train.steps=3", "--resume", "auto"])
    assert args.resume == "auto" and args.overrides == ["train.steps=3"]
    with pytest.raises(SystemExit) as info:
        parse(["train", "job.yaml", "--resume", "later"])
    assert info.value.code == 2
    assert "expected `--resume` alone or `--resume auto`, got 'later'" in capsys.readouterr().err


def test_train_refuses_a_run_with_checkpoints_without_resume(tmp_path: Path) -> None:
    """Fresh run into an output_dir with checkpoints: exit 2 naming both ways on, before any model loads."""
    (tmp_path / "run" / "checkpoints" / "step_3").mkdir(parents=True)
    result = visionrl("train", str(DEMO), f"output_dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert "holds checkpoints of an earlier run; continue it with `--resume`" in result.stderr
    assert "`--resume auto`" in result.stderr and "Traceback" not in result.stderr


def test_eval_env_plays_episodes_with_the_job_files_environment(
    eval_calls: dict[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"output_dir": "r", "model": {"path": "m"}, "data": {"train": "t.jsonl"},
                                   "rewards": [], "env": {"name": "zoom", "max_turns": 2}}))  # fmt: skip
    assert main(["eval", "--base", "m", "--env", str(job), *EVAL_SHARED]) == 0
    env = eval_calls["local"]["env"]
    assert (env.name, env.max_turns) == ("zoom", 2)
    assert main(["eval", "--endpoint", "http://h/v1", "--model", "a", "--env", str(job), *EVAL_SHARED]) == 0
    assert eval_calls["endpoint"]["env"].name == "zoom"  # the tool loop runs client-side over the endpoint
    job.write_text(yaml.safe_dump({"output_dir": "r", "model": {"path": "m"}, "data": {"train": "t.jsonl"},
                                   "rewards": [{"name": "exact_match"}]}))  # fmt: skip
    with pytest.raises(SystemExit) as usage:
        main(["eval", "--base", "m", "--env", str(job), *EVAL_SHARED])
    assert usage.value.code == 2 and "the job file has no env section" in capsys.readouterr().err


def test_serve_and_deploy_name_what_they_lack(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SM_MODEL_DIR", "VISIONRL_BASE_MODEL"):
        monkeypatch.delenv(name, raising=False)
    cases = [
        (["serve"], "serve needs --base MODEL (or --sagemaker"),
        (
            ["serve", "--sagemaker", "--api-key", "k"],
            "--api-key: SageMaker's runtime signs requests with IAM",
        ),
        (["deploy", "sagemaker", "--name", "e"], "deploy sagemaker needs --role and --base (or --delete)"),
        (
            ["deploy", "sagemaker", "--name", "e", "--role", "r", "--base", "b", "--env", "X"],
            "--env 'X' is not KEY=VALUE",
        ),
    ]
    if Path("/opt/ml/model").is_dir():  # a SageMaker container: `serve` alone is its hosting mode
        cases = cases[1:]
    for argv, message in cases:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err, argv
