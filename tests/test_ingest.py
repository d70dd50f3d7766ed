"""The trainer's ingest: which batches it has seen (in bounded memory), one read of many batches, the
received counts actors read, and the lease kept while a run starts."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

import srl
from srl.base.env import EnvConfig
from srl.base.rollout import Rollout
from srl.rl.memories.segments import SegmentBuffer
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.node.serve import CounterDeltas
from srl.runner.distribution.queues import ExperienceQueue, Message, open_queue
from srl.runner.distribution.sending.in_flight import InFlight
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import build_task
from srl.runner.distribution.trainer.counter import StoppedWhileWaiting
from srl.runner.distribution.trainer.ingest import SeenBatches
from srl.runner.distribution.trainer.run import TrainerOptions, TrainerRun
from srl.runner.distribution.trainer.versions import PolicyLag, VersionGate
from srl.runner.distribution.wire.codec import BatchHeader
from tests.conftest import broker_unavailable, port_open
from tests.nodes import board_for, tiny_config, wait_for


def test_the_version_gate_takes_what_each_data_path_accepts_and_knows_who_delivered() -> None:
    """The gate alone: sync takes only the current version, ``max_policy_lag`` bounds the age, otherwise any
    version already published; sync waits for every actor's segments, or goes on after ``sync_wait_s``."""
    from srl.base.rl import DataPath

    versions = np.array([3, 5, 6, 7, 8])
    for path, kept in [(DataPath("segments", sync=True), [False, False, False, True, False]),
                       (DataPath("segments", max_policy_lag=2), [False, True, True, True, False]),
                       (DataPath("transitions"), [True, True, True, True, False])]:
        gate = VersionGate(path)
        gate.version = 7
        assert gate.keep(versions).tolist() == kept  # type: ignore[union-attr]
        assert gate.keep(versions[:1] * 0 + 7) is None  # all of them
    sync = VersionGate(DataPath("segments", sync=True, sync_wait_s=3600.0, min_segments=1))
    assert not sync.sync_ready(0, 4, slots=[0, 1]) and sync.waiting_for == []
    assert sync.missing([0, 1]) == 2
    sync.arrived([(1, 8), (0, 0)])  # slot 0 sent no row of this version
    assert not sync.sync_ready(2, 4, slots=[0, 1]) and sync.waiting_for == [0]
    assert sync.missing([0, 1]) == 1
    sync.arrived([(0, 8)])
    assert sync.sync_ready(4, 4, slots=[0, 1]) and sync.waiting_for == []
    assert sync.missing([0, 1]) == 2  # all in: a read now waits for the next version's, from both
    sync.published(8, 100)  # a new version: who delivered counts anew
    assert not sync.sync_ready(1, 4, slots=[0, 1]) and sync.waiting_for == [0, 1]


def test_replays_are_refused_within_and_beyond_the_window() -> None:
    seen = SeenBatches(window=4096)
    for seq in range(4098):
        assert seen.is_new("a", seq)
        seen.mark("a", seq)
    assert not seen.is_new("a", 4097)  # the newest, again
    assert not seen.is_new("a", 5)  # a recent one, again
    assert not seen.is_new("a", 0)  # 4,097 batches later: at or below the window, a replay
    assert seen.is_new("a", 5000)  # ahead: new
    assert seen.is_new("b", 0)  # another actor has its own numbering


def test_a_late_batch_within_the_window_is_accepted_once() -> None:
    seen = SeenBatches(window=64)
    for seq in (0, 1, 3, 4):
        seen.mark("a", seq)
    assert seen.is_new("a", 2)  # arrived out of order (a redelivery): still new
    seen.mark("a", 2)
    assert not seen.is_new("a", 2)
    seen.mark("a", 100)  # jumps far ahead: everything at or below 36 is now too old
    assert not seen.is_new("a", 36) and seen.is_new("a", 37) and not seen.is_new("a", 100)


def test_actors_are_forgotten_least_recently_heard_first() -> None:
    seen = SeenBatches(window=16, max_actors=3)
    for actor in ("a", "b", "c"):
        seen.mark(actor, 0)
    seen.mark("a", 1)  # a was heard from again: b is now the oldest
    seen.mark("d", 0)
    assert len(seen) == 3
    assert seen.is_new("b", 0)  # forgotten
    assert not seen.is_new("a", 1) and not seen.is_new("c", 0) and not seen.is_new("d", 0)


def test_policy_lag_is_that_of_the_last_window_of_rows() -> None:
    """Rows are noted as runs of one version; the summary is what the rows one by one would give."""
    rng = np.random.default_rng(0)
    lag = PolicyLag(window=100)
    train_at = {}
    model: list[tuple[int, int]] = []  # (versions behind, steps behind) per row, oldest first
    for current in range(1, 40):
        train_at[current] = current * 7 + int(rng.integers(0, 5))
        lag.published(current, train_at[current])
        versions = rng.integers(max(0, current - 4), current + 1, int(rng.integers(0, 30)))
        if current % 3 == 0:
            versions[:] = current - 1  # a read of one version
        lag.note(versions, current)
        for v in np.sort(versions):
            steps = train_at[current] - train_at[int(v)] if int(v) in train_at else -1
            model.append((current - int(v), steps))
        window = np.array(model[-100:])
        summary = lag.summary()
        for name, column in (("lag", window[:, 0]), ("lag_steps", window[:, 1])):
            known = column[column >= 0]
            if known.size:
                assert summary[f"{name}_p50"] == np.percentile(known, 50)
                assert summary[f"{name}_p95"] == np.percentile(known, 95)
                assert summary[f"{name}_max"] == known.max()
    assert lag._rows < 100 + 30  # runs wholly out of the window are let go


