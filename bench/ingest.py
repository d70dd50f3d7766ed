"""The trainer's ingest ceiling per backend: srl's ingest path against the raw broker, same messages.

    python bench/ingest.py                        # every backend that answers; 256- and 16-row batches
    python bench/ingest.py --backends redis,amqp --rounds 5
    python bench/ingest.py --signed               # HMAC-signed batches (a secret set), as a secured cluster runs
    python bench/ingest.py --repeat 3 --rounds 5  # three sweeps, then each ratio's median and range
    python bench/ingest.py --env ALE/Pong-v5 --rows 256 --messages 200   # pixels: DQN frame rows, zstd

For each backend and message size, the queue is first filled with ``--messages`` valid batches
(real DQN CartPole-v1 rows from the algorithm's own worker, a distinct sequence number each, as
an actor sends them; with ``--env ALE/Pong-v5``, DQN's frame rows of Pong with that many
transitions a message, zstd-compressed as an actor sends images, into the frame replay); then one
consumer drains it while nothing else runs:

  srl   a real ``TrainerRun`` of that task (the object ``srl trainer`` runs), its ingest path
        alone, no training: ``ingest_once`` = read what the buffer has room for, decode, validate
        against the algorithm's schema, dedupe, apply the version policy, insert into the replay
        memory, ack, count on the board;
  raw   the broker's own client library reading and acking the same bytes (redis-py XREADGROUP +
        XACK, pika basic_consume + multiple ack, paho QoS 1 on a persistent session,
        google-cloud-pubsub unary pull + acknowledge), no decoding: the ceiling the broker and its
        client give on this machine. Reads of up to the trainer's ``ingest_max_messages`` (paho:
        as messages come); pika with the trainer's prefetch (``TrainerOptions.prefetch``), as
        srl's consumer has.

  queue only  srl's queue backend alone (get_many + ack_many of the same size, opened as the
        trainer opens it), no decoding: the share of the gap that is the transport (bounded reads,
        depth bookkeeping, manual acks).

All read a queue the broker already holds (the consumer connects once the fill is done, and the
clock starts once it is connected and subscribed, for each of the three), so the ratio is the cost
of srl's ingest path, not of a producer sharing the two cores or of a connection. Which of the
three goes first turns with each ``--repeat``, so none always runs on the coolest machine. Rates are
transitions/s; the ratio is taken within one run. ``--rounds`` fills and drains are summed, after
one more that warms up untimed (connections; the replay memory, one round big, filled once so the
timed rounds overwrite it as in a trainer that has run a while). MQTT's broker queues at most
``max_queued_messages``, 1000 by default, per session, so a round stays below.

Brokers: scripts/services.sh start. The Pub/Sub emulator is taken from $PUBSUB_EMULATOR_HOST,
else 127.0.0.1:8085. Exits 1 if a transition went missing or a message was refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from queues import ENDPOINTS, RAW, RawPikaConsumer, unavailable  # bench/queues.py
from scale import template_rows  # bench/scale.py

import srl
from srl.algorithms import dqn
from srl.base.env import EnvConfig, env_spec
from srl.base.rollout import Rollout
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import build_task
from srl.runner.distribution.trainer.run import TrainerOptions, TrainerRun
from srl.runner.distribution.wire.codec import BatchHeader

GROUP = 16  # messages per put_many while filling


def queue_params(backend: str) -> str | None:
    return None if backend == "redis" else ENDPOINTS[backend][2]  # Redis: the board's own Redis


ENV = "CartPole-v1"
"""the env whose rows the messages carry (``--env``)"""
COMPRESS: bool | None = None
"""zstd-compress the messages (``--compress``; None: as an actor does, for images only)"""
PIXELS = "ALE/Pong-v5"


def make_config(capacity: int) -> dqn.Config:
    config = dqn.Config(env_steps_per_train=None, warmup_size=256, seed=0, envs_per_actor=1)  # one actor's env
    config.hidden_block.set_mlp((64, 64))
    config.memory.capacity = capacity
    return config


def frame_rows(config: dqn.Config, transitions: int) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """One actor's batch of Pong frame rows holding exactly ``transitions`` transitions."""
    spec = env_spec(EnvConfig(PIXELS))
    worker = config.make_worker(spec, config.make_parameter(spec, torch.device("cpu")), 0, 1, 0)
    with Rollout(EnvConfig(PIXELS), worker, 1, seed=0) as rollout:
        while worker.pending() < transitions:
            rollout.step()
        rows = worker.take()
    assert rows is not None and int(rows["transition"].sum()) == transitions, "an episode ended: pick another size"
    return rows, worker.initial_priorities(rows)


