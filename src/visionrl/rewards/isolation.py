"""Running reward calls so that a failing, hanging or crashing reward cannot stop training.

Two runners evaluate a batch of calls ``(reward index, sample index)`` and return one ``Outcome`` per
call, each with its own deadline of ``timeout_s`` seconds from the moment the call starts:

- ``ThreadRunner`` (default, cheap): calls run on a few daemon threads. An overdue call scores 0 as a
  timeout and its thread is *abandoned*, not killed: Python cannot kill a thread. The abandoned thread
  keeps running (and holding what it holds) until the function returns, and a function that never
  releases the GIL (a C loop) stalls the whole process. Use it for functions that may be slow, not for
  ones that may hang forever or crash the interpreter.
- ``ProcessRunner`` (``isolation="process"``): calls run one after another in a child process started
  with the ``spawn`` method and kept across batches. An overdue call gets the child killed; a child
  that dies (segfault, ``os._exit``) scores its current call as an error. Either way a fresh child
  takes over the rest of the batch. Costs a process start at first use and after each kill.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import multiprocessing.connection
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from visionrl.rewards.registry import RewardConfigError, RewardFn, RewardSpec, resolve_reward

Pair = tuple[int, int]
"""One call: (index of the reward, index of the sample)."""


@dataclass(frozen=True)
class Outcome:
    """The result of one reward call. ``value`` is 0.0 unless ``status == "ok"``."""

    status: Literal["ok", "error", "timeout"]
    value: float = 0.0
    message: str = ""


MAX_ABS_REWARD = (
    1e6  # a reward beyond it is an error: 1e38 overflowed float32 in the advantages and histograms
)


def _as_score(raw: object) -> Outcome:
    # bool is a Real (True -> 1.0), so `return pred == answer` is a valid reward.
    if isinstance(raw, numbers.Real) and math.isfinite(float(raw)):
        if abs(float(raw)) <= MAX_ABS_REWARD:
            return Outcome("ok", float(raw))
        return Outcome(
            "error",
            message=f"returned {float(raw):g}, outside [-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}]; scale the reward "
            "down (advantages are normalised per group, so only differences within a group matter)",
        )
    shown = repr(raw)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return Outcome(
        "error", message=f"returned {type(raw).__name__} {shown}; a reward must return a finite number"
    )


def call_reward(fn: RewardFn, completion: str, record: Mapping[str, Any]) -> Outcome:
    """Calls ``fn(completion, record["answer"], record)`` and never raises."""
    try:
        raw = fn(completion, record.get("answer"), record)
    except (Exception, SystemExit) as exc:
        # Deliberate isolation boundary: reward functions are user code run on model output, and one
        # bad call must cost one score, not the training run. SystemExit too: a stray sys.exit() in a
        # reward is a bug of that reward. The message is kept so the caller can log it.
        return Outcome("error", message=f"{type(exc).__name__}: {exc}")
    return _as_score(raw)


def _timeout_outcome(timeout_s: float) -> Outcome:
    return Outcome("timeout", message=f"timed out after {timeout_s:g} s")


class _ThreadBatch:
    """One batch on daemon worker threads; the caller's thread enforces the deadlines."""

    def __init__(self, task: Callable[[int], Outcome], size: int, timeout_s: float, max_workers: int) -> None:
        self._task = task
        self._size = size
        self._timeout_s = timeout_s
        self._max_workers = max_workers
        self._cond = threading.Condition()
        self._next = 0
        self._done = 0
        self._outcomes: list[Outcome | None] = [None] * size
        self._running: dict[int, tuple[int, float]] = {}  # worker id -> (call index, start time)
        self._abandoned: set[int] = set()
        self._ids = itertools.count()

    def run(self) -> list[Outcome]:
        with self._cond:
            for _ in range(min(self._max_workers, self._size)):
                self._spawn_worker()
            while True:
                # Check after expiring: scoring the last overdue calls can finish the batch, and a wait
                # without a deadline would then never wake.
                wait_s = self._expire_overdue(time.monotonic())
                if self._done >= self._size:
                    break
                self._cond.wait(timeout=wait_s)
        return [o if o is not None else _timeout_outcome(self._timeout_s) for o in self._outcomes]

    def _spawn_worker(self) -> None:
        # Daemon threads: an abandoned, never-returning call must not block interpreter exit (the
        # threads of concurrent.futures.ThreadPoolExecutor are joined at exit, so it is not used here).
        worker_id = next(self._ids)
        threading.Thread(
            target=self._work, args=(worker_id,), name=f"visionrl-reward-{worker_id}", daemon=True
        ).start()

    def _expire_overdue(self, now: float) -> float | None:
        """Scores overdue calls as timeouts and replaces their workers; returns seconds to the next deadline."""
        next_deadline: float | None = None
        for worker_id, (index, started) in list(self._running.items()):
            deadline = started + self._timeout_s
            if now < deadline:
                next_deadline = deadline if next_deadline is None else min(next_deadline, deadline)
                continue
            del self._running[worker_id]
            self._abandoned.add(worker_id)
            self._outcomes[index] = _timeout_outcome(self._timeout_s)
            self._done += 1
            if self._next < self._size:
                self._spawn_worker()
        return None if next_deadline is None else next_deadline - now

    def _work(self, worker_id: int) -> None:
        while True:
            with self._cond:
                if self._next >= self._size:
                    return
                index = self._next
                self._next += 1
                self._running[worker_id] = (index, time.monotonic())
                self._cond.notify()  # the waiter must learn the new deadline
            outcome = self._task(index)
            with self._cond:
                if worker_id in self._abandoned:
                    return  # already scored as a timeout; the late result is dropped
                del self._running[worker_id]
                self._outcomes[index] = outcome
                self._done += 1
                self._cond.notify()