BatchMaker = Callable[..., bytes]


def trainer_run(redis_url: str, namespace: str, queue_url: str | None, scheme: str,
                options: TrainerOptions) -> tuple[Board, RedisParameters, TrainerRun, BatchMaker]:
    """A trainer's run of a tiny Pendulum DQN task on a fresh board, and a maker of valid batches of
    8 real rows: ``batch(actor, seq, start, with_priorities=True, **columns replaced)``."""
    config = tiny_config()
    runner = srl.Runner("Pendulum-v1", config)
    params = RedisParameters(url=redis_url, task_name=namespace)
    board = Board(params.connect(), namespace)
    board = board.bound(board.create_task(json.dumps({**runner.task_config(), "actor_num": 2,
                                                      "queue": {"scheme": scheme}})).task_id)
    epoch = board.claim_trainer(options.uid, 60_000)  # counts go on the board only from the lease's holder
    assert epoch is not None
    run = TrainerRun(board, params, queue_url, build_task(*board.get_task_config_raw()), epoch, options)
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    with Rollout(EnvConfig("Pendulum-v1"), worker, config.envs_per_actor, seed=0) as rollout:
        while worker.pending() < 40:
            rollout.step()
    rows = worker.take()
    assert rows is not None
    priorities = worker.initial_priorities(rows)
    assert priorities is not None
    codec = options.codec(namespace)

    def batch(actor: str, seq: int, start: int, with_priorities: bool = True, **changes: np.ndarray) -> bytes:
        cols = {k: v[start:start + 8] for k, v in rows.items()} | changes
        return codec.encode_batch(BatchHeader(actor, 0, 0, seq, 0, 8, time.time()), cols,
                                  priorities[start:start + 8] if with_priorities else None)

    return board, params, run, batch


BROKERS = {"mqtt": ("Mosquitto", 1883, "mqtt://127.0.0.1:1883"),
           "amqp": ("RabbitMQ", 5672, "amqp://guest:guest@127.0.0.1:5672/")}


def trainer_on(scheme: str, redis_url: str, namespace: str
               ) -> tuple[Board, RedisParameters, TrainerRun, BatchMaker, ExperienceQueue]:
    """``trainer_run`` over the shared broker of ``scheme`` (skipped here, failed in CI, when it is not up), and a
    producer of its queue."""
    what, port, url = BROKERS[scheme]
    if not port_open("127.0.0.1", port):
        broker_unavailable(what, "127.0.0.1", port)
    board, params, run, batch = trainer_run(redis_url, namespace, url, scheme,
                                            TrainerOptions(uid="t", secret="", lease_ttl=60.0))  # the 60 s it claims
    return board, params, run, batch, open_queue(url, namespace=namespace, role="producer", redis_params=params)


def test_one_read_of_many_batches_refuses_only_the_bad_one(redis_url: str, namespace: str) -> None:
    """The trainer validates and adds a read's good batches as one block; a bad, a duplicate and a
    batch without priorities in the same read are each handled alone, and nothing good is lost."""
    board, params, run, batch = trainer_run(redis_url, namespace, None, "redis",
                                            TrainerOptions(uid="t", secret="", ingest_max_messages=16))
    nan_obs = np.full((8, 3), np.nan, np.float32)  # Pendulum's observations, all NaN
    messages = [batch("a", 0, 0), batch("a", 1, 8), batch("a", 2, 16, obs=nan_obs), batch("a", 1, 8),
                batch("b", 0, 24, with_priorities=False), batch("b", 1, 32)]
    producer = open_queue(None, namespace=namespace, role="producer", redis_params=params)
    producer.put_many(messages)
    producer.close()
    queue = run.open_consumer()
    try:
        while run.ingest.received_batches + run.ingest.bad_messages + run.ingest.duplicates < len(messages):
            assert run.ingest.ingest_once(queue) > 0
        assert (run.ingest.received_batches, run.ingest.bad_messages, run.ingest.duplicates) == (4, 1, 1)
        assert run.ingest.received_transitions == 32 and len(run.buffer) == 32
        assert "seq 2" in run.ingest.last_bad and "NaN" in run.ingest.last_bad
        assert run.gate._arrivals == {0: 32}
        run.ingest.ack_counted()  # the read is acked once its count is on the board
        assert queue.depth() == 0  # all six acked, the bad and the duplicate too
    finally:
        run.stop.set("test over")
        queue.destroy()
        board.delete_task()


