"""Fault injection, for the tests of failure handling: `VISIONRL_FAULTS=name[,name]` in a run's environment.

A test sets the variable in the driver before the run; the run starts its actors with the driver's fault
variables (`actor_env`, as their Ray runtime environment), so the fault happens inside the actors, where real
faults happen, also on a Ray that was started before the variable was set (one shared by several runs).
Unset, nothing here changes behaviour. Faults marked "once" fire a single time per run, so that the actor
restarted after them works: they record that they fired in the directory `VISIONRL_FAULTS_DIR` (required for
them), which every process of the run sees.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

FAULTS = {
    "ignore_adapters": "engines accept every adapter but never apply one (a target layout the engine skips)",
    "drop_adapter_syncs": "engines acknowledge new adapter versions after the first without loading them",
    "skip_merger_lora": "engines apply every adapter without its merger (vision tower) LoRA",
    "misscale_adapters": "engines apply every adapter with twice its LoRA B (a scale read differently)",
    "fail_engine_batch": "vLLM engines fail internally in the first batch of their 2nd sampling call (and rebuild)",
    "kill_engine": "once: rollout engine 0 exits (as if killed) on its 2nd generate call",
    "freeze_engine": "once: rollout engine 0 stops itself (SIGSTOP: a hung engine or collective) on its 2nd "
    "generate call",
    "kill_reward_worker": "once: reward worker 0 exits on its 2nd score call",
    "hang_reward_worker": "once: reward worker 0 blocks forever (a reward holding the GIL) on its 2nd score call",
    "kill_judge": "once: judge actor 0 exits on its 2nd judge call",
    "hang_judge": "once: judge actor 0 blocks forever on its 2nd judge call",
    "kill_learner": "the learner (rank 0) exits during its 2nd train_step",
    "fail_learner_setup": "learner rank 1 raises in its setup (joining the group and loading the model)",
    "nonfinite_loss": "every learner update computes a NaN loss (and so NaN gradients), as a diverged run does",
}
AT_CALL = 2  # the faulty actors misbehave on this call of theirs (the first one shows the run was healthy)
ENV_VARS = ("VISIONRL_FAULTS", "VISIONRL_FAULTS_DIR")


def actor_env() -> dict[str, str]:
    """This process's fault variables, for the environment of the actors it starts (empty when none is set)."""
    return {name: os.environ[name] for name in ENV_VARS if name in os.environ}


def active(name: str) -> bool:
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    return name in os.environ.get("VISIONRL_FAULTS", "").split(",")


def fire_once(name: str) -> bool:
    """True the first time it is asked for an active fault in this run (in any process), else False."""
    if not active(name):
        return False
    folder = os.environ.get("VISIONRL_FAULTS_DIR")
    if not folder:
        raise ValueError(f"fault {name!r} fires once per run: set VISIONRL_FAULTS_DIR to a directory")
    try:
        fd = os.open(Path(folder) / f"{name}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())  # which process it hit, for the test to check it is gone
    os.close(fd)
    return True


def at_call(name: str, index: int, calls: int) -> None:
    """In actor `index` (0 is the faulty one) at its `calls`-th call: perform fault `name` if it is due."""
    if index != 0 or calls != AT_CALL:
        return
    if name == "kill_learner":
        if active(name):
            os._exit(1)
        return
    if not fire_once(name):
        return
    if name in ("kill_engine", "kill_reward_worker", "kill_judge"):
        os._exit(1)
    if name == "freeze_engine":
        os.kill(os.getpid(), signal.SIGSTOP)
    if name in ("hang_reward_worker", "hang_judge"):
        while True:
            time.sleep(3600)
