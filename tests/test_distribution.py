"""The Ape-X loop across real processes on a real Redis: snippets, faults, backpressure, bad input."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis

import srl
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import TaskState
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.wire.codec import BatchHeader, Codec
from tests.nodes import (
    ClientThread,
    Node,
    board_for,
    kill_all,
    lease_holder_pid,
    sigkill,
    start,
    tiny_config,
    wait_for,
)

pytestmark = pytest.mark.slow




# --------------------------------------------------------------------------- the user's three snippets
SNIPPET_ACTOR = """
from srl.runner.distribution import RedisParameters, actor_run_forever
actor_run_forever(RedisParameters(url={url!r}, task_name={ns!r}), None, run_once=True)
"""
SNIPPET_TRAINER = """
from srl.runner.distribution import RedisParameters, trainer_run_forever
trainer_run_forever(RedisParameters(url={url!r}, task_name={ns!r}), None, run_once=True)
"""
SNIPPET_CLIENT = """
import srl
from srl.algorithms import dqn
from srl.runner.distribution import RedisParameters
rl_config = dqn.Config(warmup_size=200)
rl_config.hidden_block.set_mlp((64, 64))
rl_config.memory.set_proportional_memory()
rl_config.memory.capacity = 5000
runner = srl.Runner("Pendulum-v1", rl_config)
runner.train_distribution(RedisParameters(url={url!r}, task_name={ns!r}), actor_num=1, max_train_count=600,
                          progress_interval=0.2)  # a run of ~1 s: lines while the actor holds its slot
print("EVALUATION", runner.evaluate(max_episodes=2))
"""


def test_every_node_and_its_options_come_from_the_package() -> None:
    """The package exports each node's entry point and its options, as the user's snippets import them:
    the inference server's as the actor's and the trainer's (a lazy import: torch and grpc only when used)."""
    import srl.runner.distribution as distribution
    from srl.runner.distribution.inference.run import inference_run_forever
    from srl.runner.distribution.settings.options import InferenceOptions

    assert distribution.inference_run_forever is inference_run_forever
    assert distribution.InferenceOptions is InferenceOptions
    assert {"actor_run_forever", "trainer_run_forever", "inference_run_forever", "ActorOptions", "TrainerOptions",
            "InferenceOptions"} <= set(distribution.__all__)
    for name in distribution.__all__:
        assert getattr(distribution, name) is not None, name


def test_three_snippets_as_separate_processes(redis_url: str, namespace: str, tmp_path: Path) -> None:
    procs = []
    try:
        for name, code in (("actor", SNIPPET_ACTOR), ("trainer", SNIPPET_TRAINER), ("client", SNIPPET_CLIENT)):
            log = open(tmp_path / f"{name}.log", "wb")
            procs.append((name, subprocess.Popen([sys.executable, "-c", code.format(url=redis_url, ns=namespace)],
                                                 stdout=log, stderr=subprocess.STDOUT), log))
        for name, proc, _ in procs:
            assert proc.wait(timeout=180) == 0, (tmp_path / f"{name}.log").read_text()
    finally:
        for _, proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    client_out = (tmp_path / "client.log").read_text()
    assert "EVALUATION [" in client_out
    assert "max_train_count 600 reached" in client_out
    assert "actor 0 actor-" in client_out  # progress lines name the slot holder
    # the end-of-run summary: totals, then each node by id with what it did, as it reported when it
    # stopped (the client waits for the nodes' final counts: these nodes are not its own processes)
    assert re.search(r"run END after \S+ \(max_train_count 600 reached\): train 6\d\d \(\d+/s\), env steps [1-9]",
                     client_out), client_out
    assert re.search(r"trainer trainer-\S+ \(epoch 1, cpu\): params v\d+", client_out), client_out
    assert re.search(r"actor 0 actor-\S+: [1-9]\d* env steps, \d+ episodes", client_out), client_out