def test_rows_waiting_for_room_when_the_run_stops_are_not_counted_bad_nor_acked(redis_url: str,
                                                                                namespace: str) -> None:
    """A read whose rows wait for room in a bounded buffer when the run stops leaves the buffer as it
    was and its messages unacked (delivered again), instead of failing the add and acking them as bad."""
    board, params, run, batch = trainer_run(redis_url, namespace, None, "redis", TrainerOptions(uid="t", secret=""))
    producer = open_queue(None, namespace=namespace, role="producer", redis_params=params)
    producer.put_many([batch("a", 0, 0), batch("a", 1, 8)])
    producer.close()
    queue = run.open_consumer()
    try:
        messages = queue.get_many(2, timeout=5)
        assert len(messages) == 2
        run.ingest.buffer = SegmentBuffer(20, run.schema)  # 16 rows come; room for 12
        run.ingest.buffer.add({k: np.zeros((8, *c.shape), c.dtype) for k, c in run.schema.columns.items()})
        run.stop.set("test stops the run")
        with pytest.raises(StoppedWhileWaiting):
            run.ingest._ingest(messages)
        assert len(run.ingest.buffer) == 8 and run.ingest.bad_messages == 0 and not any(m.acked for m in messages)
    finally:
        queue.destroy()
        board.delete_task()


def test_a_read_is_counted_on_the_board_before_it_is_acked(redis_url: str, namespace: str) -> None:
    """The trainer writes what a read brought to the board before it acks the read, with the batches of its
    last reads in its ledger: killed between the two, the read is counted and its redelivery recognised by
    the next trainer, so the counts add up. Actors on MQTT and Pub/Sub read the queue's depth from them."""
    board, _, run, batch, producer = trainer_on("mqtt", redis_url, namespace)
    queue = run.open_consumer()
    inbox = queue._inbox  # type: ignore[attr-defined]
    acked = 0
    counted_when_acked: list[float] = []
    original_ack = queue.ack_many

    def ack_many(messages: list[Message]) -> None:  # what the board says at the moment of an ack
        nonlocal acked
        acked += len(messages)
        counted_when_acked.append(board.get_counters().get("received_batches", 0.0) - acked)
        original_ack(messages)

    queue.ack_many = ack_many  # type: ignore[method-assign]
    try:
        for sent in range(0, 8, 2):
            producer.put_many([batch("a", sent, 0), batch("b", sent, 8)])
            wait_for(lambda: inbox.qsize() >= 2, 10, "the broker to push 2 batches", interval=0.001)
            assert run.ingest.ingest_once(queue) == 2
        assert acked == 6  # a read is acked once the next one is in: its count was written meanwhile
        assert run.ingest.ingest_once(queue) == 0 and acked == 8  # a dry queue: the last read is acked too
        assert len(counted_when_acked) == 4 and min(counted_when_acked) >= 0  # never acked before counted
        assert board.get_counters()["received_batches"] == 8
        ledger = board.get_ledgers()["t"]  # the last three reads, by (actor, seq)
        assert sorted(ledger) == [("a", 2), ("a", 4), ("a", 6), ("b", 2), ("b", 4), ("b", 6)]
    finally:
        run.stop.set("test over")
        producer.close()
        queue.destroy()
        board.delete_task()


def board_queue_url(scheme: str) -> str:
    """The URL of a broker that does not tell its queue's depth (actors read it from the board's counts)."""
    if scheme == "mqtt":
        if not port_open("127.0.0.1", 1883):
            broker_unavailable("Mosquitto", "127.0.0.1", 1883)
        return "mqtt://127.0.0.1:1883"
    emulator = os.environ.get("PUBSUB_EMULATOR_HOST", "127.0.0.1:8085")
    host, _, port = emulator.rpartition(":")
    if not port_open(host, int(port)):
        broker_unavailable("Pub/Sub emulator", host, int(port))
    return f"pubsub://srl-test?emulator_host={emulator}"


def ingest_until(run: TrainerRun, queue: ExperienceQueue, done: Callable[[], bool], what: str) -> None:
    """Let the trainer's ingest read until ``done()`` (the broker pushes what was put a moment later)."""
    wait_for(lambda: run.ingest.ingest_once(queue) >= 0 and done(), 60, what, interval=0.0)


@pytest.mark.parametrize("scheme", ["mqtt", "pubsub"])
def test_refused_batches_give_their_place_in_the_queue_back(redis_url: str, namespace: str, scheme: str) -> None:
    """On MQTT and Pub/Sub an actor reads the queue's depth from the board: the batches counted sent less those the
    trainer took off the queue. A batch it refuses (here: rows that fail the schema's check) is taken off too, so
    after more refusals than the queue's capacity the actors still have all their room, instead of waiting for
    ever on batches nobody will receive."""
    url = board_queue_url(scheme)
    board, params, run, batch = trainer_run(redis_url, namespace, url, scheme, TrainerOptions(uid="t", secret=""))
    producer = open_queue(url, namespace=namespace, role="producer", redis_params=params)
    in_flight = InFlight(producer, board, "actor:0", CounterDeltas())
    assert in_flight.on_board
    capacity = 3
    nan_obs = np.full((8, 3), np.nan, np.float32)  # Pendulum's observations, all NaN: refused
    queue = run.open_consumer()
    try:
        for seq in range(2 * capacity + 1):
            assert in_flight.depth() < capacity, f"after {seq} refused batches the actor may not send"
            producer.put_many([batch("a", seq, 0, obs=nan_obs)])
            in_flight.sent(1, 8)
            ingest_until(run, queue, lambda n=seq + 1: run.ingest.bad_messages >= n, "the trainer to read the batch")
            run.ingest.ack_counted()  # counted on the board, then acked
            assert run.ingest.bad_messages == seq + 1 and run.ingest.received_batches == 0
            assert in_flight.depth() == 0
        counters = board.get_counters()
        assert counters["sent_batches"] == counters["bad_messages"] == counters["refused_batches"] == 2 * capacity + 1
    finally:
        run.stop.set("test over")
        producer.close()
        queue.destroy()
        board.delete_task()


