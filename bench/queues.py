"""Experience-queue throughput: srl's backends against their raw clients, same run, same machine.

For every backend whose broker answers on loopback, and for ~20 KB and
~200 KB payloads, one producer process sends batches (``put_many`` groups)
for a few seconds while one consumer process takes them (``get_many`` +
``ack_many``); the producer keeps at most ``--backlog`` messages outstanding,
as an actor's backpressure does. The same loop then runs on the raw client
library (redis-py XADD pipelined / XREADGROUP + XACK, pika publish + consume
with acks, paho QoS 1, google-cloud-pubsub publish + unary pull), which is
the ceiling srl's layer sits on: the raw producers stream without waiting
for the broker per group (no publisher confirms, no PUBACK or publish-future
wait per group; only the backlog bound), while srl's ``put_many`` returns only
once the broker holds the group; RabbitMQ's returns once the group is
published within its window of unconfirmed messages (``confirm_window``), and
its ``close`` waits for the last confirms. ``--group 1`` is how an actor puts
(one batch per call). The raw MQTT client gets the same socket
tuning as srl's (TCP_NODELAY, TCP_QUICKACK after each read), so the ratio
shows the cost of srl's layer, not Nagle's algorithm. Speed is quoted as the
ratio of the two, measured in the same run.

    python bench/queues.py                      # all backends, ~2 s per measurement
    python bench/queues.py --backends redis,mqtt --seconds 3

Brokers: scripts/services.sh start. The Pub/Sub emulator is taken from
$PUBSUB_EMULATOR_HOST, else 127.0.0.1:8085.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PUBSUB_HOST = os.environ.get("PUBSUB_EMULATOR_HOST", "127.0.0.1:8085")
ENDPOINTS = {
    "redis": ("127.0.0.1", 6379, "redis://127.0.0.1:6379/0"),
    "amqp": ("127.0.0.1", 5672, "amqp://guest:guest@127.0.0.1:5672/"),
    "mqtt": ("127.0.0.1", 1883, "mqtt://127.0.0.1:1883"),
    "pubsub": (PUBSUB_HOST.rpartition(":")[0], int(PUBSUB_HOST.rpartition(":")[2]),
               f"pubsub://srl-bench?emulator_host={PUBSUB_HOST}"),
}
LIBRARIES = {"redis": "redis", "amqp": "pika", "mqtt": "paho.mqtt", "pubsub": "google.cloud.pubsub_v1"}
PUBSUB_PROJECT = "srl-bench"


class Producer(Protocol):
    def put_many(self, items: list[bytes]) -> None: ...
    def close(self) -> None: ...


class Consumer(Protocol):
    def take(self, max_messages: int) -> int:
        """Get up to max_messages, ack them, return how many."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- srl
class SrlProducer:
    def __init__(self, backend: str, namespace: str) -> None:
        from srl.runner.distribution.queues import open_queue

        self.queue = open_queue(ENDPOINTS[backend][2], namespace=namespace, role="producer")

    def put_many(self, items: list[bytes]) -> None:
        self.queue.put_many(items)

    def close(self) -> None:
        self.queue.close()


class SrlConsumer:
    def __init__(self, backend: str, namespace: str) -> None:
        from srl.runner.distribution.queues import open_queue

        self.queue = open_queue(ENDPOINTS[backend][2], namespace=namespace, role="consumer")

    def take(self, max_messages: int) -> int:
        messages = self.queue.get_many(max_messages, timeout=0.2)
        self.queue.ack_many(messages)
        return len(messages)

    def close(self) -> None:
        self.queue.destroy()