# --------------------------------------------------------------------------- faults
def test_sigkilled_actor_is_replaced_by_a_standby_within_ttl(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=400_000)
    client.start()
    board = board_for(redis_url, namespace)
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    first = start(nodes, "actor", redis_url, namespace, tmp_path)
    wait_for(lambda: lease_holder_pid(board, "actor:0") == first.proc.pid, 30, "the first actor to hold slot 0")
    standby = start(nodes, "actor", redis_url, namespace, tmp_path)
    wait_for(lambda: "standing by" in standby.output(), 30, "the second actor to stand by")
    sigkill(first.proc.pid)
    killed_at = time.monotonic()
    wait_for(lambda: lease_holder_pid(board, "actor:0") == standby.proc.pid, 2 + 1 + 1, "the standby to take slot 0")
    assert time.monotonic() - killed_at <= 2 + 1 + 0.5  # lease TTL (2 s) + 1 s
    board.end_task(TaskState.END, "test over")
    client.join(30)


def test_an_actor_restarted_under_its_fixed_uid_is_a_new_sender(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """An actor process restarted with the same ``--uid`` (a pod named by its StatefulSet, a unit file) numbers
    its batches from seq 0 again: its batches must not be taken for the first process's, already received."""
    runner = srl.Runner("CartPole-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=10**9)
    client.start()
    board = board_for(redis_url, namespace)
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    first = start(nodes, "actor", redis_url, namespace, tmp_path, "--uid", "actor-fixed")
    wait_for(lambda: board.get_counters().get("received_batches", 0) >= 20, 120, "batches from the first actor")
    first.stop()  # its final report says how many batches it sent: the trainer receives them all
    sent = wait_for(lambda: (s := board.get_all_stats().get("actor:0")) is not None and s["sent_batches"], 30,
                    "the first actor's final report")
    wait_for(lambda: board.get_counters().get("received_batches", 0) >= sent, 60, "the first actor's batches")
    start(nodes, "actor", redis_url, namespace, tmp_path, "--uid", "actor-fixed")
    counters = wait_for(lambda: c if ((c := board.get_counters()).get("duplicates", 0) > 0
                                      or c.get("received_batches", 0) >= sent + 20) else None, 120,
                        "batches from the restarted actor, received or taken as duplicates")
    assert counters.get("duplicates", 0) == 0, counters
    board.end_task(TaskState.END, "test over")
    client.join(30)


def test_sigkilled_trainer_is_replaced_and_train_count_goes_on(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=2500)
    client.start()
    board = board_for(redis_url, namespace)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    first = start(nodes, "trainer", redis_url, namespace, tmp_path)
    standby = start(nodes, "trainer", redis_url, namespace, tmp_path)
    wait_for(lambda: lease_holder_pid(board, "trainer") in (first.proc.pid, standby.proc.pid), 30, "a trainer")
    holder_pid = lease_holder_pid(board, "trainer")
    holder, other = (first, standby) if holder_pid == first.proc.pid else (standby, first)
    status = wait_for(lambda: (s := board.get_status()) and s.train_count >= 300 and s, 90, "300 published steps")
    sigkill(holder.proc.pid)
    before = status.train_count
    wait_for(lambda: lease_holder_pid(board, "trainer") == other.proc.pid, 10, "the standby trainer to take over")
    restored = wait_for(lambda: "train_count continues from" in other.output() and other.output(), 30, "restore")
    assert "epoch 2" in restored
    client.join(120)
    assert client.error is None, client.error
    final = board.get_status()
    assert final is not None and final.status == TaskState.END
    assert final.train_count >= 2500 and final.train_count >= before
    assert final.params_epoch == 2
    assert runner.train_count == final.train_count


def test_paused_trainer_cannot_overwrite_params_after_takeover(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=400_000)
    client.start()
    board = board_for(redis_url, namespace)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    zombie = start(nodes, "trainer", redis_url, namespace, tmp_path)
    wait_for(lambda: (s := board.get_status()) and s.params_version > 0, 90, "first params")
    zombie.signal(signal.SIGSTOP)
    successor = start(nodes, "trainer", redis_url, namespace, tmp_path)
    wait_for(lambda: lease_holder_pid(board, "trainer") == successor.proc.pid, 30, "the successor to take over")
    wait_for(lambda: (s := board.get_status()) and s.params_epoch == 2, 60, "params of epoch 2")
    zombie.signal(signal.SIGCONT)
    out = wait_for(lambda: "stopped: fenced off" in (o := zombie.output()) and o, 20,
                   "the resumed trainer to notice it is fenced off")
    assert "(epoch 1, " in out  # it gave up its run at epoch 1
    status = board.get_status()
    assert status is not None
    successor_uid = status.trainer_uid
    assert f"trainer {successor_uid} (epoch 2)" in out  # and says who took over
    # its renewal was refused (it stopped on that): a params write under its identity is refused the same way,
    # and nothing it wrote before it stopped landed
    events = " ".join(e.text for e in board.get_events(200))
    zombie_uid = re.search(r"trainer (trainer-\S+) \(epoch 1\) fenced off", events)
    assert zombie_uid is not None, events
    assert not board.bound(status.task_id).publish_params(zombie_uid[1], 1, status.params_version + 1, b"x", 1)
    after = board.get_status()
    assert after is not None and after.params_epoch == 2 and after.params_version >= status.params_version
    board.end_task(TaskState.END, "test over")
    client.join(30)


def test_garbage_forged_and_oversized_messages_are_counted_and_skipped(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    secret = "s3cret"
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=800,
                          secret=secret)
    client.start()
    board = board_for(redis_url, namespace)
    env = {"SRL_SECRET": secret}
    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path, env=env)
    wait_for(lambda: lease_holder_pid(board, "trainer") == trainer.proc.pid, 30, "the trainer")
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    header = BatchHeader("intruder", 0, 0, 0, 0, 4, time.time())
    columns = {"obs": np.zeros((4, 3), np.float32), "action": np.zeros(4, np.int64),
               "reward": np.zeros(4, np.float32), "next_obs": np.zeros((4, 3), np.float32),
               "discount": np.zeros(4, np.float32)}
    forged = Codec(secret="not-the-secret", task=namespace).encode_batch(header, columns, None)
    big = {k: np.zeros((20_000, *v.shape[1:]), v.dtype) for k, v in columns.items()}
    oversized = Codec(secret=secret, task=namespace).encode_batch(  # over the rows a message may carry
        BatchHeader("big", 0, 0, 0, 0, 20_000, time.time()), big, None)
    with open_queue(None, namespace=namespace, role="producer", redis_params=redis_params) as queue:
        queue.put_many([b"\x00garbage" * 10, b"cos\nsystem\n(S'echo pwned'\ntR.", forged, oversized])
    wait_for(lambda: board.get_counters().get("bad_messages", 0) >= 4, 30, "4 bad messages to be counted")
    out = trainer.output()
    assert "skipped a bad message from redis stream" in out
    assert trainer.alive()
    start(nodes, "actor", redis_url, namespace, tmp_path, env=env)
    client.join(120)
    assert client.error is None, client.error
    assert board.get_counters()["bad_messages"] == 4
    status = board.get_status()
    assert status is not None and status.status == TaskState.END


def test_unknown_algorithm_fails_the_task_with_a_reason(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    board = board_for(redis_url, namespace)
    config = srl.Runner("Pendulum-v1", tiny_config()).task_config()
    config["algorithm"] = "dqnn"
    board.create_task({**config, "max_train_count": 10})
    board.set_active()
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    status = wait_for(lambda: (s := board.get_status()) and s.status == TaskState.FAILED and s, 30, "FAILED")
    assert "no algorithm named 'dqnn'" in status.end_reason and "Did you mean 'dqn'" in status.end_reason

    from srl.runner.distribution.client.train import TaskFailedError

    runner = srl.Runner("Pendulum-v1", tiny_config())
    object.__setattr__(runner.rl_config, "algorithm", "dqnn")  # what a client of another srl would write
    ns2 = namespace + "-b"
    start(nodes, "trainer", redis_url, ns2, tmp_path)
    with pytest.raises(TaskFailedError, match="no algorithm named 'dqnn'"):
        runner.train_distribution(RedisParameters(url=redis_url, task_name=ns2), max_train_count=10,
                                  progress_interval=None)


def test_redis_restart_mid_run_the_run_continues(tmp_path: Path, nodes: list[Node]) -> None:
    from tests.queue_fixtures import PrivateRedis

    server = PrivateRedis(persistent=True)
    server.start()
    try:
        url, ns = server.url, "restart"
        runner = srl.Runner("Pendulum-v1", tiny_config())
        client = ClientThread(runner, RedisParameters(url=url, task_name=ns), max_train_count=1500)
        client.start()
        board = board_for(url, ns)
        start(nodes, "trainer", url, ns, tmp_path)
        start(nodes, "actor", url, ns, tmp_path)
        wait_for(lambda: (s := board.get_status()) and s.train_count >= 200, 90, "training to be under way")
        server.restart()
        client.join(150)
        assert client.error is None, client.error
        status = board.get_status()
        assert status is not None and status.status == TaskState.END and status.train_count >= 1500
    finally:
        kill_all(nodes)
        server.cleanup()


@pytest.mark.parametrize("refusal", ["OOM", "READONLY", "BUSY"])
def test_redis_refusing_for_a_while_mid_run_the_run_continues(
    refusal: str, tmp_path: Path, nodes: list[Node], caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis that refuses for a while (full, a replica after a failover, a slow script) is waited out like
    an outage by the nodes and the client, which name it; the run goes on once it answers again."""
    from tests.queue_fixtures import PrivateRedis, redis_refusing

    server = PrivateRedis()
    server.start()
    try:
        url, ns = server.url, "refusing"
        runner = srl.Runner("Pendulum-v1", tiny_config())
        client = ClientThread(runner, RedisParameters(url=url, task_name=ns), max_train_count=1500,
                              progress_interval=0.5)
        board = board_for(url, ns)
        with caplog.at_level("WARNING"):
            client.start()
            trainer = start(nodes, "trainer", url, ns, tmp_path)
            actor = start(nodes, "actor", url, ns, tmp_path)
            wait_for(lambda: not client.is_alive() or ((s := board.get_status()) and s.train_count >= 200), 120,
                     "training to be under way")
            admin = redis.Redis(port=server.port)

            def met_it() -> bool:
                """The client and a node said they met the refusal, or something ended (the defect this guards).
                Not always both nodes: with OOM a node that needs no standalone write meanwhile never meets it
                (its heartbeat script renews the lease with PEXPIRE first, and Redis lets a script that has
                written go on), e.g. a trainer waiting for rows the actor cannot send."""
                if not client.is_alive() or not trainer.alive() or not actor.alive():
                    return True
                with contextlib.suppress(redis.RedisError):
                    if (s := admin.hget(f"srl:{{{ns}}}:task", "status")) is not None and s != b"ACTIVE":
                        return True
                return refusal in caplog.text and (refusal in trainer.output() or refusal in actor.output())

            with redis_refusing(admin, refusal):
                wait_for(met_it, 120, f"the client and a node to meet {refusal}")
            client.join(240)
        assert not client.is_alive(), "the run did not end"
        assert client.error is None, f"the client crashed: {client.error!r}"
        status = board.get_status()
        assert status is not None and status.status == TaskState.END, status
        assert status.train_count >= 1500
        assert trainer.alive() and actor.alive(), "a node ended on a refusal"
        for output in (trainer.output(), actor.output(), caplog.text):
            assert "Traceback" not in output
        assert refusal in caplog.text and (refusal in trainer.output() or refusal in actor.output())
    finally:
        kill_all(nodes)
        server.cleanup()


def test_a_new_trainer_gets_a_warmup_of_rows_from_a_rate_limited_actor() -> None:
    """A trainer that takes over starts with an empty replay memory at its checkpoint's train_count: an
    actor at its rate limit must be allowed a warmup's share again, or each waits for the other."""
    from srl.algorithms import dqn
    from srl.runner.distribution.actor.pacing import Pacing

    config = dqn.Config(warmup_size=1000)  # the rate limit alone: no board, queue or env needed
    path = config.data_path()
    actor = Pacing(path, actor_num=2, max_steps=None, batch_rows=64, first_rows_steps=path.first_rows_steps(1))

    actor.note_head(1, 0)
    assert actor.allowed_steps(0) == 500 + 64  # its share of the warmup, and one batch of slack
    actor.note_head(1, 400)
    env_steps = 700  # at its limit: 500 + 400 / 2 + 64
    assert actor.allowed_steps(env_steps) == 764
    actor.note_head(1, 450)  # the trainer got further, then died; its checkpoint says 300
    actor.note_head(2, 300)
    assert actor.latest_train_count == 300
    assert actor.allowed_steps(env_steps) == 700 + 500 + 64  # a warmup's share again, from here
    actor.note_head(2, 500)
    assert actor.allowed_steps(env_steps) == 700 + 500 + 200 / 2 + 64
    actor.note_head(2, 400)  # an older head read late does not move the count back
    assert actor.latest_train_count == 500


def test_a_step_budget_ends_at_its_count(redis_url: str, namespace: str) -> None:
    """An actor holds once the run's env steps, as far as it can tell, reach ``max_steps``, and counts its last
    steps at once: one actor ends exactly at the budget (it stepped on until the trainer saw the count: 456)."""
    runner = srl.Runner("CartPole-v1", tiny_config())  # a rate-limited actor: one env step a train step
    beats = {"heartbeat_interval": 0.1}
    runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), actor_num=1, max_steps=400,
                              progress_interval=None, local_processes=True, actor_options=beats,
                              trainer_options=beats)
    board = board_for(redis_url, namespace)
    steps = board.get_counters()["env_steps"]
    assert steps == 400
    assert board.get_all_stats()["actor:0"]["env_steps"] == steps
    board.delete_task()


def test_a_step_budget_holds_actors_that_do_not_wait_for_the_trainer(redis_url: str, namespace: str) -> None:
    """Two actors flat out, heartbeats as by default: each supposes the other took as many steps as itself
    since the last count, and both count every 50 ms near the end, so the run stops within a few batches of
    the budget (up to about 1,500 steps past it under a loaded test suite on a fast machine, where the actors
    step fastest) instead of a heartbeat or two of both actors' steps after it (8,000 and more of 5,000): the
    bound, 7,000, sits between the two."""
    runner = srl.Runner("CartPole-v1", tiny_config(env_steps_per_train=None))
    runner.train_distribution(RedisParameters(url=redis_url, task_name=namespace), actor_num=2, max_steps=5000,
                              progress_interval=None, local_processes=True)
    board = board_for(redis_url, namespace)
    steps = board.get_counters()["env_steps"]
    assert 5000 <= steps <= 7000
    actors = [s["env_steps"] for role, s in board.get_all_stats().items() if role.startswith("actor")]
    assert sum(actors) == steps and min(actors) > 0
    board.delete_task()


def test_a_lone_actor_anneals_epsilon_over_the_tasks_plan(redis_url: str, namespace: str) -> None:
    """An actor stepping the task's one env plans its ε from the task's limits (a replaced actor takes it up
    where the params' version says the run is: tests/test_core.py)."""
    import json

    from srl.algorithms import dqn
    from srl.runner.distribution.actor.run import ActorRun
    from srl.runner.distribution.board.board import Board
    from srl.runner.distribution.settings.options import ActorOptions
    from srl.runner.distribution.settings.task import build_task

    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    board = Board(redis_params.connect(), namespace)
    runner = srl.Runner("CartPole-v1", dqn.Config(seed=0, envs_per_actor=1, epsilon_start=0.9, epsilon_decay=0.5))
    config_json = json.dumps({**runner.task_config(), "actor_num": 1, "max_train_count": 10_000,
                              "queue": {"scheme": "redis", "capacity": 100}})
    codec = Codec(task=namespace)
    status = board.create_task(config_json, signature=codec.config_signature(config_json))
    board = board.bound(status.task_id)
    actor = ActorRun(board, redis_params, None, build_task(config_json, codec.config_signature(config_json), codec),
                     0, ActorOptions(uid="actor-plan-test"))
    try:
        worker = actor.worker
        assert isinstance(worker, dqn.DQNWorker)
        worker.act(np.zeros((1, 4), np.float32))
        np.testing.assert_allclose(worker.epsilon, [0.9])  # the first of 0.5 x (1,000 + 10,000) env steps
        for _ in range(5_500):
            worker.act(np.zeros((1, 4), np.float32))
        np.testing.assert_allclose(worker.epsilon, [0.1])  # epsilon, reached at the half of the plan
    finally:
        if actor.rows is not None:
            actor.rows.close()
        actor.rollout.close()
        board.delete_task()
