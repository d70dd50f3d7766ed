"""The test harness's fork server (tests/forkserver.py): a node forked from it must behave as the fresh
``python -m srl.cli`` / ``python -c`` it stands in for, or every test that starts a node tests something else."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from tests import forkserver
from tests.nodes import Node


@pytest.fixture()
def server() -> forkserver.ForkServer:
    return forkserver.ForkServer.get()


def run(server: forkserver.ForkServer, tmp_path: Path, code: str, *argv: str,
        env: dict[str, str] | None = None) -> tuple[int, str]:
    log_path = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.log"
    with open(log_path, "wb") as log:
        proc = server.spawn(list(argv), {**os.environ, **(env or {})}, log, code)
        assert proc.stdin is not None
        proc.stdin.close()
        code_ = proc.wait(60)
    return code_, log_path.read_text()


def test_a_forked_child_has_its_own_argv_environment_directory_and_random_numbers(
        server: forkserver.ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = ("import os, sys, random, numpy\n"
            "print(sys.argv[1:], os.environ.get('SRL_HARNESS_X'), os.getcwd())\n"
            "print(random.random(), numpy.random.random())\n")
    first = run(server, tmp_path, code, "a", "--b", env={"SRL_HARNESS_X": "one"})
    second = run(server, tmp_path, code, "a", "--b", env={"SRL_HARNESS_X": "one"})
    assert first[0] == second[0] == 0
    assert first[1].splitlines()[0] == f"['a', '--b'] one {tmp_path}"
    python_random, numpy_random = zip(*(out.splitlines()[1].split() for _, out in (first, second)), strict=True)
    assert python_random[0] != python_random[1]  # forks of one process, not one seed: Python's own generator
    assert numpy_random[0] != numpy_random[1]  # and numpy's global one, which a fork alone would share


def test_a_forked_child_holds_only_its_own_stdin_stdout_and_stderr(server: forkserver.ForkServer,
                                                                   tmp_path: Path) -> None:
    """No socket or pipe of the server (nor another node's) stays open in a node: a reader of one would never
    see its end, and a node would hold the server's listener."""
    status, out = run(server, tmp_path, "import os\nprint(*sorted(int(fd) for fd in os.listdir('/proc/self/fd')))")
    assert status == 0
    assert out.split() in (["0", "1", "2"], ["0", "1", "2", "3"])  # 3: listdir's own handle on /proc/self/fd


def test_a_signalled_child_reports_the_signal_as_popen_does(server: forkserver.ForkServer, tmp_path: Path) -> None:
    with open(tmp_path / "out.log", "wb") as log:
        proc = server.spawn([], dict(os.environ), log, "import sys, time\nsys.stdin.read()\ntime.sleep(60)")
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
        proc.send_signal(signal.SIGTERM)  # over: nothing to signal, and no error (as Popen)
        proc.kill()
        assert proc.stdin is not None
        proc.stdin.close()


def test_a_broken_request_is_refused_and_the_server_serves_the_next(server: forkserver.ForkServer,
                                                                    tmp_path: Path) -> None:
    for junk in (b"", b"not json\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server.path)
            conn.sendall(junk)
            conn.shutdown(socket.SHUT_WR)
            assert conn.recv(64) == b""  # refused: closed without a pid
    assert run(server, tmp_path, "print('served')") == (0, "served\n")
    assert "a request refused" in server.stderr_path.read_text()


def test_the_server_takes_its_nodes_with_it_when_the_harness_goes(tmp_path: Path) -> None:
    own = forkserver.ForkServer()  # not the suite's: this one is closed here
    with open(tmp_path / "out.log", "wb") as log:
        left = own.spawn([], dict(os.environ), log, "import sys, time\nsys.stdin.close()\ntime.sleep(600)")
    assert left.stdin is not None
    left.stdin.close()  # the gate's write end: the node has closed its read end and sleeps on
    own.close()
    assert own.proc.returncode == 0
    with pytest.raises(RuntimeError, match="exited before node"):
        left.wait(30)
    with pytest.raises(ProcessLookupError):  # SIGKILLed and reaped by the server as it went
        os.kill(left.pid, 0)


def test_a_forked_child_exits_as_the_interpreter_would(server: forkserver.ForkServer, tmp_path: Path) -> None:
    status, out = run(server, tmp_path, "import sys\nsys.exit(3)")
    assert status == 3 and out == ""
    status, out = run(server, tmp_path, "raise ValueError('boom')")
    assert status == 1 and "Traceback" in out and "ValueError: boom" in out
    status, out = run(server, tmp_path, ("import atexit, threading, time\n"
                                         "atexit.register(lambda: print('atexit ran', flush=True))\n"
                                         "def late(): time.sleep(0.3); print('thread done')\n"
                                         "threading.Thread(target=late).start()"))
    assert status == 0 and out.splitlines() == ["thread done", "atexit ran"]  # joined, then atexit
    status, out = run(server, tmp_path, "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)")
    assert status == -signal.SIGINT and "KeyboardInterrupt" in out  # Python's own exit on an uncaught Ctrl-C


def test_a_forked_node_runs_the_cli_as_python_m_would_and_answers_signals(tmp_path: Path) -> None:
    if not forkserver.enabled():
        pytest.skip("SRL_TEST_FORKSERVER=0: nodes are fresh interpreters")
    bad = Node("actor", "redis://127.0.0.1:6379/0", "harness", tmp_path, "--no-such-option")
    assert bad.proc.wait(60) == 2
    assert bad.output().startswith("usage: srl ") and "unrecognized arguments: --no-such-option" in bad.output()
    bad.stop()
    gated = Node("actor", "redis://127.0.0.1:1/0", "harness", tmp_path, gated=True)  # no Redis there: it waits
    assert gated.alive()  # for its gate
    gated.open_gate()
    gated.signal(signal.SIGKILL)
    assert gated.proc.wait(30) == -signal.SIGKILL
    gated.stop()
    never_opened = Node("actor", "redis://127.0.0.1:1/0", "harness", tmp_path, gated=True)
    never_opened.stop()
    assert never_opened.proc.returncode == 0
