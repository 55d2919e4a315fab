"""Job config: the shipped job files validate; bad files fail with a ConfigError naming the key, the problem and
the fix; `a.b=value` overrides are typed by YAML and applied without touching the input."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from visionrl.config import (
    LM_PROJECTIONS,
    ConfigError,
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
)
from visionrl.errors import InputError
from visionrl.rewards import RewardSpec, resolve_reward

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PRODUCTION = CONFIGS / "qwen3vl_8b_grpo_lora.yaml"

MINIMAL: dict[str, Any] = {
    "output_dir": "runs/x",
    "model": {"path": "models/base"},
    "data": {"train": "data/train.jsonl"},
    "rewards": [{"name": "exact_match"}],
}


def write_yaml(tmp_path: Path, data: Any, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def config_error(data: dict[str, Any], overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(apply_overrides(data, overrides or []))
    return str(info.value)


# --------------------------------------------------------------------------- shipped job files


@pytest.mark.parametrize(
    "name", ["demo.yaml", "qwen3vl_8b_grpo_lora.yaml", "same_color.yaml", "easy_vqa.yaml"]
)
def test_shipped_job_files_validate_and_round_trip(name: str, tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / name)
    # Every reward of the file can be built (names and kwargs are right, not just well-typed).
    for reward in cfg.rewards:
        resolve_reward(RewardSpec(reward.name, reward.weight, dict(reward.kwargs)))
    # The resolved YAML that `visionrl validate` prints is itself a valid job file with the same values.
    again = load_config(write_yaml(tmp_path, yaml.safe_load(dump_config(cfg))))
    assert again == cfg


def test_data_layout_keys_default_to_our_field_names_and_must_name_a_field() -> None:
    cfg = config_from_dict(MINIMAL)
    assert (cfg.data.prompt_key, cfg.data.answer_key, cfg.data.image_key) == ("prompt", "answer", "images")
    geo = config_from_dict(apply_overrides(MINIMAL, ["data.prompt_key=problem", "data.image_key=image"]))
    assert (geo.data.prompt_key, geo.data.image_key) == ("problem", "image")
    assert "data.image_key" in config_error(MINIMAL, ["data.image_key="])
    assert "data.answer_keys: unknown key" in config_error(MINIMAL, ["data.answer_keys=label"])


def test_demo_file_values_are_kept_as_written() -> None:
    raw = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    cfg = load_config(CONFIGS / "demo.yaml")
    assert cfg.lora.rank == raw["lora"]["rank"] == 16
    assert cfg.rollout.max_new_tokens == raw["rollout"]["max_new_tokens"] == 2
    assert cfg.train.lr == pytest.approx(3.0e-3)
    assert cfg.model.dtype == "float32"
    # Keys the file leaves out take their documented defaults.
    assert cfg.lora.target_modules == LM_PROJECTIONS
    assert cfg.algorithm.updates_per_batch == raw["algorithm"]["updates_per_batch"] == 2
    assert cfg.algorithm.dual_clip is None  # the learner's old policy: no dual clip by default


def test_production_job_file_describes_the_8b_job() -> None:
    cfg = load_config(PRODUCTION)
    assert Path(cfg.model.path).name == "Qwen3-VL-8B-Instruct"
    assert not Path(cfg.model.path).is_absolute()  # a placeholder the header tells the user to fill
    # the learner setting measured fastest within the colocated memory budget on an H200
    # (benchmarks/results/gpu_learner.json, gpu_grpo_step.json): no recompute, compiled decoder layers,
    # 8192-token micro-batches while the engine sleeps, the engine's log-probs as the old policy
    assert cfg.model.dtype == "bfloat16" and not cfg.model.gradient_checkpointing
    assert (
        cfg.train.micro_batch_tokens == 8192 and cfg.train.logit_chunk_tokens > 0 and cfg.train.share_images
    )
    assert cfg.train.compile and cfg.rollout.sleep_during_update
    assert cfg.train.packing == "auto" and cfg.train.packed_attention == "auto"  # packed rows on the GPU
    # the clipped ratio is taken against the engine's log-probs, so no second correction on top of it
    assert cfg.algorithm.old_logprobs == "engine" and cfg.algorithm.rollout_correction == "off"
    assert (cfg.lora.rank, cfg.lora.alpha) == (64, 128)
    assert cfg.lora.target_modules == LM_PROJECTIONS and cfg.lora.train_merger
    assert cfg.rollout.engine == "vllm" and cfg.rollout.gpus_per_engine > 0 and cfg.ray.learner_gpus > 0
    assert cfg.ray.placement == "colocated"
    assert (cfg.algorithm.group_size, cfg.rollout.prompts_per_step) == (8, 64)
    assert (cfg.rollout.max_new_tokens, cfg.rollout.temperature) == (512, 1.0)
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (0.2, 0.28)
    assert cfg.algorithm.kl_coef <= 0.01
    assert {r.name for r in cfg.rewards} <= {"exact_match", "numeric", "format"}
    assert not Path(cfg.data.train).is_absolute()


def test_production_job_file_header_says_what_where_and_how() -> None:
    header = "\n".join(line for line in PRODUCTION.read_text().splitlines() if line.startswith("#"))
    assert "Qwen3-VL-8B-Instruct" in header
    assert "models/Qwen3-VL-8B-Instruct" in header  # where to download the base to
    assert re.search(r"H200|H100", header)
    assert "visionrl train configs/qwen3vl_8b_grpo_lora.yaml" in header


# --------------------------------------------------------------------------- unknown keys and wrong types


def test_minimal_config_is_valid_and_fills_defaults() -> None:
    cfg = config_from_dict(MINIMAL)
    assert cfg.algorithm.group_size == 8 and cfg.rollout.engine == "vllm" and cfg.ray.placement == "colocated"


@pytest.mark.parametrize(("text", "mode"), [("on", "on"), ("off", "off"), ("auto", "auto"), ("'on'", "on")])
def test_fsdp_on_and_off_as_yaml_reads_them_mean_on_and_off(text: str, mode: str, tmp_path: Path) -> None:
    # YAML 1.1 reads a bare `on` as True and `off` as False, in a job file and in a key=value override alike
    data = {**MINIMAL, "train": yaml.safe_load(f"fsdp: {text}")}
    assert config_from_dict(data).train.fsdp == mode
    assert config_from_dict(apply_overrides(MINIMAL, [f"train.fsdp={text}"])).train.fsdp == mode
    with pytest.raises(ConfigError, match="train.fsdp"):
        config_from_dict({**MINIMAL, "train": {"fsdp": "yes please"}})


@pytest.mark.parametrize(
    ("override", "key"),
    [("train.stepz=3", "train.stepz"), ("trian.steps=3", "trian"), ("lora.extra.deep=1", "lora.extra")],
)
def test_unknown_key_names_the_key_and_the_fix(override: str, key: str) -> None:
    message = config_error(MINIMAL, [override])
    assert f"{key}: unknown key" in message
    assert "visionrl validate --schema" in message


def test_unknown_key_inside_a_list_item_names_its_index() -> None:
    data = {**MINIMAL, "rewards": [{"name": "exact_match"}, {"name": "format", "wieght": 2}]}
    assert "rewards.1.wieght: unknown key" in config_error(data)


@pytest.mark.parametrize(
    ("override", "key", "got"),
    [
        ("train.steps=many", "train.steps", "'many'"),
        ("train.steps=7.5", "train.steps", "7.5"),
        ("rollout.temperature=hot", "rollout.temperature", "'hot'"),
        ("model.gradient_checkpointing=[1]", "model.gradient_checkpointing", "[1]"),
        ("model.dtype=fp8", "model.dtype", "'fp8'"),
        ("train=3", "train", "3"),
        ("rewards=null", "rewards", "None"),
    ],
)
def test_wrong_type_names_the_key_and_the_value(override: str, key: str, got: str) -> None:
    message = config_error(MINIMAL, [override])
    assert re.search(rf"^  - {re.escape(key)}: .*\(got {re.escape(got)}\)$", message, re.MULTILINE), message


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algorithm.group_size=1", "algorithm.group_size"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("lora.rank=0", "lora.rank"),
        ("algorithm.dual_clip=1.0", "algorithm.dual_clip"),
    ],
)
def test_out_of_range_values_name_the_key(override: str, key: str) -> None:
    assert f"  - {key}: " in config_error(MINIMAL, [override])


def test_missing_required_keys_are_all_listed() -> None:
    message = config_error({"model": {}})
    assert message.startswith("config: 4 problem(s)")
    for key in ("output_dir", "model.path", "data", "rewards"):
        assert f"  - {key}: required key is missing" in message


# --------------------------------------------------------------------------- consistency between keys


def test_updates_per_batch_that_does_not_divide_the_completions() -> None:
    # 32 prompts x 8 = 256 completions; 3 does not divide 256.
    message = config_error(MINIMAL, ["rollout.prompts_per_step=32", "algorithm.updates_per_batch=3"])
    assert "algorithm.updates_per_batch=3 must divide the 256 completions" in message
    assert "rollout.prompts_per_step" in message and "choose a divisor" in message
    assert "(got" not in message  # a cross-field error does not dump the whole file as the "value"


def test_updates_per_batch_must_keep_groups_whole() -> None:
    # 256 completions / 64 updates = 4 completions per update: half a group of 8.
    message = config_error(MINIMAL, ["rollout.prompts_per_step=32", "algorithm.updates_per_batch=64"])
    assert (
        "whole groups" in message
        and "rollout.prompts_per_step must be divisible by algorithm.updates_per_batch" in message
    )
    # A divisor of prompts_per_step is fine.
    cfg = config_from_dict(
        apply_overrides(MINIMAL, ["rollout.prompts_per_step=32", "algorithm.updates_per_batch=4"])
    )
    assert cfg.algorithm.updates_per_batch == 4


def test_max_new_tokens_must_leave_room_for_the_prompt() -> None:
    message = config_error(MINIMAL, ["rollout.max_model_len=512", "rollout.max_new_tokens=512"])
    assert "rollout.max_new_tokens=512" in message and "rollout.max_model_len=512" in message
    assert "raise max_model_len or lower max_new_tokens" in message
    cfg = config_from_dict(
        apply_overrides(MINIMAL, ["rollout.max_model_len=512", "rollout.max_new_tokens=511"])
    )
    assert cfg.rollout.max_new_tokens == 511


def test_image_budget_defaults_and_bounds() -> None:
    cfg = config_from_dict(MINIMAL)
    # 1024 x 1024 at most (1,024 Qwen3-VL image tokens), 32 x 32 at least, 4 images per record.
    assert (cfg.data.min_pixels, cfg.data.max_pixels, cfg.data.max_images_per_prompt) == (1024, 1_048_576, 4)
    message = config_error(MINIMAL, ["data.min_pixels=4096", "data.max_pixels=1024"])
    assert (
        "data.min_pixels=4096 is above data.max_pixels=1024" in message
        and "min_pixels <= max_pixels" in message
    )
    assert "data.max_images_per_prompt" in config_error(MINIMAL, ["data.max_images_per_prompt=0"])


def test_split_placement_needs_gpus() -> None:
    message = config_error(MINIMAL, ["ray.placement=split"])
    assert "ray.placement=split" in message
    assert "rollout.gpus_per_engine" in message and "ray.learner_gpus" in message
    assert "ray.placement=colocated" in message
    cfg = config_from_dict(
        apply_overrides(MINIMAL, ["ray.placement=split", "rollout.gpus_per_engine=1", "ray.learner_gpus=1"])
    )
    assert cfg.ray.placement == "split"


# --------------------------------------------------------------------------- overrides


def test_overrides_take_yaml_types() -> None:
    out = apply_overrides(
        MINIMAL,
        [
            "train.steps=7",
            "train.lr=0.5e-3",
            "model.gradient_checkpointing=true",
            "train.betas=[0.8, 0.95]",
            "lora.target_modules=[q_proj, v_proj]",
            "data.eval=null",
            "model.path=models/other",
            "data.system_prompt=",
        ],
    )
    assert out["train"]["steps"] == 7 and isinstance(out["train"]["steps"], int)
    assert out["train"]["lr"] == 0.0005
    assert out["model"]["gradient_checkpointing"] is True
    assert out["train"]["betas"] == [0.8, 0.95]
    assert out["data"]["eval"] is None and out["data"]["system_prompt"] == ""
    cfg = config_from_dict(out)
    assert cfg.train.betas == (0.8, 0.95)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.model.path == "models/other"


def test_override_does_not_modify_its_input_and_the_last_one_wins() -> None:
    before = yaml.safe_dump(MINIMAL)
    out = apply_overrides(MINIMAL, ["model.path=a", "model.path=b", "rewards=[{name: numeric}]"])
    assert out["model"]["path"] == "b" and out["rewards"] == [{"name": "numeric"}]
    assert yaml.safe_dump(MINIMAL) == before


def test_override_creates_a_missing_section() -> None:
    assert "lora" not in MINIMAL
    cfg = config_from_dict(apply_overrides(MINIMAL, ["lora.rank=4", "lora.train_merger=true"]))
    assert cfg.lora.rank == 4 and cfg.lora.train_merger and cfg.lora.alpha == 32.0  # the rest: defaults


def test_override_of_a_section_left_empty_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(MINIMAL) + "train:\n")  # `train:` with nothing under it is null
    assert load_config(path, ["train.steps=3"]).train.steps == 3


def test_override_of_a_scalar_as_a_section_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"'train\.steps\.x=1': 'steps' is a value, not a section"):
        apply_overrides(MINIMAL, ["train.steps=7", "train.steps.x=1"])
    with pytest.raises(ConfigError, match="'path' is a value, not a section"):
        apply_overrides(MINIMAL, ["model.path.x=1"])


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        ("train.steps", "is not of the form key.path=value"),
        ("=3", "empty key part"),
        ("train..steps=3", "empty key part"),
        ("train.steps=[1, 2", "value is not valid YAML"),
    ],
)
def test_malformed_override_is_an_error(item: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(problem)):
        apply_overrides(MINIMAL, [item])


# --------------------------------------------------------------------------- loading files


def test_load_config_applies_overrides_and_names_the_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, MINIMAL)
    assert load_config(path, ["train.steps=7"]).train.steps == 7
    with pytest.raises(ConfigError) as info:
        load_config(path, ["train.stepz=7"])
    assert str(info.value).startswith(f"{path}: 1 problem(s)")


def test_malformed_yaml_reports_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("output_dir: x\nmodel:\n  path: m\n  dtype: [float32\ndata:\n  train: t\n")
    with pytest.raises(
        ConfigError, match=r"bad\.yaml: not valid YAML at line 5, column \d+: .*fix the syntax"
    ):
        load_config(path)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (bytes(range(256)) * 4, "not UTF-8 text (byte 0x80 at position 128)"),
        ("output_dir: x\n".encode("utf-16"), "UTF-16 text (byte 0xff at position 0)"),
        (b"output_dir: x\x00\x00\n", "holds NUL bytes, so it is a binary file"),
        (("a: " + "[" * 5000 + "]" * 5000).encode(), "nested too deeply to read"),
    ],
    ids=["binary", "utf16", "nul", "deep"],
)
def test_a_job_file_that_is_no_yaml_text_is_named_not_a_traceback(
    tmp_path: Path, content: bytes, says: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ") and says in str(info.value)


@pytest.mark.parametrize(
    "override",
    [
        "rollout.prompts_per_step=1e12",
        "rollout.prompts_per_step=1000000000000",
        "algorithm.group_size=100000",
        "rollout.max_new_tokens=1000000000",
        "train.steps=1000000000000",
        "ray.num_learners=100000",
        "rewards=[{name: exact_match, weight: 1e308}]",
    ],
)
def test_absurd_sizes_are_refused_at_validate_naming_the_bound(override: str) -> None:
    """1e12 prompts a step validated, then `train` hung building the sampler's order."""
    key = override.split("=")[0]
    text = config_error(MINIMAL, [override])
    assert (key.split(".")[1] if "." in key else "weight") in text and (
        "less than or equal to" in text or "valid integer" in text
    ), text


