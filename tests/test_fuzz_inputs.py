"""Property-based tests (hypothesis) of the two loaders a user feeds by hand: job files and data files.

Whatever YAML or JSONL comes in, `visionrl validate` (with `--check-data` for the data) exits 0 with a valid
config, or 2 with one `error:` message; it never lets an exception out (a traceback). Run through the CLI's
entry function, so the exit code is the one a user sees.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from visionrl.cli import main

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Values of every YAML kind, including the floats that must be refused (.nan, .inf) and odd strings.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["exact_match", "numeric", "no_such_module_vr:f", "visionrl:nothing", "off", "1e-3", ""]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
SECTIONS = {
    "model": ["path", "dtype", "gradient_checkpointing", "checkpoint_layers"],
    "lora": ["rank", "alpha", "dropout", "target_modules", "train_merger"],
    "data": ["train", "eval", "on_bad_image", "max_eval_samples"],
    "algorithm": ["group_size", "clip_low", "clip_high", "dual_clip", "loss", "updates_per_batch", "overlong_buffer"],
    "rollout": ["prompts_per_step", "temperature", "max_new_tokens", "max_model_len", "engine", "num_engines", "gpus_per_engine"],
    "train": ["steps", "lr", "betas", "max_grad_norm", "on_nonfinite", "max_consecutive_skips", "target_accuracy", "fsdp"],
    "logging": ["eval_every", "save_every", "keep_checkpoints"],
    "ray": ["address", "placement", "num_cpus", "reward_timeout_s", "num_learners", "learner_gpus"],
}  # fmt: skip
MINIMAL: dict[str, Any] = {
    "output_dir": "runs/x",
    "model": {"path": "m"},
    "data": {"train": "t.jsonl"},
    "rewards": [{"name": "exact_match"}],
}
key_paths = st.one_of(
    st.sampled_from([(s, k) for s, keys in SECTIONS.items() for k in keys]),
    st.tuples(st.sampled_from([*SECTIONS, "rewards", "output_dir", "nope"]), st.text(max_size=6)),
)


def _validate(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["validate", *argv])
        except SystemExit as exit_:  # argparse usage errors
            code = int(exit_.code or 0)
    return code, err.getvalue()


def _check(code: int, err: str) -> None:
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2:
        assert err.startswith("error: ") or "error:" in err, err
        assert len(err.strip()) > len("error: ")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz")
    Image.new("RGB", (8, 8), (255, 0, 0)).save(out / "red.png")
    (out / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return out


@SETTINGS
@given(text=st.text(max_size=300))
def test_any_text_as_a_job_file_is_valid_or_exit_2(folder: Path, text: str) -> None:
    path = folder / "any.yaml"
    path.write_text(text)
    _check(*_validate(str(path)))


# PyYAML recurses once per nesting level: past Python's limit (1,000) it raises RecursionError
deep = st.integers(min_value=1, max_value=3_000)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=2000),  # any bytes: binary files, other encodings, NULs
        st.text(max_size=50).map(lambda t: t.encode("utf-16")),
        deep.map(lambda n: ("a: " + "[" * n + "]" * n).encode()),
        deep.map(lambda n: ("a: " + "{b: " * n + "1" + "}" * n).encode()),
    )
)
def test_any_bytes_as_a_job_file_are_valid_or_exit_2(folder: Path, data: bytes) -> None:
    """Binary and non-UTF-8 files, and nesting thousands of levels deep (lists, or mappings)."""
    path = folder / "bytes.yaml"
    path.write_bytes(data)
    _check(*_validate(str(path)))


@SETTINGS
@given(
    changes=st.lists(st.tuples(key_paths, values), max_size=4),
    overrides=st.lists(st.text(max_size=20), max_size=2),
)
def test_any_yaml_document_and_overrides_are_valid_or_exit_2(
    folder: Path, changes: list[tuple[tuple[str, str], Any]], overrides: list[str]
) -> None:
    """A valid job file with random keys set to random values (sections replaced by scalars, lists where
    mappings go, NaN learning rates, unknown keys) plus random command-line overrides."""
    doc: dict[str, Any] = json.loads(json.dumps(MINIMAL))
    for (section, key), value in changes:
        if isinstance(doc.get(section), dict):
            doc[section][key] = value
        elif key == "":
            doc[section] = value
        else:
            doc[section] = {key: value}
    path = folder / "doc.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    overrides = [
        o for o in overrides if not o.startswith("-")
    ]  # a leading dash is an option, not an override
    code, err = _validate(str(path), *overrides)
    _check(code, err)


record_fields = st.fixed_dictionaries(
    {},
    optional={
        "id": values,
        "images": st.one_of(values, st.lists(st.sampled_from(["red.png", "broken.png", "missing.png", ""]))),
        "messages": values,
        "prompt": values,
        "answer": values,
        "metadata": values,
    },
)
lines = st.one_of(
    record_fields.map(json.dumps),
    values.map(lambda v: json.dumps(v, allow_nan=True)),
    st.text(max_size=40),
    st.just('{"id": "a", "images": ["red.png"], "prompt": "Which colour?", "answer": "red"}'),
)


@SETTINGS
@given(rows=st.lists(lines, max_size=6), on_bad_image=st.sampled_from(["error", "skip"]), crlf=st.booleans())
def test_any_jsonl_data_file_is_valid_or_exit_2(
    folder: Path, rows: list[str], on_bad_image: str, crlf: bool
) -> None:
    data = folder / "train.jsonl"
    data.write_text(("\r\n" if crlf else "\n").join(rows))
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump({**MINIMAL, "data": {"train": str(data), "on_bad_image": on_bad_image}}))
    code, err = _validate(str(job), "--check-data")
    _check(code, err)
    if code == 0:
        assert "# data.train: " in err


def test_a_valid_data_file_is_counted_and_a_nan_lr_is_refused(folder: Path) -> None:
    data = folder / "ok.jsonl"
    data.write_text('{"id": "a", "images": ["red.png"], "prompt": "Which colour?", "answer": "red"}\n')
    job = folder / "ok.yaml"
    job.write_text(yaml.safe_dump({**MINIMAL, "data": {"train": str(data)}}))
    code, err = _validate(str(job), "--check-data")
    assert code == 0 and f"# data.train: 1 records in {data}" in err
    code, err = _validate(str(job), "train.lr=.inf")
    assert code == 2
    assert "train.lr: must be a finite number (got inf)" in err


def test_check_data_reads_the_records_by_the_jobs_layout_keys(folder: Path) -> None:
    """A Geometry3K-style file (`problem`, `image`, `solution`): training read it by data.prompt_key / image_key /
    answer_key, `--check-data` ignored them and rejected it, asking for a key that was already set."""
    data = folder / "geo.jsonl"
    data.write_text('{"problem": "<image>What colour is it?", "image": "red.png", "solution": "red"}\n')
    keys = {"prompt_key": "problem", "image_key": "image", "answer_key": "solution"}
    job = folder / "geo.yaml"
    job.write_text(yaml.safe_dump({**MINIMAL, "data": {"train": str(data), **keys}}))
    code, err = _validate(str(job), "--check-data")
    assert code == 0, err
    assert f"# data.train: 1 records in {data}" in err
