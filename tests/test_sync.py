"""Sync distributed PPO across real processes: lockstep versions, stale segments, a dead actor."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import srl
from srl.algorithms import ppo
from srl.base.env import EnvConfig, env_spec
from srl.base.rollout import Rollout
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import Board, TaskState
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.settings.task import build_task
from srl.runner.distribution.trainer.run import TrainerOptions, TrainerRun
from srl.runner.distribution.wire.codec import BatchHeader, Codec
from tests.nodes import ClientThread, Node, board_for, lease_holder_pid, sigkill, start, wait_for

pytestmark = pytest.mark.slow




def segments_of(config: ppo.Config, version: int) -> dict[str, np.ndarray]:
    """Real CartPole segments, labelled with ``version``."""
    runner = srl.Runner("CartPole-v1", config)
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    with Rollout(EnvConfig("CartPole-v1"), worker, config.envs_per_actor, seed=0) as rollout:
        while worker.pending() == 0:
            rollout.step()
    rows = worker.take()
    assert rows is not None
    rows["version"][:] = version
    return rows


def test_a_sync_update_copies_encodes_and_signs_its_params_outside_the_gate_lock(
    redis_url: str, namespace: str
) -> None:
    """After a sync update the trainer moves the version under the gate's lock (no row of the old version slips
    in), but copies the weights off the device, encodes and signs them after letting go of it: the ingest
    thread, which takes that lock for each read, is not held back by a publication."""
    config = ppo.Config(seed=0, envs_per_actor=4)
    runner = srl.Runner("CartPole-v1", config)
    params = RedisParameters(url=redis_url, task_name=namespace)
    board = Board(params.connect(), namespace)
    board = board.bound(board.create_task(json.dumps({**runner.task_config(), "actor_num": 1})).task_id)
    options = TrainerOptions(uid="t", secret="")
    epoch = board.claim_trainer(options.uid, 60_000)
    assert epoch is not None
    run = TrainerRun(board, params, None, build_task(*board.get_task_config_raw()), epoch, options)
    try:
        run.gate.version = version = 1  # the first weights' version, as the run's start sets it
        run.buffer.add(segments_of(config, version))  # one segment per env of the one actor: an update's worth
        lock = run.gate.lock
        held_while: dict[str, bool] = {}
        to_arrays, encode_params = run.parameter.to_arrays, run.publisher.codec.encode_params

        def copy_off_the_device() -> dict[str, np.ndarray]:
            held_while["copying the weights"] = lock.locked()
            return to_arrays()

        def encode_and_sign(*args: Any, **kwargs: Any) -> bytes:
            held_while["encoding and signing them"] = lock.locked()
            return encode_params(*args, **kwargs)

        run.parameter.to_arrays = copy_off_the_device  # type: ignore[method-assign]
        run.publisher.codec.encode_params = encode_and_sign  # type: ignore[method-assign]
        assert run._update()
        assert run.publisher.requested[0] == version + 1 and run.gate.version == version + 1
        assert held_while == {"copying the weights": False, "encoding and signing them": False}
    finally:
        run.stop.set("test over")
        board.delete_task()


def test_sync_ppo_trains_in_lockstep_and_refuses_stale_segments(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    config = ppo.Config(seed=0, envs_per_actor=4)
    runner = srl.Runner("CartPole-v1", config)
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    client = ClientThread(runner, redis_params, actor_num=2, max_steps=40_000)
    client.start()
    board = board_for(redis_url, namespace)
    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path)
    for _ in range(2):
        start(nodes, "actor", redis_url, namespace, tmp_path)
    wait_for(lambda: (s := board.get_status()) and s.params_version >= 3, 90, "a few updates")
    current = board.get_status().params_version  # type: ignore[union-attr]
    codec = Codec(secret="", task=namespace)
    with open_queue(None, namespace=namespace, role="producer", redis_params=redis_params) as queue:
        for seq, version in enumerate((0, current - 2, current + 50)):  # too old, too old, from the future
            rows = segments_of(config, version)
            queue.put(codec.encode_batch(BatchHeader("injector", 0, 1, seq, version, 4, time.time()), rows, None))
    wait_for(lambda: board.get_counters().get("stale_rows", 0) >= 12, 30, "the 12 stale segments refused")
    client.join(180)
    assert client.error is None, client.error
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    counters = board.get_counters()
    # the 12 injected at least (rarely, under load, a real actor's late segment is refused too)
    assert counters["stale_rows"] >= 12 and counters.get("bad_messages", 0) == 0
    # lockstep: a version per update (after the first weights' version 1), each update on one segment per env
    # of both actors (2 x 4), K = 20 epochs of one minibatch per actor's segments (the preset's size), two an epoch
    updates = status.params_version - 1
    assert runner.train_count == 2 * 20 * updates
    # plus, at most, one round made with the version after the last update and one with the final
    # publication (an actor quick to pick it up sends it before it sees the task END)
    assert updates * 8 <= counters["received_transitions"] <= (updates + 2) * 8
    stats = board.get_all_stats()
    for slot in range(2):  # lockstep: each actor waited for new params after its segments, and says so
        assert float(stats[f"actor:{slot}"]["sync_wait_s"]) > 0, stats[f"actor:{slot}"]
    assert trainer.alive() or trainer.proc.returncode == 0
    assert np.mean(runner.evaluate(max_episodes=5)) >= 150


def test_a_sigkilled_actor_mid_segment_does_not_stall_the_run(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    config = ppo.Config(seed=0, envs_per_actor=2, sync_wait_s=2.0)
    runner = srl.Runner("CartPole-v1", config)
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), actor_num=2,
                          max_steps=12_000, progress_interval=1.0)
    client.start()
    board = board_for(redis_url, namespace)
    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    wait_for(lambda: (s := board.get_status()) and s.params_version >= 3, 90, "a few updates")
    victim_pid = lease_holder_pid(board, "actor:1")
    assert victim_pid is not None
    import os

    os.kill(victim_pid, signal.SIGKILL)
    waiting = wait_for(lambda: board.get_all_stats().get("trainer", {}).get("waiting_for") == "1" or None, 30,
                       "the trainer to say it waits for slot 1")
    assert waiting
    version = board.get_status().params_version  # type: ignore[union-attr]
    wait_for(lambda: (s := board.get_status()) and s.params_version >= version + 3, 60,
             "updates to go on without the dead actor")
    assert "going on with 2 of 4 segments" in trainer.output() and "slot(s) [1]" in trainer.output()
    standby = start(nodes, "actor", redis_url, namespace, tmp_path)  # takes the freed slot
    wait_for(lambda: lease_holder_pid(board, "actor:1") == standby.proc.pid, 30, "the standby to take slot 1")
    client.join(180)
    assert client.error is None, client.error
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    assert board.get_counters().get("bad_messages", 0) == 0


def test_a_sigkilled_trainer_after_taking_a_versions_segments_does_not_stall_the_run(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """The trainer is SIGKILLed once it has counted (and acked) every segment of the version on the board, while
    it trains on them, before it publishes the next: those segments are gone with it. The standby that takes
    the lease publishes a version newer than every actor's segments, so each acts again, and the run ends."""
    config = ppo.Config(seed=0, envs_per_actor=4, epochs=1000)  # an update of seconds: the kill lands inside it
    runner = srl.Runner("CartPole-v1", config)
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), actor_num=2,
                          max_train_count=4 * 1000)
    client.start()
    board = board_for(redis_url, namespace)
    first = start(nodes, "trainer", redis_url, namespace, tmp_path)
    wait_for(lambda: lease_holder_pid(board, "trainer") == first.proc.pid, 60, "the first trainer's lease")
    standby = start(nodes, "trainer", redis_url, namespace, tmp_path)
    wait_for(lambda: "standing by" in standby.output(), 60, "the second trainer to stand by")
    for _ in range(2):
        start(nodes, "actor", redis_url, namespace, tmp_path)
    wait_for(lambda: (s := board.get_status()) and s.params_version >= 2, 120, "an update")

    def segments_taken() -> int | None:
        """The version on the board once every actor's segments of it are counted (2 actors x 4 envs), while
        the trainer trains on them."""
        before = board.get_status()
        received = board.get_counters().get("received_transitions", 0)
        after = board.get_status()
        if before is None or after is None or before.params_version != after.params_version:
            return None
        return after.params_version if received >= 8 * after.params_version else None

    version = wait_for(segments_taken, 120, "a version's segments all taken")
    sigkill(first.proc.pid)
    wait_for(lambda: lease_holder_pid(board, "trainer") == standby.proc.pid, 30, "the standby to take the lease")
    client.join(240)
    assert not client.is_alive(), (
        f"the run did not end after the trainer was killed holding version {version}'s segments: "
        f"status {board.get_status()}, trainer stats {board.get_all_stats().get('trainer')}")
    assert client.error is None, client.error
    status = board.get_status()
    assert status is not None and status.status == TaskState.END and status.params_epoch == 2
    assert status.params_version > version + 1  # the standby moved every actor on, and trained on
    assert board.get_counters().get("bad_messages", 0) == 0


