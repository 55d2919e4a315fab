"""A long-running HTTP server (vLLM's OpenAI server) as a child process: start, wait until ready, stop.

The child runs in its own process group (session): a Ctrl-C at the terminal reaches only us, and we
forward it, so the server shuts its engine processes down in order; if it hangs, `stop()` kills the whole
group it started, by group id, and nothing else. Its output is read by a thread that keeps the last lines
(shown when it fails), and optionally writes them to a log file and echoes them (the `serve` command).
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from visionrl.errors import InputError, RunError

PROGRESS_EVERY_S = 10.0
TAIL_LINES = 200
API_KEY_ENV = (
    "VLLM_API_KEY"  # vLLM's own: with it set, every path under /v1 needs `Authorization: Bearer KEY`
)


def api_key_from_env(api_key: str | None = None) -> str | None:
    """`api_key`, else $VLLM_API_KEY, else None (no key)."""
    return api_key or os.environ.get(API_KEY_ENV) or None


class ServerError(RunError):
    """The server failed to start, died, or refused a request; the message carries its reason (the CLI
    prints it and exits 1)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status of a refused request, None when there was no answer


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Raise InputError when `port` on `host` cannot be bound now (another server holds it): vLLM would find out
    only after loading the model, with a traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as servers bind: a closed socket's wait is no holder
        try:
            s.bind((host, port))
        except OSError as err:
            raise InputError(
                f"port {port} on {host} cannot be used ({err.strerror or err}): another server may hold it; "
                "stop it, or pass another --port"
            ) from None


def root_url(url: str) -> str:
    """`http://host:port` from that or the OpenAI base URL `http://host:port/v1` (trailing slashes too)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body as text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text[:500]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return text[:500]


def http_json(
    method: str, url: str, payload: Any = None, *, timeout_s: float = 30.0, api_key: str | None = None
) -> bytes:
    """Send `payload` as JSON (if any), with `api_key` as a bearer token (if any), and return the response body;
    any failure raises ServerError."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return bytes(response.read())
    except urllib.error.HTTPError as err:
        raise ServerError(
            f"{method} {url} failed with HTTP {err.code}: {_error_message(err.read())}", status=err.code
        ) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        reason = getattr(err, "reason", err)
        raise ServerError(f"{method} {url}: no answer ({reason})") from None


class ServerHandle:
    """One server child process. `url` is `http://host:port`; `base_url` adds `/v1` (OpenAI clients)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        url: str,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        echo: TextIO | None = None,
        adapters: Sequence[str] = (),
        ready_path: str = "/v1/models",
        api_key: str | None = None,
    ) -> None:
        self.command = list(command)
        self.url = root_url(url)
        self.env = dict(env) if env is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.echo = echo
        self.adapters = list(adapters)  # adapter names the server was started with
        self.ready_path = ready_path  # answers 200 once the server serves (vLLM: after the model loaded)
        self.api_key = api_key  # the bearer token the server requires (None: none)
        self._proc: subprocess.Popen[bytes] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._reader: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> ServerHandle:
        if self._proc is not None:
            raise RuntimeError("this server was already started; make a new handle")
        self._proc = subprocess.Popen(
            self.command,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: see the module docstring
        )
        self._reader = threading.Thread(target=self._read_output, name="server-log", daemon=True)
        self._reader.start()
        return self

    def _read_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        log = self.log_path.open("a", encoding="utf-8") if self.log_path is not None else None
        try:
            for raw in self._proc.stdout:
                line = raw.decode("utf-8", "replace")
                self._tail.append(line.rstrip("\n"))
                for stream in (log, self.echo):
                    if stream is not None:
                        stream.write(line)
                        stream.flush()
        finally:
            if log is not None:
                log.close()

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines the server printed."""
        return "\n".join(list(self._tail)[-lines:])

    def poll(self) -> int | None:
        """The exit code if the server has exited, else None."""
        return None if self._proc is None else self._proc.poll()

    def wait_ready(
        self, timeout_s: float, *, progress: Callable[[str], None] | None = None, poll_s: float = 0.5
    ) -> float:
        """Block until GET `ready_path` answers 200; returns the seconds it took since this call.

        Raises ServerError, with the server's last log lines, if it exits first or is not ready in time.
        """
        if self._proc is None:
            raise RuntimeError("start() the server before waiting for it")
        start = time.monotonic()
        next_progress = start + PROGRESS_EVERY_S
        while True:
            code = self._proc.poll()
            if code is not None:
                self._join_reader()
                raise ServerError(
                    f"the server exited with code {code} before it was ready; its last log lines:\n"
                    f"{self.log_tail()}"
                )
            try:
                http_json("GET", f"{self.url}{self.ready_path}", timeout_s=5.0, api_key=self.api_key)
            except ServerError:
                pass  # not listening yet, or still loading the model
            else:
                return time.monotonic() - start
            now = time.monotonic()
            if now - start > timeout_s:
                raise ServerError(
                    f"the server at {self.url} was not ready after {timeout_s:.0f} s; its last log lines:\n"
                    f"{self.log_tail()}"
                )
            if progress is not None and now >= next_progress:
                progress(f"waiting for the server at {self.url} to load the model ({now - start:.0f} s)")
                next_progress = now + PROGRESS_EVERY_S
            time.sleep(poll_s)

    def send_signal(self, signum: int) -> None:
        """Send `signum` to the server process (not yet to what it started: it stops those itself)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signum)

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait until the server exits; its exit code (negative: killed by that signal)."""
        if self._proc is None:
            raise RuntimeError("the server was never started")
        return self._proc.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop the server: SIGTERM, wait up to `timeout_s`, then SIGKILL its process group. Idempotent.

        Returns the exit code (None if it was never started).
        """
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._kill_group()
                self._proc.wait()
        # The engine processes it started share its group; none should outlive it, but make sure.
        self._kill_group()
        self._join_reader()
        return self._proc.returncode

    def _kill_group(self) -> None:
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)  # the group id is the child's pid (own session)
        except ProcessLookupError:
            pass  # the group is gone: nothing left to stop

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5.0)

    def __enter__(self) -> ServerHandle:
        return self if self._proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