class ReplyLoss:
    """A Redis client whose next script reply, once ``armed``, is lost: the script runs in Redis, then the
    connection drops before the reply is read (a reset, a failover), and the caller sends the call again."""

    def __init__(self, params: RedisParameters) -> None:
        self.armed = False
        self.lost = 0
        self.client = params.connect()
        loss = self
        base: Any = self.client.connection_pool.connection_class

        class Losing(base):  # type: ignore[misc, valid-type]
            losing = False

            def send_command(self, *args: Any, **kwargs: Any) -> None:
                self.losing = loss.armed and str(args[0]).upper() in ("EVALSHA", "EVAL")
                super().send_command(*args, **kwargs)

            def read_response(self, *args: Any, **kwargs: Any) -> Any:
                reply = super().read_response(*args, **kwargs)
                if self.losing:
                    self.losing = loss.armed = False
                    loss.lost += 1
                    self.disconnect()
                    raise redis.ConnectionError("the reply was lost with the connection")
                return reply

        self.client.connection_pool.connection_class = Losing


def test_a_count_whose_reply_was_lost_is_counted_once(redis_url: str, namespace: str) -> None:
    """A count whose reply is lost after its script ran in Redis is sent again (redis-py's retry, then
    ``with_retry``): the actor's count of the batches it sent and the trainer's count of a read still land once,
    so the depth actors read on MQTT and Pub/Sub, and the run's accounts, stay exact."""
    url = board_queue_url("mqtt")
    board, params, run, batch = trainer_run(redis_url, namespace, url, "mqtt", TrainerOptions(uid="t", secret=""))
    loss = ReplyLoss(params)
    lossy = Board(loss.client, namespace).bound(board.task_id)
    producer = open_queue(url, namespace=namespace, role="producer", redis_params=params)
    in_flight = InFlight(producer, lossy, "actor:0", CounterDeltas())
    run.ingest.board = lossy
    queue = run.open_consumer()
    try:
        producer.put_many([batch("a", 0, 0), batch("a", 1, 8)])
        loss.armed = True
        in_flight.sent(2, 16)
        assert loss.lost == 1
        counters = board.get_counters()
        assert (counters["sent_batches"], counters["sent_transitions"]) == (2, 16)
        assert in_flight.depth() == 2
        loss.armed = True  # the trainer's count of its read
        ingest_until(run, queue, lambda: run.ingest.received_batches >= 2, "the trainer to read both batches")
        run.ingest.ack_counted()
        assert loss.lost == 2 and run.ingest.received_batches == 2
        counters = board.get_counters()
        assert (counters["received_batches"], counters["received_transitions"]) == (2, 16)
        assert in_flight.depth() == 0
    finally:
        run.stop.set("test over")
        producer.close()
        queue.destroy()
        board.delete_task()
        loss.client.close()


@pytest.mark.parametrize("death", ["closed", "sigkill"])
def test_a_trainer_that_takes_over_takes_the_rows_its_killed_predecessor_counted_but_did_not_ack(
    redis_url: str, namespace: str, death: str
) -> None:
    """A trainer killed between counting a read and acking it: the read comes again to the trainer that takes
    over, which adds its rows (the killed one's buffer went with it) and counts its batches as redelivered, not
    as received twice; one more copy of them is a duplicate. SIGKILLed (its queue never closed), the read comes
    on the successor's first read, not once it has idled for ``claim_min_idle_s`` (a run ending before then
    would end with it counted as received and as still queued)."""
    board, params, run, batch = trainer_run(redis_url, namespace, None, "redis", TrainerOptions(uid="t", secret=""))
    producer = open_queue(None, namespace=namespace, role="producer", redis_params=params)
    producer.put_many([batch("a", 0, 0), batch("b", 0, 8)])
    queue = run.open_consumer()
    successor_queue = None
    try:
        messages = queue.get_many(2, timeout=5)
        assert len(messages) == 2
        run.ingest._count(*run.ingest._ingest(messages))  # in the buffer, counted on the board; the trainer
        if death == "closed":
            queue.close()  # dies before it acks the read: its unacked entries go back to the queue
        else:
            queue._client.close()  # type: ignore[attr-defined]  # its socket goes with the process: nothing sent
        assert board.get_counters()["received_batches"] == 2 and sorted(board.get_ledgers()["t"]) == [("a", 0),
                                                                                                      ("b", 0)]
        board.release_lease("trainer", "t")
        epoch = board.claim_trainer("t2", 60_000)
        assert epoch is not None
        successor = TrainerRun(board, params, None, run.task, epoch, TrainerOptions(uid="t2", secret=""))
        successor.ingest.recall_counted_batches()
        producer.put_many([batch("a", 1, 16), batch("a", 0, 0)])  # a new batch, and a copy of a counted one
        successor_queue = successor.open_consumer()
        ingest = successor.ingest
        assert ingest.ingest_once(successor_queue) == 2 and ingest.redelivered_batches == 2  # its first read

        def all_in() -> bool:
            ingest.ingest_once(successor_queue)
            return ingest.received_batches + ingest.redelivered_batches + ingest.duplicates >= 4

        wait_for(all_in, 60, "the redelivered read, the new batch and the copy")
        ingest.ack_counted()
        assert (ingest.received_batches, ingest.redelivered_batches, ingest.duplicates) == (1, 2, 1)
        assert len(successor.buffer) == 24 and ingest.received_transitions == 8  # every row, counted once
        counters = board.get_counters()
        assert (counters["received_batches"], counters["redelivered_batches"], counters["duplicates"]) == (3, 2, 1)
        assert successor_queue.depth() == 0
    finally:
        run.stop.set("test over")
        producer.close()
        if successor_queue is not None:
            successor_queue.destroy()
        board.delete_task()
