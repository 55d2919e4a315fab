"""One place that turns a folder or object-store URL into an fsspec filesystem (export, fetch for serving).

Credentials and the endpoint come from the standard AWS environment (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_DEFAULT_REGION`, profiles and instance roles), read by
botocore under s3fs. botocore also reads `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` itself (checked with the
pinned s3fs 2026.9 / aiobotocore 3.10); we still pass the endpoint explicitly, because fsspec caches one
filesystem object per set of constructor arguments: without the endpoint among them, a process that changes
`AWS_ENDPOINT_URL` (a test against a local S3 server, a script switching stores) would silently keep talking
to the first endpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec

from visionrl.errors import InputError

S3_PROTOCOLS = ("s3", "s3a")
# botocore's order: the service-specific variable wins over the global one.
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def s3_endpoint_url() -> str | None:
    """The S3 endpoint from the environment (`AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`), or None."""
    for name in ENDPOINT_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def storage_options(url: str) -> dict[str, Any]:
    """fsspec options for `url`: for s3:// the endpoint from the environment (see the module docstring)."""
    protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
    if protocol not in S3_PROTOCOLS:
        return {}
    endpoint = s3_endpoint_url()
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}


def filesystem(url: str | os.PathLike[str]) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) of a local folder or a URL such as `s3://bucket/prefix`; a malformed S3 URL
    (`s3:/bucket`, a bare `s3://`) is an InputError rather than a local folder named `s3:`."""
    text = os.fspath(url)
    check_s3_url(text)
    return fsspec.core.url_to_fs(text, **storage_options(text))


def check_s3_url(text: str) -> None:
    """Raise InputError for a path that means S3 but is not `s3://bucket[/prefix]`."""
    head = text.split(":", 1)[0].lower() if ":" in text else ""
    if head not in S3_PROTOCOLS:
        return
    bucket = text.split("://", 1)[1].split("/", 1)[0] if "://" in text else ""
    if not bucket:
        raise InputError(
            f"{text!r} is not an S3 location: write it as {head}://BUCKET/PREFIX (two slashes after the colon, "
            "then the bucket's name)"
        )


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `fs` is the local disk (where a path can be handed to another process as is)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "file" in protocols


def is_s3(url: str | os.PathLike[str]) -> bool:
    text = os.fspath(url)
    return "://" in text and text.split("://", 1)[0].lower() in S3_PROTOCOLS


class ObjectStoreError(InputError):
    """The object store could not be used: the endpoint does not answer, no credentials, access denied, no such
    bucket. The message names the URL, the endpoint and what to check."""


def _where(url: str) -> str:
    endpoint = s3_endpoint_url()
    return (
        f"{url} (endpoint {endpoint}, from {'/'.join(ENDPOINT_VARIABLES)})" if endpoint else f"{url} (AWS S3)"
    )


@contextmanager
def object_store_errors(url: str | os.PathLike[str], doing: str) -> Iterator[None]:
    """Turn what botocore and s3fs raise inside for an S3 `url` into an ObjectStoreError saying what failed while
    `doing` (e.g. "exporting to") and what to check. Local paths and other errors pass through unchanged."""
    text = os.fspath(url)
    if not is_s3(text):
        yield
        return
    import botocore.exceptions as bx  # type: ignore[import-untyped]

    try:
        yield
    except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError) as err:
        raise ObjectStoreError(
            f"{doing} {_where(text)}: the endpoint did not answer ({err}). Check the endpoint variable (unset for "
            "AWS itself), that the server runs, and the network"
        ) from None
    except (bx.NoCredentialsError, bx.PartialCredentialsError) as err:
        raise ObjectStoreError(
            f"{doing} {_where(text)}: no AWS credentials ({err}). Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "a profile (AWS_PROFILE), or run where an instance or pod role provides them"
        ) from None
    except PermissionError as err:  # s3fs's AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch
        import botocore.session  # type: ignore[import-untyped]

        unsigned = botocore.session.get_session().get_credentials() is None
        why = " No AWS credentials were found, so the requests went unsigned." if unsigned else ""
        raise ObjectStoreError(
            f"{doing} {_where(text)}: access denied ({err}).{why} Check the credentials (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, a role) and that they may list the bucket and read or write "
            "objects under the prefix"
        ) from None
    except bx.BotoCoreError as err:
        raise ObjectStoreError(f"{doing} {_where(text)}: {type(err).__name__}: {err}") from None


def require_bucket(fs: fsspec.AbstractFileSystem, url: str) -> None:
    """Raise ObjectStoreError when the bucket of S3 `url` does not exist: writing would create it (s3fs's
    makedirs), in whatever region and with whatever policy the credentials give, which nobody asked for."""
    if not is_s3(url):
        return
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    try:
        fs.info(bucket)  # not fs.exists: that answers False for an endpoint that does not answer
    except FileNotFoundError:
        raise ObjectStoreError(
            f"bucket {bucket!r} of {_where(url)} does not exist, or these credentials cannot see it; create it "
            f"first (aws s3 mb s3://{bucket}) or check the name"
        ) from None
