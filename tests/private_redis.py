"""A private redis-server on a free port, with persistence, that a test may restart.

The shared Redis on 6379 is never restarted by a test.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from srl.runner.distribution.embedded import redis_server_executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server") or redis_server_executable()
        self.proc = subprocess.Popen(
            [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    return
            except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis flushes its append-only file and exits
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> PrivateRedis:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
