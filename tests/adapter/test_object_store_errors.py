"""What a user sees when the object store cannot be used, through `visionrl export` and `visionrl fetch` against
a real S3-compatible server (moto, on 127.0.0.1): a bucket that does not exist (refused, not created), an endpoint
nobody answers on, keys the store refuses and no keys at all. Each is one line saying what and what to check,
exit 2, never a botocore traceback; nothing is written."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from visionrl.cli import main
from visionrl.serve.process import ServerHandle, free_port

pytestmark = pytest.mark.slow
BUCKET = "visionrl-errors"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The moto server's URL, with one bucket."""
    import boto3

    port, home = free_port(), tmp_path_factory.mktemp("aws")
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with ServerHandle(
        command, url=f"http://127.0.0.1:{port}", ready_path="/moto-api/", log_path=home / "moto.log"
    ) as moto:
        moto.wait_ready(60, poll_s=0.1)
        client = boto3.client("s3", endpoint_url=moto.url, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip
        client.create_bucket(Bucket=BUCKET)
        yield moto.url


@pytest.fixture
def aws(store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", store)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # a dead endpoint fails at once, not after retries
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    return monkeypatch


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from visionrl.config import LoraConfig
    from visionrl.models.loader import apply_lora, load_base_model

    out = tmp_path_factory.mktemp("adapter") / "adapter"
    apply_lora(load_base_model(tiny_model), LoraConfig(rank=4)).save_pretrained(out)
    return out


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def _objects(store: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=store, region_name="us-east-1")
    return [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET).get("Contents", [])]


def test_a_missing_bucket_is_refused_not_created(aws, adapter: Path, store: str, capsys) -> None:
    import boto3

    err = _fails(["export", str(adapter), "s3://no-such-bucket-x/color/v1"], capsys)
    assert "bucket 'no-such-bucket-x' of s3://no-such-bucket-x/color/v1" in err and "does not exist" in err
    assert "aws s3 mb s3://no-such-bucket-x" in err
    names = [b["Name"] for b in boto3.client("s3", endpoint_url=store).list_buckets()["Buckets"]]
    assert names == [BUCKET]  # the export did not create it
    err = _fails(["fetch", "s3://no-such-bucket-x/color/v1"], capsys)
    assert "bucket 'no-such-bucket-x'" in err and "does not exist" in err


def test_an_endpoint_nobody_answers_on_is_named(aws, adapter: Path, capsys) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    aws.setenv("AWS_ENDPOINT_URL", dead)
    for argv in (["export", str(adapter), f"s3://{BUCKET}/v1"], ["fetch", f"s3://{BUCKET}/v1"]):
        err = _fails(argv, capsys)
        assert (
            f"(endpoint {dead}, from AWS_ENDPOINT_URL_S3/AWS_ENDPOINT_URL): the endpoint did not answer"
            in err
        )


def _reset_auth(store: str, count: str) -> urllib.request.Request:
    """moto's switch: after `count` more requests, every request's keys are checked (inf: never)."""
    url, headers = f"{store}/moto-api/reset-auth", {"Content-Type": "text/plain"}
    return urllib.request.Request(url, data=count.encode(), headers=headers, method="POST")


def test_refused_or_missing_keys_are_access_denied_with_what_to_check(
    aws, adapter: Path, store: str, capsys
) -> None:
    with urllib.request.urlopen(
        _reset_auth(store, "0")
    ) as response:  # the store now checks every request's keys
        assert json.loads(response.read())["status"] == "ok"
    try:
        err = _fails(["export", str(adapter), f"s3://{BUCKET}/v2"], capsys)
        assert "access denied" in err and "No AWS credentials were found" not in err
        aws.delenv("AWS_ACCESS_KEY_ID")
        aws.delenv("AWS_SECRET_ACCESS_KEY")
        err = _fails(["fetch", f"s3://{BUCKET}/v2"], capsys)
        assert (
            "access denied" in err and "No AWS credentials were found, so the requests went unsigned" in err
        )
    finally:
        urllib.request.urlopen(_reset_auth(store, "inf")).close()
    assert _objects(store) == []  # nothing was written by any of them