def test_a_heartbeat_whose_reply_was_lost_counts_once(redis_url: str, namespace: str) -> None:
    """A heartbeat whose reply is lost after its script ran in Redis fails, and the next one sends its counts
    again with what was counted meanwhile: each lands once."""
    params = RedisParameters(url=redis_url, task_name=namespace)
    board = board_for(redis_url, namespace)
    board = board.bound(board.create_task(srl.Runner("Pendulum-v1", tiny_config()).task_config()).task_id)
    loss = ReplyLoss(params)
    lossy = Board(loss.client, namespace).bound(board.task_id)
    counters = CounterDeltas()
    assert board.claim_lease("actor:0", "a", 60_000)

    def heartbeat() -> None:
        counters.send(lambda deltas, token: lossy.heartbeat("actor:0", "a", 60_000, "actor:0", None, deltas,
                                                            token=token))

    try:
        counters.add(env_steps=5, sent_batches=2)
        loss.armed = True
        with pytest.raises(redis.ConnectionError):  # the heartbeat fails: the node's next one sends it again
            heartbeat()
        assert loss.lost == 1
        counters.add(env_steps=1)  # counted while the board was away
        heartbeat()
        assert board.get_counters() == {"env_steps": 6, "sent_batches": 2}
        counters.add(env_steps=1)
        heartbeat()
        assert board.get_counters() == {"env_steps": 7, "sent_batches": 2}
    finally:
        board.delete_task()
        loss.client.close()


def test_a_trainer_keeps_its_lease_while_it_restores_params(redis_url: str, namespace: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading params of hundreds of MB over a slow link can outlast the lease's TTL; the trainer renews
    its lease until its heartbeats start, so a standby does not take the task over meanwhile."""
    options = TrainerOptions(uid="t", secret="", lease_ttl=1.0, heartbeat_interval=0.1)
    board, _, run, _ = trainer_run(redis_url, namespace, None, "redis", options)
    assert board.release_lease("trainer", "t") and board.claim_lease("trainer", "t", 1000)  # a 1 s lease
    holders: list[str | None] = []

    def slow_restore(resumed: bool) -> None:
        time.sleep(3.0)  # a read that takes three TTLs: the time passing is the case under test
        holders.append(board.lease_holder("trainer")[0])
        run.stop.set("test over")

    monkeypatch.setattr(run.checkpoints, "restore", slow_restore)
    try:
        run.run()
    finally:
        board.delete_task()
    assert holders == ["t"]


def ppo_trainer(redis_url: str, namespace: str, max_steps: int) -> tuple[Board, RedisParameters, TrainerRun]:
    """The trainer's run (epoch 1, uid ``t1``) of a sync PPO task on Pendulum (its rewards normalized, its
    learning rate and clip range annealed over ``max_steps``) on a fresh board."""
    from srl.algorithms import ppo
    from srl.rl.blocks import MLPBlockConfig

    config = ppo.Config(seed=0, envs_per_actor=1, segment_length=16, hidden_block=MLPBlockConfig((16, 16)))
    runner = srl.Runner("Pendulum-v1", config)
    params = RedisParameters(url=redis_url, task_name=namespace)
    board = Board(params.connect(), namespace)
    board = board.bound(board.create_task(json.dumps({**runner.task_config(), "actor_num": 1, "max_steps": max_steps,
                                                      "queue": {"scheme": "redis"}})).task_id)
    epoch = board.claim_trainer("t1", 60_000)
    assert epoch is not None
    return board, params, TrainerRun(board, params, None, build_task(*board.get_task_config_raw()), epoch,
                                     TrainerOptions(uid="t1", secret=""))


def successor_of(board: Board, params: RedisParameters, run: TrainerRun, **options: Any) -> TrainerRun:
    """The run of the trainer (uid ``t2``) that takes the task over once ``run``'s trainer died."""
    assert board.release_lease("trainer", run.options.uid)  # as its lease lapsing would
    epoch = board.claim_trainer("t2", 60_000)
    assert epoch == run.epoch + 1
    return TrainerRun(board, params, None, run.task, epoch, TrainerOptions(uid="t2", secret="", **options))


