"""Elastic actors (``train_distribution(elastic_actors=True)``): ``actor_num`` is a maximum. Actors that
arrive mid-run take the next free slot; ones that leave are not waited for; free slots are not reported
missing. Sync PPO is where it shows: an update waits for the segments of every actor it waits for."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

import srl
from srl.algorithms import ppo
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import Board, TaskState
from tests.nodes import ClientThread, Node, board_for, start, tiny_config, wait_for
from tests.partitions import train_count

pytestmark = pytest.mark.slow

NEVER_S = 600.0
"""sync_wait_s: an update that waited for a missing actor would wait this long (the test ends long before)"""


def _slot_of(board: Board, node: Node, actor_num: int) -> int | None:
    return next((i for i in range(actor_num) if str(node.proc.pid) in (board.lease_holder(f"actor:{i}")[0] or "")),
                None)


def test_sync_ppo_with_elastic_actors_trains_with_those_there_and_never_waits_for_one_that_left(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="srl.client")
    board = board_for(redis_url, namespace)
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    first = start(nodes, "actor", redis_url, namespace, tmp_path)
    config = ppo.Config(envs_per_actor=2, segment_length=32, sync_wait_s=NEVER_S, seed=0)
    client = ClientThread(srl.Runner("CartPole-v1", config), RedisParameters(url=redis_url, task_name=namespace),
                          actor_num=3, max_train_count=10**9, elastic_actors=True, progress_interval=0.5)
    client.start()
    # one actor of up to three: updates go on with its segments alone
    wait_for(lambda: train_count(board) >= 3, 120, "updates with one actor of three")
    assert _slot_of(board, first, 3) == 0
    second = start(nodes, "actor", redis_url, namespace, tmp_path)
    wait_for(lambda: _slot_of(board, second, 3) == 1, 60, "the actor that came to take the next free slot")
    joined_at = train_count(board)
    wait_for(lambda: (s := board.get_all_stats().get("actor:1")) is not None and s.get("sent_batches", 0) > 0
             and train_count(board) >= joined_at + 3, 120, "updates with the segments of both actors")
    second.stop()  # it leaves (and lets its slot go): the next updates do not wait for it
    wait_for(lambda: board.lease_holder("actor:1")[0] is None, 30, "the slot to be free")
    left_at = train_count(board)
    wait_for(lambda: train_count(board) >= left_at + 3, 120, "updates after an actor left")
    assert board.end_task("END", "the elastic test is over")
    client.join(120)
    assert not client.is_alive() and client.error is None, client.error
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    progress = [r.getMessage() for r in caplog.records]
    assert any("free (elastic: 1 of up to 3 actors)" in line for line in progress), progress[-20:]
    missing_slots = [line for line in progress if re.search(r"actor \d+: MISSING", line)]
    assert missing_slots == []  # a free slot is not missing (no actor at all is, before the first came)


def test_elastic_actors_must_be_a_bool_on_the_client_and_in_the_task() -> None:
    from srl.runner.distribution.settings.task import TaskConfigError, build_task

    runner = srl.Runner("CartPole-v1", ppo.Config())
    with pytest.raises(TypeError, match="elastic_actors must be True or False"):
        runner.train_distribution(RedisParameters(host="localhost"), max_train_count=1,
                                  elastic_actors="yes")  # type: ignore[arg-type]
    import json

    task = {**runner.task_config(), "actor_num": 2, "elastic_actors": "yes"}
    with pytest.raises(TaskConfigError, match="'elastic_actors' must be true or false"):
        build_task(json.dumps(task))


def test_replay_with_a_warmup_and_elastic_actors_trains_with_any_number_of_actors_there(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """DQN (a warmup, then a replay ratio) with up to 16 actors: one actor there fills the warmup alone, a
    second that comes later paces with it, and the one left after the first leaves goes on alone. Each
    actor's allowance is its share among the actors there (not among the 16 slots), and starts over from
    where it stands when they change, so what those that left did not send is made up by those still there."""
    board = board_for(redis_url, namespace)
    # a trainer that trains no further ahead of the rows than the replay ratio says: no slack of its own
    start(nodes, "trainer", redis_url, namespace, tmp_path, "--train-ahead", "1")
    first = start(nodes, "actor", redis_url, namespace, tmp_path)
    client = ClientThread(srl.Runner("CartPole-v1", tiny_config()), RedisParameters(url=redis_url, task_name=namespace),
                          actor_num=16, max_train_count=10**9, elastic_actors=True)
    client.start()
    # one actor of up to sixteen: the warmup (200 rows) is its alone, then the replay ratio's env steps
    # (far enough that a share of it taken back when the second comes would be more than the slack)
    wait_for(lambda: train_count(board) >= 600, 240, "train steps with one actor of sixteen")
    second = start(nodes, "actor", redis_url, namespace, tmp_path)
    wait_for(lambda: _slot_of(board, second, 16) == 1, 60, "the actor that came to take the next free slot")
    wait_for(lambda: (s := board.get_all_stats().get("actor:1")) is not None and s.get("sent_batches", 0) > 0,
             120, "rows from the actor that came")
    joined_at = train_count(board)
    wait_for(lambda: train_count(board) >= joined_at + 1000, 240, "train steps with both actors")
    first.stop()  # it leaves (and lets its slot go): the one still there goes on alone
    wait_for(lambda: board.lease_holder("actor:0")[0] is None, 30, "the slot to be free")
    left_at = train_count(board)
    wait_for(lambda: train_count(board) >= left_at + 1000, 240, "train steps after an actor left")
    assert board.end_task("END", "the elastic test is over")
    client.join(120)
    assert not client.is_alive() and client.error is None, client.error
