"""The user-facing ends: the all-local run on an embedded Redis, Ctrl-C, and the srl command."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import srl
from srl.algorithms import dqn
from srl.cli import build_parser, field_docs, main
from srl.runner.distribution import ActorOptions, RedisParameters
from srl.runner.distribution.board.board import DeadLetter, TaskExistsError, TaskState
from tests.nodes import (
    ClientThread,
    Node,
    board_for,
    kill_all,
    lease_holder_pid,
    tiny_config,
    wait_for,
)


@pytest.mark.slow
def test_all_local_run_on_an_embedded_redis() -> None:
    runner = srl.Runner("Pendulum-v1", tiny_config())
    runner.train_distribution(RedisParameters(), actor_num=2, max_train_count=300, progress_interval=None,
                              actor_options={"batch_size": 64, "batch_max_age": 0.2})
    assert runner.train_count == 300
    rewards = runner.evaluate(max_episodes=2)
    assert len(rewards) == 2 and all(np.isfinite(rewards))
    # the final params carry the greedy average: it lags the online net, it was not rebuilt from it
    parameter = runner.parameter
    assert isinstance(parameter, dqn.DQNParameter) and parameter.q_average is not None
    online = torch.cat([p.flatten() for p in parameter.q.parameters()])
    average = torch.cat([p.flatten() for p in parameter.q_average.parameters()])
    assert not torch.allclose(online, average)


CLIENT_SCRIPT = """
import srl
from srl.runner.distribution import RedisParameters
from tests.nodes import tiny_config
runner = srl.Runner("Pendulum-v1", tiny_config())
runner.train_distribution(RedisParameters(url={url!r}, task_name={ns!r}), max_train_count=10**9,
                          progress_interval=0.5)
"""


@pytest.mark.slow
def test_ctrl_c_on_the_client_ends_the_task_as_cancelled(redis_url: str, namespace: str, tmp_path: Path) -> None:
    log = tmp_path / "client.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT.format(url=redis_url, ns=namespace)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
        try:
            board = board_for(redis_url, namespace)
            wait_for(lambda: (s := board.get_status()) and s.status == TaskState.ACTIVE, 60, "the task")
            wait_for(lambda: "MISSING" in log.read_text(), 30, "progress saying what the client waits for")
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    status = board.get_status()
    assert status is not None and status.status == TaskState.END and status.end_reason == "cancelled"
    assert "start one: srl trainer" in log.read_text()


LOCAL_CLIENT_SCRIPT = """
import srl
from srl.runner.distribution import RedisParameters
from tests.nodes import tiny_config
runner = srl.Runner("Pendulum-v1", tiny_config())
runner.train_distribution(RedisParameters(url={url!r}, task_name={ns!r}), max_train_count=10**9,
                          local_processes=True, progress_interval=0.5)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waits for its reaper; it no longer runs
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_local_nodes_stop_when_their_client_is_killed(redis_url: str, namespace: str, tmp_path: Path) -> None:
    log = tmp_path / "client.log"
    board = board_for(redis_url, namespace)
    pids: list[int] = []
    with open(log, "wb") as out:
        # as a shell's background job starts it: SIGINT ignored, which the local nodes inherit (set by the
        # script itself: a preexec_fn would fork this process's gRPC, see conftest.py)
        script = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n" + LOCAL_CLIENT_SCRIPT
        proc = subprocess.Popen([sys.executable, "-c", script.format(url=redis_url, ns=namespace)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
        try:
            started = wait_for(lambda: re.search(r"local actor\(s\) \(pids \[([\d, ]+)\]\)", log.read_text()), 60,
                               "the client to start its local nodes")
            pids = [int(p) for p in started.group(1).split(",")]
            wait_for(lambda: (st := board.get_status()) is not None and st.train_count > 0, 60, "training to start")
            proc.kill()  # no finally, no atexit: only the kernel knows
            proc.wait(timeout=10)
            wait_for(lambda: not any(_alive(p) for p in pids), 30, "the local trainer and actor to stop")
            assert log.read_text().count("the client that started this local node is gone: stopping") == len(pids)
        finally:
            if proc.poll() is None:
                proc.kill()
            for pid in pids:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
    board.delete_task()


@pytest.mark.slow
def test_ctrl_c_on_an_actor_releases_its_slot_at_once(redis_url: str, namespace: str, tmp_path: Path) -> None:
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=10**9)
    client.start()
    board = board_for(redis_url, namespace)
    actor = Node("actor", redis_url, namespace, tmp_path, "--lease-ttl", "30")
    try:
        wait_for(lambda: lease_holder_pid(board, "actor:0") == actor.proc.pid, 60, "the actor to hold slot 0")
        actor.signal(signal.SIGINT)
        assert actor.proc.wait(timeout=15) == 0
        holder, _ = board.lease_holder("actor:0")
        assert holder is None  # released, not left to expire after 30 s
    finally:
        kill_all([actor])
        board.end_task(TaskState.END, "test over")
        client.join(30)


def test_client_refuses_to_clobber_an_active_task(redis_url: str, namespace: str) -> None:
    board = board_for(redis_url, namespace)
    board.create_task({**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "max_train_count": 5})
    board.set_active()
    runner = srl.Runner("Pendulum-v1", tiny_config())
    with pytest.raises(TaskExistsError, match="overwrite=True"):
        runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), max_train_count=5,
                                  progress_interval=None)
    board.delete_task()


