"""Error types for bad user input: the CLI prints them as one clear message and exits with code 2."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class InputError(ValueError):
    """Bad input from the user (job file, data, adapter, arguments). The message says what, why and what to do."""


class ExportError(InputError):
    """An adapter cannot be exported, fetched or served, or does not verify; the message says what, why and
    what to do."""


class RunError(RuntimeError):
    """The run failed at run time (an actor died, an engine broke); the message says how to continue."""


class NonFiniteError(RunError):
    """Training produced a NaN or infinite loss or gradient (the update was not applied)."""


class StorageError(RunError):
    """A file could not be written (disk full, read-only, no permission); the message names the path, the
    bytes needed and what was kept intact."""


BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (InputError,)


class OutOfMemory(RunError):
    """An actor ran out of accelerator memory; the message names the actor, the phase, the memory in use and
    the settings that lower it."""


# What lowers each actor's memory, in the order worth trying.
MEMORY_ADVICE = {
    "learner": (
        "lower train.micro_batch_tokens (now {micro_batch_tokens}), set model.gradient_checkpointing=true "
        "(checkpoint_layers: null checkpoints every layer), lower train.logit_chunk_tokens (now "
        "{logit_chunk_tokens}), or, colocated, give the engine less: rollout.gpu_memory_utilization (now "
        "{gpu_memory_utilization}) or rollout.sleep_during_update=true; train.gpu_memory_gib (now "
        "{gpu_memory_gib}; null: the whole card) is the learner's own cap"
    ),
    "rollout engine": (
        "lower rollout.gpu_memory_utilization (now {gpu_memory_utilization}) if the learner shares the GPU, or "
        "rollout.max_model_len (now {max_model_len}) / rollout.prompts_per_step (now {prompts_per_step})"
    ),
}


def out_of_memory(actor: str, phase: str, err: BaseException, settings: dict[str, object]) -> OutOfMemory:
    """The OutOfMemory error for `err` raised in `actor` during `phase`, with the device's memory figures."""
    used = ""
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            mine = torch.cuda.memory_reserved() / 2**30
            used = (
                f" GPU memory: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use on the device, "
                f"{mine:.1f} GiB reserved by this {actor}."
            )
    except RuntimeError:  # the device itself may be unusable after the failure: report without figures
        pass
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    advice = MEMORY_ADVICE[actor].format(**settings)
    return OutOfMemory(f"the {actor} ran out of memory during {phase}.{used}\nTo fix: {advice}.\n({first})")


class Preempted(RunError):
    """A stop signal (SIGTERM, SIGINT) ended the run; the CLI exits with 128 + the signal number. Raised bare
    where the loop notices the request; the loop re-raises it with the checkpoint it wrote in the message."""

    def __init__(self, signum: int, message: str = "") -> None:
        import signal

        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(message or f"stopped by {self.signal_name}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def storage_error(
    err: OSError, path: str | os.PathLike[str], needed: int | None, kept: str = ""
) -> StorageError:
    """The StorageError for `err` raised while writing `needed` bytes (None: not known) to `path`: what, how
    much, what to do."""
    where = Path(path)
    free = ""
    for parent in (where, *where.parents):
        if parent.exists():
            free = f", {shutil.disk_usage(parent).free:,} bytes free there"
            break
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        need = f"needs {needed:,} bytes" if needed is not None else "failed"
        why = f"the disk is full: writing {where} {need}{free}"
        fix = "free space there, or point output_dir at a larger disk"
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = f"{where} cannot be written ({os.strerror(err.errno or 0)})"
        if needed is not None:
            why += f"; {needed:,} bytes were to be written"
        fix = "give the run write access there, or choose another output_dir"
    elif err.errno in (errno.ENOENT, errno.ENOTDIR):
        why = f"{where} cannot be created there ({os.strerror(err.errno or 0)}): a folder on its path is missing or a file"
        fix = "choose a folder on a writable disk (output_dir, or the export destination)"
    else:
        why = f"writing {f'{needed:,} bytes to ' if needed is not None else ''}{where} failed: {err.strerror or err}"
        fix = "check the storage"
    return StorageError(f"{why}. {kept + ' ' if kept else ''}To fix: {fix}.")


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike[str], needed: int | None, kept: str = "") -> Iterator[None]:
    """Turn an OSError of the writes inside (a full disk, a read-only mount) into `storage_error`'s StorageError."""
    try:
        yield
    except OSError as err:
        raise storage_error(err, path, needed, kept) from None