def test_an_empty_output_dir_and_all_zero_reward_weights_are_refused() -> None:
    assert "output_dir: String should have at least 1 character" in config_error(MINIMAL, ["output_dir=''"])
    zero = config_error(MINIMAL, ["rewards=[{name: exact_match, weight: 0}, {name: format, weight: 0.0}]"])
    assert "every reward has weight 0" in zero and "rewards[].weight" in zero
    config_from_dict(apply_overrides(MINIMAL, ["rewards=[{name: exact_match, weight: 0}, {name: format}]"]))


def test_bad_indentation_reports_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("output_dir: x\nmodel:\n  path: m\n   dtype: float32\n")
    with pytest.raises(ConfigError, match="not valid YAML at line 4"):
        load_config(path)


def test_duplicate_key_is_an_error_with_its_line(tmp_path: Path) -> None:
    # PyYAML alone would keep the second `train:` and silently drop the first one's steps.
    path = tmp_path / "dup.yaml"
    path.write_text(
        yaml.safe_dump(MINIMAL) + "train:\n  steps: 5\nlogging:\n  log_every: 2\ntrain:\n  lr: 0.1\n"
    )
    text = path.read_text().splitlines()
    line = len(text) - 1  # the second `train:`
    assert text[line - 1] == "train:"
    with pytest.raises(ConfigError, match=rf"at line {line}, column 1: key 'train' appears twice"):
        load_config(path)


