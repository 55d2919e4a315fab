"""Tests of visionrl.storage: which fsspec options a URL gets from the AWS environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from visionrl.adapter.storage import filesystem, is_local, storage_options
from visionrl.errors import InputError


@pytest.fixture(autouse=True)
def _no_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


def test_s3_urls_get_the_endpoint_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert storage_options("s3://bucket/prefix") == {}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert storage_options("s3://bucket/prefix") == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}
    }
    monkeypatch.setenv(
        "AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9001"
    )  # the S3-specific one wins, as in botocore
    assert storage_options("s3a://bucket/prefix") == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9001"}
    }
    assert storage_options("memory://x") == {} and storage_options("relative/folder") == {}


def test_a_changed_endpoint_gives_another_filesystem(monkeypatch: pytest.MonkeyPatch) -> None:
    # fsspec caches filesystems by their arguments: the endpoint must be one of them.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    first, path = filesystem("s3://bucket/prefix")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9002")
    second, _ = filesystem("s3://bucket/prefix")
    assert path == "bucket/prefix" and first is not second
    assert second.client_kwargs == {"endpoint_url": "http://127.0.0.1:9002"}


def test_local_folders_are_local(tmp_path: Path) -> None:
    fs, path = filesystem(tmp_path)
    assert is_local(fs) and path == str(tmp_path)
    assert not is_local(filesystem("memory://bucket/x")[0])


@pytest.mark.parametrize("url", ["s3:/bucket/x", "s3://", "s3:///prefix", "S3:bucket", "s3a:/b"])
def test_a_malformed_s3_url_is_refused_not_a_local_folder(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"is not an S3 location: write it as s3a?://BUCKET/PREFIX"):
        filesystem(url)
    assert list(tmp_path.iterdir()) == []  # no folder named `s3:` appeared
    assert filesystem("s3://bucket/x")[1] == "bucket/x" and filesystem("runs/s3:x")[1].endswith("runs/s3:x")