def test_a_trainer_taking_over_goes_on_with_the_runs_schedule_and_return_statistics(
    redis_url: str, namespace: str
) -> None:
    """A standby that takes a PPO run over at 6,000 of its 10,000 env steps anneals the learning rate and the
    clip range from 40% of their start, as the dead trainer would have, not from the start again; and it
    scales rewards by the return statistics the run gathered, not by fresh ones."""
    board, params, first = ppo_trainer(redis_url, namespace, max_steps=10_000)
    try:
        rms = first.learner.return_rms  # type: ignore[attr-defined]
        rms.mean.fill_(0.5)
        rms.var.fill_(4.0)
        rms.count.fill_(6000.0)
        board.incr_counters("actor-a", env_steps=6000)  # the run's env steps so far, as actors count them
        first.gate.version = 7
        first.publisher.request(first.learner.train_count)
        first.publisher.flush()
        assert first.publisher.published_version == 7
        successor = successor_of(board, params, first, heartbeat_interval=0.2)
        run = threading.Thread(target=successor.run, name="successor")
        run.start()
        try:
            wait_for(lambda: (head := board.get_params_version()) and head[0] == 2, 60, "the successor's first params")
        finally:
            successor.stop.set("test over")
            run.join(60)
        learner = successor.learner
        assert learner.anneal.advance(0, learner.train_count) == pytest.approx(0.4)  # type: ignore[attr-defined]
        restored = learner.return_rms  # type: ignore[attr-defined]
        assert (restored.mean.item(), restored.var.item(), restored.count.item()) == (0.5, 4.0, 6000.0)
    finally:
        first.stop.set("test over")
        board.delete_task()


def test_a_trainer_taking_over_from_float16_params_restores_the_float32_weights(
    redis_url: str, namespace: str
) -> None:
    """With ``params_float16`` actors read float16 weights while the run goes on; a standby that takes the run
    over goes on from the trainer's float32 weights, not from their float16 rounding."""
    board, params, first, _ = trainer_run(redis_url, namespace, None, "redis",
                                          TrainerOptions(uid="t1", secret="", params_float16=True))
    try:
        rng = np.random.default_rng(0)
        weights = {k: (v + rng.normal(0, 1e-3, v.shape)).astype(v.dtype) if v.dtype == np.float32 else v
                   for k, v in first.parameter.to_arrays().items()}
        first.parameter.from_arrays(weights)
        trained = first.parameter.to_arrays()
        first.gate.version = 3
        first.publisher.request(first.learner.train_count)
        first.publisher.flush()
        record = board.get_params()
        assert record is not None and record.version == 3
        _, sent = first.codec.decode_params(record.blob)
        assert all(sent[k].dtype == np.float16 for k in trained if trained[k].dtype == np.float32)  # what actors read
        successor = successor_of(board, params, first)
        successor.checkpoints.restore(resumed=False)
        assert successor.gate.version == 3
        restored = successor.parameter.to_arrays()
        rounded = [k for k in trained if not np.array_equal(restored[k], trained[k])]
        assert not rounded, f"restored rounded weights: {rounded}"
    finally:
        first.stop.set("test over")
        board.delete_task()


def test_an_off_policy_trainer_cut_off_from_new_rows_stops_at_a_bounded_replay_ratio(
    redis_url: str, namespace: str
) -> None:
    """No new rows (a queue or board outage, actors gone): the trainer makes at most ``train_ahead`` times the
    replay ratio's train steps for the rows it received, then waits, instead of replaying the same memory
    without end; new rows let it go on."""
    options = TrainerOptions(uid="t", secret="", train_ahead=2.0)
    board, params, run, batch = trainer_run(redis_url, namespace, None, "redis", options)
    path = run.data_path
    assert path.env_steps_per_train == 1.0 and path.warmup_rows == 200 and path.publish_every == 100
    producer = open_queue(None, namespace=namespace, role="producer", redis_params=params)
    queue = run.open_consumer()

    def receive(batches: int) -> None:
        first = run.ingest.received_batches
        producer.put_many([batch("a", first + i, (8 * i) % 32) for i in range(batches)])
        while run.ingest.received_batches < first + batches:
            run.ingest.ingest_once(queue)

    def train_until_it_waits() -> int:
        while run._update():
            pass
        return run.learner.train_count

    try:
        receive(30)  # 240 rows: 40 past the warmup
        assert train_until_it_waits() == 2 * 40 + 100  # twice the ratio's steps, and one publication interval
        assert not run._update()  # it waits: no new rows
        receive(10)  # 80 rows more
        assert train_until_it_waits() == 2 * 120 + 100
    finally:
        run.stop.set("test over")
        producer.close()
        queue.destroy()
        board.delete_task()