class ThreadRunner:
    """Runs reward calls on daemon threads with per-call deadlines (see the module docstring)."""

    def __init__(self, fns: Sequence[RewardFn], timeout_s: float, max_workers: int) -> None:
        self._fns = list(fns)
        self._timeout_s = timeout_s
        self._max_workers = max_workers

    def run(
        self, completions: Sequence[str], records: Sequence[Mapping[str, Any]], pairs: Sequence[Pair]
    ) -> list[Outcome]:
        def task(index: int) -> Outcome:
            reward, sample = pairs[index]
            return call_reward(self._fns[reward], completions[sample], records[sample])

        return _ThreadBatch(task, len(pairs), self._timeout_s, self._max_workers).run()

    def close(self) -> None:
        """Nothing to release: worker threads live for one batch."""


class RewardWorkerError(RuntimeError):
    """The reward worker process could not be started."""


def _worker_main(conn: multiprocessing.connection.Connection, specs: list[RewardSpec]) -> None:
    """Child process: resolve the rewards, then score batches until told to stop (``None``)."""
    try:
        fns = [resolve_reward(spec) for spec in specs]
    except RewardConfigError as exc:
        conn.send(("load_error", str(exc)))
        return
    conn.send(("ready", ""))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the parent is gone
        if message is None:
            return
        completions, records, pairs = message
        for reward, sample in pairs:
            conn.send(call_reward(fns[reward], completions[sample], records[sample]))


def _shutdown(
    process: multiprocessing.process.BaseProcess, conn: multiprocessing.connection.Connection
) -> None:
    if process.is_alive():
        process.kill()
    process.join(timeout=5)
    conn.close()


class ProcessRunner:
    """Runs reward calls in a killable child process (see the module docstring)."""

    def __init__(
        self, specs: Sequence[RewardSpec], timeout_s: float, startup_timeout_s: float = 120.0
    ) -> None:
        self._specs = list(specs)
        self._timeout_s = timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> multiprocessing.connection.Connection:
        conn, child_conn = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main, args=(child_conn, self._specs), name="visionrl-reward-worker", daemon=True
        )
        process.start()
        child_conn.close()  # so that the child's death reads as EOF here
        self._process, self._conn = process, conn
        self._finalizer = weakref.finalize(self, _shutdown, process, conn)
        if not conn.poll(self._startup_timeout_s):
            self._stop()
            raise RewardWorkerError(
                f"reward worker process did not start within {self._startup_timeout_s:g} s"
            )
        try:
            kind, detail = conn.recv()
        except (EOFError, OSError) as exc:
            process.join(timeout=5)
            code = process.exitcode
            self._stop()
            raise RewardWorkerError(
                f"reward worker process exited while starting (exit code {code})"
            ) from exc
        if kind == "load_error":
            self._stop()
            raise RewardConfigError(f"in the reward worker process: {detail}")
        return conn

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills and joins the child, closes the pipe; runs at most once
        self._process = self._conn = self._finalizer = None

    def _connection(self) -> multiprocessing.connection.Connection:
        if self._conn is None or self._process is None or not self._process.is_alive():
            self._stop()
            return self._start()
        return self._conn

    def run(
        self, completions: Sequence[str], records: Sequence[Mapping[str, Any]], pairs: Sequence[Pair]
    ) -> list[Outcome]:
        outcomes: list[Outcome] = []
        while len(outcomes) < len(pairs):
            outcomes.extend(self._run_until_failure(completions, records, pairs[len(outcomes) :]))
        return outcomes

    def _run_until_failure(
        self, completions: Sequence[str], records: Sequence[Mapping[str, Any]], pairs: Sequence[Pair]
    ) -> list[Outcome]:
        """Scores ``pairs`` in order; stops after the first call that hangs or kills the child."""
        batch = (list(completions), list(records), list(pairs))
        conn = self._connection()
        try:
            conn.send(batch)
        except OSError:
            # The child died between the liveness check and the send: one fresh child, one retry.
            self._stop()
            conn = self._connection()
            conn.send(batch)
        outcomes: list[Outcome] = []
        for _ in pairs:
            # Deadline counted from the previous result: the child runs calls back to back.
            if not conn.poll(self._timeout_s):
                self._stop()
                outcomes.append(_timeout_outcome(self._timeout_s))
                return outcomes
            try:
                outcomes.append(conn.recv())
            except (EOFError, OSError):
                assert self._process is not None
                self._process.join(timeout=5)
                code = self._process.exitcode
                self._stop()
                outcomes.append(Outcome("error", message=f"reward worker process died (exit code {code})"))
                return outcomes
        return outcomes

    def close(self) -> None:
        """Stops the child process (a new one starts if ``run`` is called again)."""
        if self._conn is not None and self._process is not None and self._process.is_alive():
            try:
                self._conn.send(None)
                self._process.join(timeout=2)
            except OSError:
                pass  # the child is already gone; _stop below cleans up
        self._stop()
