"""vLLM behind SageMaker's front (`visionrl.serve.sagemaker_front`): the base model and the start-up adapters
fetched and checked, vLLM started on 127.0.0.1 and waited for, on a thread; then the adapters it serves, loaded and
unloaded at run time, and loaded on first use from an adapter root (`VISIONRL_ADAPTER_ROOT=s3://bucket/adapters`:
a request for `color-v3` loads `s3://bucket/adapters/color-v3` once, checked against its manifest, on each
instance that gets such a request, so every instance of an endpoint serves every adapter under the root).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from visionrl.errors import InputError, RunError
from visionrl.serve.adapters import load_adapter, unload_adapter
from visionrl.serve.model_source import local_model_dir
from visionrl.serve.process import ServerHandle
from visionrl.serve.server import prepare_server

BASE_NAME = "base"  # the base model's name at the endpoint (vLLM's --served-model-name)
# SageMaker sends SIGKILL 30 s after SIGTERM when it stops a container: vLLM gets 20 s of that to stop in order.
STOP_TIMEOUT_S = 20.0


class Backend:
    """`state` is loading, ready or failed (then `error` says why); `stage` says what is loading."""

    def __init__(self, base: str, adapters: Sequence[str], *, cache_dir: Path | None, extra: Sequence[str],
                 ready_timeout_s: float, echo: TextIO | None, progress: Any,
                 adapter_root: str | None = None) -> None:  # fmt: skip
        self.base, self.adapters, self.cache_dir = base, list(adapters), cache_dir
        self.extra, self.ready_timeout_s, self.echo, self.progress = (
            list(extra),
            ready_timeout_s,
            echo,
            progress,
        )
        self.adapter_root = adapter_root.rstrip("/") if adapter_root else None
        self.state, self.error, self.stage = "loading", "", "starting"
        self.handle: ServerHandle | None = None
        self.loaded = {item.partition("=")[0] for item in self.adapters}
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._name_locks: dict[str, threading.Lock] = {}
        self._stopping = False

    def _cache(self, name: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / name

    def load(self) -> None:
        try:
            self.stage = f"fetching the base model {self.base}"
            model = local_model_dir(self.base, self._cache("models"), progress=self.progress)
            self.stage = "fetching and checking the adapters"
            extra = ["--served-model-name", BASE_NAME, *self.extra]  # a later flag of the user's wins
            handle = prepare_server(str(model), self.adapters, extra=extra, echo=self.echo,
                                    cache_dir=self._cache("adapters"))  # fmt: skip
            with self._lock:
                if self._stopping:
                    return
                self.handle = handle.start()
            self.stage = "vLLM is loading the model"
            handle.wait_ready(self.ready_timeout_s, progress=self.progress)
            self.state = "ready"
        except (InputError, RunError) as err:  # a bad base or adapter, vLLM failing to start
            self.state, self.error = "failed", str(err)
        finally:
            self.done.set()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        if self.handle is not None:
            self.handle.stop(timeout_s=STOP_TIMEOUT_S)

    def status(self) -> dict[str, Any]:
        return {"status": self.state, "stage": self.stage, **({"error": self.error} if self.error else {})}

    def register(self, name: str, src: str) -> None:
        """Fetch, check and load the adapter at `src` as `name` (ExportError/InputError: a bad export or name;
        ServerError: vLLM refused)."""
        assert self.handle is not None
        with self._name_lock(name):
            load_adapter(self.handle.url, name, src, cache_dir=self._cache("adapters"))
            self.loaded.add(name)

    def unregister(self, name: str) -> None:
        assert self.handle is not None
        with self._name_lock(name):
            unload_adapter(self.handle.url, name)
            self.loaded.discard(name)

    def ensure(self, model: str | None) -> None:
        """Load `model` from the adapter root on its first request (nothing for the base, a loaded adapter, or
        without a root). A name that is not an export under the root raises InputError saying so."""
        if self.adapter_root is None or not model or model == BASE_NAME or model in self.loaded:
            return
        if model.startswith(".") or "/" in model:
            raise InputError(f"model {model!r} is not an adapter name")
        with self._name_lock(model):
            if model in self.loaded:  # another request loaded it meanwhile
                return
            assert self.handle is not None
            load_adapter(
                self.handle.url, model, f"{self.adapter_root}/{model}", cache_dir=self._cache("adapters")
            )
            self.loaded.add(model)

    def _name_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._name_locks.setdefault(name, threading.Lock())
