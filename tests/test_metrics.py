"""Tests of visionrl.metrics: the TensorBoard writer and reader, the rollout grid, and console progress."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFont

from visionrl import metrics
from visionrl.metrics import (
    MetricsWriter,
    Progress,
    format_duration,
    load_events,
    read_scalars,
    read_tags,
    reward_component_tag,
)
from visionrl.pictures import RolloutSample, render_rollout_grid, samples_markdown, truncate, wrap_text


def _sample(reward: float = 1.0, completion: str = "<answer>blue</answer>", size: int = 16) -> RolloutSample:
    return RolloutSample(
        image=Image.new("RGB", (size, size), (0, 0, 255)),
        question="What colour is the square?",
        completion=completion,
        answer="blue",
        reward=reward,
    )


# ---------------------------------------------------------------- tags


def test_required_tags_are_module_constants() -> None:
    assert metrics.REQUIRED_SCALARS == (
        "reward/mean",
        "reward/std",
        "loss/policy",
        "loss/kl",
        "policy/clip_fraction",
        "policy/entropy",
        "policy/grad_norm",
        "response/length_mean",
        "response/truncated_fraction",
        "timing/rollout_s",
        "timing/update_s",
        "timing/step_s",
        "throughput/tokens_per_s",
        "eval/accuracy",
    )
    assert metrics.REQUIRED_HISTOGRAMS == ("reward/hist", "response/length_hist")
    assert metrics.SAMPLES_IMAGE.startswith(metrics.SAMPLES_PREFIX)
    assert metrics.SAMPLES_TABLE.startswith(metrics.SAMPLES_PREFIX)


def test_reward_component_tag() -> None:
    assert reward_component_tag("format") == "reward/component/format"
    with pytest.raises(ValueError, match="empty"):
        reward_component_tag("  ")


# ---------------------------------------------------------------- write and read back


def test_scalars_histograms_images_round_trip(tmp_path: Path) -> None:
    # Values are exact in float32 (TensorBoard stores scalars as float32), so equality is exact.
    rewards = {1: 0.25, 2: 0.5, 3: 0.75}
    with MetricsWriter(tmp_path / "tb") as writer:
        for step, reward in rewards.items():
            writer.scalars(
                step,
                {
                    metrics.REWARD_MEAN: reward,
                    metrics.LOSS_POLICY: -reward,
                    metrics.EVAL_ACCURACY: 0.5 if step == 2 else None,  # only measured at step 2
                },
            )
            assert writer.histogram(step, metrics.REWARD_HIST, [0.0, 1.0, 1.0, float(step)])
            assert writer.histogram(step, metrics.LENGTH_HIST, torch.tensor([4.0, 8.0]))
            assert writer.rollout_images(step, [_sample(), _sample(reward=0.0)], cols=2, cell=32)
            writer.rollout_table(step, [_sample()])

    scalars = read_scalars(tmp_path / "tb")
    assert scalars[metrics.REWARD_MEAN] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert scalars[metrics.LOSS_POLICY] == [(1, -0.25), (2, -0.5), (3, -0.75)]
    assert scalars[metrics.EVAL_ACCURACY] == [(2, 0.5)]

    tags = read_tags(tmp_path / "tb")
    assert tags["scalars"] == sorted([metrics.REWARD_MEAN, metrics.LOSS_POLICY, metrics.EVAL_ACCURACY])
    assert tags["histograms"] == sorted([metrics.REWARD_HIST, metrics.LENGTH_HIST])
    assert tags["images"] == [metrics.SAMPLES_IMAGE]
    assert any(tag.startswith(metrics.SAMPLES_TABLE) for tag in tags["tensors"])  # text is a tensor summary

    events = load_events(tmp_path / "tb")
    hists = events.Histograms(metrics.REWARD_HIST)
    assert [h.step for h in hists] == [1, 2, 3]
    # step s: values 0, 1, 1, s -> num 4, sum 2 + s, max max(1, s)
    assert [(h.histogram_value.num, h.histogram_value.sum, h.histogram_value.max) for h in hists] == [
        (4, 3.0, 1.0),
        (4, 4.0, 2.0),
        (4, 5.0, 3.0),
    ]
    images = events.Images(metrics.SAMPLES_IMAGE)
    assert [i.step for i in images] == [1, 2, 3]
    # 2 cells of 32 px in one row: width 2*32 + 3*8 = 88; height cell_height(32) + 2*8
    # = 32 + 4 + 11*14 + 16 = 206.
    assert {(i.width, i.height) for i in images} == {(88, 206)}


def test_read_scalars_handles_new_style_tensor_scalars(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    writer.add_scalar(metrics.GRAD_NORM, 1.5, global_step=4, new_style=True)
    writer.add_scalar(metrics.GRAD_NORM, 2.5, global_step=5, new_style=True)
    writer.close()

    assert read_tags(tmp_path)["scalars"] == []  # stored as tensors, not as simple values
    assert read_scalars(tmp_path) == {metrics.GRAD_NORM: [(4, 1.5), (5, 2.5)]}


def test_histogram_drops_non_finite_values_and_skips_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="visionrl.metrics"), MetricsWriter(tmp_path) as writer:
        assert writer.histogram(1, metrics.REWARD_HIST, np.array([1.0, np.nan, 3.0, np.inf]))
        assert not writer.histogram(2, metrics.REWARD_HIST, [])
        assert not writer.histogram(3, metrics.REWARD_HIST, [float("nan")])
    assert "dropped 2 non-finite values" in caplog.text
    assert "step 2: no finite values" in caplog.text

    hists = load_events(tmp_path).Histograms(metrics.REWARD_HIST)
    assert [(h.step, h.histogram_value.num, h.histogram_value.sum) for h in hists] == [(1, 2, 4.0)]


def test_unreadable_image_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A PNG cut in half: opening reads the header fine, drawing it raises OSError inside PIL.
    path = tmp_path / "cut.png"
    Image.new("RGB", (64, 64), (10, 200, 30)).save(path)
    path.write_bytes(path.read_bytes()[:60])
    with (
        Image.open(path) as opened,
        caplog.at_level(logging.WARNING, logger="visionrl.metrics"),
        MetricsWriter(tmp_path / "tb") as writer,
    ):
        broken = RolloutSample(opened, "q", "c", "a", 1.0)
        assert not writer.rollout_images(7, [_sample(), broken])
        assert writer.rollout_images(8, [_sample()])  # the writer still works afterwards
        assert not writer.rollout_images(9, [])
    assert "step 7: rollout picture not written: OSError" in caplog.text
    assert [i.step for i in load_events(tmp_path / "tb").Images(metrics.SAMPLES_IMAGE)] == [8]


# ---------------------------------------------------------------- rollout grid


@pytest.mark.parametrize(
    ("n", "cols", "cell", "size"),
    [
        # width = c*cell + (c+1)*8 with c = min(cols, n); height = r*(cell + 4 + 11*14) + (r+1)*8
        (1, 4, 192, (192 + 16, 350 + 16)),  # one cell: 192+4+154 = 350 tall
        (5, 4, 192, (4 * 192 + 5 * 8, 2 * 350 + 3 * 8)),  # 4 columns, 2 rows: 808 x 724
        (3, 2, 64, (2 * 64 + 3 * 8, 2 * 222 + 3 * 8)),  # 64+4+154 = 222 tall: 152 x 468
        (4, 4, 100, (4 * 100 + 5 * 8, 258 + 16)),  # one row: 440 x 274
    ],
)
def test_grid_size(n: int, cols: int, cell: int, size: tuple[int, int]) -> None:
    grid = render_rollout_grid([_sample() for _ in range(n)], cols=cols, cell=cell)
    assert grid.mode == "RGB"
    assert grid.size == size


def test_grid_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        render_rollout_grid([])
    with pytest.raises(ValueError, match="cols"):
        render_rollout_grid([_sample()], cols=0)


def test_grid_picture_is_scaled_with_nearest_neighbour() -> None:
    # A 2x2 checker enlarged to 64 px: each quadrant is one flat colour (no blending at the seams).
    checker = Image.new("RGB", (2, 2))
    checker.putdata([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)])
    sample = RolloutSample(checker, "q", "c", "a", 1.0)
    grid = np.asarray(render_rollout_grid([sample], cols=1, cell=64))
    picture = grid[8 : 8 + 64, 8 : 8 + 64]  # the cell starts at (GRID_PAD, GRID_PAD)
    assert (picture[:32, :32] == (255, 0, 0)).all()
    assert (picture[:32, 32:] == (0, 255, 0)).all()
    assert (picture[32:, :32] == (0, 0, 255)).all()
    assert (picture[32:, 32:] == (255, 255, 0)).all()


def test_grid_reward_colour() -> None:
    # Two cells of 64 px; the reward bar is the last 14 px line of each cell. Its right end holds no text.
    # Cell height 222: the bar spans y = 8 + 222 - 14 .. 8 + 222 - 1; sample at y = 8 + 222 - 3.
    grid = render_rollout_grid([_sample(reward=1.0), _sample(reward=0.5)], cols=2, cell=64)
    y = 8 + 222 - 3
    good = grid.getpixel((8 + 64 - 3, y))  # first cell: x in 8 .. 71
    bad = grid.getpixel((8 + 64 + 8 + 64 - 3, y))  # second cell: x in 80 .. 143
    assert good == (30, 150, 60)  # green: reward > 0.5
    assert bad == (200, 40, 40)  # red: 0.5 is not > 0.5


def test_long_completion_does_not_change_the_grid() -> None:
    short = render_rollout_grid([_sample(completion="blue")], cols=1, cell=96)
    long = render_rollout_grid([_sample(completion="word " * 5000)], cols=1, cell=96)
    assert long.size == short.size


# ---------------------------------------------------------------- text helpers


def test_truncate() -> None:
    assert truncate("abc", 3) == "abc"
    assert truncate("abcdefgh", 6) == "abc..."
    assert len(truncate("x" * 10_000, 400)) == 400


def test_wrap_text_fits_width_and_marks_the_cut() -> None:
    font = ImageFont.load_default()
    lines = wrap_text("lorem ipsum dolor " * 200, width=80, max_lines=3, font=font)
    assert len(lines) == 3
    assert all(font.getlength(line) <= 80 for line in lines)
    assert lines[-1].endswith("...")
    assert lines[0].startswith("lorem")


def test_wrap_text_keeps_short_text_and_splits_long_words() -> None:
    font = ImageFont.load_default()
    assert wrap_text("a b  c", width=200, max_lines=3, font=font) == ["a b c"]
    lines = wrap_text("x" * 100, width=30, max_lines=50, font=font)
    assert "".join(lines) == "x" * 100  # split by character, nothing lost
    assert len(lines) > 1 and all(font.getlength(line) <= 30 for line in lines)


def test_samples_markdown_escapes_and_truncates() -> None:
    sample = RolloutSample(Image.new("RGB", (2, 2)), "a | b?\nnext", "z" * 50, "b", 0.25)
    table = samples_markdown([sample], max_chars=10).splitlines()
    assert table[0] == "| # | question | completion | answer | reward |"
    assert table[2] == "| 0 | a \\| b? next | zzzzzzz... | b | 0.25 |"
    assert len(table) == 3


# ---------------------------------------------------------------- progress


class _Clock:
    """A clock the test advances by hand, so the ETA is exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (45.4, "45s"), (62, "1m02s"), (3599.6, "1h00m"), (7500, "2h05m")]
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_progress_prints_compact_lines_when_not_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    clock = _Clock()
    progress = Progress(25, every=10, clock=clock)  # capsys stdout is not a TTY
    for step in range(1, 26):
        clock.now += 2.5  # 2.5 s per step
        progress.update(step, reward=0.4 + step / 100, acc=0.3 if step == 10 else None)
    progress.close()
    # step 10: 25 s for 10 steps, 15 left -> 37.5 s rounds to 38s; acc stays at its last value.
    assert capsys.readouterr().out.splitlines() == [
        "step 10/25 reward 0.50 acc 0.30 eta 38s",
        "step 20/25 reward 0.60 acc 0.30 eta 12s",  # 50 s / 20 steps * 5 = 12.5 -> 12 (banker's rounding)
        "step 25/25 reward 0.65 acc 0.30 eta 0s",
    ]


