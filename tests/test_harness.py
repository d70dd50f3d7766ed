"""The test harness's fork server (tests/forkserver.py): a node forked from it must behave as the fresh
``python -m srl.cli`` / ``python -c`` it stands in for, or every test that starts a node tests something else."""

from __future__ import annotations

import os
import signal
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
    assert first[1].splitlines()[1] != second[1].splitlines()[1]  # forks of one process, not one seed


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
