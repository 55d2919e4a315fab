"""vLLM's running batch, open to new requests (`types.SteppingEngine` for `VLLMEngine`): one thread of the engine's
own adds what was submitted to vLLM's `LLMEngine` (`add_request`) and calls `step()` while any of its requests is
unfinished, so a request submitted mid-batch joins at the next step (continuous multi-turn episodes).

vLLM's engine is not thread-safe: only this thread calls into it while requests are in flight, and the engine's
other methods (`generate`, `load_adapter`, `judge`) refuse to run then (`busy`), so an adapter never changes under
a request and `LLM.generate` never collects this thread's outputs. Requests carry ids of their own (their outputs
come back under them); an error inside vLLM rebuilds the engine once and adds the requests in flight again, as
`VLLMEngine._run` retries a batch (docs/ENGINE_NOTES.md)."""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

from visionrl.rollout.rejects import vllm_rejections
from visionrl.rollout.stepping import check_spec
from visionrl.types import Completion, PromptItem, SamplingSpec

logger = logging.getLogger(__name__)
ABORT_WAIT_S = 60.0


@dataclass
class _Request:
    rid: str
    inputs: dict[str, Any]
    params: Any
    lora: Any
    sample_id: str


class VLLMStepper:
    """The stepping API of `engine` (a `VLLMEngine`: its vLLM engine, sampling parameters, served LoRA,
    completions and rebuild; typed loosely, as the engine module imports this one)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._queue: list[_Request] = []  # submitted, not yet added to vLLM
        self._running: dict[str, _Request] = {}  # added (or about to be), not finished
        self._done: dict[str, list[Completion]] = {}  # finished, not yet collected
        self._aborting = False
        self._woken = False  # `wake` was called: a waiting `collect` returns now
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)

    def busy(self) -> bool:
        with self._cond:
            return bool(self._queue or self._running)

    def submit(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[str]:
        from vllm.sampling_params import RequestOutputKind

        check_spec(spec)
        with self._cond:
            self._raise_error()
            if spec.seed is not None:
                if self._queue or self._running:
                    raise RuntimeError(
                        "a seeded submit while requests are in flight: only a lane's first turns seed"
                    )
                self.engine.reseed(spec.seed)  # the thread is waiting: nothing of ours is in vLLM
            params = self.engine.sampling_params(spec)
            params.output_kind = RequestOutputKind.FINAL_ONLY  # a request's output once, when it finishes
            lora = self.engine.served_lora()
            inputs = self.engine.inputs(prompts)
            reqs = [_Request(f"visionrl-{next(self._ids)}", i, params, lora, p.sample_id) for p, i in zip(prompts, inputs, strict=True)]  # fmt: skip
            self._queue += reqs
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="visionrl-vllm-step", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return [r.rid for r in reqs]

    def collect(self, timeout_s: float) -> dict[str, list[Completion]]:
        with self._cond:
            self._cond.wait_for(
                lambda: self._done or self._error or self._woken or not (self._queue or self._running),
                timeout_s,
            )
            self._raise_error()
            done, self._done, self._woken = self._done, {}, False
        return done

    def wake(self) -> None:
        """End a waiting `collect` now (an environment answered in this process: its episode's turn goes in)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def abort(self) -> int:
        """Drop what is queued, abort what runs (in the thread) and forget what was not collected."""
        with self._cond:
            dropped = len(self._queue) + len(self._running) + len(self._done)
            self._queue, self._done = [], {}
            if self._running:
                self._aborting = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: not self._running or self._error is not None, ABORT_WAIT_S)
            return dropped

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=ABORT_WAIT_S)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"the vLLM engine failed while stepping requests: {self._error}"
            ) from self._error

    # ------------------------------------------------------------------ the stepping thread
    def _loop(self) -> None:
        failures = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._running or self._closed)
                if self._closed:
                    return
                new, self._queue = self._queue, []
                self._running.update((r.rid, r) for r in new)
                aborting, self._aborting = self._aborting, False
            try:
                if aborting:
                    self._abort_running()
                    continue
                refused = self._add(new)
                outputs = self._step() if len(self._running) > len(refused) else []
                failures = 0
            except (RuntimeError, AssertionError) as err:
                failures += 1
                if not self._recover(err, failures):
                    return
                continue
            self._finish(refused, outputs)

    def _add(self, new: list[_Request]) -> dict[str, BaseException]:
        """Add `new` to vLLM; a prompt it refuses at validation comes back at once with no completion."""
        refused: dict[str, BaseException] = {}
        llm_engine = self.engine.llm_engine()
        for r in new:
            try:
                llm_engine.add_request(r.rid, r.inputs, r.params, lora_request=r.lora)
            except vllm_rejections() as err:
                logger.warning("vLLM rejected prompt %r; skipping it: %s", r.sample_id, err)
                refused[r.rid] = err
        return refused

    def _step(self) -> list[Any]:
        return [out for out in self.engine.llm_engine().step() if out.finished]

    def _finish(self, refused: dict[str, BaseException], outputs: list[Any]) -> None:
        with self._cond:
            for rid in refused:
                if self._running.pop(rid, None) is not None:
                    self._done[rid] = []
            for out in outputs:
                if self._running.pop(out.request_id, None) is not None:  # else aborted meanwhile
                    self._done[out.request_id] = [self.engine.completion(0, c) for c in out.outputs]
            self._cond.notify_all()

    def _abort_running(self) -> None:
        with self._cond:
            ids = list(self._running)
        self.engine.llm_engine().abort_request(ids)
        with self._cond:
            for rid in ids:
                self._running.pop(rid, None)
            self._cond.notify_all()

    def _recover(self, err: BaseException, failures: int) -> bool:
        """After an error inside vLLM: rebuild the engine and add the requests in flight again (once in a row);
        a second failure is the caller's (`collect` raises it). Returns whether stepping goes on."""
        if failures < 2:
            logger.warning(
                "vLLM engine failed while stepping (%s); rebuilding it, requests in flight added again", err
            )
            try:
                self.engine.rebuild()
                with self._cond:
                    self._queue = [*self._running.values(), *self._queue]
                    self._running = {}
                return True
            except (RuntimeError, AssertionError) as again:
                err = again
        with self._cond:
            self._error = err
            self._running, self._queue = {}, []
            self._cond.notify_all()
        return False
