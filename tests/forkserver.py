"""A fork server for the test harness's ``srl`` nodes: one process imports srl (torch, gymnasium, the queue
libraries) once, and each node is a fork of it that runs ``python -m srl.cli``'s ``__main__`` as a fresh
interpreter would, without the seconds a fresh interpreter spends importing torch.

A suite starts a few hundred nodes; on a 2-core machine their imports were minutes of its wall time, and the
matrix's cells (bench/faults.py) spent half their time importing. ``SRL_TEST_FORKSERVER=0`` starts every node
as its own ``python -m srl.cli`` instead (the CLI's own tests, ``_srl`` in tests/test_operating.py, run it
that way in any case).

What a node sees is what ``python -m srl.cli ARGS`` would give it: its argv, its environment, its working
directory, its stdin (a pipe for a gated node) and its stdout/stderr (the node's log) as fds 0-2, SIGINT
raising KeyboardInterrupt, and the interpreter's own exit: atexit handlers, non-daemon threads joined, an
uncaught exception's traceback, death by SIGINT after an uncaught KeyboardInterrupt. The server is
single-threaded (a fork copies only the forking thread) and reaps its children, sending each exit status to the
connection that asked for it: :class:`ForkedProcess` reads it back with the parts of ``subprocess.Popen`` the
harness uses. A request that fails (a client gone mid-request, a failed fork) is that request's alone: the
server says so on its own stderr (``ForkServer.stderr_path``, quoted in the harness's errors) and serves the
next. When the harness goes, the server SIGKILLs the nodes still running and exits.

A node's environment is its request's, set before its code runs; what the interpreter itself read at its start
(``PYTHONHASHSEED``, ``PYTHONPATH``) or a library at its import (``OMP_NUM_THREADS`` for torch) is the server's.
No test sets those for a node; one that must starts it with ``SRL_TEST_FORKSERVER=0``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

NODE_MODULE = "srl.cli"
"""what a node runs as ``__main__`` (``python -m srl.cli``)"""

PRELOAD = (NODE_MODULE, "srl.algorithms.dqn", "srl.algorithms.ppo", "srl.algorithms.impala", "srl.algorithms.r2d2",
           "srl.algorithms.sac", "srl.runner.distribution.queues.rabbitmq", "srl.runner.distribution.queues.mqtt",
           "srl.runner.distribution.queues.pubsub", "srl.runner.distribution.queues.redis_stream",
           "gymnasium.envs.classic_control")
"""what the server imports before it forks: what most nodes import (a module a node imports that is not here it
imports itself, as any Python would)"""

REAP_INTERVAL_S = 0.02
REQUEST_TIMEOUT_S = 10.0
"""how long the server waits for a request's bytes before it gives that request up (and serves the next)"""
SPAWN_TIMEOUT_S = 60.0
"""how long a spawn waits for the server to take its request and answer with the node's pid"""


def enabled() -> bool:
    return os.environ.get("SRL_TEST_FORKSERVER", "1") != "0"


# ------------------------------------------------------------------------------------------- the server
def _serve(path: str) -> dict[str, Any] | None:
    """Serve fork requests on the unix socket ``path`` until the parent closes our stdin. Returns (in a forked
    child only) the request the child is to run; the server itself returns None when it is done, its nodes
    SIGKILLed (a node still running when its harness is gone is a leak: it would load the machine's next run)."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional queue library not installed: the nodes that need it say so
            pass
    if threading.active_count() != 1:  # a fork copies only the forking thread: another one's locks stay held
        raise RuntimeError(f"an import started a thread ({threading.enumerate()}): forks of this process are "
                           "unsafe; run the tests with SRL_TEST_FORKSERVER=0")
    # what the imports made lives as long as any node: out of the collector's sight, a fork shares its pages
    # (a collection writes to every object it visits) and a node's exit skips a second of collecting them
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    server = os.getpid()
    children: dict[int, socket.socket] = {}
    try:
        return _serve_requests(listener, children)
    finally:
        if os.getpid() == server:
            for pid in children:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            for pid in children:  # reaped here: not zombies left to an init that may not reap
                with contextlib.suppress(OSError):
                    os.waitpid(pid, 0)


def _serve_requests(listener: socket.socket, children: dict[int, socket.socket]) -> dict[str, Any] | None:
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    while True:
        for key, _ in selector.select(REAP_INTERVAL_S):
            if key.data == "parent":
                if not sys.stdin.readline():  # the harness is gone: so is the server (its nodes are the harness's)
                    listener.close()
                    return None
                continue
            conn, _ = listener.accept()
            with conn:
                try:  # one request's failure is that request's (its client sees the connection close), not the server's
                    conn.settimeout(REQUEST_TIMEOUT_S)
                    request, fds = _receive(conn)
                    conn.settimeout(None)
                except (OSError, ValueError) as error:
                    _say(f"a request refused: {error!r}")
                    continue
                try:
                    pid = os.fork()
                except OSError as error:
                    _say(f"fork failed: {error!r}")
                    for fd in fds:
                        os.close(fd)
                    continue
                if pid == 0:
                    try:
                        selector.close()
                        listener.close()
                        for other in children.values():
                            other.close()
                        for target, fd in enumerate(fds):
                            os.dup2(fd, target)
                            os.close(fd)
                    except BaseException:
                        os._exit(70)  # EX_SOFTWARE: never the server's loop in a child
                    return request
                for fd in fds:
                    os.close(fd)
                children[pid] = conn.dup()  # before the pid is sent: a client gone at once still has its node reaped
                with contextlib.suppress(OSError):
                    conn.sendall(f"{pid}\n".encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _say(message: str) -> None:
    sys.stderr.write(f"fork server: {message}\n")
    sys.stderr.flush()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    try:
        while not message.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            message += more
        if len(fds) != 3:
            raise ValueError(f"a request carries stdin, stdout and stderr: {len(fds)} fds came")
        return json.loads(message), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _run_child(request: dict[str, Any]) -> None:
    """Become the node: the request's environment, directory and argv, then its code as ``__main__``."""
    import runpy

    import numpy as np

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    np.random.seed()  # a fresh interpreter's global generators differ; forks of one would not (random reseeds itself)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["code"] is not None:
        sys.argv = ["-c", *request["argv"]]
        sys.path[0] = ""
        exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
    else:
        module = NODE_MODULE
        sys.argv = ["", *request["argv"]]
        sys.path[0] = request["cwd"]
        # ``python -m`` runs the module's code as __main__ with no ``srl.cli`` imported: the one PRELOAD imported
        # is forgotten (a later ``import srl.cli`` imports it again, as it would there)
        sys.modules.pop(module, None)
        package, _, name = module.rpartition(".")
        if package and hasattr(sys.modules.get(package), name):
            delattr(sys.modules[package], name)
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    request = _serve(sys.argv[1])
    if request is not None:
        _run_child(request)  # returns or raises as the node's own main would: the interpreter exits as it would