def test_batches_of_the_task_this_one_replaced_are_dropped_not_counted(redis_url: str, namespace: str) -> None:
    """Actors of a replaced task send until their next heartbeat tells them: their batches carry the old
    task's id, and the new task's trainer drops them (noted apart), instead of learning from another run."""
    options = TrainerOptions(uid="t", secret="")
    board, params, run, batch = trainer_run(redis_url, namespace, None, "redis", options)
    codec = options.codec(namespace)
    frame = codec.open_batch(batch("a", 0, 0))
    columns, priorities = frame.arrays()
    old_task = codec.encode_batch(BatchHeader("old", 0, 0, 0, 0, 8, time.time(), task=run.ingest.task_tag ^ 1), columns,
                                  priorities)
    this_task = codec.encode_batch(BatchHeader("new", 0, 0, 0, 0, 8, time.time(), task=run.ingest.task_tag), columns,
                                   priorities)
    producer = open_queue(None, namespace=namespace, role="producer", redis_params=params)
    producer.put_many([old_task, this_task, batch("tool", 0, 8)])  # a hand-made batch says no task: taken
    queue = run.open_consumer()
    try:
        while run.ingest.received_batches + run.ingest.other_task_batches < 3:
            run.ingest.ingest_once(queue)
        run.ingest.ack_counted()
        assert (run.ingest.received_batches, run.ingest.other_task_batches, run.ingest.bad_messages) == (2, 1, 0)
        counters = board.get_counters()
        assert counters["other_task_batches"] == 1 and counters["received_batches"] == 2
        assert queue.depth() == 0  # acked: it is not delivered again
    finally:
        run.stop.set("test over")
        producer.close()
        queue.destroy()
        board.delete_task()


