"""TensorBoard metrics for visionrl: every metric name, the writer, a reader, and console progress.

All tag strings used anywhere in the project live in this module, so a dashboard, a test or a
benchmark can import the name instead of retyping it. `MetricsWriter` writes scalars, histograms,
a picture grid of a few rollouts and a Markdown table of them (drawn by `visionrl.pictures`); `read_scalars` / `read_tags` read an
event directory back with TensorBoard's own reader. `Progress` prints training progress to the console.
A full or unwritable disk under the event files is a `visionrl.errors.StorageError` naming the folder and the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

from visionrl.errors import storage_error
from visionrl.pictures import RolloutSample, rollout_grid, samples_markdown

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- tags
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
ZERO_STD_FRACTION = "reward/zero_std_fraction"  # share of groups whose rewards are all equal (no signal)
REWARD_ERRORS = "reward/errors"  # completions whose reward function raised
REWARD_TIMEOUTS = "reward/timeouts"  # completions whose reward function ran out of time
# judges (`judge` rewards): samples whose judging failed or ran out of time (scored on_error), their mean score
JUDGE_ERRORS = "reward/judge_errors"
JUDGE_TIMEOUTS = "reward/judge_timeouts"
JUDGE_MEAN = "reward/judge_mean"
JUDGE_HIST = "reward/judge_hist"  # the judges' scores of the step
LOSS_POLICY = "loss/policy"
LOSS_KL = "loss/kl"
LOSS_TOTAL = "loss/total"
CLIP_FRACTION = "policy/clip_fraction"
# its two sides: tokens with A < 0 held at the lower bound, tokens with A > 0 at the upper one
CLIP_FRACTION_LOW = "policy/clip_fraction_low"
CLIP_FRACTION_HIGH = "policy/clip_fraction_high"
# the largest and smallest ratio to the old policy of a trained token in the step (over every mini-batch)
RATIO_MAX = "policy/ratio_max"
RATIO_MIN = "policy/ratio_min"
ENTROPY = "policy/entropy"
GRAD_NORM = "policy/grad_norm"
APPROX_KL = "policy/approx_kl"
LR = "policy/lr"
LENGTH_MEAN = "response/length_mean"
LENGTH_MAX = "response/length_max"
TRUNCATED_FRACTION = "response/truncated_fraction"
TIMING_PREFIX = "timing/"
TIMING_ROLLOUT = "timing/rollout_s"
TIMING_REWARD = "timing/reward_s"
TIMING_UPDATE = "timing/update_s"
TIMING_SYNC = "timing/sync_s"
TIMING_SYNC_LOAD = "timing/sync_load_s"  # part of sync_s: the adapter to every engine, loaded there
# part of sync_s: each engine's fingerprint under it, learner-scored
TIMING_SYNC_CHECK = "timing/sync_check_s"
TIMING_STEP = "timing/step_s"
TIMING_JUDGE = "timing/judge_s"  # part of timing/reward_s: the judges' batches
# start-up, logged with a run's first step: from `train` to that step's start, and two of its parts: the actors
# started (the learner and engines load the model, vLLM compiles) and the check that the adapter reaches them
TIMING_STARTUP = "timing/startup_s"
TIMING_START_ACTORS = "timing/start_actors_s"
TIMING_DELIVERY_CHECK = "timing/delivery_check_s"
TIMING_PHASES: tuple[str, ...] = (TIMING_ROLLOUT, TIMING_REWARD, TIMING_UPDATE, TIMING_SYNC, TIMING_STEP)
THROUGHPUT = "throughput/tokens_per_s"
EVAL_ACCURACY = "eval/accuracy"
LOGPROB_DIFF = "rollout/logprob_diff"  # engine vs learner log-prob mismatch of the same tokens
# the largest over engines of the fingerprint mismatch after the sync (orchestrate.delivery)
FINGERPRINT_DIFF = "rollout/fingerprint_diff"
ADAPTER_VERSION = "rollout/adapter_version"
# learner's adapter version at the update minus the version that sampled the batch (mean over its sequences):
# 0 synchronous, 1 with rollout.async_steps=1
STALENESS = "rollout/staleness"
TIMING_ROLLOUT_WAIT = "timing/rollout_wait_s"  # async: waiting after the update for the next batch's rollouts
# share of groups whose rewards differ (1 - zero_std_fraction)
GROUPS_WITH_SIGNAL = "rollout/groups_with_signal"
GROUPS_KEPT = "rollout/groups_kept"  # groups left after dynamic sampling drops zero-signal ones
SAMPLING_ROUNDS = "rollout/sampling_rounds"  # prompt batches sampled this step (dynamic sampling)
SKIPPED_PROMPTS = "rollout/skipped_prompts"  # prompts the engine rejected this step (left out, not the batch)
RESPONSE_TOKENS = "response/tokens"  # completion tokens generated this step
LEARNER_MICRO_BATCHES = "learner/micro_batches"
# FSDP: update passes a rank ran without sequences, so that every rank runs as many collectives as the busiest
LEARNER_FILLER_PASSES = "learner/filler_passes"
# train.compile: graphs Dynamo has compiled so far; a rise after the first steps is a recompilation
LEARNER_COMPILED_GRAPHS = "learner/compiled_graphs"
LEARNER_TOKENS = "learner/tokens"
# prompt (image tokens included) + completion tokens trained on
LEARNER_SEQUENCE_TOKENS = "learner/sequence_tokens"
LEARNER_OLD_LOGPROB_S = "learner/old_logprob_s"  # the no-grad pass for mini-batches after the first
LEARNER_REF_LOGPROB_S = "learner/ref_logprob_s"  # the no-grad reference (adapter off) pass, with kl_coef > 0
LEARNER_RANKS = "learner/ranks"  # learner ranks the step was split over (ray.num_learners)
LEARNER_PEAK_MEM = "learner/peak_mem_gib"  # the learner's torch allocator peak during the step (GPUs)
# completions left out of the loss because they sampled a vision token (the logit bias should make it impossible)
VISION_TOKENS_SAMPLED = "rollout/vision_tokens_sampled"
TRUNCATED_MASKED = "response/truncated_masked"  # completions left out of the loss (algorithm.mask_truncated)
OVERLONG_PENALIZED = "response/overlong_penalized"  # completions the overlong shaping penalised
OVERLONG_PENALTY_MEAN = "reward/overlong_penalty_mean"  # mean shaping term added to the rewards
CORRECTION_WEIGHT = "rollout/correction_weight_mean"  # mean rollout-correction weight of the loss's tokens
CORRECTION_CLIPPED = "rollout/correction_clipped_fraction"  # share of tokens truncated or masked by it
MISMATCH_KL = "rollout/mismatch_kl"  # KL estimate between the engine's and the learner's token distributions
ENGINE_SLEEP = "timing/engine_sleep_s"  # rollout.sleep_during_update: putting the engines to sleep
ENGINE_WAKE = "timing/engine_wake_s"  # ... and waking them before the sync
# engines and reward workers restarted so far in the run, resumes included
ACTOR_RESTARTS = "faults/actor_restarts"
SKIPPED_UPDATES = "faults/skipped_updates"  # learner updates not applied: non-finite loss or gradient
DATA_SKIPPED_AT_LOAD = "data/skipped_at_load"  # training records dropped for a bad image when the data loaded
DATA_SKIPPED_MIDRUN = "data/skipped_midrun"  # records whose image failed to decode during the run, so far
REWARD_HIST = "reward/hist"
LENGTH_HIST = "response/length_hist"
# multi-turn episodes (visionrl.envs): per step
EPISODE_PREFIX = "episode/"
EPISODE_TURNS = "episode/turns_mean"  # model turns per episode
EPISODE_ENV_REWARD = "episode/env_reward_mean"  # the environment's step rewards summed per episode
EPISODE_IMAGES = "episode/images_mean"  # images per episode, the prompt's included
# share of an episode's tokens the environment wrote (not trained)
EPISODE_ENV_TOKENS = "episode/env_token_fraction"
# episodes whose one-piece re-render differs from the tokens
EPISODE_REPLAY_MISMATCHES = "episode/replay_mismatches"
# + why: done, max_turns, truncated, error, timeout, too_long, max_images
EPISODE_ENDED_PREFIX = "episode/ended_"
TIMING_ENV = "timing/env_s"  # part of timing/rollout_s: the environments' steps (summed over engine lanes)

SAMPLES_PREFIX = "samples/"
SAMPLES_IMAGE = SAMPLES_PREFIX + "rollouts"
SAMPLES_TABLE = SAMPLES_PREFIX + "table"

REQUIRED_SCALARS: tuple[str, ...] = (
    REWARD_MEAN,
    REWARD_STD,
    LOSS_POLICY,
    LOSS_KL,
    CLIP_FRACTION,
    ENTROPY,
    GRAD_NORM,
    LENGTH_MEAN,
    TRUNCATED_FRACTION,
    TIMING_ROLLOUT,
    TIMING_UPDATE,
    TIMING_STEP,
    THROUGHPUT,
    EVAL_ACCURACY,
)
"""Scalar tags every training run must write (tests/integration/test_loop.py reads them back)."""

REQUIRED_HISTOGRAMS: tuple[str, ...] = (REWARD_HIST, LENGTH_HIST)
"""Histogram tags every training run must write (read back by the same test)."""

REWARD_COMPONENT_PREFIX = "reward/component/"


def timing_tag(phase: str) -> str:
    """Tag of the wall time of one phase of a step, e.g. `timing/rollout_s` for phase `rollout`."""
    if not phase or "/" in phase:
        raise ValueError(f"phase name {phase!r} must be non-empty and without '/'")
    return f"{TIMING_PREFIX}{phase}_s"


def reward_component_tag(name: str) -> str:
    """Tag of the mean of one reward component of a combined reward, e.g. `reward/component/format`."""
    if not name.strip():
        raise ValueError("reward component name is empty; give each reward function a non-empty name")
    return REWARD_COMPONENT_PREFIX + name


# ---------------------------------------------------------------- writer
def _wait_past_event_files(log_dir: Path) -> None:
    """TensorBoard reads a folder's event files in name order. A name starts with the second the file was opened in,
    then the host, the process id and a counter that is not zero-padded ("10" sorts before "9"), so two files opened
    in one second can be read in the wrong order: a purge marker, or a resumed run's values, before the events they
    replace. Wait until the clock has left the latest second named in `log_dir` (at most a second or two; a name
    from a clock far ahead is not waited for)."""
    seconds = []
    for path in log_dir.glob("events.out.tfevents.*"):
        field = path.name.split(".")[3]
        if field.isdigit():
            seconds.append(int(field))
    wait = max(seconds, default=-1) + 1 - time.time()
    if 0 < wait <= 2:
        time.sleep(wait)


class MetricsWriter:
    """Writes one run's metrics as TensorBoard event files in `log_dir` (created if missing).

    Tags are free strings, but callers take them from the constants of this module.
    Use as a context manager, or call `close()` at the end.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self._pending = (
            0  # bytes of the events handed to the writer since the last flush that reached the disk
        )
        self._failed = (
            False  # a write failed: the writer's thread has ended, and closing it would raise again
        )
        self._empty = True  # the open writer's file holds only its header: no event, no purge marker
        with self._storage():
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = self._open()

    def _open(self, purge_step: int | None = None) -> SummaryWriter:
        from torch.utils.tensorboard import SummaryWriter  # heavy: imports torch

        _quiet_writer_threads()
        _wait_past_event_files(self.log_dir)
        writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
        # Count the bytes of every event as it goes to the event file (a record frames it with 16 bytes), so a
        # full disk can be reported with what did not fit.
        file_writer: Any = writer.file_writer  # torch declares it Optional; the constructor opened it
        add_event = file_writer.add_event

        def counted(event: Any, step: int | None = None, walltime: float | None = None) -> None:
            self._empty = False
            try:
                add_event(event, step, walltime)  # sets the event's step and time, then queues it
            finally:  # also an event refused because an earlier write failed: it did not fit either
                self._pending += event.ByteSize() + 16

        file_writer.add_event = counted
        self._empty = purge_step is None  # a purge marker went in before `counted` was in place
        return writer

    @contextlib.contextmanager
    def _storage(self) -> Iterator[None]:
        """A write that fails (a full disk, a read-only mount): StorageError naming the folder and the bytes. The
        event file is written by TensorBoard's background thread; its error comes up at the next call here."""
        try:
            yield
        except OSError as err:
            self._failed = True
            kept = f"The events written before are intact in {self.log_dir}."
            raise storage_error(err, self.log_dir, self._pending or None, kept=kept) from None

    def purge_from(self, step: int) -> None:
        """Hide every event of `step` and later already in `log_dir` (a resumed run re-runs those steps): TensorBoard
        then shows each step once, the new value. Call before writing anything for `step`."""
        # The purge marker is written when a writer opens its event file, so a new writer (new file) carries it.
        with self._storage():
            file_writer: Any = self._writer.file_writer  # torch declares it Optional; open until closed here
            unused = Path(file_writer.event_writer._file_name) if self._empty else None
            self._writer.close()
            if unused is not None:  # the file this writer opened holds no event yet: one file fewer to read
                unused.unlink(missing_ok=True)
            self._writer = self._open(purge_step=step)

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Write each value of `values` under its tag; None means "not measured this step" and is skipped."""
        with self._storage():
            for tag, value in values.items():
                if value is not None:
                    self._writer.add_scalar(tag, float(value), global_step=step)

    def histogram(self, step: int, tag: str, values: Sequence[float] | np.ndarray | torch.Tensor) -> bool:
        """Write a histogram of the finite `values`; returns False (and warns) when none is left to write."""
        if hasattr(values, "detach"):  # a torch tensor, possibly on an accelerator
            values = values.detach().cpu().numpy()
        array = np.asarray(values, dtype=np.float64).ravel()
        finite = array[np.isfinite(array)]
        if finite.size < array.size:
            logger.warning(
                "histogram %s step %d: dropped %d non-finite values", tag, step, array.size - finite.size
            )
        if finite.size == 0:
            logger.warning("histogram %s step %d: no finite values, nothing written", tag, step)
            return False
        with self._storage():
            self._writer.add_histogram(tag, finite, global_step=step)
        return True

    def image(self, step: int, tag: str, picture: Image.Image) -> None:
        """Write a PIL picture (converted to RGB, HWC uint8)."""
        array = np.asarray(picture.convert("RGB"), dtype=np.uint8)
        with self._storage():
            self._writer.add_image(tag, array, global_step=step, dataformats="HWC")

    def rollout_images(
        self, step: int, samples: Sequence[RolloutSample], cols: int = 4, cell: int = 192
    ) -> bool:
        """Write a grid picture of `samples` under SAMPLES_IMAGE; True if written.

        A picture that cannot be drawn (an unreadable or truncated image file) is logged as a warning
        and skipped: a debugging aid must never stop training.
        """
        grid = rollout_grid(step, samples, cols=cols, cell=cell)
        if grid is not None:
            self.image(step, SAMPLES_IMAGE, grid)
        return grid is not None

    def text(self, step: int, tag: str, markdown: str) -> None:
        """Write Markdown text (shown by TensorBoard's Text tab)."""
        with self._storage():
            self._writer.add_text(tag, markdown, global_step=step)

    def rollout_table(self, step: int, samples: Sequence[RolloutSample]) -> None:
        """Write the Markdown table of `samples` under SAMPLES_TABLE."""
        if samples:
            self.text(step, SAMPLES_TABLE, samples_markdown(samples))

    def flush(self) -> None:
        """Push buffered events to disk, so a reader sees them now."""
        with self._storage():
            self._writer.flush()
        self._pending = 0

    def close(self) -> None:
        """Flush and close the event file (after a failed write: nothing is left to flush)."""
        if not self._failed:
            with self._storage():
                self._writer.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _quiet_writer_threads() -> None:
    """TensorBoard's writer thread re-raises a failed write (a full disk) to end itself, and Python prints that
    traceback (docs/ENGINE_NOTES.md); the error reaches the user once, as the StorageError of the writer's next
    call. Other threads' exceptions are printed as before."""
    shown = threading.excepthook
    if getattr(shown, "visionrl", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            logger.debug("TensorBoard's writer thread ended: %s", args.exc_value)
            return
        shown(args)

    hook.visionrl = True  # type: ignore[attr-defined]
    threading.excepthook = hook


# ---------------------------------------------------------------- reader
def load_events(log_dir: str | os.PathLike[str]) -> EventAccumulator:
    """TensorBoard's EventAccumulator over the event files in `log_dir`, loaded, keeping every event."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    keep_all = {
        ea.SCALARS: 0,
        ea.HISTOGRAMS: 0,
        ea.COMPRESSED_HISTOGRAMS: 0,
        ea.IMAGES: 0,
        ea.TENSORS: 0,
    }
    accumulator = ea.EventAccumulator(str(log_dir), size_guidance=keep_all)
    accumulator.Reload()
    return accumulator


def read_tags(log_dir: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Tags in `log_dir` by kind: {"scalars": [...], "histograms": [...], "images": [...], "tensors": [...], ...}."""
    tags: dict[str, Any] = load_events(log_dir).Tags()
    return {kind: sorted(names) for kind, names in tags.items() if isinstance(names, list)}


def read_scalars(log_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in `log_dir` as {tag: [(step, value), ...]} in the order written.

    Old-style writers store scalars as `simple_value` (TensorBoard's Scalars); new-style ones store
    0-d tensors with the scalars plugin's metadata (TensorBoard's Tensors). Both are read.
    """
    from tensorboard.util import tensor_util

    accumulator = load_events(log_dir)
    tags = accumulator.Tags()
    result = {tag: [(e.step, float(e.value)) for e in accumulator.Scalars(tag)] for tag in tags["scalars"]}
    for tag in tags["tensors"]:
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            continue  # text, histograms of new-style writers, ...
        events = accumulator.Tensors(tag)
        result[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto).item())) for e in events]
    return result


# ---------------------------------------------------------------- console progress
def format_duration(seconds: float) -> str:
    """Compact duration: 45s, 1m02s, 2h05m."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _format_fields(fields: Mapping[str, float]) -> str:
    return " ".join(
        f"{name} {value:.2f}" if isinstance(value, float) else f"{name} {value}"
        for name, value in fields.items()
    )


class Progress:
    """Training progress on the console: step i/N, the latest value of each field, and the ETA.

    On a terminal it is a live rich progress bar. Elsewhere (CI logs, files) it prints one compact line
    every `every` steps and at the last step, e.g. `step 10/100 reward 0.41 acc 0.30 eta 1m02s`.
    Fields keep their latest value, so an accuracy measured every 50 steps stays on the line between evals.
    """

    def __init__(
        self,
        total: int,
        *,
        every: int = 10,
        stream: TextIO | None = None,
        start_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total < 1 or every < 1:
            raise ValueError(f"total and every must be positive, got total={total}, every={every}")
        self.total = total
        self.every = every
        self._stream = stream if stream is not None else sys.stdout
        self._start_step = start_step  # a resumed run: the ETA counts only steps done in this process
        self._clock = clock
        self._started = clock()
        self._fields: dict[str, float] = {}
        self._live: Any = None
        self._task: Any = None
        if self._stream.isatty():
            self._start_live()

    def _start_live(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        # auto_refresh off: no background thread; the bar is redrawn at each update, which is often enough.
        self._live = RichProgress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=Console(file=self._stream),
            auto_refresh=False,
        )
        self._task = self._live.add_task("train", total=self.total, completed=self._start_step, info="")
        self._live.start()

    def line(self, step: int) -> str:
        """The compact progress line for `step` with the current fields."""
        done = step - self._start_step
        eta = "?"
        if done > 0:
            per_step = (self._clock() - self._started) / done
            eta = format_duration(per_step * (self.total - step))
        info = _format_fields(self._fields)
        return f"step {step}/{self.total}" + (f" {info}" if info else "") + f" eta {eta}"

    def update(self, step: int, **fields: float | None) -> None:
        """Record that `step` is done with these field values (None: not measured now, keep the last)."""
        self._fields.update({name: value for name, value in fields.items() if value is not None})
        if self._live is not None:
            self._live.update(self._task, completed=step, info=_format_fields(self._fields))
            self._live.refresh()
        elif step % self.every == 0 or step == self.total:
            print(self.line(step), file=self._stream, flush=True)

    def close(self) -> None:
        """Stop the live bar (no-op for line output)."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
