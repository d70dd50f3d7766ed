"""A whole distributed run over each queue backend: Redis holds only the board."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import srl
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import TaskState
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.trainer.run import TrainerOptions
from tests.nodes import ClientThread, Node, board_for, kill_all, lease_holder_pid, tiny_config, wait_for
from tests.test_queues import Broker, broker  # noqa: F401 - the parametrized broker fixture

pytestmark = pytest.mark.slow


def test_distributed_run_ends_with_an_evaluation(broker: Broker, redis_url: str, namespace: str) -> None:  # noqa: F811
    # what an earlier task of this name left on the broker (its trainer gone): the new task starts without it
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    with open_queue(broker.url, namespace=namespace, role="consumer", redis_params=redis_params):
        pass  # the queue, subscription or persistent session exists, as after a run
    with open_queue(broker.url, namespace=namespace, role="producer", redis_params=redis_params) as leftover:
        leftover.put_many([b"left over by an earlier task"] * 3)
    runner = srl.Runner("Pendulum-v1", tiny_config(reward_scale=None))
    runner.train_distribution(
        RedisParameters(url=redis_url, task_name=namespace), broker.url, actor_num=2, max_train_count=300,
        progress_interval=None, local_processes=True, actor_options={"batch_size": 64, "batch_max_age": 0.2},
    )
    board = board_for(redis_url, namespace)
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    counters = board.get_counters()
    assert counters["received_transitions"] >= tiny_config().warmup_size
    assert counters.get("bad_messages", 0) == 0
    assert board.get_task_config()["rl_config"]["reward_scale"] == 10**-0.5  # settled by the client for every node
    assert runner.train_count == 300
    assert len(runner.evaluate(max_episodes=2)) == 2
    board.delete_task()


def test_a_node_with_another_queue_than_the_task_refuses(redis_url: str, namespace: str) -> None:
    from srl.runner.distribution.settings.task import TaskConfigError, build_task, check_queue_matches

    board = board_for(redis_url, namespace)
    config = srl.Runner("Pendulum-v1", tiny_config()).task_config()
    board.create_task({**config, "max_train_count": 5,
                       "queue": {"scheme": "amqp", "describe": "amqp://127.0.0.1:5672/ queue srl.x", "capacity": 8}})
    task = build_task(board.get_task_config_raw()[0])
    with pytest.raises(TaskConfigError, match=r"amqp://127.0.0.1:5672/.*queue_params=None"):
        check_queue_matches(task, None, "actor")
    check_queue_matches(task, "amqp://guest:guest@127.0.0.1:5672/", "actor")
    board.delete_task()


def drain(queue_params: Any, redis_params: RedisParameters) -> int:
    """Read and ack what a task's queue still holds, then remove the queue: how many messages were left."""
    left = 0
    with open_queue(queue_params, namespace=redis_params.task_name, role="consumer",
                    redis_params=redis_params) as queue:
        while messages := queue.get_many(64, timeout=2.0):
            left += len(messages)
            queue.ack_many(messages)
        queue.destroy()
    return left


def test_broker_refusals_are_resent_not_dropped(redis_url: str, namespace: str) -> None:
    """RabbitMQ's own capacity (x-max-length 2, reject-publish) far below the task's queue capacity:
    the trainer is paused, so the actor is refused; it waits and resends, and the run ends."""
    from srl.runner.distribution import RabbitMQParameters
    from tests.test_queues import _rabbitmq

    queue = RabbitMQParameters(url=_rabbitmq().url, capacity=2)
    runner = srl.Runner("Pendulum-v1", tiny_config(env_steps_per_train=None))
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    client = ClientThread(runner, redis_params, queue_params=queue,
                          actor_num=1, max_train_count=300, local_processes=True, queue_capacity=50,
                          actor_options={"batch_size": 4, "batch_max_age": 0.05})
    client.start()
    board = board_for(redis_url, namespace)
    wait_for(lambda: (s := board.get_status()) and s.params_version >= 1, 60, "the trainer's first params")
    trainer = lease_holder_pid(board, "trainer")
    assert trainer is not None
    os.kill(trainer, signal.SIGSTOP)  # the actor outpaces it for certain
    try:
        wait_for(lambda: board.get_counters().get("refused_messages", 0) > 0, 60, "RabbitMQ to refuse the actor")
    finally:
        os.kill(trainer, signal.SIGCONT)
    client.join(120)
    assert client.error is None, client.error
    queued = drain(queue, redis_params)  # what the run ended before reading is still on the broker
    counters = board.get_counters()
    assert counters.get("bad_messages", 0) == 0
    assert counters["received_batches"] > 0 and counters["backpressure_wait_s"] > 0
    # every batch counted as sent was received or is still queued: one the broker refused, even after the run
    # stopped (RabbitMQ confirms over a window), is not counted as sent; a copy delivered again (a resend whose
    # first copy landed, a read given back by a trainer whose lease lapsed) is a duplicate, never counted as sent
    assert counters["sent_batches"] == counters["received_batches"] + queued
    events = " ".join(e.text for e in board.get_events(50))
    assert "stopped: task END" in events
    board.delete_task()


