"""Shared fixtures: real brokers on loopback.

A fixture that cannot reach its broker skips on a developer's machine but
fails when the ``CI`` environment variable is set, so CI never goes green by
skipping everything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeVar

import pytest

# Node processes must stop on SIGINT as they do when a user presses Ctrl-C, even where the suite runs as a
# shell's background job (``... &``), whose SIGINT is ignored and would be inherited through exec. A Python
# handler here is reset to the default action by exec, so every child starts with it. (Not a ``preexec_fn``
# per Popen: that makes Popen fork without vfork, and runs the atfork handlers of a gRPC this process has
# loaded, whose poller thread then died in the child before its exec: a node that never started.)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
import redis

from srl.runner.distribution.board.board import Board
from tests.nodes import Node, kill_all

if TYPE_CHECKING:
    from tests.queue_fixtures import PrivateServer


def broker_unavailable(what: str, host: str, port: int) -> None:
    """Skip (locally) or fail (in CI) because a broker does not answer."""
    message = f"{what} is not answering on {host}:{port}; start it (see scripts/services.sh)"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {message}")
    pytest.skip(message)


ServerT = TypeVar("ServerT", bound="PrivateServer")


@contextlib.contextmanager
def running(server: ServerT) -> Iterator[ServerT]:
    """A private broker of the test's own, started and removed at the end; one that cannot start skips
    the test on a developer's machine and fails it when ``CI`` is set (scripts/setup.sh installs them)."""
    try:
        server.start()
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        message = f"cannot start a private {server.name}: {e}"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {message}")
        pytest.skip(message)
    try:
        yield server
    finally:
        server.cleanup()


def require_tool(command: str, where: str) -> None:
    """Skip (locally) or fail (in CI) when ``command`` is not on PATH."""
    if shutil.which(command) is None:
        message = f"{command} is not installed ({where})"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {message}")
        pytest.skip(message)


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@pytest.fixture()
def namespace() -> Iterator[str]:
    """A fresh task namespace so tests sharing one Redis never collide; whatever the test left under it
    (and under names it made from it, ``<namespace>-b``) is removed from that Redis at the end, so a
    developer's own ``srl status`` and dashboard do not fill with test tasks."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    port = int(os.environ.get("SRL_TEST_REDIS_PORT", "6379"))
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
        keys = list(client.scan_iter(match=f"srl:{{{name}*", count=500))
        if keys:
            client.unlink(*keys)
        client.close()
    except redis.RedisError:  # no Redis here: nothing was left on it
        pass


@pytest.fixture()
def redis_url() -> Iterator[str]:
    import redis

    host, port = "127.0.0.1", int(os.environ.get("SRL_TEST_REDIS_PORT", "6379"))
    url = f"redis://{host}:{port}/0"
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError:
        broker_unavailable("Redis", host, port)
    yield url


@pytest.fixture()
def nodes() -> Iterator[list[Node]]:
    """Real ``srl`` processes a test starts (``tests.nodes.start``); all stopped at the end."""
    started: list[Node] = []
    yield started
    kill_all(started)


@pytest.fixture()
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture()
def board(client: redis.Redis, namespace: str) -> Iterator[Board]:
    """The board of a fresh task namespace, deleted at the end."""
    b = Board(client, namespace)
    yield b
    b.delete_task()
