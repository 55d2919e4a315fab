"""A Ray cluster of several nodes on this host, each started with `ray start` (its own raylet, its own resources),
on 127.0.0.1 and ports chosen free, in a temp dir of its own; stopped by signalling the `ray start --block`
processes this code started (never `ray stop`, which would stop every Ray on the machine).

    with LocalCluster(nodes=[{"num_cpus": 1}, {"num_cpus": 1}, {"num_cpus": 1}]) as cluster:
        ... ray.address = cluster.address ...
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# The GCS is reached at 127.0.0.1. Ray itself advertises each node under the host's own address (it replaces a
# loopback --node-ip-address, and its loopback-only mode refuses a second node), as an embedded ray.init does.
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    def __init__(
        self, nodes: list[dict[str, Any]], start_timeout_s: float = 120.0, keep_logs: Path | None = None
    ) -> None:
        self.nodes, self.timeout, self.keep_logs = nodes, start_timeout_s, keep_logs
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []
        self.groups: list[int] = []  # process group ids (= the `ray start` pids) of the nodes
        self.tmp = Path(tempfile.mkdtemp(prefix="vrl-cl-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.address = f"127.0.0.1:{free_port()}"
        self.stray: list[str] = []  # what `stop` found still running after the drain (it then killed it)

    def _start(self, index: int, spec: dict[str, Any]) -> None:
        head = index == 0
        cmd = [
            *RAY,
            "start",
            "--block",
            "--disable-usage-stats",
            f"--num-cpus={spec.get('num_cpus', 1)}",
            f"--num-gpus={spec.get('num_gpus', 0)}",
            f"--resources={json.dumps(spec.get('resources', {}))}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--object-store-memory={spec.get('object_store_bytes', 200 * 2**20)}",
        ]
        if head:
            cmd += [
                "--head",
                f"--port={self.address.split(':')[1]}",
                f"--ray-client-server-port={free_port()}",
                "--include-dashboard=false",
                f"--temp-dir={self.tmp}",
            ]
        else:
            cmd += [f"--address={self.address}"]
        env = {**os.environ, **RAY_ENV}
        log = open(self.tmp / f"node-{index}.log", "ab")  # open for the node's life; closed by stop()
        self.logs.append(log)
        # A session of its own: every process this node starts can be found (and, if one outlives the drain,
        # stopped) by its process group, without touching any other Ray on the machine.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(proc)
        self.groups.append(proc.pid)

    def __enter__(self) -> LocalCluster:
        try:
            for i, spec in enumerate(self.nodes):
                self._start_node(i, spec)
        except BaseException:
            self.stop()
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return self

    def _start_node(self, index: int, spec: dict[str, Any], attempts: int = 3) -> None:
        """One node at a time, each up before the next: `ray start` gives a node 30 s to register with the GCS
        (fixed in Ray), which a loaded 2-core machine can miss; a node that missed it is started again."""
        for attempt in range(attempts):
            self._start(index, spec)
            try:
                self._wait_for(index + 1)
                return
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                failed = self.procs.pop()
                failed.wait()
                self.groups.pop()
                self.logs.pop().close()

    def alive_nodes(self) -> int:
        """Nodes the cluster's GCS lists as alive (asked by a short-lived process, so this one stays clean)."""
        probe = (
            "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        env = {**os.environ, **RAY_ENV}
        out = subprocess.run(
            [sys.executable, "-c", probe, self.address], capture_output=True, text=True, env=env
        )
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0

    def _wait_for(self, n: int) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]  # ray start exited
            if dead:
                raise RuntimeError(f"ray start of node(s) {dead} exited: see {self.tmp}/node-*.log")
            if self.alive_nodes() >= n:
                return
            time.sleep(1.0)
        raise TimeoutError(
            f"{n} Ray nodes did not come up in {self.timeout:.0f} s: see {self.tmp}/node-*.log"
        )

    def stop(self) -> None:
        """SIGTERM each `ray start --block` (it drains and stops the processes it started), workers first."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        for log in self.logs:
            log.close()
        self.logs.clear()
        self.stray = self.leftovers()
        for group in self.groups:  # anything of ours that outlived the drain
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftovers(self) -> list[str]:
        """Processes still running in this cluster's process groups (none after a clean `stop`)."""
        out = subprocess.run(["ps", "-eo", "pid=,pgid=,args="], capture_output=True, text=True).stdout
        rows = [line.split(None, 2) for line in out.splitlines() if line.strip()]
        return [" ".join(r) for r in rows if len(r) == 3 and int(r[1]) in self.groups]

    def __exit__(self, kind: object, *exc: object) -> None:
        self.stop()
        if kind is not None and self.keep_logs is not None:  # a failed test keeps the nodes' logs to read
            shutil.copytree(
                self.tmp, self.keep_logs, ignore=shutil.ignore_patterns("sockets"), dirs_exist_ok=True
            )
        shutil.rmtree(self.tmp, ignore_errors=True)
