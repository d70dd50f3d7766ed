"""Test harness: real actor/trainer processes (the ``srl`` CLI) and a client thread.

Processes are started with ``python -m srl.cli`` so the command line a user
types is what the tests run. Waiting is done by polling observable state (the
board, a process's exit) with a deadline, never by a blind sleep.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import srl
from srl.algorithms import dqn
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import Board
from tests import forkserver

FAST_NODE = ["--lease-ttl", "2", "--heartbeat-interval", "0.3", "--task-poll-interval", "0.2"]
FAST_ACTOR = [*FAST_NODE, "--batch-size", "64", "--batch-max-age", "0.2", "--params-poll-interval", "0.2"]
FAST_TRAINER = [*FAST_NODE]


def tiny_config(**changes: Any) -> dqn.Config:
    config = dqn.Config(batch_size=32, warmup_size=200, seed=0, target_update_interval=100)
    config.hidden_block.set_mlp((32, 32))
    config.memory.set_proportional_memory(capacity=5000)
    for k, v in changes.items():
        setattr(config, k, v)
    return config


WAIT_FLOOR_S = 120.0
"""the least any wait_for waits before it fails: a budget bounds a failing test, it never asks for speed,
and a loaded 2-core machine (processes importing torch, other suites running) takes a minute where an idle
one takes a second. A passing wait returns as soon as its condition holds, whatever the budget."""


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout`` (at least
    ``WAIT_FLOOR_S``)."""
    timeout = max(timeout, WAIT_FLOOR_S)
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


GATED_NODE = ("import sys, srl.cli\n"
              "if sys.stdin.readline().strip() != 'go':\n"
              "    sys.exit(0)\n"
              "sys.exit(srl.cli.main(sys.argv[1:]))")
"""a node that has imported srl and waits for ``go`` on its stdin before it runs (``Node(gated=True)``); its
stdin closed without it, it exits"""


class Node:
    """One ``srl actor`` / ``srl trainer`` process with its output in a log file."""

    def __init__(self, role: str, redis_url: str, task_name: str, log_dir: Path, *extra: str,
                 env: dict[str, str] | None = None, gated: bool = False) -> None:
        """``gated``: the process imports srl (and torch) and waits for :meth:`open_gate` before it runs the
        node: a node that arrives mid-run, at a moment of the caller's choosing, without the seconds its
        imports take."""
        self.role = role
        self.log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
        args = FAST_ACTOR if role == "actor" else FAST_TRAINER
        node_args = [role, "--url", redis_url, "--task-name", task_name, *args, *extra]
        self._log = open(self.log_path, "wb")
        node_env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | forkserver.ForkedProcess
        if forkserver.enabled():  # python -m srl.cli without its imports' seconds (tests/forkserver.py)
            self.proc = forkserver.ForkServer.get().spawn(node_args, node_env, self._log, GATED_NODE if gated else None)
        else:
            cmd = ([sys.executable, "-c", GATED_NODE, *node_args] if gated
                   else [sys.executable, "-m", forkserver.NODE_MODULE, *node_args])
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.PIPE if gated else None, env=node_env)  # SIGINT: conftest.py

    def open_gate(self) -> None:
        """Let a ``gated`` node run (it waits for a line on its stdin)."""
        assert self.proc.stdin is not None, "open_gate is for a node started with gated=True"
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.close()

    @property
    def uid_prefix(self) -> str:
        return f"{self.role}-"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.begin_stop()
        self.finish_stop()

    def begin_stop(self) -> None:
        """Ask the node to exit as Ctrl-C would (a gate never opened: closed, and the node exits)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        elif self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGINT)

    def finish_stop(self) -> None:
        """Wait for the node :meth:`begin_stop` asked to exit; SIGKILL it after 10 s."""
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class ClientThread(threading.Thread):
    """``runner.train_distribution`` in a thread; ``error`` holds what it raised."""

    def __init__(self, runner: srl.Runner, redis_params: RedisParameters, **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.runner = runner
        self.redis_params = redis_params
        self.kwargs = {"progress_interval": None, **kwargs}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.runner.train_distribution(self.redis_params, **self.kwargs)
        except BaseException as e:
            self.error = e


def start(nodes: list[Node], role: str, redis_url: str, ns: str, tmp_path: Path, *extra: str,
          env: dict[str, str] | None = None) -> Node:
    """Start an ``srl`` node and add it to ``nodes`` (the ``nodes`` fixture stops them all)."""
    node = Node(role, redis_url, ns, tmp_path, *extra, env=env)
    nodes.append(node)
    return node


def board_for(redis_url: str, task_name: str) -> Board:
    return Board(RedisParameters(url=redis_url, task_name=task_name).connect(), task_name)


def short_distributed_run(runner: srl.Runner, redis_url: str, namespace: str, train_count: int,
                          queue_params: Any = None) -> None:
    """Train ``runner`` with 2 local actors for ``train_count`` train steps; check the task ended with no bad
    message, rows received and an evaluation; delete the task."""
    from srl.runner.distribution.board.board import TaskState

    runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), queue_params, actor_num=2,
                              max_train_count=train_count, progress_interval=None, local_processes=True,
                              actor_options={"batch_size": 64, "batch_max_age": 0.2})
    board = board_for(redis_url, namespace)
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    counters = board.get_counters()
    assert counters.get("bad_messages", 0) == 0 and counters["received_transitions"] > 0
    assert runner.train_count >= train_count
    assert len(runner.evaluate(max_episodes=2)) == 2
    board.delete_task()


def uid_pid(uid: str) -> int:
    """The pid encoded in a node's uid (role-host-pid-suffix)."""
    return int(uid.split("-")[-2])


def lease_holder_pid(board: Board, name: str) -> int | None:
    """The pid encoded in a lease holder's uid."""
    holder, _ = board.lease_holder(name)
    return None if holder is None else uid_pid(holder)


def kill_all(nodes: list[Node]) -> None:
    """Stop every node: all asked at once, then each waited for (their exits overlap)."""
    for node in nodes:
        node.begin_stop()
    for node in nodes:
        node.finish_stop()


def thread_nices(pid: int) -> dict[int, int]:
    """Each thread's nice in a process (/proc, field 19 of stat), by thread id (the main thread's is the pid)."""
    nices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/stat") as f:
            nices[int(tid)] = int(f.read().rpartition(")")[2].split()[16])
    return nices


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
