"""Error types for bad user input: the CLI prints them as one clear message and exits with code 2."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user (job file, data, adapter, arguments). The message says what, why and what to do."""


class RunError(RuntimeError):
    """The run failed at run time (an actor died, an engine broke); the message says how to continue."""


BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (InputError,)