def test_yaml_merge_key_then_an_explicit_key_is_not_a_duplicate(tmp_path: Path) -> None:
    # `<<:` merges a mapping; a key written next to it overrides the merged one (YAML rule).
    path = tmp_path / "merge.yaml"
    path.write_text(
        yaml.safe_dump(MINIMAL) + "rollout:\n  <<: {temperature: 0.5, top_p: 0.9}\n  temperature: 0.7\n"
    )
    cfg = load_config(path)
    assert (cfg.rollout.temperature, cfg.rollout.top_p) == (0.7, 0.9)


def test_yes_no_on_off_are_words_and_only_true_false_are_booleans(tmp_path: Path) -> None:
    # YAML 1.1 (PyYAML's default) reads yes/no/on/off as booleans: a judge's `yes: yes` became {True: True}.
    template = tmp_path / "t.txt"
    template.write_text("{completion} right? yes or no")
    judge = (
        f"  - name: judge\n    kwargs: {{backend: engine, template: {template}, yes: [yes, Yes], no: No}}\n"
    )
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump({k: v for k, v in MINIMAL.items() if k != "rewards"}) + "rewards:\n" + judge
    )
    kwargs = load_config(path).rewards[0].kwargs
    assert (kwargs["yes"], kwargs["no"]) == (["yes", "Yes"], "No")
    assert load_config(path, ["lora.train_merger=true"]).lora.train_merger is True
    assert (
        load_config(path, ["lora.train_merger=on"]).lora.train_merger is True
    )  # the schema still reads "on"
    assert apply_overrides({}, ["a=yes", "b=true", "c=OFF"]) == {"a": "yes", "b": True, "c": "OFF"}