def test_progress_eta_of_a_resumed_run_counts_only_new_steps() -> None:
    clock = _Clock()
    stream = io.StringIO()
    progress = Progress(100, every=5, stream=stream, start_step=90, clock=clock)
    clock.now += 10.0  # 5 steps in 10 s: 2 s per step, 5 steps left
    progress.update(95)
    assert stream.getvalue() == "step 95/100 eta 10s\n"


def test_progress_on_a_tty_draws_a_bar_not_lines() -> None:
    class _Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = _Tty()
    with Progress(10, every=1, stream=stream) as progress:
        progress.update(3, reward=0.5)
    out = stream.getvalue()
    assert "3/10" in out and "reward 0.50" in out
    assert "step 3/10 reward" not in out  # the bar layout, not the compact line


def test_progress_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="total"):
        Progress(0)


def test_purge_from_hides_the_steps_a_resumed_run_writes_again(tmp_path: Path) -> None:
    """Steps 1-3 written, the run resumed from step 2's checkpoint: steps 3 and 4 written again. TensorBoard's
    own reader shows each step once, step 3 with the new value."""
    from visionrl.metrics import MetricsWriter, read_scalars

    with MetricsWriter(tmp_path) as tb:
        for step in (1, 2, 3):
            tb.scalars(step, {"reward/mean": step / 4})  # exact in float32
    with MetricsWriter(tmp_path) as tb:
        tb.purge_from(3)
        for step in (3, 4):
            tb.scalars(step, {"reward/mean": step})
    assert read_scalars(tmp_path)["reward/mean"] == [(1, 0.25), (2, 0.5), (3, 3.0), (4, 4.0)]


