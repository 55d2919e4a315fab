"""SageMaker's hosting contract in front of vLLM's OpenAI server: `visionrl serve --sagemaker`, which is what the
image runs as `docker run IMAGE serve` on a SageMaker endpoint.

The contract (docs/AWS.md): the container listens on port 8080 (`SAGEMAKER_BIND_TO_PORT` where SageMaker sets
another), `GET /ping` answers 200 once the model can answer and anything else before, `POST /invocations` takes the
request. vLLM's server has both routes but listens only after its model loaded, so a caller (and SageMaker's health
check) would see a refused connection rather than a 503 for the minutes an 8B model takes. Here a small front binds
the port at once and answers 503 (with what is loading) while, on a thread, the base model is fetched (a folder, the
model directory SageMaker mounts, or `s3://`), the adapters are fetched and checked against their manifests (as
`visionrl serve` does) and vLLM starts on 127.0.0.1 (`serve.sagemaker_backend`); from then on every request goes
through to vLLM (`/invocations` takes the OpenAI chat request, images as data URLs; the adapter is the body's `model`
or SageMaker's `X-Amzn-SageMaker-Adapter-Identifier` header), and adapters load at run time (`serve.sagemaker_front`).
This module reads the settings SageMaker can give, all by environment, and runs the two.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from visionrl.errors import InputError
from visionrl.serve.sagemaker_backend import Backend
from visionrl.serve.sagemaker_front import Front
from visionrl.serve.server import READY_TIMEOUT_S

PORT = 8080
PORT_ENV = "SAGEMAKER_BIND_TO_PORT"
MODEL_DIR_ENV = "SM_MODEL_DIR"
DEFAULT_MODEL_DIR = "/opt/ml/model"
BASE_ENV = "VISIONRL_BASE_MODEL"
ADAPTERS_ENV = "VISIONRL_ADAPTERS"
VLLM_ARGS_ENV = "VISIONRL_VLLM_ARGS"
ADAPTER_ROOT_ENV = "VISIONRL_ADAPTER_ROOT"


def adapters_from_env(text: str | None) -> list[str]:
    """`VISIONRL_ADAPTERS` ("color-v1=s3://bucket/color/v1,count=s3://...") as `NAME=SRC` items."""
    items = [item.strip() for item in (text or "").split(",") if item.strip()]
    for item in items:
        name, sep, src = item.partition("=")
        if not (sep and name.strip() and src.strip()):
            raise InputError(
                f"{ADAPTERS_ENV} entry {item!r} is not NAME=SRC; write the adapters as "
                "'color-v1=s3://bucket/color/v1,count-v2=s3://bucket/count/v2'"
            )
    return items


def base_source(base: str | None, environ: Mapping[str, str]) -> str:
    """The base model: `base`, else $VISIONRL_BASE_MODEL, else the model directory SageMaker mounts."""
    return base or environ.get(BASE_ENV) or environ.get(MODEL_DIR_ENV) or DEFAULT_MODEL_DIR


def in_sagemaker(environ: Mapping[str, str]) -> bool:
    """Whether this looks like a SageMaker hosting container (`docker run IMAGE serve` with no base given): a base
    named by the environment, or SageMaker's model directory present."""
    return bool(environ.get(BASE_ENV) or environ.get(MODEL_DIR_ENV)) or Path(DEFAULT_MODEL_DIR).is_dir()


def hosting_port(port: int | None, environ: Mapping[str, str]) -> int:
    """`port`, else $SAGEMAKER_BIND_TO_PORT, else 8080."""
    text = environ.get(PORT_ENV, "") if port is None else str(port)
    try:
        return int(text) if text else PORT
    except ValueError:
        raise InputError(f"{PORT_ENV}={text!r} is not a port number") from None


def serve_sagemaker(
    base: str | None = None,
    adapters: Sequence[str] = (),
    *,
    host: str = "0.0.0.0",
    port: int | None = None,
    extra: Sequence[str] = (),
    cache_dir: str | os.PathLike[str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    out: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """`visionrl serve --sagemaker`: the front on `host:port` at once, the model behind it as it loads; runs until
    SIGTERM/SIGINT (0) or until loading fails or vLLM dies (1, the reason on stderr). Adapters are `adapters`
    plus $VISIONRL_ADAPTERS, and any export under $VISIONRL_ADAPTER_ROOT on its first request; $VISIONRL_VLLM_ARGS
    adds vLLM flags (e.g. "--max-loras 4 --max-lora-rank 64"). The base model's name at the endpoint is `base`."""
    environ = os.environ if environ is None else environ
    out = out or sys.stdout
    named = adapters_from_env(environ.get(ADAPTERS_ENV)) + list(adapters)
    extra = shlex.split(environ.get(VLLM_ARGS_ENV, "")) + list(extra)
    cache = Path(cache_dir) if cache_dir is not None else None
    say = lambda text: print(f"[sagemaker] {text}", file=sys.stderr, flush=True)  # noqa: E731
    backend = Backend(base_source(base, environ), named, cache_dir=cache, extra=extra,
                      ready_timeout_s=ready_timeout_s, echo=sys.stderr, progress=say,
                      adapter_root=environ.get(ADAPTER_ROOT_ENV) or None)  # fmt: skip
    try:
        front = Front((host, hosting_port(port, environ)), backend)
    except OSError as err:
        raise InputError(f"cannot listen on {host}:{hosting_port(port, environ)} ({err.strerror or err}); "
                         "another server may hold the port") from None  # fmt: skip
    url = f"http://{host}:{front.server_address[1]}"
    print(f"SageMaker hosting contract at {url} (/ping, /invocations, /adapters); loading {backend.base}",
          file=out, flush=True)  # fmt: skip
    return _run(front, backend, url, out)


def _run(front: Front, backend: Backend, url: str, out: TextIO) -> int:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    threading.Thread(target=front.serve_forever, name="sagemaker-front", daemon=True).start()
    threading.Thread(target=backend.load, name="sagemaker-load", daemon=True).start()
    start, code, announced = time.monotonic(), 0, False
    try:
        while not stop.wait(0.5):
            if backend.state == "failed":
                print(f"error: {backend.error}", file=sys.stderr, flush=True)
                code = 1
                break
            if backend.state == "ready" and not announced:
                print(
                    f"ready after {time.monotonic() - start:.0f} s: {url}/invocations", file=out, flush=True
                )
                announced = True
            handle = backend.handle
            exited = handle.poll() if handle is not None and announced else None
            if handle is not None and exited is not None:
                print(f"error: vLLM exited with code {exited}; its last log lines:\n{handle.log_tail()}",
                      file=sys.stderr, flush=True)  # fmt: skip
                code = 1
                break
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        front.shutdown()
        front.server_close()
        backend.stop()
    return code