def test_duplicate_key_in_an_override_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        apply_overrides(MINIMAL, ["rollout={temperature: 0.5, temperature: 0.7}"])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml' does not exist; pass the path of a YAML job file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path)  # a directory is not a job file


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("just text\n", "str"), ("3\n", "int")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"top level must be a mapping of sections.*got {kind}$"):
        load_config(path)


def test_empty_file_lists_the_required_keys(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"4 problem\(s\)(.|\n)*output_dir: required key is missing"):
        load_config(path)


def test_config_error_is_bad_input() -> None:
    # The CLI turns InputError into exit code 2 with the message and no traceback.
    assert issubclass(ConfigError, InputError) and issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------- rules of their own


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rewards=[{name: exact_mach}]", r"rewards\[0\]: unknown reward 'exact_mach'"),
        (
            "rewards=[{name: exact_match, kwargs: {strictness: 2}}]",
            r"rewards\[0\]: reward 'exact_match' cannot be called",
        ),
        (
            "rewards=[{name: 'no_such_module_xyz:score'}]",
            r"rewards\[0\]: reward 'no_such_module_xyz:score': importing module",
        ),
        (
            "rewards=[{name: 'json:no_such_function'}]",
            r"rewards\[0\]: .*module 'json' has no attribute 'no_such_function'",
        ),
    ],
)
def test_rewards_that_do_not_resolve_are_config_errors(override: str, message: str) -> None:
    assert re.search(message, config_error(MINIMAL, [override]))


