"""A local AWS for tests: moto's server (S3, SageMaker, ...) on 127.0.0.1 in a child process, and the AWS
environment pointed at it with fake keys and no user configuration.

moto runs in a child process, not as moto's in-process ThreadedMotoServer: importing flask into the test process
breaks every later in-process vLLM engine (vLLM 0.32 scans all module globals at start, and flask's `current_app`
proxy raises RuntimeError there).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from visionrl.serve.process import ServerHandle, free_port

REGION = "us-east-1"


@contextmanager
def moto_server(home: Path, *, update_endpoint: bool = False) -> Iterator[str]:
    """moto's server, ready; yields its URL and stops it (its log is `home/moto.log`). `update_endpoint` adds
    SageMaker's UpdateEndpoint, which moto lacks (tests/moto_sagemaker.py)."""
    port = free_port()
    server = (
        [str(Path(__file__).with_name("moto_sagemaker.py"))] if update_endpoint else ["-m", "moto.server"]
    )
    command = [sys.executable, *server, "-H", "127.0.0.1", "-p", str(port)]
    with ServerHandle(
        command, url=f"http://127.0.0.1:{port}", ready_path="/moto-api/", log_path=home / "moto.log"
    ) as moto:
        moto.wait_ready(60, poll_s=0.1)
        yield moto.url


def point_aws_at(mp: pytest.MonkeyPatch, url: str, home: Path) -> None:
    """Every AWS client of this process (boto3, s3fs) talks to `url` with fake keys; no user config leaks in."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        mp.delenv(name, raising=False)
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    mp.setenv("AWS_DEFAULT_REGION", REGION)
    mp.setenv("AWS_ENDPOINT_URL", url)
    mp.setenv("AWS_CONFIG_FILE", str(home / "config"))
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "credentials"))