def test_a_resume_in_the_same_second_is_read_after_the_run_it_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard reads event files in name order; a name holds the second, the pid and a counter that is not
    zero-padded. With the counter at 9, the resumed writer's file is named ...11 and, in the same second, would be
    read before ...9: the purge marker first, then the old steps 3 shown again. The writer waits for the next
    second instead, so the old events come first."""
    from tensorboard.summary.writer import event_file_writer

    from visionrl.metrics import MetricsWriter, read_scalars

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    with MetricsWriter(tmp_path) as tb:
        for step in (1, 2, 3):
            tb.scalars(step, {"reward/mean": step / 4})
    with MetricsWriter(tmp_path) as tb:
        tb.purge_from(3)
        tb.scalars(3, {"reward/mean": 3})
    names = sorted(p.name for p in tmp_path.glob("events.out.tfevents.*"))
    assert [name.rsplit(".", 1)[1] for name in names] == [
        "9",
        "11",
    ]  # the resumed writer's unused file is gone
    assert names[0].split(".")[3] < names[1].split(".")[3]  # a later second
    assert read_scalars(tmp_path)["reward/mean"] == [(1, 0.25), (2, 0.5), (3, 3.0)]


def test_a_fresh_run_that_purges_at_once_keeps_one_file_and_does_not_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop opens its writer, then purges from its first step: the first file (header only) is removed, so
    nothing in the folder shares its second and no wait happens."""
    import visionrl.metrics as metrics

    waits: list[float] = []
    monkeypatch.setattr(metrics.time, "sleep", waits.append)
    with metrics.MetricsWriter(tmp_path) as tb:
        tb.purge_from(1)
        tb.scalars(1, {"reward/mean": 0.5})
    assert waits == []
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert metrics.read_scalars(tmp_path)["reward/mean"] == [(1, 0.5)]