def test_a_user_reward_that_imports_is_accepted() -> None:
    # os.path.join(*paths) accepts f(completion, answer, record): an importable callable that binds.
    cfg = config_from_dict(apply_overrides(MINIMAL, ["rewards=[{name: 'os.path:join'}]"]))
    assert cfg.rewards[0].name == "os.path:join"


def test_target_accuracy_needs_eval_data() -> None:
    message = config_error(MINIMAL, ["train.target_accuracy=0.9"])
    assert "train.target_accuracy=0.9 stops on held-out accuracy, but data.eval is not set" in message
    cfg = config_from_dict(
        apply_overrides(MINIMAL, ["train.target_accuracy=0.9", "data.eval=data/eval.jsonl"])
    )
    assert cfg.train.target_accuracy == 0.9


@pytest.mark.parametrize("betas", ["[0.9, 1.0]", "[-0.1, 0.999]", "[1.5, 0.5]"])
def test_betas_outside_zero_one_are_config_errors(betas: str) -> None:
    assert "train.betas: each of train.betas must lie in [0, 1)" in config_error(
        MINIMAL, [f"train.betas={betas}"]
    )


def test_betas_at_the_lower_bound_are_kept_as_written() -> None:
    cfg = config_from_dict(apply_overrides(MINIMAL, ["train.betas=[0.0, 0.5]"]))
    assert cfg.train.betas == (0.0, 0.5)