def encoded_batches(rows: int, count: int, task_name: str, options: TrainerOptions) -> list[bytes]:
    """``count`` valid batch messages of ``rows`` rows (transitions) each, as one actor sends them."""
    pixels = ENV == PIXELS
    columns, priorities = frame_rows(make_config(1000), rows) if pixels else template_rows(make_config(1000), rows)
    codec = options.codec(task_name, compress=pixels if COMPRESS is None else COMPRESS)
    actor_id = f"bench-{uuid.uuid4().hex[:8]}"
    count_rows = len(columns["action"])
    return [codec.encode_batch(BatchHeader(actor_id, 0, 0, seq, 0, count_rows, time.time()), columns, priorities)
            for seq in range(count)]


def fill(put_many: Any, blobs: list[bytes]) -> None:
    for start in range(0, len(blobs), GROUP):
        put_many(blobs[start:start + GROUP])


def timed_drains(backend: str, namespace: str, redis_params: RedisParameters, blobs: list[bytes], messages: int,
                 rounds: int, open_consumer: Callable[[], Any], drain: Callable[[Any, int], int]) -> tuple[float, int]:
    """Each round: fill the queue with the round's messages through srl's producer, then open a
    consumer and time ``drain(consumer, count)`` (which returns the rows it took); the timed seconds
    and rows. Round 0 warms up (connections, and the replay memory's pages touched once, as in a
    trainer that has run a while) and is not timed: ``blobs`` holds ``rounds + 1`` rounds."""
    drain_s = 0.0
    taken = 0
    for r in range(rounds + 1):
        part = blobs[r * messages:(r + 1) * messages]
        producer = open_queue(queue_params(backend), namespace=namespace, role="producer", redis_params=redis_params)
        fill(producer.put_many, part)
        producer.close()
        queue = open_consumer()
        t0 = time.perf_counter()
        got = drain(queue, len(part))
        if r > 0:
            drain_s += time.perf_counter() - t0
            taken += got
        queue.close()
    return drain_s, taken


def measure_srl(backend: str, rows: int, messages: int, rounds: int, options: TrainerOptions) -> dict[str, Any]:
    """Transitions/s through a real TrainerRun's ingest path, and what it counted."""
    task_name = f"ingest-{backend}-{uuid.uuid4().hex[:6]}"
    redis_params = RedisParameters(host="127.0.0.1", task_name=task_name)
    board = Board(redis_params.connect(), task_name)
    # a ring of one round: the warm-up fills it, the timed rounds overwrite (a full memory, as in a long run)
    config = make_config(capacity=rows * messages)
    config_json = srl.Runner(ENV, config).task_config()
    config_json.update(actor_num=1, max_train_count=10**9, queue={"scheme": backend})
    text = json.dumps(config_json)
    codec = options.codec(task_name)
    board = board.bound(board.create_task(text, signature=codec.config_signature(text)).task_id)
    epoch = board.claim_trainer(options.uid, 3_600_000)  # a trainer counts reads on the board as its lease's holder
    assert epoch is not None
    run = TrainerRun(board, redis_params, queue_params(backend), build_task(*board.get_task_config_raw(), codec),
                     epoch, options)
    blobs = encoded_batches(rows, messages * (rounds + 1), task_name, options)

    def handled() -> int:  # rows taken off the queue, whatever became of them
        return run.ingest.received_transitions + (run.ingest.bad_messages + run.ingest.duplicates) * rows

    def drain(queue: Any, count: int) -> int:
        start = run.ingest.received_transitions
        target = handled() + count * rows
        deadline = time.perf_counter() + 120
        while handled() < target and time.perf_counter() < deadline:
            run.ingest.ingest_once(queue)
        run.ingest.ack_counted()  # the last read is acked once its count is on the board
        return run.ingest.received_transitions - start

    try:
        drain_s, timed_rows = timed_drains(backend, task_name, redis_params, blobs, messages, rounds,
                                           run.open_consumer, drain)
    finally:
        run.stop.set("bench over")
        leftover = open_queue(queue_params(backend), namespace=task_name, role="consumer",
                              redis_params=redis_params)
        leftover.destroy()
        board.delete_task()
        board.client.close()
    return {"rate": timed_rows / drain_s, "sent": len(blobs) * rows, "received": run.ingest.received_transitions,
            "bad": run.ingest.bad_messages, "last_bad": run.ingest.last_bad, "duplicates": run.ingest.duplicates,
            "bytes": len(blobs[0])}


