"""Serve a base model with exported LoRA adapters through vLLM's OpenAI-compatible server (`visionrl serve`).

- `fetch_adapter(src)`: an export (folder or `s3://bucket/prefix`) -> a local copy whose every file matched
  the export's manifest; vLLM only ever reads such copies.
- `server_command(...)`: the vLLM command line, with the LoRA flags each adapter needs (pure).
- `ServerHandle` / `start_server(...)`: the server as a child process: start, wait until ready, stop.
- `load_adapter` / `unload_adapter` / `list_models`: adapter management of a running server over HTTP.
- `serve(...)`: the command line entry: runs the server in the foreground, forwarding Ctrl-C / SIGTERM.

The server process itself lives in `visionrl.server_process`; this module decides what it runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import fsspec

from visionrl.errors import InputError
from visionrl.export import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST_NAME,
    ExportError,
    read_manifest,
    read_safetensors_header,
)
from visionrl.servable import check_servable
from visionrl.server_process import ServerError, ServerHandle, free_port, http_json, root_url
from visionrl.storage import filesystem, is_local

logger = logging.getLogger(__name__)

__all__ = [
    "ServedAdapter", "ServerError", "ServerHandle", "fetch_adapter", "list_models", "load_adapter",
    "prepare_server", "serve", "server_command", "start_server", "unload_adapter",
]  # fmt: skip

CACHE_ENV = "VISIONRL_ADAPTER_CACHE"
CPU_MAX_MODEL_LEN = (
    4096  # the engine's KV cache on CPU is small (VLLM_CPU_KVCACHE_SPACE); keep prompts modest
)
DEFAULT_RUNTIME_RANK = 16  # LoRA slot size when no adapter is given at start (adapters come at run time)
READY_TIMEOUT_S = 900.0  # an 8B model loads in minutes; the tiny model in about 50 s
_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------------
# Fetching a verified local copy


def default_cache_dir() -> Path:
    """$VISIONRL_ADAPTER_CACHE, else $XDG_CACHE_HOME/visionrl/adapters, else ~/.cache/visionrl/adapters."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "visionrl" / "adapters"


def _cache_key(fs: fsspec.AbstractFileSystem, root: str, manifest_raw: bytes) -> str:
    """A folder name unique to (where the export lives, which manifest it has)."""
    where = str(Path(root).resolve()) if is_local(fs) else fs.unstrip_protocol(root.rstrip("/"))
    digest = hashlib.sha256(where.encode() + b"\n" + hashlib.sha256(manifest_raw).digest())
    return digest.hexdigest()[:24]


def _local_mismatch(folder: Path, files: Mapping[str, Any]) -> str | None:
    """The first file of `folder` that differs from the manifest's `files`, or None."""
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return name
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                digest.update(chunk)
        if digest.hexdigest() != expected["sha256"]:
            return name
    return None