def test_cli_options_come_from_the_dataclasses() -> None:
    parser = build_parser()
    actor_help = parser._subparsers._group_actions[0].choices["actor"].format_help()  # type: ignore[union-attr]
    docs = field_docs(ActorOptions)
    assert docs["batch_size"] in " ".join(actor_help.split()) and "--batch-max-age" in actor_help
    assert "--task-name" in actor_help and "--queue-url" in actor_help
    args = parser.parse_args(["actor", "--host", "h", "--batch-size", "7", "--no-compress"])
    assert args.batch_size == 7 and args.compress is False and args.host == "h"


def test_srl_status_shows_the_task_and_missing_nodes(
    redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    board = board_for(redis_url, namespace)
    board.create_task({**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "actor_num": 2,
                       "max_train_count": 5})
    board.set_active()
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    assert main(["status", "--host", host, "--port", port, "--task-name", namespace]) == 0
    out = capsys.readouterr().out
    assert "task ACTIVE" in out and "trainer: MISSING" in out and "actor 1: MISSING" in out
    assert "refused messages" not in out
    board.add_dead_letters([DeadLetter(time.time(), "redis stream x id 1-0", "bad signature", 601)])
    assert main(["status", "--host", host, "--port", port, "--task-name", namespace]) == 0
    out = capsys.readouterr().out
    assert "refused messages" in out and "601 bytes from redis stream x id 1-0: bad signature" in out
    assert main(["stop", "--host", host, "--port", port, "--task-name", namespace]) == 0
    status = board.get_status()
    assert status is not None and status.end_reason == "cancelled"
    board.delete_task()
    assert main(["status", "--host", host, "--port", port, "--task-name", namespace]) == 1


def test_a_task_whose_env_a_node_cannot_build_fails_with_the_reason(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    board = board_for(redis_url, namespace)
    config = srl.Runner("Pendulum-v1", tiny_config()).task_config()
    config["env"] = {"id": "Pendulm-v1", "kwargs": {}}  # as written by a client that skipped the check
    board.create_task({**config, "max_train_count": 5})
    board.set_active()
    trainer = Node("trainer", redis_url, namespace, tmp_path, "--run-once")
    try:
        assert trainer.proc.wait(timeout=60) == 0
    finally:
        kill_all([trainer])
    status = board.get_status()
    assert status is not None and status.status == TaskState.FAILED
    assert "Pendulm-v1" in status.end_reason and "Did you mean 'Pendulum-v1'" in status.end_reason
    holder, _ = board.lease_holder("trainer")
    assert holder is None


def test_the_client_checks_the_env_before_submitting(redis_url: str, namespace: str) -> None:
    from srl.base.env import EnvError

    runner = srl.Runner("Pendulm-v1", tiny_config())
    with pytest.raises(EnvError, match="Did you mean 'Pendulum-v1'"):
        runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), max_train_count=5)
    assert board_for(redis_url, namespace).get_status() is None


def test_deleting_a_task_removes_its_redis_queue_too(redis_url: str, namespace: str) -> None:
    from srl.runner.distribution.queues import open_queue
    from srl.runner.distribution.queues.redis_stream import stream_key_for

    board = board_for(redis_url, namespace)
    board.create_task({**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "max_train_count": 5})
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    with open_queue(None, namespace=namespace, role="producer", redis_params=redis_params) as queue:
        queue.put(b"one batch")
    assert board.client.exists(stream_key_for(namespace))
    board.delete_task()
    assert not board.client.exists(stream_key_for(namespace))
    assert not list(board.client.scan_iter(match=f"*{namespace}*"))


def test_events_tell_who_did_what(redis_url: str, namespace: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=200)
    client.start()
    nodes = [Node("trainer", redis_url, namespace, tmp_path, "--run-once"),
             Node("actor", redis_url, namespace, tmp_path, "--run-once")]
    try:
        client.join(120)
        assert client.error is None, client.error
        for node in nodes:
            node.proc.wait(timeout=30)
    finally:
        kill_all(nodes)
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    assert main(["status", "--host", host, "--port", port, "--task-name", namespace, "--events", "20"]) == 0
    out = capsys.readouterr().out
    assert "task END" in out and "max_train_count 200 reached" in out
    for text in ("task submitted", "took lease trainer", "took lease actor:0", "trainer trainer-", "stopped: task END"):
        assert text in out, text


def test_the_client_ends_a_timed_task_that_no_trainer_serves(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from srl.runner.distribution.client import train as client_module

    monkeypatch.setattr(client_module, "TIMEOUT_GRACE_S", 0.5)
    runner = srl.Runner("Pendulum-v1", tiny_config())
    runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), timeout=0.5,
                              progress_interval=None)
    status = board_for(redis_url, namespace).get_status()
    assert status is not None and status.status == TaskState.END and "no trainer ended it" in status.end_reason


@pytest.mark.parametrize("argv, expected", [
    (["actor", "--lease-ttl", "0"], "--lease-ttl must be"),
    (["trainer", "--train-ahead", "0.5"], "--train-ahead must be a number >= 1"),
    (["inference", "--listen", "bad"], "--listen must be host:port"),
    (["inference", "--tls-cert-file", "cert.pem"], "--tls-cert-file and --tls-key-file go together"),
])
def test_a_node_option_no_node_can_run_with_is_one_line_and_exit_2(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([argv[0], "--host", "127.0.0.1", *argv[1:]]) == 2  # before anything connects or waits
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