def test_new_algorithm_keys_and_their_checks() -> None:
    # YAML reads a bare `off` as false; the option is still the one named "off"
    cfg = config_from_dict(
        apply_overrides(MINIMAL, ["algorithm.rollout_correction=off", "algorithm.loss=gspo"])
    )
    assert cfg.algorithm.rollout_correction == "off" and cfg.algorithm.loss == "gspo"
    defaults = config_from_dict(MINIMAL).algorithm
    assert (defaults.loss, defaults.rollout_correction, defaults.correction_mode) == (
        "ppo",
        "token",
        "truncate",
    )
    assert defaults.overlong_buffer is None and not defaults.mask_truncated
    with pytest.raises(ConfigError, match="overlong_buffer=300 is longer than rollout.max_new_tokens=256"):
        config_from_dict(
            apply_overrides(MINIMAL, ["algorithm.overlong_buffer=300", "rollout.max_new_tokens=256"])
        )
    with pytest.raises(ConfigError, match="dual_clip applies to the ppo loss only"):
        config_from_dict(apply_overrides(MINIMAL, ["algorithm.loss=cispo", "algorithm.dual_clip=3.0"]))
    with pytest.raises(ConfigError, match="sleep_during_update frees the engines' GPU memory"):
        config_from_dict(
            apply_overrides(
                MINIMAL,
                [
                    "rollout.sleep_during_update=true",
                    "ray.placement=split",
                    "ray.learner_gpus=1",
                    "rollout.gpus_per_engine=1",
                ],
            )
        )
    with pytest.raises(ConfigError, match="algorithm.loss"):
        config_from_dict(apply_overrides(MINIMAL, ["algorithm.loss=grpo"]))


def test_resume_and_the_reliability_keys() -> None:
    defaults = config_from_dict(MINIMAL)
    assert defaults.resume is False  # a fresh run by default: existing checkpoints are never silently reused
    assert (defaults.ray.reward_isolation, defaults.ray.max_actor_restarts) == ("thread", 3)
    assert defaults.ray.call_timeout_s == defaults.ray.startup_timeout_s == 1800.0
    keys = [
        "resume=auto",
        "ray.reward_isolation=process",
        "ray.call_timeout_s=60",
        "ray.max_actor_restarts=0",
    ]
    cfg = config_from_dict(apply_overrides(MINIMAL, keys))
    assert cfg.resume == "auto" and cfg.ray.reward_isolation == "process"
    assert (cfg.ray.call_timeout_s, cfg.ray.max_actor_restarts) == (60.0, 0)
    assert config_from_dict(apply_overrides(MINIMAL, ["resume=true"])).resume is True
    with pytest.raises(ConfigError, match=r"resume"):
        config_from_dict(apply_overrides(MINIMAL, ["resume=later"]))
    with pytest.raises(ConfigError, match=r"ray.reward_isolation: Input should be 'thread' or 'process'"):
        config_from_dict(apply_overrides(MINIMAL, ["ray.reward_isolation=fork"]))
    with pytest.raises(ConfigError, match=r"ray.call_timeout_s: Input should be greater than 0"):
        config_from_dict(apply_overrides(MINIMAL, ["ray.call_timeout_s=0"]))


# --------------------------------------------------------------------------- non-finite values


@pytest.mark.parametrize(
    ("override", "key", "shown"),
    [("train.lr=.inf", "train.lr", "inf"), ("algorithm.clip_high=.nan", "algorithm.clip_high", "nan"),
     ("train.betas=[0.9, .nan]", "train.betas.1", "nan"), ("rewards.0.weight=-.inf", "rewards.0.weight", "-inf"),
     ("ray.reward_timeout_s=.inf", "ray.reward_timeout_s", "inf")],
)  # fmt: skip
def test_non_finite_numbers_are_refused_naming_the_key(override: str, key: str, shown: str) -> None:
    data = {**MINIMAL, "rewards": [{"name": "exact_match"}]}
    if override.startswith("rewards."):  # overrides address mappings; set the list item directly
        data = {**MINIMAL, "rewards": [{"name": "exact_match", "weight": float(shown)}]}
        text = config_error(data)
    else:
        text = config_error(data, [override])
    assert f"  - {key}: must be a finite number (got {shown})" in text
    assert "write a number such as 1e-5" in text


def test_on_nonfinite_defaults_to_skip_with_a_limit() -> None:
    cfg = config_from_dict(MINIMAL)
    assert (cfg.train.on_nonfinite, cfg.train.max_consecutive_skips) == ("skip", 3)
    assert (
        config_from_dict(apply_overrides(MINIMAL, ["train.on_nonfinite=stop"])).train.on_nonfinite == "stop"
    )
    assert "train.on_nonfinite" in config_error(MINIMAL, ["train.on_nonfinite=ignore"])
    assert "train.max_consecutive_skips" in config_error(MINIMAL, ["train.max_consecutive_skips=0"])


