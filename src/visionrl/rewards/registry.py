"""Reward specs and their resolution to callables: built-in names or user functions by import path.

A ``RewardSpec`` is what a job file names (``name``, ``weight``, ``kwargs``); ``resolve_reward`` turns it
into a plain callable ``f(completion, answer, record) -> float`` with the kwargs bound. Every mistake a
user can make here (unknown name, missing module, missing attribute, not callable, wrong kwargs) raises
``RewardConfigError`` saying what is wrong, why, and what to do, at build time rather than mid-run.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from visionrl.errors import InputError
from visionrl.rewards.builtin import BUILTIN_KWARG_CHECKS, BUILTIN_REWARDS, list_builtin_rewards
from visionrl.rewards.judge import JUDGE

RewardFn = Callable[[str, Any, Mapping[str, Any]], float]
"""A reward: ``f(completion, answer, record) -> float``; ``answer`` is ``record["answer"]``."""


class RewardConfigError(InputError):
    """A reward spec cannot be turned into a callable (bad name, import path or kwargs)."""


@dataclass
class RewardSpec:
    """One reward term of the job file.

    Attributes:
        name: a built-in name (see ``list_builtin_rewards()``) or a user function as
            ``"package.module:function"`` (``"package.module:Class.method"`` also works).
        weight: multiplier of this term in the total reward; may be negative (a penalty).
        kwargs: keyword arguments passed to the function on every call.
    """

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise RewardConfigError(f"reward name must be a non-empty string, got {self.name!r}")
        if (
            isinstance(self.weight, bool)
            or not isinstance(self.weight, int | float)
            or not math.isfinite(self.weight)
        ):
            raise RewardConfigError(
                f"reward '{self.name}': weight must be a finite number, got {self.weight!r}"
            )
        if not isinstance(self.kwargs, Mapping) or not all(isinstance(k, str) for k in self.kwargs):
            raise RewardConfigError(
                f"reward '{self.name}': kwargs must be a mapping of names to values, got {self.kwargs!r}"
            )
        self.kwargs = dict(self.kwargs)


def _import_user_function(path: str) -> Callable[..., Any]:
    """Imports ``"package.module:attr.path"`` and returns the attribute."""
    module_name, _, attr_path = path.partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise RewardConfigError(
            f"reward '{path}' is not a valid import path; write it as 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardConfigError(
            f"reward '{path}': importing module '{module_name}' failed ({exc}). Install the package or add "
            "its directory to PYTHONPATH in every process that scores rewards (Ray reward workers too)."
        ) from exc
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise RewardConfigError(
                f"reward '{path}': module '{module_name}' has no attribute '{attr_path}'. "
                f"Check the name after ':'; callables defined there: {defined}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise RewardConfigError(
            f"reward '{path}' is a {type(target).__name__}, not a function. Point it to a callable "
            "f(completion, answer, record) -> float."
        )
    return target


def _check_call_signature(name: str, fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Fails at build time if ``fn(completion, answer, record, **kwargs)`` cannot be called."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some C-implemented callables expose no signature; the call itself will tell.
    try:
        signature.bind("", None, {}, **kwargs)
    except TypeError as exc:
        raise RewardConfigError(
            f"reward '{name}' cannot be called as f(completion, answer, record, **{dict(kwargs)}): {exc}. "
            f"Its signature is {name}{signature}; fix `kwargs` in the reward spec or the function."
        ) from exc


def resolve_reward(spec: RewardSpec) -> RewardFn:
    """Returns the callable for ``spec`` with its kwargs bound.

    Raises:
        RewardConfigError: unknown built-in, failed import, missing or non-callable attribute, or
            kwargs the function does not accept / a built-in rejects.
    """
    if spec.name == JUDGE:
        raise RewardConfigError(
            "reward 'judge' scores whole batches with a model (orchestrate.judging), not one call per completion; "
            "it cannot be built as a function"
        )
    if ":" in spec.name:
        fn = _import_user_function(spec.name)
    elif spec.name in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[spec.name]
        check = BUILTIN_KWARG_CHECKS.get(spec.name)
        if check is not None:
            try:
                check(spec.kwargs)
            except ValueError as exc:
                raise RewardConfigError(f"reward '{spec.name}': {exc}") from exc
    else:
        raise RewardConfigError(
            f"unknown reward '{spec.name}'. Built-in rewards are {list_builtin_rewards()}; "
            "for your own function write 'package.module:function'."
        )
    _check_call_signature(spec.name, fn, spec.kwargs)
    return functools.partial(fn, **spec.kwargs) if spec.kwargs else fn