def test_a_full_disk_under_tensorboard_names_the_folder_and_the_bytes(
    small_disk, capfd: pytest.CaptureFixture[str]
) -> None:
    """TensorBoard writes on its own thread (the stand-in disk of `small_disk` cannot reach it: a real tmpfs).
    Steps of 20 scalars until the 16 KiB disk is full: StorageError naming the folder, the bytes of the step that
    did not fit and the bytes free; every step before it reads back whole; no thread traceback is printed."""
    from visionrl.errors import StorageError

    folder = small_disk(16 * 1024, real=True) / "tensorboard"
    values = {f"a/{i}": 1.0 for i in range(20)}
    written = 0
    with pytest.raises(StorageError) as err, MetricsWriter(folder) as tb:
        for step in range(1, 1000):  # about 830 bytes a step: the disk is full after about 19 steps
            tb.scalars(step, values)
            tb.flush()
            written = step
    # One scalar event: wall_time (1 + 8 bytes) + step < 128 (1 + 1) + summary (1 + 1 + Summary); Summary: one
    # value (1 + 1 + Value); Value: tag "a/0" (1 + 1 + 3) + simple_value float (1 + 4) = 10; so 12, 14, and the
    # event 25 bytes; a record adds length (8) + 2 CRCs (4 + 4): 41 bytes, 42 for the 4-letter tags a/10..a/19.
    # A whole step: 10 x 41 + 10 x 42 = 830 bytes; its first k scalars: 41 k (k <= 10), 410 + 42 (k - 10).
    prefixes = {41 * k for k in range(1, 11)} | {410 + 42 * k for k in range(1, 11)}
    text = str(err.value)
    where = re.escape(str(folder))
    found = re.match(
        rf"the disk is full: writing {where} needs ([\d,]+) bytes, [\d,]+ bytes free there", text
    )
    assert found and int(found.group(1).replace(",", "")) in prefixes, text
    assert "The events written before are intact" in text and "To fix: free space there" in text
    assert 5 < written < 999
    scalars = read_scalars(folder)
    assert all([s for s, _ in scalars[tag]][:written] == list(range(1, written + 1)) for tag in values)
    assert "Traceback" not in capfd.readouterr().err


def test_a_read_only_tensorboard_folder_is_a_clear_error(small_disk) -> None:
    from visionrl.errors import StorageError

    folder = small_disk(64 * 1024, read_only=True, real=True) / "tensorboard"
    with pytest.raises(StorageError, match=r"tensorboard cannot be written \(Read-only file system\)\. "):
        MetricsWriter(folder)