def test_stalled_trainer_backpressure_blocks_and_loses_nothing(
    broker: Broker, redis_url: str, namespace: str, tmp_path: Path  # noqa: F811
) -> None:
    """The trainer is paused: actors fill the queue to its capacity, then wait (and say so) instead of
    sending more; once it resumes the task ends and every batch sent was received or is still queued."""
    capacity, actor_num = 6, 2
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    client = ClientThread(srl.Runner("Pendulum-v1", tiny_config(env_steps_per_train=None)), redis_params,
                          queue_params=broker.url, actor_num=actor_num, max_train_count=1500, queue_capacity=capacity)
    client.start()
    board = board_for(redis_url, namespace)
    queue_args = ("--queue-url", broker.url)
    nodes = [Node("trainer", redis_url, namespace, tmp_path, "--run-once", *queue_args)]
    try:
        wait_for(lambda: lease_holder_pid(board, "trainer") == nodes[0].proc.pid, 30, "the trainer")
        wait_for(lambda: (s := board.get_status()) and s.params_version >= 1, 30, "its first params")
        nodes[0].signal(signal.SIGSTOP)
        # --send-ahead 0: each actor sends its own batches, so the bound below is exact. With a sending thread
        # (the default) an actor may keep what two puts' round trips carry in transit beyond the capacity
        # (Sender.in_transit): 0 on an idle loopback, but a Pub/Sub emulator slowed by a loaded machine
        # measured 1 and the queue held 9 of a bound of 8
        nodes += [Node("actor", redis_url, namespace, tmp_path, "--run-once", "--send-ahead", "0", *queue_args)
                  for _ in range(actor_num)]

        def in_flight() -> float:
            counters = board.get_counters()
            return counters.get("sent_batches", 0) - counters.get("received_batches", 0)

        wait_for(lambda: in_flight() >= capacity, 60, "the queue to fill")
        wait_for(lambda: sum(float(s.get("stalled_now_s", 0)) > 0 for r, s in board.get_all_stats().items()
                             if r.startswith("actor")) == actor_num, 20, "both actors to report they wait")
        samples = []
        for _ in range(15):  # the actors wait: what is in flight does not grow past the bound
            samples.append(in_flight())
            time.sleep(0.1)
        # RabbitMQ counts what it already pushed to the (paused) trainer as not queued: the trainer keeps
        # that window to three reads (TrainerOptions.prefetch = 3 x ingest_max_messages)
        pushed_ahead = TrainerOptions().prefetch if broker.name == "amqp" else 0
        assert max(samples) <= capacity + actor_num + pushed_ahead
        nodes[0].signal(signal.SIGCONT)
        client.join(120)
        assert client.error is None, client.error
        for node in nodes:
            assert node.proc.wait(timeout=30) == 0, node.output()
    finally:
        kill_all(nodes)
    pending = drain(broker.url, redis_params)
    counters = board.get_counters()
    # the trainer was stopped past its lease: the reads it held went back to the queue and came again to it once it
    # took its lease back (duplicates, of batches counted once)
    assert counters["sent_batches"] == counters["received_batches"] + pending
    assert counters.get("bad_messages", 0) == 0
    board.delete_task()