@pytest.mark.parametrize("algorithm", ["appo", "impala"])
def test_asynchronous_trainers_refuse_segments_beyond_max_policy_lag_and_report_the_lag(
    algorithm: str, redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """Segments more than ``max_policy_lag`` versions old (or from a version not yet published) are refused
    and counted, and the lag the trainer reports stays within the bound (IMPALA's bound is off by
    default: V-trace corrects; here it is set)."""
    from srl.algorithms import impala

    if algorithm == "appo":
        config: ppo.Config | impala.Config = ppo.Config(seed=0, envs_per_actor=4, sync=False, max_policy_lag=20)
    else:
        config = impala.Config(seed=0, envs_per_actor=4, max_policy_lag=20)
    runner = srl.Runner("CartPole-v1", config)
    redis_params = RedisParameters(url=redis_url, task_name=namespace)
    client = ClientThread(runner, redis_params, actor_num=1, timeout=120)
    client.start()
    board = board_for(redis_url, namespace)
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    wait_for(lambda: (s := board.get_status()) and s.params_version >= 26, 90, "26 versions")
    current = board.get_status().params_version  # type: ignore[union-attr]
    codec = Codec(secret="", task=namespace)
    with open_queue(None, namespace=namespace, role="producer", redis_params=redis_params) as queue:
        for seq, version in enumerate((current - 25, current + 50)):  # beyond the bound, from the future
            rows = segments_of(config, version)  # type: ignore[arg-type]
            queue.put(codec.encode_batch(BatchHeader("injector", 0, 1, seq, version, 4, time.time()), rows, None))
    wait_for(lambda: board.get_counters().get("stale_rows", 0) >= 8, 30, "the 8 stale segments refused")
    wait_for(lambda: "lag_p95" in board.get_all_stats().get("trainer", {}), 60, "the trainer's lag stats")
    trainer_stats = board.get_all_stats()["trainer"]
    assert 0 <= trainer_stats["lag_p95"] <= 20 and trainer_stats["lag_max"] <= 20
    board.end_task("END", "test over")
    client.join(60)
    assert client.error is None, client.error
    assert board.get_counters()["stale_rows"] >= 8  # (a real actor's segments may age past the bound too)


def test_an_asynchronous_actor_makes_no_more_than_its_lead_of_versions_ahead_of_the_learner() -> None:
    """Asynchronous segments are paced on the lag budget: an actor makes at most its share of ``lead_versions``
    versions' segments (half ``max_policy_lag``) beyond what the learner consumed, and starts over with a new
    trainer; sync PPO and IMPALA without a lag bound are not paced (V-trace corrects what ages)."""
    from srl.algorithms import impala
    from srl.runner.distribution.actor.pacing import Pacing

    path = ppo.Config(sync=False, max_policy_lag=10, envs_per_actor=8).data_path()
    assert path.lead_versions == 5
    pacing = Pacing(path, actor_num=2, max_steps=None, batch_rows=8, first_rows_steps=0, envs_per_actor=8)
    assert pacing.paced and pacing.version_segments == 16  # an update: one segment per env of both actors
    pacing.note_head(1, 0, 1)
    assert pacing.allowed_segments(0) == 5 * 16 / 2  # five of its rollouts of 8 segments, before any update
    pacing.note_head(1, 96, 4)  # three updates later
    assert pacing.allowed_segments(40) == 8 * 16 / 2
    pacing.note_head(2, 96, 4)  # a new trainer: counted from here
    assert pacing.allowed_segments(64) == 64 + 5 * 16 / 2
    pacing.saw_actors(("a", None))  # elastic: one of two there, it makes the whole update
    pacing.saw_actors(("a", "b"))
    assert pacing.allowed_segments(70) == 70 + 5 * 16 / 2

    # a central actor's segments are the server's: one per segment_length steps of each of its envs
    central = Pacing(ppo.Config(sync=False, segment_length=32, envs_per_actor=8).data_path(), 2, None, 8, 0, 8)
    assert central.served_segments(8 * (3 * 32 + 5), 8) == 3 * 8
    # a segment length left to the preset is known once the config is resolved for the env, as nodes resolve it
    cartpole = env_spec(EnvConfig("CartPole-v1"))
    assert Pacing(impala.Config().data_path(), 2, None, 8, 0, 8).served_segments(800, 8) is None
    impala_path = impala.Config().resolved(cartpole).data_path()
    assert Pacing(impala_path, 2, None, 8, 0, 8).served_segments(800, 8) == 8 * 6
    assert impala_path.segment_length == 16
    appo = ppo.Config(sync=False, envs_per_actor=8).resolved(cartpole).data_path()
    assert Pacing(appo, 2, None, 8, 0, 8).served_segments(8 * (2 * 32 + 5), 8) == 2 * 8  # the Discrete preset's 32

    assert not Pacing(ppo.Config().data_path(), 2, None, 8, 0, 8).paced
    assert impala.Config().data_path().lead_versions is None
    bounded = impala.Config(max_policy_lag=4, batch_segments=8, publish_every=4).data_path()
    assert bounded.lead_versions == 2 and bounded.segments_per_version(2, 8) == 32  # 4 train steps of 8


def test_a_learner_bound_asynchronous_run_refuses_no_row_as_stale(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """A learner much slower than its actor (100 epochs an update): without pacing the queue and the trainer's
    buffer fill with segments that age past ``max_policy_lag`` and are refused; paced on the lag budget, the
    actor waits instead (rate-limited), and every row it made is trained on within the bound."""
    from srl.runner.distribution.node.stats import Reports

    config = ppo.Config(seed=0, envs_per_actor=4, segment_length=32, epochs=100, sync=False, max_policy_lag=6)
    board, actor = _one_actor_to_the_end(config, 1, 12_000, redis_url, namespace, tmp_path, nodes)
    counters = board.get_counters()
    reports = Reports.read(board)
    assert reports.trainer is not None and reports.trainer.lag_max is not None
    assert counters.get("stale_rows", 0) == 0, (counters, reports.trainer, actor.output()[-3000:])
    assert reports.trainer.lag_max <= 6
    assert reports.actors[0].rate_limited_s > 0, reports.actors[0]  # it waited for the learner


def test_an_asynchronous_run_with_an_actor_slot_left_empty_still_reaches_its_budget(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """Asynchronous PPO's update takes the segments of whoever is there: one actor of two slots (the other
    never started) makes every update's segments. Paced on its lead, it counts the actors there, not the
    slots, or it would make its half-share of a few versions and wait for ever for a learner waiting for it."""
    config = ppo.Config(seed=0, envs_per_actor=4, segment_length=32, sync=False)
    board, _ = _one_actor_to_the_end(config, 2, 8_000, redis_url, namespace, tmp_path, nodes)
    status = board.get_status()
    assert status is not None and status.params_version > 8, status


def _one_actor_to_the_end(config: ppo.Config, actor_num: int, max_steps: int, redis_url: str, namespace: str,
                          tmp_path: Path, nodes: list[Node]) -> tuple[Board, Node]:
    """A trainer and one actor process run ``config`` on CartPole for ``max_steps`` (``actor_num`` slots);
    check the run ended END; the board and the actor's node."""
    client = ClientThread(srl.Runner("CartPole-v1", config), RedisParameters(url=redis_url, task_name=namespace),
                          actor_num=actor_num, max_steps=max_steps)
    client.start()
    board = board_for(redis_url, namespace)
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    actor = start(nodes, "actor", redis_url, namespace, tmp_path)
    client.join(240)
    assert not client.is_alive(), f"the run did not end: {board.get_status()}, {board.get_all_stats()}"
    assert client.error is None, client.error
    status = board.get_status()
    assert status is not None and status.status == TaskState.END, status
    return board, actor