# ------------------------------------------------------------------------------------------- the client
class ForkedProcess:
    """A node forked by the server: what of ``subprocess.Popen`` the harness uses (pid, poll, wait, returncode,
    send_signal, kill, stdin)."""

    def __init__(self, server: ForkServer, conn: socket.socket, pid: int, stdin: Any, received: bytes) -> None:
        """``received``: what the server sent after the pid (the exit status, where the node was over at once)"""
        self._conn = conn
        self._server = server
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None
        self._buffer = received

    def _read_status(self, timeout: float | None) -> None:
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buffer:
                chunk = self._conn.recv(64)
                if not chunk:  # the server went away before the node did (and SIGKILLed it): no status to know
                    raise RuntimeError(f"the fork server exited before node {self.pid}" + self._server.stderr_tail())
                self._buffer += chunk
        except (TimeoutError, BlockingIOError):
            return
        self.returncode = int(self._buffer.split(b"\n", 1)[0])
        self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"srl node {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            # reaped by the server, its status not read yet: gone, as Popen takes a pid it reaped in the same gap
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The server process of this harness (one per process that starts nodes; started on first use)."""

    _lock = threading.Lock()
    _instance: ForkServer | None = None

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="srl-forkserver-")
        self.path = str(Path(self._dir) / "s")
        self.stderr_path = Path(self._dir) / "stderr.log"  # its own: not whichever test's output pytest captures
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen([sys.executable, "-c", "import tests.forkserver as f; f.main()", self.path],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                         cwd=Path(__file__).resolve().parents[1])
        assert self.proc.stdout is not None
        if self.proc.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the test harness's fork server did not start (exit {self.proc.wait()})"
                               + self.stderr_tail())
        atexit.register(self.close)

    def stderr_tail(self) -> str:
        """The end of the server's stderr, for an error that the server's state explains ("" when it said nothing)."""
        try:
            said = self.stderr_path.read_text(errors="replace")[-3000:].strip()
        except OSError:
            return ""
        return f"; its stderr ({self.stderr_path}) ends:\n{said}" if said else ""

    @classmethod
    def get(cls) -> ForkServer:
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = ForkServer()
            return cls._instance

    def spawn(self, argv: list[str], env: dict[str, str], log: Any, gated_code: str | None = None) -> ForkedProcess:
        """Fork a node running ``python -m srl.cli argv`` (or ``python -c gated_code argv``) with ``env``, its
        output to the open file ``log``; a gated node's stdin is a pipe (``ForkedProcess.stdin``)."""
        stdin_read, stdin_write = os.pipe() if gated_code is not None else (os.open(os.devnull, os.O_RDONLY), -1)
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "code": gated_code}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                conn.settimeout(SPAWN_TIMEOUT_S)
                conn.connect(self.path)
                socket.send_fds(conn, [json.dumps(request).encode() + b"\n"],
                                [stdin_read, log.fileno(), log.fileno()])
            finally:
                os.close(stdin_read)
            received = b""
            while b"\n" not in received:
                chunk = conn.recv(64)
                if not chunk:
                    raise RuntimeError("the test harness's fork server closed the connection before it forked"
                                       + self.stderr_tail())
                received += chunk
        except BaseException:  # nothing of a node that never was stays open (a gate's write end would hold it)
            conn.close()
            if stdin_write >= 0:
                os.close(stdin_write)
            raise
        pid, rest = received.split(b"\n", 1)
        stdin = open(stdin_write, "wb", buffering=0) if stdin_write >= 0 else None
        return ForkedProcess(self, conn, int(pid), stdin, rest)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
