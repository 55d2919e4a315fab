"""The quiet console (orchestrate.console): an actor's output, C-level and its children's included, appended to the
run's log; this process's Ray, vLLM and Python warnings sent there while a run is on; `--verbose` leaves them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from visionrl.orchestrate import console


def test_an_actor_writes_its_output_and_its_childrens_into_the_log(tmp_path: Path) -> None:
    log = tmp_path / "visionrl.log"
    log.write_text("before\n")
    script = (
        "import os, sys; from visionrl.orchestrate.console import quiet_actor; print('not yet', flush=True); "
        "quiet_actor(); print('python stdout'); print('python stderr', file=sys.stderr); "
        "os.system('echo child process'); os.write(2, b'raw fd 2\\n')"
    )
    env = {**os.environ, console.ACTOR_LOG_ENV: str(log)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert done.stdout == "not yet\n" and done.stderr == ""
    assert log.read_text().splitlines()[0] == "before"  # appended, nothing lost
    assert set(log.read_text().splitlines()[1:]) == {
        "python stdout",
        "python stderr",
        "child process",
        "raw fd 2",
    }
    env.pop(console.ACTOR_LOG_ENV)  # no run asked for it (verbose): the output stays where it was
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert "python stdout" in done.stdout and "raw fd 2" in done.stderr


def test_the_libraries_warnings_go_to_the_log_while_a_run_is_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    monkeypatch.delenv(console.ACTOR_LOG_ENV, raising=False)
    log = tmp_path / "run" / "visionrl.log"
    ray_handlers = logging.getLogger("ray").handlers[:]
    with console.libraries_to(log):
        assert console.actor_env() == {console.ACTOR_LOG_ENV: str(log.resolve())}
        logging.getLogger("ray._private.worker").warning("ray says hello")
        logging.getLogger("vllm.engine").warning("vllm says hello")
        warnings.warn("a deprecation", DeprecationWarning, stacklevel=1)
    assert capsys.readouterr().err == ""
    text = log.read_text()
    assert "ray says hello" in text and "vllm says hello" in text and "a deprecation" in text
    assert console.actor_env() == {} and logging.getLogger("ray").handlers == ray_handlers  # restored

    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    with console.libraries_to(log):
        assert console.actor_env() == {}  # --verbose: the actors keep their output on the console


def test_a_phase_says_when_it_begins_and_how_long_it_took(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="visionrl"), console.phase("loading the model"):
        pass
    assert caplog.messages[0] == "loading the model ..."
    assert caplog.messages[1].startswith("loading the model: ready in ") and caplog.messages[1].endswith(" s")
