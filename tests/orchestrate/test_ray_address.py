"""A `ray.address` nothing answers at is an error naming it, not `ray.init` retrying forever (127.0.0.1 only)."""

from __future__ import annotations

import re
import socket
import time

import pytest

from visionrl.errors import InputError
from visionrl.orchestrate.ray_session import wait_for_ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_address_nobody_listens_at_is_an_error_after_the_startup_timeout() -> None:
    address = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(InputError) as err:
        wait_for_ray(address, timeout_s=1.5, poll_s=0.2)
    waited = time.monotonic() - t0
    assert 1.5 <= waited < 10
    assert re.match(rf"no Ray answers at ray\.address={address} after \d+ s \(", str(err.value))
    assert "leave ray.address and RAY_ADDRESS unset for a local Ray" in str(err.value)


def test_a_listening_address_and_other_forms_pass_at_once() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        t0 = time.monotonic()
        wait_for_ray(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=30)
        assert time.monotonic() - t0 < 2
    for left_to_ray in ("auto", "ray://127.0.0.1:1", "local"):
        wait_for_ray(left_to_ray, timeout_s=0.1)  # returns: Ray resolves these itself