def test_async_rollouts_key_and_its_check() -> None:
    assert config_from_dict(MINIMAL).rollout.async_steps == 0  # synchronous by default
    cfg = config_from_dict(apply_overrides(MINIMAL, ["rollout.async_steps=1"]))
    assert cfg.rollout.async_steps == 1
    with pytest.raises(ConfigError, match="rollout.async_steps"):  # staleness beyond one step: not supported
        config_from_dict(apply_overrides(MINIMAL, ["rollout.async_steps=2"]))
    # engines that sleep during the update cannot generate the next batch meanwhile
    with pytest.raises(ConfigError, match="but rollout.sleep_during_update puts them to sleep") as err:
        config_from_dict(
            apply_overrides(MINIMAL, ["rollout.async_steps=1", "rollout.sleep_during_update=true"])
        )
    assert "set rollout.sleep_during_update=false" in str(err.value)


def test_lora_serving_key_and_its_check() -> None:
    assert config_from_dict(MINIMAL).rollout.lora_serving == "adapter"
    assert (
        config_from_dict(apply_overrides(MINIMAL, ["rollout.lora_serving=merged"])).rollout.lora_serving
        == "merged"
    )
    assert "rollout.lora_serving" in config_error(MINIMAL, ["rollout.lora_serving=fused"])


def test_stale_batches_without_an_old_policy_that_sampled_them_are_refused() -> None:
    stale = ["rollout.async_steps=1", "algorithm.old_logprobs=learner"]
    # the clip centred on the current policy and no weight for the gap: refused, naming the three ways out
    msg = config_error(MINIMAL, [*stale, "algorithm.rollout_correction=off"])
    for fix in ("old_logprobs=engine", "rollout_correction=token", "rollout.async_steps=0"):
        assert fix in msg
    # each of the three ways out validates
    assert config_from_dict(apply_overrides(MINIMAL, [*stale, "algorithm.rollout_correction=token"]))
    engine = ["algorithm.old_logprobs=engine", "algorithm.rollout_correction=off"]
    assert config_from_dict(apply_overrides(MINIMAL, ["rollout.async_steps=1", *engine]))
    assert config_from_dict(apply_overrides(MINIMAL, ["algorithm.rollout_correction=off"]))


def test_a_nucleus_with_the_engines_old_policy_is_refused() -> None:
    engine = ["algorithm.old_logprobs=engine", "algorithm.rollout_correction=off"]
    msg = config_error(MINIMAL, [*engine, "rollout.top_p=0.9"])
    assert "rollout.top_p=0.9" in msg and "set rollout.top_p=1.0" in msg
    assert config_from_dict(apply_overrides(MINIMAL, [*engine, "rollout.top_p=1.0"]))
    assert config_from_dict(
        apply_overrides(MINIMAL, ["rollout.top_p=0.9"])
    )  # the learner's old policy: allowed


def test_defaults_that_depend_on_the_loss_and_the_old_policy() -> None:
    def algo(*over: str) -> Any:
        return config_from_dict(apply_overrides(MINIMAL, list(over))).algorithm

    plain = algo()
    assert (plain.clip_low, plain.dual_clip, plain.loss_aggregation) == (0.2, None, "token_mean")
    # CISPO bounds its weight above only; GSPO's objective is per sequence
    assert algo("algorithm.loss=cispo").clip_low is None
    assert algo("algorithm.loss=gspo").loss_aggregation == "seq_mean_token_mean"
    # the engine's log-probs as the old policy: dual clip 3 bounds the negative-advantage side
    engine = ["algorithm.old_logprobs=engine", "algorithm.rollout_correction=off"]
    assert algo(*engine).dual_clip == 3.0
    assert algo(*engine, "algorithm.loss=sapo").dual_clip is None  # ppo only
    # what the job file says is kept
    assert algo("algorithm.loss=cispo", "algorithm.clip_low=0.2").clip_low == 0.2
    assert (
        algo("algorithm.loss=gspo", "algorithm.loss_aggregation=token_mean").loss_aggregation == "token_mean"
    )
    assert algo(*engine, "algorithm.dual_clip=null").dual_clip is None
    assert "for loss cispo only" in config_error(MINIMAL, ["algorithm.clip_low=null"])


# --------------------------------------------------------------------------- multi-turn episodes


