"""Serve a base model with exported LoRA adapters through vLLM's OpenAI-compatible server (`visionrl serve`).

- `server_command(...)` / `server_env(...)`: the vLLM command line and environment, with the LoRA flags each
  adapter needs (pure);
- `prepare_server(...)` / `start_server(...)`: fetch and check the adapters, then the server as a child
  process (`visionrl.serve.process`): start, wait until ready, stop;
- `serve(...)`: the command line entry: runs the server in the foreground, forwarding Ctrl-C / SIGTERM.

Adapters of a running server (load, unload, list) are `visionrl.serve.adapters`'.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from visionrl.adapter.fetch import fetch_adapter
from visionrl.adapter.servable import vllm_max_lora_rank
from visionrl.data.images import ImageBudget
from visionrl.errors import InputError
from visionrl.rollout.vllm_platform import cpu_env, cpu_only, fill_env
from visionrl.serve.adapters import ServedAdapter, list_models, served_adapter
from visionrl.serve.guard import MIDDLEWARE as GUARD
from visionrl.serve.process import (
    API_KEY_ENV,
    ServerError,
    ServerHandle,
    api_key_from_env,
    check_port_free,
    free_port,
)

CPU_MAX_MODEL_LEN = (
    4096  # the engine's KV cache on CPU is small (VLLM_CPU_KVCACHE_SPACE); keep prompts modest
)
DEFAULT_RUNTIME_RANK = 16  # LoRA slot size when no adapter is given at start (adapters come at run time)
READY_TIMEOUT_S = 900.0  # an 8B model loads in minutes; the tiny model in about 50 s


# --------------------------------------------------------------------------------------------------
# What the server runs


def serving_budget(adapters: Sequence[ServedAdapter]) -> ImageBudget:
    """The image budget the server applies: the one the adapters were trained with (their manifests), else
    the default. Adapters trained with different budgets cannot share one server: InputError."""
    budgets = {a.budget for a in adapters if a.budget is not None}
    if len(budgets) > 1:
        listed = "; ".join(f"{a.name}: {a.budget.as_dict()}" for a in adapters if a.budget is not None)
        raise InputError(
            f"the adapters were trained with different image budgets ({listed}); the server resizes every "
            "image one way, so serve them from separate servers"
        )
    return budgets.pop() if budgets else ImageBudget()


def server_command(
    base: str,
    adapters: Sequence[ServedAdapter],
    *,
    host: str,
    port: int,
    cpu: bool,
    extra: Sequence[str] = (),
    max_lora_rank: int | None = None,
    max_loras: int | None = None,
    tower_connector_lora: bool = False,
) -> list[str]:
    """The vLLM OpenAI server command line.

    LoRA slots are sized for the largest adapter (rounded up to a rank vLLM accepts) or `max_lora_rank` for
    adapters loaded later; `--enable-tower-connector-lora` is on when an adapter trains the vision merger
    (or `tower_connector_lora`), since without it vLLM silently serves the merger untrained. Images are
    resized into the adapters' image budget (`serving_budget`), with at most its number of images per
    prompt, as in training. `extra` comes last, so a flag repeated there wins.
    """
    needed = max((a.max_lora_rank for a in adapters), default=DEFAULT_RUNTIME_RANK)
    if max_lora_rank is not None and max_lora_rank < needed:
        raise InputError(f"max_lora_rank {max_lora_rank} is below the adapters' rank {needed}; raise it")
    rank = vllm_max_lora_rank(max_lora_rank or needed)
    loras = max_loras if max_loras is not None else max(1, len(adapters))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base, "--enable-lora",
           "--max-lora-rank", str(rank), "--max-loras", str(loras)]  # fmt: skip
    if adapters:
        cmd += ["--lora-modules", *(f"{a.name}={a.path}" for a in adapters)]
    if tower_connector_lora or any(a.tower_connector_lora for a in adapters):
        cmd.append("--enable-tower-connector-lora")
    budget = serving_budget(adapters)
    cmd += ["--mm-processor-kwargs", json.dumps(budget.vllm_processor_kwargs()),
            "--limit-mm-per-prompt", json.dumps(budget.vllm_mm_limit())]  # fmt: skip
    if cpu:
        cmd += ["--dtype", "float32", "--max-model-len", str(CPU_MAX_MODEL_LEN)]
    cmd += ["--host", host, "--port", str(port), *extra]
    return cmd


def server_env(base: str, *, cpu: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: runtime LoRA loading on, and the CPU build's settings
    (`visionrl.rollout.vllm_platform`) where the user has not set them."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    if Path(base).is_dir():
        # A local checkpoint needs no hub, and some machines cannot reach it (startup would wait on it).
        env.setdefault("HF_HUB_OFFLINE", "1")
    if cpu:
        fill_env(env, cpu_env())
    return env


def _named_sources(adapters: Mapping[str, Any] | Sequence[str] | None) -> dict[str, str]:
    """{name: src} from a mapping or from `NAME=SRC` strings (the CLI form); names must be unique."""
    if adapters is None:
        return {}
    if isinstance(adapters, Mapping):
        return {str(k): os.fspath(v) for k, v in adapters.items()}
    named: dict[str, str] = {}
    for item in adapters:
        name, sep, src = item.partition("=")
        if not sep or not name or not src:
            raise InputError(f"adapter {item!r} is not NAME=SRC, e.g. --adapter color-v1=s3://bucket/run1")
        if name in named:
            raise InputError(f"adapter name {name!r} is given twice; give each adapter its own name")
        named[name] = src
    return named


def prepare_server(
    base: str,
    adapters: Mapping[str, Any] | Sequence[str] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    extra: Sequence[str] = (),
    cache_dir: str | os.PathLike[str] | None = None,
    max_lora_rank: int | None = None,
    max_loras: int | None = None,
    tower_connector_lora: bool = False,
    log_path: str | os.PathLike[str] | None = None,
    echo: TextIO | None = None,
    api_key: str | None = None,
    allow_insecure: bool = False,
) -> ServerHandle:
    """Fetch and check every adapter, then build (not start) the server. `port=None` picks a free port.

    `api_key` (default $VLLM_API_KEY) protects every route but the health probes (completions, models,
    run-time adapter load/unload, /invocations, /metrics); it reaches vLLM through its environment, not its
    command line, which any local user can read. Binding a non-loopback `host` without a key is refused unless
    `allow_insecure`."""
    key = api_key_from_env(api_key)
    check_exposure(host, key, allow_insecure)
    served = [
        served_adapter(name, fetch_adapter(src, cache_dir)) for name, src in _named_sources(adapters).items()
    ]
    cpu = cpu_only()
    if port is None:
        port = free_port(host)
    else:
        check_port_free(host, port)  # before the model loads, not after
    cmd = server_command(base, served, host=host, port=port, cpu=cpu, extra=extra, max_lora_rank=max_lora_rank,
                         max_loras=max_loras, tower_connector_lora=tower_connector_lora)  # fmt: skip
    env = server_env(base, cpu=cpu)
    if key:  # vLLM checks it under /v1 only; the guard covers every other route too (serve.guard)
        env[API_KEY_ENV] = key
        cmd += ["--middleware", GUARD]
    return ServerHandle(cmd, url=f"http://{host}:{port}", env=env, log_path=log_path, echo=echo,
                        adapters=[a.name for a in served], api_key=key)  # fmt: skip


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_exposure(host: str, api_key: str | None, allow_insecure: bool) -> None:
    """Refuse to serve on a network interface without an API key: anyone who reaches it could run the model
    and load or unload adapters."""
    if api_key or allow_insecure or is_loopback(host):
        return
    raise InputError(
        f"--host {host} makes the server reachable from the network, and without an API key anyone who reaches "
        "it can use the model and load or unload adapters; set an API key (--api-key KEY or the environment "
        f"variable {API_KEY_ENV}; clients send it as `Authorization: Bearer KEY`), bind --host 127.0.0.1, or pass "
        "--allow-insecure if the network is closed"
    )


@contextmanager
def start_server(
    base: str,
    adapters: Mapping[str, Any] | Sequence[str] | None = None,
    *,
    ready_timeout_s: float = READY_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> Iterator[ServerHandle]:
    """Start a vLLM server for `base` + `adapters` ({name: src} or ["NAME=SRC"]), wait until it answers,
    yield its handle, and stop it (and everything it started) on exit, also on errors.

    `options` are those of `prepare_server` (host, port, extra, cache_dir, max_lora_rank, max_loras,
    tower_connector_lora, log_path, echo).
    """
    handle = prepare_server(base, adapters, **options)
    try:
        handle.start()
        handle.wait_ready(ready_timeout_s, progress=progress)
        yield handle
    finally:
        handle.stop()


# --------------------------------------------------------------------------------------------------
# The command line entry


def run_server(
    handle: ServerHandle,
    *,
    ready_timeout_s: float = READY_TIMEOUT_S,
    out: TextIO | None = None,
    on_ready: Callable[[ServerHandle], None] | None = None,
) -> int:
    """Run `handle` in the foreground until it exits; SIGINT/SIGTERM are forwarded to it. Returns the exit code.

    0 when the server stopped because we were asked to stop; otherwise non-zero, with the server's last
    log lines on stderr (it failed to start, or it died). Must be called from the main thread.
    """
    out = out or sys.stdout
    forwarded: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        forwarded.append(signum)
        handle.send_signal(signum)  # the server shuts its engine down itself; stop() escalates if it hangs

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        handle.start()
        try:
            seconds = handle.wait_ready(
                ready_timeout_s, progress=lambda m: print(m, file=sys.stderr, flush=True)
            )
        except ServerError as err:
            if forwarded:  # stopped while loading, as asked
                return 0 if handle.stop() in (0, -forwarded[0]) else 1
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(
            f"vLLM server ready after {seconds:.0f} s at {handle.url} (OpenAI base URL {handle.base_url})",
            file=out,
        )
        print(f"models: {', '.join(list_models(handle.url, api_key=handle.api_key))}", file=out)
        print("Ctrl-C stops it.", file=out, flush=True)
        if on_ready is not None:
            on_ready(handle)
        code = handle.wait()
        if forwarded:
            return 0 if code in (0, -forwarded[0]) else code if code > 0 else 1
        print(f"error: the vLLM server exited with code {code}; its last log lines:\n{handle.log_tail()}",
              file=sys.stderr)  # fmt: skip
        return code if code > 0 else 1
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        handle.stop()


def serve(
    base: str,
    adapters: Sequence[str] | Mapping[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    extra: Sequence[str] = (),
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    api_key: str | None = None,
    allow_insecure: bool = False,
) -> int:
    """`visionrl serve`: fetch and verify the adapters (["NAME=SRC", ...]), run vLLM's OpenAI server in the
    foreground with its log on stderr, print the URL and the model names; returns the exit code."""
    handle = prepare_server(base, adapters, host=host, port=port, extra=extra, cache_dir=cache_dir, echo=sys.stderr,
                            api_key=api_key, allow_insecure=allow_insecure)  # fmt: skip
    return run_server(handle, ready_timeout_s=ready_timeout_s)