# ---------------------------------------------------------------- raw redis
class RawRedisProducer:
    def __init__(self, namespace: str) -> None:
        import redis

        self.r = redis.Redis(port=6379)
        self.key = f"bench:{namespace}"

    def put_many(self, items: list[bytes]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for data in items:
            pipe.xadd(self.key, {b"d": data})
        pipe.execute()

    def close(self) -> None:
        self.r.close()


class RawRedisConsumer:
    def __init__(self, namespace: str) -> None:
        import redis

        self.r = redis.Redis(port=6379)
        self.key = f"bench:{namespace}"
        self.r.xgroup_create(self.key, "g", id="0", mkstream=True)

    def take(self, max_messages: int) -> int:
        reply = self.r.xreadgroup("g", "c", {self.key: ">"}, count=max_messages, block=200)
        if not reply:
            return 0
        ids = [entry_id for entry_id, _ in reply[0][1]]
        self.r.xack(self.key, "g", *ids)
        return len(ids)

    def close(self) -> None:
        self.r.delete(self.key)
        self.r.close()


# ---------------------------------------------------------------- raw pika
class RawPikaProducer:
    def __init__(self, namespace: str) -> None:
        import pika

        self.conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1"))
        self.ch = self.conn.channel()
        self.name = f"bench.{namespace}"
        self.ch.queue_declare(self.name, durable=True)
        self.props = pika.BasicProperties(delivery_mode=2)

    def put_many(self, items: list[bytes]) -> None:
        for data in items:
            self.ch.basic_publish("", self.name, data, self.props)

    def close(self) -> None:
        self.conn.close()


class RawPikaConfirmProducer(RawPikaProducer):
    """pika's own publisher confirms (confirm_delivery): every basic_publish waits for its confirm."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.ch.confirm_delivery()


class RawPikaConsumer:
    def __init__(self, namespace: str, prefetch: int = 128) -> None:
        """``prefetch``: unacked messages the broker pushes ahead, as srl's consumer it is compared with gets
        (128, RabbitMQParameters' default, here; the trainer's ``TrainerOptions.prefetch`` in bench/ingest.py)."""
        import pika

        self.conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1"))
        self.ch = self.conn.channel()
        self.name = f"bench.{namespace}"
        self.ch.queue_declare(self.name, durable=True)
        self.ch.basic_qos(prefetch_count=prefetch)
        self.tags: list[int] = []
        self.ch.basic_consume(self.name, lambda ch, method, props, body: self.tags.append(method.delivery_tag))

    def take(self, max_messages: int) -> int:
        """At most ``max_messages``, as srl's ``get_many``: the rest stay unacked for the next take."""
        if len(self.tags) < max_messages:
            self.conn.process_data_events(time_limit=0.2 if not self.tags else 0)
        n = min(len(self.tags), max_messages)
        if n:
            self.ch.basic_ack(self.tags[n - 1], multiple=True)
            del self.tags[:n]
        return n

    def close(self) -> None:
        self.ch.queue_delete(self.name)
        self.conn.close()


# ---------------------------------------------------------------- raw paho
def _tune_paho(client: Any) -> None:
    """TCP_NODELAY, and TCP_QUICKACK after each read, as srl's MQTT backend does."""

    def quickack(*_: Any) -> None:
        sock = client.socket()
        if isinstance(sock, socket.socket) and hasattr(socket, "TCP_QUICKACK"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    client.on_socket_open = lambda c, u, sock: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.on_publish = lambda *args: quickack()
    return None


class RawPahoProducer:
    def __init__(self, namespace: str) -> None:
        import paho.mqtt.client as mqtt

        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-p-{namespace}")
        _tune_paho(self.c)
        self.c.max_inflight_messages_set(100)
        self.c.connect("127.0.0.1", 1883)
        self.c.loop_start()
        self.topic = f"bench/{namespace}"
        self.infos: list[Any] = []

    def put_many(self, items: list[bytes]) -> None:
        self.infos += [self.c.publish(self.topic, data, qos=1) for data in items]
        if len(self.infos) > 1024:
            self.infos = [i for i in self.infos if not i.is_published()]

    def close(self) -> None:
        for info in self.infos:
            info.wait_for_publish()
        self.c.disconnect()
        self.c.loop_stop()


class RawPahoConsumer:
    def __init__(self, namespace: str) -> None:
        import queue

        import paho.mqtt.client as mqtt

        self.inbox: queue.Queue[bytes] = queue.Queue()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"bench-c-{namespace}")
        _tune_paho(self.c)

        def on_message(c: Any, u: Any, m: Any) -> None:
            self.c.on_publish()  # the quickack
            self.inbox.put(m.payload)

        self.c.on_message = on_message
        self.c.connect("127.0.0.1", 1883)
        self.c.subscribe(f"bench/{namespace}", qos=1)
        self.c.loop_start()
        time.sleep(0.3)  # SUBACK

    def take(self, max_messages: int) -> int:
        import queue

        n = 0
        try:
            self.inbox.get(timeout=0.2)
            n = 1
            while n < max_messages:
                self.inbox.get_nowait()
                n += 1
        except queue.Empty:
            pass
        return n

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


# ---------------------------------------------------------------- raw pubsub
def _pubsub_clients() -> tuple[Any, Any]:
    import grpc
    from google.cloud import pubsub_v1
    from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport
    from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    publisher = pubsub_v1.PublisherClient(
        batch_settings=pubsub_v1.types.BatchSettings(max_messages=100, max_bytes=9 << 20, max_latency=0.005),
        transport=PublisherGrpcTransport(channel=grpc.insecure_channel(PUBSUB_HOST, options=options)))
    subscriber = pubsub_v1.SubscriberClient(
        transport=SubscriberGrpcTransport(channel=grpc.insecure_channel(PUBSUB_HOST, options=options)))
    return publisher, subscriber


class RawPubSubProducer:
    def __init__(self, namespace: str) -> None:
        self.publisher, _ = _pubsub_clients()
        self.topic = f"projects/{PUBSUB_PROJECT}/topics/bench-{namespace}"
        self.futures: list[Any] = []

    def put_many(self, items: list[bytes]) -> None:
        self.futures += [self.publisher.publish(self.topic, data) for data in items]
        if len(self.futures) > 1024:
            self.futures = [f for f in self.futures if not f.done()]

    def close(self) -> None:
        for f in self.futures:
            f.result()
        self.publisher.stop()


class RawPubSubConsumer:
    def __init__(self, namespace: str) -> None:
        self.publisher, self.subscriber = _pubsub_clients()
        self.topic = f"projects/{PUBSUB_PROJECT}/topics/bench-{namespace}"
        self.sub = f"projects/{PUBSUB_PROJECT}/subscriptions/bench-{namespace}"
        self.publisher.create_topic(name=self.topic)
        self.subscriber.create_subscription(
            request={"name": self.sub, "topic": self.topic, "ack_deadline_seconds": 60})

    def take(self, max_messages: int) -> int:
        from google.api_core import exceptions

        try:
            response = self.subscriber.pull(
                request={"subscription": self.sub, "max_messages": max_messages}, timeout=0.5, retry=None)
        except exceptions.DeadlineExceeded:
            return 0
        ack_ids = [m.ack_id for m in response.received_messages]
        if ack_ids:
            self.subscriber.acknowledge(request={"subscription": self.sub, "ack_ids": ack_ids})
        return len(ack_ids)

    def close(self) -> None:
        self.subscriber.delete_subscription(subscription=self.sub)
        self.publisher.delete_topic(topic=self.topic)


RAW: dict[str, tuple[Callable[[str], Producer], Callable[[str], Consumer]]] = {
    "redis": (RawRedisProducer, RawRedisConsumer),
    "amqp": (RawPikaProducer, RawPikaConsumer),
    "mqtt": (RawPahoProducer, RawPahoConsumer),
    "pubsub": (RawPubSubProducer, RawPubSubConsumer),
}


# ---------------------------------------------------------------- the measurement
@dataclass
class Shared:
    sent: Synchronized[int]
    received: Synchronized[int]
    started_at: Synchronized[float]
    ready: Event
    producer_done: Event


def _make(backend: str, kind: str, role: str, namespace: str) -> Any:
    if kind == "srl":
        return (SrlProducer if role == "producer" else SrlConsumer)(backend, namespace)
    if kind == "raw-confirms":
        return (RawPikaConfirmProducer if role == "producer" else RawPikaConsumer)(namespace)
    producer_cls, consumer_cls = RAW[backend]
    return (producer_cls if role == "producer" else consumer_cls)(namespace)


def producer_main(backend: str, kind: str, namespace: str, size: int, group: int, backlog: int,
                  seconds: float, shared: Shared) -> None:
    producer = _make(backend, kind, "producer", namespace)
    payloads = [os.urandom(size) for _ in range(group)]
    shared.ready.wait(60)
    t0 = time.perf_counter()
    shared.started_at.value = t0
    while time.perf_counter() - t0 < seconds:
        while shared.sent.value - shared.received.value + group > backlog:
            time.sleep(0.0005)
        producer.put_many(payloads)
        with shared.sent.get_lock():
            shared.sent.value += group
    shared.producer_done.set()
    producer.close()


def consumer_main(backend: str, kind: str, namespace: str, result: Any, shared: Shared) -> None:
    consumer = _make(backend, kind, "consumer", namespace)
    shared.ready.set()
    last_progress = time.perf_counter()
    finished_at = None
    while True:
        n = consumer.take(64)
        now = time.perf_counter()
        if n:
            last_progress = now
            with shared.received.get_lock():
                shared.received.value += n
        if shared.producer_done.is_set() and shared.received.value >= shared.sent.value:
            finished_at = now
            break
        if now - last_progress > 15:
            break
    consumer.close()
    received = shared.received.value
    elapsed = (finished_at or time.perf_counter()) - shared.started_at.value
    lost = shared.sent.value - received if finished_at is None else 0
    result.put((received, elapsed, lost))


def measure(backend: str, kind: str, size: int, seconds: float, group: int, backlog: int) -> tuple[float, int]:
    """(msg/s, messages lost) for one backend, client kind and payload size."""
    ctx = mp.get_context("fork")  # the parent imports no client library (gRPC dislikes fork after use)
    shared = Shared(ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("d", 0.0), ctx.Event(), ctx.Event())
    result: Any = ctx.Queue()
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    consumer = ctx.Process(target=consumer_main, args=(backend, kind, namespace, result, shared))
    producer = ctx.Process(target=producer_main,
                           args=(backend, kind, namespace, size, group, backlog, seconds, shared))
    consumer.start()
    producer.start()
    received, elapsed, lost = result.get(timeout=seconds + 120)
    producer.join(30)
    consumer.join(30)
    return received / elapsed, lost


def broker_answers(backend: str) -> bool:
    host, port, _ = ENDPOINTS[backend]
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def library_installed(backend: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(LIBRARIES[backend]) is not None
    except ModuleNotFoundError:
        return False


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot be measured here (its broker or its client library is missing), or None."""
    if not broker_answers(backend):
        host, port, _ = ENDPOINTS[backend]
        return f"nothing answers on {host}:{port} (scripts/services.sh start)"
    if not library_installed(backend):
        return f"{LIBRARIES[backend]} is not installed"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="redis,amqp,mqtt,pubsub")
    parser.add_argument("--sizes", default="20000,200000", help="payload bytes, comma separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="sending time per measurement")
    parser.add_argument("--group", type=int, default=16, help="messages per put_many")
    parser.add_argument("--backlog", type=int, default=256,
                        help="most messages outstanding (below Mosquitto's default max_queued_messages 1000)")
    args = parser.parse_args()
    import srl.runner.distribution.queues  # noqa: F401  (once here, not in every forked process)

    sizes = [int(s) for s in args.sizes.split(",")]

    header = f"{'backend':<8} {'payload':>8} {'srl msg/s':>10} {'srl MB/s':>9} {'raw msg/s':>10} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    confirms: list[str] = []
    for backend in args.backends.split(","):
        why = unavailable(backend)
        if why:
            print(f"{backend:<8} skipped: {why}")
            continue
        for size in sizes:
            srl_rate, srl_lost = measure(backend, "srl", size, args.seconds, args.group, args.backlog)
            raw_rate, raw_lost = measure(backend, "raw", size, args.seconds, args.group, args.backlog)
            note = ""
            if srl_lost or raw_lost:
                note = f"  (unfinished: srl {srl_lost}, raw {raw_lost} messages never arrived)"
            print(f"{backend:<8} {size // 1000:>6}KB {srl_rate:>10.0f} {srl_rate * size / 1e6:>9.1f} "
                  f"{raw_rate:>10.0f} {srl_rate / raw_rate:>6.2f}{note}", flush=True)
            if backend == "amqp":
                rate, _ = measure(backend, "raw-confirms", size, args.seconds, args.group, args.backlog)
                confirms.append(f"{size // 1000}KB {rate:.0f} msg/s (srl/that {srl_rate / rate:.2f})")
    if confirms:
        print("amqp raw with pika's publisher confirms (one wait per message, the durable equivalent): "
              + ", ".join(confirms))


if __name__ == "__main__":
    main()
