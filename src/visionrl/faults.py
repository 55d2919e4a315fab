"""Fault injection, for the tests of failure handling: `VISIONRL_FAULTS=name[,name]` in a run's environment.

Ray workers inherit the environment of the process that starts Ray, so a test sets the variable before the run
and the fault happens inside the actors, where real faults happen. Unset, nothing here changes behaviour.
"""

from __future__ import annotations

import os

FAULTS = {
    "ignore_adapters": "engines accept every adapter but never apply one (a target layout the engine skips)",
    "drop_adapter_syncs": "engines acknowledge new adapter versions after the first without loading them",
    "nonfinite_loss": "every learner update computes a NaN loss (and so NaN gradients), as a diverged run does",
}


def active(name: str) -> bool:
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    return name in os.environ.get("VISIONRL_FAULTS", "").split(",")