def _download_verified(fs: fsspec.AbstractFileSystem, remote: str, local: Path, expected: Mapping[str, Any],
                       src: str) -> None:  # fmt: skip
    """Copy `remote` to `local`, hashing on the way; a file that differs from the manifest is refused."""
    name = local.name
    if not fs.exists(remote):
        raise ExportError(
            f"adapter file {name} listed in the manifest of {src} is missing: the export is damaged; re-export it"
        )
    digest, size = hashlib.sha256(), 0
    with fs.open(remote, "rb") as fin, local.open("wb") as fout:
        for chunk in iter(lambda: fin.read(_CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
            fout.write(chunk)
    if digest.hexdigest() != expected["sha256"] or size != expected["bytes"]:
        raise ExportError(
            f"adapter file {name} in {src} does not match the sha256 in its manifest ({size} bytes, sha256 "
            f"{digest.hexdigest()[:16]}...; the manifest says {expected['bytes']} bytes, "
            f"{str(expected['sha256'])[:16]}...): it was modified or damaged after the export. Refusing to "
            "serve it; re-export the adapter"
        )


def fetch_adapter(src: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A verified local copy of the exported adapter at `src` (a folder or `s3://bucket/prefix`).

    The export must have its manifest (written last by `visionrl export`: without it the export is not
    complete and is refused). Every file the manifest lists is downloaded into
    `cache_dir/<sha of src + manifest>/` (default `default_cache_dir()`) and checked against its sha256;
    a file that differs raises ExportError naming it. A cached copy is re-hashed before it is reused, so
    it is always what the manifest describes (a later change at `src` without a new manifest is refused
    by the next fresh fetch, and a re-export gets a new cache folder).
    """
    src_text = os.fspath(src)
    fs, root = filesystem(src_text)
    manifest, raw = read_manifest(fs, root, src_text)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / _cache_key(fs, root, raw)
    if target.is_dir():
        bad = _local_mismatch(target, manifest["files"])
        if bad is None:
            return target
        logger.warning("cached copy %s of %s differs in %s; downloading it again", target, src_text, bad)
        shutil.rmtree(target)
    cache.mkdir(parents=True, exist_ok=True)
    # Download into a temporary folder and rename: a reader never sees a half-downloaded copy.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
    try:
        for name, expected in manifest["files"].items():
            _download_verified(fs, f"{root.rstrip('/')}/{name}", tmp / name, expected, src_text)
        (tmp / MANIFEST_NAME).write_bytes(raw)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not the race of two fetches of the same export
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------------------
# What the server runs


@dataclass(frozen=True)
class ServedAdapter:
    """A verified local adapter and the vLLM settings it needs (from `visionrl.servable.check_servable`)."""

    name: str
    path: Path
    max_lora_rank: int
    tower_connector_lora: bool


def _check_name(name: str) -> None:
    if not name or any(c.isspace() for c in name) or "=" in name or "/" in name:
        raise InputError(
            f"adapter name {name!r} is not usable: give a non-empty name without spaces, '=' or '/', "
            "e.g. --adapter color-v1=s3://bucket/run1"
        )


def served_adapter(name: str, path: str | os.PathLike[str]) -> ServedAdapter:
    """Check that vLLM serves the adapter at `path` as trained; raise ExportError with the problems if not."""
    _check_name(name)
    folder = Path(path)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ExportError(f"adapter {name!r} at {folder} has no readable {ADAPTER_CONFIG} ({err})") from None
    weights = folder / ADAPTER_WEIGHTS
    check = check_servable(config, read_safetensors_header(weights) if weights.is_file() else None)
    if not check["ok"]:
        raise ExportError(
            f"vLLM cannot serve adapter {name!r} ({folder}) as trained:\n  - "
            + "\n  - ".join(check["problems"])
        )
    return ServedAdapter(name, folder, check["max_lora_rank"], check["tower_connector_lora"])


def cpu_only() -> bool:
    """No CUDA device: serve in float32 with a small context (bf16 is 4-20x slower on AVX2 CPUs)."""
    from visionrl.rollout.vllm_engine import cpu_only as torch_cpu_only

    return torch_cpu_only()


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
    (or `tower_connector_lora`), since without it vLLM silently serves the merger untrained. `extra` comes
    last, so a flag repeated there wins.
    """
    from visionrl.rollout.vllm_engine import vllm_max_lora_rank

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
    if cpu:
        cmd += ["--dtype", "float32", "--max-model-len", str(CPU_MAX_MODEL_LEN)]
    cmd += ["--host", host, "--port", str(port), *extra]
    return cmd


def server_env(base: str, *, cpu: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: runtime LoRA loading on, and the CPU build's settings (FACTS.md) unless set."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    if Path(base).is_dir():
        # A local checkpoint needs no hub, and some machines cannot reach it (startup would wait on it).
        env.setdefault("HF_HUB_OFFLINE", "1")
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default reserves about 20 GiB
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
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
) -> ServerHandle:
    """Fetch and check every adapter, then build (not start) the server. `port=None` picks a free port."""
    served = [
        served_adapter(name, fetch_adapter(src, cache_dir)) for name, src in _named_sources(adapters).items()
    ]
    cpu = cpu_only()
    port = free_port(host) if port is None else port
    cmd = server_command(base, served, host=host, port=port, cpu=cpu, extra=extra, max_lora_rank=max_lora_rank,
                         max_loras=max_loras, tower_connector_lora=tower_connector_lora)  # fmt: skip
    return ServerHandle(cmd, url=f"http://{host}:{port}", env=server_env(base, cpu=cpu), log_path=log_path,
                        echo=echo, adapters=[a.name for a in served])  # fmt: skip


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
# Adapters of a running server


def list_models(url: str, timeout_s: float = 10.0) -> list[str]:
    """The model ids a server offers (the base model and every loaded adapter): GET /v1/models."""
    body = http_json("GET", f"{root_url(url)}/v1/models", timeout_s=timeout_s)
    return [str(m["id"]) for m in json.loads(body).get("data", [])]


def load_adapter(
    url: str, name: str, src: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 120.0,
) -> Path:  # fmt: skip
    """Fetch and verify the export at `src`, then have the server at `url` load it as `name`; returns the
    local copy. The server reads that path from its own disk: call this on the server's machine.

    Equivalent HTTP calls (for a README; `visionrl fetch SRC` prints the verified local copy):

        curl -X POST http://127.0.0.1:8000/v1/load_lora_adapter -H 'Content-Type: application/json' \\
             -d '{"lora_name": "color-v2", "lora_path": "'"$(visionrl fetch s3://bucket/run2)"'"}'
        curl -X POST http://127.0.0.1:8000/v1/unload_lora_adapter -H 'Content-Type: application/json' \\
             -d '{"lora_name": "color-v2"}'
        curl http://127.0.0.1:8000/v1/models

    Give every new adapter version a new name: vLLM keys cached image embeddings by adapter, so reloading
    changed weights under an old name may serve stale results. A server started without an adapter that
    trains the vision merger needs `tower_connector_lora=True` (`--vllm-arg=--enable-tower-connector-lora`)
    to apply such adapters loaded later. Raises ExportError (bad export) or ServerError (the server refused).
    """
    path = served_adapter(name, fetch_adapter(src, cache_dir)).path
    payload = {"lora_name": name, "lora_path": str(path.resolve())}
    http_json("POST", f"{root_url(url)}/v1/load_lora_adapter", payload, timeout_s=timeout_s)
    return path


def unload_adapter(url: str, name: str, *, timeout_s: float = 60.0) -> None:
    """Have the server at `url` stop offering adapter `name` (POST /v1/unload_lora_adapter)."""
    http_json("POST", f"{root_url(url)}/v1/unload_lora_adapter", {"lora_name": name}, timeout_s=timeout_s)


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
        print(f"models: {', '.join(list_models(handle.url))}", file=out)
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
) -> int:
    """`visionrl serve`: fetch and verify the adapters (["NAME=SRC", ...]), run vLLM's OpenAI server in the
    foreground with its log on stderr, print the URL and the model names; returns the exit code."""
    handle = prepare_server(
        base, adapters, host=host, port=port, extra=extra, cache_dir=cache_dir, echo=sys.stderr
    )
    return run_server(handle, ready_timeout_s=ready_timeout_s)