def test_the_env_section_is_checked_at_validation() -> None:
    env = {**MINIMAL, "env": {"name": "zoom", "max_turns": 2}}
    cfg = config_from_dict(env)
    assert cfg.env is not None and cfg.env.max_images == 8 and cfg.env.step_timeout_s == 30.0
    assert "neither a built-in environment" in config_error({**MINIMAL, "env": {"name": "mazes"}})
    assert "env.max_turns" in config_error({**MINIMAL, "env": {"name": "maze", "max_turns": 0}})
    assert (
        cfg.env.pipeline == "turns"
    )  # continuous is slower with even environments (benchmarks/NOTES-zoom.md)
    assert "env.pipeline" in config_error({**MINIMAL, "env": {"name": "maze", "pipeline": "halves"}})
    tools = [{"name": "crop", "function": "a.b:c"}, {"name": "crop", "function": "a.b:d"}]
    assert "names a tool twice" in config_error({**MINIMAL, "env": {"name": "tools", "tools": tools}})
    bad = [{"name": "crop", "function": "a.b.c"}]
    assert "write a tool's function as package.module:function" in config_error(
        {**MINIMAL, "env": {"name": "tools", "tools": bad}}
    )
    # the job's rewards may be left empty only when an environment rewards the episodes
    assert config_from_dict({**env, "rewards": []}).rewards == []
    assert "rewards: list at least one reward" in config_error({**MINIMAL, "rewards": []})


def test_vllm_env_is_written_as_strings_and_names_are_checked() -> None:
    assert config_from_dict(MINIMAL).rollout.vllm_env == {}
    over = ["rollout.vllm_env={VLLM_LORA_ENABLE_DUAL_STREAM: 1, VLLM_LORA_DISABLE_PDL: false, VLLM_X: on}"]
    cfg = config_from_dict(apply_overrides(MINIMAL, over))
    # YAML reads 1 as a number and false as a boolean (on stays a word): the process gets 1, 0 and on
    assert cfg.rollout.vllm_env == {
        "VLLM_LORA_ENABLE_DUAL_STREAM": "1",
        "VLLM_LORA_DISABLE_PDL": "0",
        "VLLM_X": "on",
    }
    msg = config_error(MINIMAL, ["rollout.vllm_env={'VLLM LORA': 1}"])
    assert "['VLLM LORA'] are not environment variable names" in msg


def test_vllm_engine_args_pass_through_but_not_what_visionrl_sets() -> None:
    assert config_from_dict(MINIMAL).rollout.vllm_engine_args == {}
    cfg = config_from_dict(
        apply_overrides(
            MINIMAL, ["rollout.vllm_engine_args={max_num_seqs: 64, max_num_batched_tokens: 8192}"]
        )
    )
    assert cfg.rollout.vllm_engine_args == {"max_num_seqs": 64, "max_num_batched_tokens": 8192}
    msg = config_error(
        MINIMAL, ["rollout.vllm_engine_args={max_model_len: 100, dtype: float16, max_num_seqs: 8}"]
    )
    assert "rollout.vllm_engine_args sets what visionrl sets itself" in msg
    assert "dtype (set model.dtype), max_model_len (set rollout.max_model_len)" in msg


def test_the_production_headers_80gb_setting_is_a_valid_job() -> None:
    """The header's overrides for an 80 GB GPU load, as written, into the job it describes."""
    header = " ".join(
        line.lstrip("#").strip() for line in Path(PRODUCTION).read_text().splitlines() if line.startswith("#")
    )
    setting = header.split("On an 80 GB H100 set ", 1)[1].split(" (measured", 1)[0]
    overrides = setting.split()
    assert overrides and all("=" in o for o in overrides), setting
    cfg = load_config(PRODUCTION, overrides)
    assert cfg.model.gradient_checkpointing and cfg.model.checkpoint_layers == 18
    assert cfg.train.micro_batch_tokens == 4096 and cfg.rollout.gpu_memory_utilization == 0.5


def test_the_learners_memory_cap_is_a_share_of_its_card() -> None:
    """train.gpu_memory_gib: 80 GiB of a 141 GiB card (an H200's 143,771 MiB) is 80 / 140.4 = 0.5698 of it;
    more than the card is the whole card; zero or negative is refused."""
    from visionrl.orchestrate.actors import memory_fraction

    h200 = 143_771 * 2**20
    assert memory_fraction(80.0, h200) == pytest.approx(80 / (143_771 / 1024), abs=1e-12)
    assert round(memory_fraction(80.0, h200), 4) == 0.5698
    assert memory_fraction(200.0, h200) == 1.0
    assert config_from_dict({**MINIMAL, "train": {"gpu_memory_gib": 80}}).train.gpu_memory_gib == 80.0
    with pytest.raises(ConfigError, match="train.gpu_memory_gib"):
        config_from_dict({**MINIMAL, "train": {"gpu_memory_gib": 0}})