def measure_transport(backend: str, blobs: list[bytes], rows: int, messages: int, rounds: int,
                      take: int, prefetch: int) -> float:
    """Transitions/s srl's queue alone hands over (get_many + ack_many, the trainer's read size), no decoding."""
    namespace = f"ingest-q-{uuid.uuid4().hex[:8]}"
    redis_params = RedisParameters(host="127.0.0.1", task_name=namespace)

    def drain(queue: Any, count: int) -> int:
        deadline = time.perf_counter() + 120
        n = 0
        while n < count and time.perf_counter() < deadline:
            batch = queue.get_many(take, timeout=0.2)
            queue.ack_many(batch)
            n += len(batch)
        return n * rows

    def open_consumer() -> Any:
        return open_queue(queue_params(backend), namespace=namespace, role="consumer", redis_params=redis_params,
                          consumer_name="bench", prefetch=prefetch)

    try:
        drain_s, timed_rows = timed_drains(backend, namespace, redis_params, blobs, messages, rounds, open_consumer,
                                           drain)
    finally:
        open_queue(queue_params(backend), namespace=namespace, role="consumer", redis_params=redis_params).destroy()
    return timed_rows / drain_s


class RawPahoSession:
    """paho, QoS 1, on a persistent session: subscribed before the fill, reconnected to drain it."""

    def __init__(self, namespace: str) -> None:
        import paho.mqtt.client as mqtt

        self.mqtt = mqtt
        self.topic = f"bench/{namespace}"
        self.client_id = f"bench-s-{namespace}"
        self.received = 0
        self.lock = threading.Condition()
        self.client: Any = None  # the draining connection (connect)
        client = self._client()
        subscribed = threading.Event()
        client.on_subscribe = lambda *args: subscribed.set()
        client.connect("127.0.0.1", 1883)
        client.loop_start()
        client.subscribe(self.topic, qos=1)
        if not subscribed.wait(10):
            raise RuntimeError("no SUBACK from the MQTT broker")
        client.disconnect()
        client.loop_stop()

    def _client(self) -> Any:
        mqtt = self.mqtt
        return mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, clean_session=False,
                           protocol=mqtt.MQTTv311)

    def connect(self) -> None:
        """Reconnect to the session and wait for its CONNACK and SUBACK, before the clock starts, as srl's
        consumer is opened (connected and subscribed) before it; the broker may start sending meanwhile,
        as it may to srl's."""
        from queues import _tune_paho

        self.received = 0
        client = self._client()
        _tune_paho(client)
        connected, subscribed = threading.Event(), threading.Event()

        def on_message(c: Any, u: Any, m: Any) -> None:
            client.on_publish()  # the quickack
            with self.lock:
                self.received += 1
                self.lock.notify()

        client.on_message = on_message
        client.on_connect = lambda *args: connected.set()
        client.on_subscribe = lambda *args: subscribed.set()
        client.connect("127.0.0.1", 1883)
        client.loop_start()
        if not connected.wait(10):
            raise RuntimeError("no CONNACK from the MQTT broker")
        client.subscribe(self.topic, qos=1)
        if not subscribed.wait(10):
            raise RuntimeError("no SUBACK from the MQTT broker")
        self.client = client

    def drain(self, count: int, timeout: float) -> int:
        """Wait until ``count`` messages came on the connected session (acked by paho after each callback)."""
        with self.lock:
            self.lock.wait_for(lambda: self.received >= count, timeout)
        return self.received

    def disconnect(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def close(self) -> None:
        client = self.mqtt.Client(self.mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                                  clean_session=True, protocol=self.mqtt.MQTTv311)
        client.connect("127.0.0.1", 1883)  # a clean session discards the persistent one
        client.disconnect()


def measure_raw(backend: str, blobs: list[bytes], rows: int, messages: int, rounds: int, take: int,
                prefetch: int) -> dict[str, Any]:
    """Transitions/s the raw client reads and acks from a filled queue (round 0 not timed); pika gets the
    trainer's ``prefetch``, as srl's consumer does."""
    namespace = f"ingest-raw-{uuid.uuid4().hex[:8]}"
    producer_cls, consumer_cls = RAW[backend]
    if backend == "amqp":
        consumer_cls = partial(RawPikaConsumer, prefetch=prefetch)
    drain_s = 0.0
    got = 0
    session = RawPahoSession(namespace) if backend == "mqtt" else None
    early = consumer_cls(namespace) if backend in ("redis", "pubsub") else None  # creates group / subscription
    try:
        for r in range(rounds + 1):
            part = blobs[r * messages:(r + 1) * messages]
            producer = producer_cls(namespace)
            fill(producer.put_many, part)
            producer.close()
            if session is not None:
                session.connect()
                t0 = time.perf_counter()
                n = session.drain(len(part), timeout=120)
                if r > 0:
                    drain_s += time.perf_counter() - t0
                    got += n
                session.disconnect()
                continue
            consumer = early or consumer_cls(namespace)  # RabbitMQ: connect once the queue is full
            t0 = time.perf_counter()
            deadline = t0 + 120
            n = 0
            while n < len(part) and time.perf_counter() < deadline:
                n += consumer.take(take)
            if r > 0:
                drain_s += time.perf_counter() - t0
                got += n
            if consumer is not early:
                if r == rounds:
                    consumer.close()
                else:
                    consumer.conn.close()
    finally:
        if session is not None:
            session.close()
        if early is not None:
            early.close()
    return {"rate": got * rows / drain_s, "received": got * rows}


ORDER = ("srl", "raw", "queue only")


def turned(turn: int) -> list[str]:
    """The three measurements in the order of sweep ``turn``: each goes first in turn, so none is always
    measured on the coolest (or the warmest) machine."""
    return [ORDER[(turn + i) % len(ORDER)] for i in range(len(ORDER))]


def measure_cell(backend: str, rows: int, messages: int, rounds: int, options: TrainerOptions,
                 turn: int = 0) -> tuple[tuple[float, float, float], bool]:
    """srl, the raw client and srl's queue alone on one backend and message size, in the order of ``turn``;
    prints the table's row. Returns (srl rows/s, ÷ raw, queue alone ÷ raw) and whether a transition went
    missing or was refused."""
    blobs = encoded_batches(rows, messages * (rounds + 1), "raw", options)
    measures: dict[str, Callable[[], Any]] = {
        "srl": lambda: measure_srl(backend, rows, messages, rounds, options),
        "raw": lambda: measure_raw(backend, blobs, rows, messages, rounds, options.ingest_max_messages,
                                   options.prefetch),
        "queue only": lambda: measure_transport(backend, blobs, rows, messages, rounds, options.ingest_max_messages,
                                                options.prefetch),
    }
    results = {name: measures[name]() for name in turned(turn)}
    srl_result, raw, transport = results["srl"], results["raw"], results["queue only"]
    lost = srl_result["sent"] - srl_result["received"]
    failed = lost > 0 or srl_result["bad"] > 0 or raw["received"] < rows * messages * rounds
    ratio, queue_ratio = srl_result["rate"] / raw["rate"], transport / raw["rate"]
    print(f"{backend:<8} {rows:>8} {srl_result['bytes']:>9,} {srl_result['rate']:>11,.0f} {raw['rate']:>11,.0f} "
          f"{ratio:>6.2f} {srl_result['rate'] / rows:>9,.0f} {transport:>11,.0f} {queue_ratio:>6.2f} "
          f"{lost:>5} {srl_result['bad']:>4}", flush=True)
    if srl_result["bad"]:
        print(f"      last refused: {srl_result['last_bad']}")
    return (srl_result["rate"], ratio, queue_ratio), failed


def spread(values: list[float]) -> str:
    """'median (min-max)' of sorted ``values``."""
    return f"{statistics.median(values):.2f} ({values[0]:.2f}-{values[-1]:.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="redis,amqp,mqtt,pubsub")
    parser.add_argument("--rows", default="256,16", help="rows per message, comma separated (256: an actor's "
                        "default batch_size)")
    parser.add_argument("--messages", type=int, default=800, help="messages per fill (below Mosquitto's 1000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--signed", action="store_true", help="sign batches with a shared secret (HMAC)")
    parser.add_argument("--env", default="CartPole-v1", choices=["CartPole-v1", PIXELS],
                        help="whose rows the messages carry")
    parser.add_argument("--compress", action=argparse.BooleanOptionalAction, default=None,
                        help="zstd-compress the batches (default: as actors do, for images only)")
    parser.add_argument("--repeat", type=int, default=1, help="run the whole sweep this many times and end with "
                        "the median and range of each ratio (they move by up to 0.15 from run to run on 2 cores)")
    args = parser.parse_args()
    if args.repeat < 1 or args.rounds < 1 or args.messages < 1:
        parser.error("--repeat, --rounds and --messages must be at least 1")
    global ENV, COMPRESS
    ENV, COMPRESS = args.env, args.compress
    logging.getLogger("srl").setLevel(logging.WARNING)
    options = TrainerOptions(uid="bench-ingest", secret=uuid.uuid4().hex if args.signed else "")
    header = (f"{'backend':<8} {'rows/msg':>8} {'bytes/msg':>9} {'srl rows/s':>11} {'raw rows/s':>11} "
              f"{'ratio':>6} {'srl msg/s':>9} {'queue only':>11} {'ratio':>6} {'lost':>5} {'bad':>4}")
    print(f"ingest path alone (no training), {args.rounds} x {args.messages} messages per case after a warm-up round, "
          f"{'signed' if args.signed else 'unsigned'}, batches of {options.ingest_max_messages} per read, {ENV} rows"
          f"{' (DQN frame rows)' if ENV == PIXELS else ''}, "
          f"{'zstd' if (ENV == PIXELS if COMPRESS is None else COMPRESS) else 'uncompressed'}")
    print(header)
    print("-" * len(header))
    failed = False
    ratios: dict[tuple[str, int], list[tuple[float, float, float]]] = {}  # (srl rate, srl ratio, queue ratio)
    for repeat in range(args.repeat):
        if args.repeat > 1:
            print(f"-- run {repeat + 1} of {args.repeat}, measured in the order {', '.join(turned(repeat))}")
        for backend in args.backends.split(","):
            why = unavailable(backend)
            if why:
                print(f"{backend:<8} skipped: {why}")
                continue
            for rows in (int(x) for x in args.rows.split(",")):
                cell, cell_failed = measure_cell(backend, rows, args.messages, args.rounds, options, repeat)
                ratios.setdefault((backend, rows), []).append(cell)
                failed = failed or cell_failed
    if args.repeat > 1:
        print(f"\nmedian (min-max) over {args.repeat} runs")
        print(f"{'backend':<8} {'rows/msg':>8} {'srl rows/s':>11} {'ratio':>17} {'queue only ratio':>17}")
        for (backend, rows), runs in ratios.items():
            rate, ratio, queue = (sorted(column) for column in zip(*runs, strict=True))
            print(f"{backend:<8} {rows:>8} {statistics.median(rate):>11,.0f} {spread(ratio):>17} {spread(queue):>17}")
    if failed:
        print("\nFAILED: a transition went missing or a message was refused (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