def test_the_read_window_grows_the_buffer_to_what_the_round_trip_needs_and_not_on_loopback() -> None:
    """Over a round trip of r seconds at ``rate`` rows a second the learner's FIFO needs about 2 × rate × r
    rows beyond the algorithm's size; it grows to that (whole messages, up to its limit), once a second, by a
    quarter at least, and not on loopback, where the algorithm's size is kept. The round trip is the second's
    fastest read (one that found messages waiting)."""
    from srl.base.schema import Column, Schema
    from srl.runner.distribution.node.serve import InTransit
    from srl.runner.distribution.trainer.ingest import ReadWindow

    now = [0.0]

    def window(limit: int) -> tuple[ReadWindow, SegmentBuffer]:
        buffer = SegmentBuffer(64, Schema({"x": Column("float32")}))
        return ReadWindow(buffer, 64, limit, 8, InTransit(clock=lambda: now[0])), buffer

    def second_at(w: ReadWindow, rows_per_s: int, round_trip: float) -> None:
        w.link.timed(10 * round_trip)  # a read that waited in Redis for data: not the round trip
        w.link.timed(round_trip)
        now[0] += 0.5
        w.added(rows_per_s // 2)  # not a second yet: nothing is looked at
        now[0] += 0.5
        w.added(rows_per_s // 2)

    loopback, buffer = window(1024)
    for _ in range(5):
        second_at(loopback, 2000, 0.0005)
    assert buffer.capacity == 64  # 2 × 2000 × 0.0005 = 2 rows: within a quarter
    wan, buffer = window(1024)
    second_at(wan, 2000, 0.02)
    assert buffer.capacity == 144 == wan.capacity  # 64 + 2 × 2000 × 0.02 = 144, a whole number of 8-row messages
    second_at(wan, 2100, 0.02)
    assert buffer.capacity == 144  # 148: within a quarter of 144
    second_at(wan, 20_000, 0.1)
    assert buffer.capacity == 1024  # 4064 wanted: held to the limit
    capped, buffer = window(64)
    second_at(capped, 2000, 0.1)
    assert buffer.capacity == 64  # a limit of its own size: never


def test_reads_given_back_after_their_count_landed_are_counted_as_given_back_until_read_again(
    namespace: str
) -> None:
    """Redis refuses writes (READONLY) while the trainer's read waits to be counted: its lease lapses by its
    own clock and it gives the read back to the queue, unacked, while the count keeps trying. Redis writable
    again, the trainer takes its lease back and the count lands: those batches are received *and* queued, so
    the board counts them as given back (the accounts balance: sent = received + refused + still queued - given
    back) until the trainer reads them again, as duplicates."""
    from tests.conftest import require_tool
    from tests.queue_fixtures import PrivateRedis, redis_refusing

    require_tool("redis-server", "a private Redis to refuse writes")
    if not port_open("127.0.0.1", 5672):
        broker_unavailable("RabbitMQ", "127.0.0.1", 5672)
    url = "amqp://guest:guest@127.0.0.1:5672/"
    server = PrivateRedis()
    server.start()
    options = TrainerOptions(uid="t", secret="", lease_ttl=2.0, heartbeat_interval=0.5)
    board, params, run, batch = trainer_run(server.url, namespace, url, "amqp", options)
    producer = open_queue(url, namespace=namespace, role="producer", redis_params=params)
    try:
        producer.put_many([batch("a", 0, 0), batch("b", 0, 8)])
        with redis_refusing(redis.Redis(port=server.port), "READONLY"):
            run.lease_guard.start()
            run.ingest.start()  # reads both; the count waits for Redis; the lease lapses by the trainer's clock
            wait_for(lambda: run.ingest.received_batches == 2, 60, "the trainer to read both batches")
            wait_for(lambda: producer.depth() == 2, 60, "the trainer to give its read back to the queue")
            assert board.get_counters().get("received_batches", 0) == 0
        assert run.take_lease_back()
        run.lease_guard.renewed(time.monotonic())  # what the board thread's next heartbeat does
        wait_for(lambda: board.get_counters().get("duplicates", 0) == 2, 60,
                 "the trainer to read its given-back batches again")
        counters = board.get_counters()
        assert run.ingest.given_back.batches == 2, "the count that landed after the read went back was not noticed"
        assert counters["received_batches"] == 2 and counters.get("given_back_batches", 0) == 0, counters
        assert producer.depth() == 0 and len(run.buffer) == 16  # their rows are in the buffer once
    finally:
        run.stop.set("test over")
        run.ingest.join(10)
        run.lease_guard.stop()
        producer.destroy()
        producer.close()
        server.stop()


@pytest.mark.parametrize("copies_read_first", [False, True], ids=["ack-first", "copies-read-first"])
def test_a_counted_read_whose_connection_was_lost_before_its_ack_keeps_the_accounts_balanced(
    redis_url: str, namespace: str, copies_read_first: bool
) -> None:
    """RabbitMQ's consumer connection is lost (a broker restart, a reset) after a read was counted and before
    its ack: the broker delivers those batches again and the ack on the new connection cannot be made. Made
    first, they are received and queued at once, so the trainer counts them as given back until it reads them
    again (as duplicates). In the order a running trainer meets it, its next read takes the copies before the
    ack comes back undone: they are no longer queued, and nothing is given back
    (``impala/amqp/broker-restart`` seed 74417515 ended "14 NOT ACCOUNTED FOR" on this). Either way the
    accounts balance whenever the run ends."""
    board, _, run, batch, producer = trainer_on("amqp", redis_url, namespace)
    consumer = run.open_consumer()
    ingest = run.ingest
    try:
        producer.put_many([batch("a", 0, 0), batch("b", 0, 8)])
        wait_for(lambda: ingest.ingest_once(consumer) == 2, 30, "the trainer to read both batches", interval=0.0)
        wait_for(lambda: board.get_counters().get("received_batches", 0) == 2, 30, "the read to be counted")
        consumer._drop_connection()  # type: ignore[attr-defined]  # the broker takes the unacked read back
        if not copies_read_first:
            ingest.ack_counted()  # on the connection it comes back with: the ack cannot be made
            counters = board.get_counters()
            assert counters.get("given_back_batches") == 2 and ingest.given_back.batches == 2, counters
        # the next reads take the copies (and, at their end, ack what came before them)
        wait_for(lambda: ingest.ingest_once(consumer) >= 0 and board.get_counters().get("duplicates", 0) == 2, 30,
                 "the trainer to read the batches delivered again", interval=0.0)
        ingest.ack_counted()
        counters = board.get_counters()
        assert counters["received_batches"] == 2 and counters.get("given_back_batches", 0) == 0, counters
        if not copies_read_first:  # else the copies may come in two reads, one of them after its ack came back
            assert ingest.given_back.batches == 2  # given back, ever
        assert len(run.buffer) == 16 and consumer.depth() == 0  # their rows, once; none left queued
    finally:
        run.stop.set("test over")
        consumer.destroy()
        consumer.close()
        producer.close()
        board.delete_task()


def test_a_trainer_whose_lease_lapsed_gives_its_unacked_reads_back_to_the_queue(
    redis_url: str, namespace: str
) -> None:
    """A trainer cut from the board (a partition) but not from RabbitMQ: its reads wait to be counted, unacked,
    and the broker keeps them for it while its connection lives, out of the queue's depth. Once its lease is a
    TTL old by its own clock, the standby may hold it: the trainer gives its unacked reads back to the queue,
    and the one that holds the lease receives and counts them."""
    if not port_open("127.0.0.1", 5672):
        broker_unavailable("RabbitMQ", "127.0.0.1", 5672)
    url = "amqp://guest:guest@127.0.0.1:5672/"
    options = TrainerOptions(uid="t", secret="", lease_ttl=2.0, heartbeat_interval=0.5)
    board, params, run, batch = trainer_run(redis_url, namespace, url, "amqp", options)
    producer = open_queue(url, namespace=namespace, role="producer", redis_params=params)
    successor_queue = None
    try:
        board.release_lease("trainer", "t")  # the partitioned trainer's lease lapsed; a standby took it
        epoch = board.claim_trainer("t2", 60_000)
        assert epoch is not None
        successor = TrainerRun(board, params, url, run.task, epoch, TrainerOptions(uid="t2", secret=""))
        producer.put_many([batch("a", 0, 0), batch("b", 0, 8)])
        run.lease_guard.start()  # renewing finds the lease gone; nothing renews it again
        run.ingest.start()  # reads both, and cannot count them: "not held"
        wait_for(lambda: run.ingest.received_batches == 2, 60, "the cut-off trainer to read both batches")
        successor_queue = successor.open_consumer()
        ingest = successor.ingest
        wait_for(lambda: ingest.ingest_once(successor_queue) >= 0 and ingest.received_batches >= 2, 60,
                 "the standby to receive the batches the cut-off trainer read and could not count", interval=0.0)
        ingest.ack_counted()
        assert board.get_counters()["received_batches"] == 2  # counted once, by the lease's holder
        assert len(successor.buffer) == 16
    finally:
        run.stop.set("test over")
        run.ingest.join(10)
        run.lease_guard.stop()
        producer.close()
        if successor_queue is not None:
            successor_queue.destroy()
        board.delete_task()
