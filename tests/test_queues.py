"""Contract tests of the experience queue: one set of bodies, every backend.

Each backend runs against a real broker on loopback (Redis 6379, RabbitMQ
5672, Mosquitto 1883, the Pub/Sub emulator at $PUBSUB_EMULATOR_HOST or
127.0.0.1:8085; scripts/services.sh start brings them up). A broker that does
not answer skips its cases locally and fails them when CI is set. Tests that
restart a broker start a private one on a free port.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.backoff import NoBackoff
from redis.retry import Retry

from srl.runner.distribution.queues import (
    BrokerUnavailableError,
    ExperienceQueue,
    Message,
    MissingBackendLibraryError,
    QueueFullError,
    open_queue,
    queue_scheme,
)
from srl.runner.distribution.queues.redis_stream import stream_key_for
from srl.runner.distribution.settings.credentials import CredentialsError
from srl.runner.distribution.settings.queue_parameters import GCPParameters, MQTTParameters, RabbitMQParameters
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from tests.conftest import broker_unavailable, port_open, require_tool, running
from tests.nodes import wait_for
from tests.queue_fixtures import PrivateMosquitto, PrivateRedis, closed_port, redis_server_binaries

PUBSUB_HOST = os.environ.get("PUBSUB_EMULATOR_HOST", "127.0.0.1:8085")


@dataclass
class Broker:
    """One backend under test: how to reach it and what it promises."""

    name: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)
    exact_depth: bool = False

    def open(self, namespace: str, role: str, **options: Any) -> ExperienceQueue:
        return open_queue(self.url, namespace=namespace, role=role,  # type: ignore[arg-type]
                          options={**self.options, **options})


def _redis() -> Broker:
    port = int(os.environ.get("SRL_TEST_REDIS_PORT", "6379"))
    if not port_open("127.0.0.1", port):
        broker_unavailable("Redis", "127.0.0.1", port)
    return Broker("redis", f"redis://127.0.0.1:{port}/0",
                  {"claim_min_idle_s": 0.5, "claim_interval_s": 0.2}, exact_depth=True)


def _rabbitmq() -> Broker:
    if not port_open("127.0.0.1", 5672):
        broker_unavailable("RabbitMQ", "127.0.0.1", 5672)
    return Broker("amqp", "amqp://guest:guest@127.0.0.1:5672/", exact_depth=True)


def _mqtt() -> Broker:
    if not port_open("127.0.0.1", 1883):
        broker_unavailable("Mosquitto", "127.0.0.1", 1883)
    return Broker("mqtt", "mqtt://127.0.0.1:1883")


def _pubsub() -> Broker:
    host, _, port = PUBSUB_HOST.rpartition(":")
    if not port_open(host, int(port)):
        broker_unavailable("Pub/Sub emulator", host, int(port))
    return Broker("pubsub", f"pubsub://srl-test?emulator_host={PUBSUB_HOST}")


BROKERS: dict[str, Callable[[], Broker]] = {
    "redis": _redis, "amqp": _rabbitmq, "mqtt": _mqtt, "pubsub": _pubsub,
}


@pytest.fixture(params=list(BROKERS))
def broker(request: pytest.FixtureRequest, namespace: str) -> Iterator[Broker]:
    b = BROKERS[request.param]()
    yield b
    with b.open(namespace, "consumer") as q:  # delete the stream / queue / session / topic of this test
        q.destroy()


def drain(queue: ExperienceQueue, count: int, timeout: float = 10.0, max_messages: int = 16) -> list[Message]:
    """Take ``count`` messages (not acked), waiting at most ``timeout`` in all."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        out += queue.get_many(min(max_messages, count - len(out)), timeout=0.5)
    return out


def settle(queue: ExperienceQueue) -> None:
    """Wait until the broker confirmed what was put, where put returns before that (RabbitMQ's confirm window)."""
    flush = getattr(queue, "flush", None)
    if flush is not None:
        flush()


# ---------------------------------------------------------------- the contract
def test_round_trip_is_byte_exact(broker: Broker, namespace: str) -> None:
    payloads = [b"\x00\x01binary\xff", b"x" * 20_000, bytes(range(256)) * 3, b"last"]
    with broker.open(namespace, "producer") as producer, broker.open(namespace, "consumer") as consumer:
        for p in payloads:
            producer.put(p)
        producer.put_many([bytearray(b"from a bytearray"), memoryview(b"from a memoryview")])  # type: ignore[list-item]
        payloads += [b"from a bytearray", b"from a memoryview"]
        got = drain(consumer, len(payloads))
        assert sorted(m.data for m in got) == sorted(payloads)
        assert all(isinstance(m.data, bytes) and m.source for m in got)
        for m in got:
            m.ack()
        assert consumer.get(timeout=0.3) is None


def test_put_many_get_many_ack_many(broker: Broker, namespace: str) -> None:
    payloads = [f"batch-{i}".encode() * 50 for i in range(60)]
    with broker.open(namespace, "producer") as producer, broker.open(namespace, "consumer") as consumer:
        producer.put_many(payloads[:30])
        producer.put_many(payloads[30:])
        first = consumer.get_many(25, timeout=5.0)
        assert 1 <= len(first) <= 25
        rest = drain(consumer, len(payloads) - len(first))
        assert sorted(m.data for m in first + rest) == sorted(payloads)
        consumer.ack_many(first + rest)
        consumer.ack_many(first)  # acking twice is harmless
        assert consumer.get_many(10, timeout=0.3) == []


def test_unacked_messages_come_back_after_close(broker: Broker, namespace: str) -> None:
    payloads = [b"one", b"two", b"three"]
    with broker.open(namespace, "producer") as producer:
        producer.put_many(payloads)
    first = broker.open(namespace, "consumer")
    held = drain(first, 3)
    assert sorted(m.data for m in held) == sorted(payloads)
    first.close()  # without acking
    with broker.open(namespace, "consumer") as second:
        again = drain(second, 3)
        assert sorted(m.data for m in again) == sorted(payloads)
        second.ack_many(again)


_CHILD = """
import sys, time
from srl.runner.distribution.queues import open_queue
url, namespace, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
q = open_queue(url, namespace=namespace, role="consumer", options=eval(sys.argv[4]))
held = []
deadline = time.monotonic() + 20
while len(held) < count and time.monotonic() < deadline:
    held += q.get_many(count - len(held), timeout=0.5)
print("HELD", len(held), flush=True)
time.sleep(60)
"""


def test_unacked_messages_come_back_after_consumer_is_killed(broker: Broker, namespace: str) -> None:
    options = dict(broker.options)
    if broker.name == "pubsub":
        options["ack_deadline_s"] = 10  # Pub/Sub's minimum: a dead consumer's messages return after it
    payloads = [b"alpha", b"beta"]
    with broker.open(namespace, "producer", **options) as producer:
        producer.put_many(payloads)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, broker.url, namespace, str(len(payloads)), repr(options)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().split() == ["HELD", str(len(payloads))]
        child.send_signal(signal.SIGKILL)
        child.wait(5)
        with broker.open(namespace, "consumer") as survivor:
            again = drain(survivor, len(payloads), timeout=20.0)
            assert sorted(m.data for m in again) == sorted(payloads)
            survivor.ack_many(again)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_one_megabyte_message(broker: Broker, namespace: str) -> None:
    big = os.urandom(1024 * 1024)
    with broker.open(namespace, "producer") as producer, broker.open(namespace, "consumer") as consumer:
        producer.put(big)
        got = drain(consumer, 1)
        assert len(got) == 1 and got[0].data == big
        got[0].ack()


def test_depth(broker: Broker, namespace: str) -> None:
    with broker.open(namespace, "producer") as producer:
        if not broker.exact_depth:
            producer.put(b"x")
            assert producer.depth() is None
            return
        producer.put_many([b"m"] * 5)
        settle(producer)
        assert producer.depth() == 5
        with broker.open(namespace, "consumer") as consumer:
            got = drain(consumer, 5)
            if broker.name == "redis":
                assert producer.depth() == 5  # taken but not acked still counts
            consumer.ack_many(got)
            if broker.name == "redis":
                assert producer.depth() == 5  # the acks wait for the consumer's next command
            consumer.send_acks()
            deadline = time.monotonic() + 60  # a budget for a loaded machine, not a speed
            while producer.depth() != 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert producer.depth() == 0


def test_message_above_max_message_bytes_raises(broker: Broker, namespace: str) -> None:
    with broker.open(namespace, "producer", max_message_bytes=1000) as producer:
        assert producer.max_message_bytes == 1000
        producer.put(b"x" * 1000)
        with pytest.raises(ValueError, match="split"):
            producer.put(b"x" * 1001)
        with pytest.raises(ValueError, match="max_message_bytes"):
            producer.put_many([b"ok", b"x" * 5000])
        with pytest.raises(TypeError, match="bytes"):
            producer.put("text")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="empty"):
            producer.put(b"")


def test_default_max_message_bytes_is_sane(broker: Broker, namespace: str) -> None:
    with broker.open(namespace, "producer") as producer:
        limit = producer.max_message_bytes
    expected = {"redis": (64 << 20, 512 << 20), "amqp": (16 << 20, 128 << 20), "mqtt": (16 << 20, 256 << 20),
                "pubsub": (9_000_000, 10_000_000)}[broker.name]
    assert expected[0] <= limit <= expected[1]


def test_missing_broker_is_a_fast_clear_error(broker: Broker, namespace: str) -> None:
    port = closed_port()
    url = {
        "redis": f"redis://:secret@127.0.0.1:{port}/0",
        "amqp": f"amqp://guest:secret@127.0.0.1:{port}/",
        "mqtt": f"mqtt://user:secret@127.0.0.1:{port}",
        "pubsub": f"pubsub://srl-test?emulator_host=127.0.0.1:{port}",
    }[broker.name]
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError) as info:
        open_queue(url, namespace=namespace, role="producer")
    assert time.monotonic() - started < 12
    text = str(info.value)
    assert f"127.0.0.1:{port}" in text and "secret" not in text
    assert "services.sh" in text
    assert isinstance(info.value, ConnectionError)


# ---------------------------------------------------------------- registry and parameters
def test_unknown_scheme_lists_known_ones_and_suggests() -> None:
    with pytest.raises(ValueError) as info:
        open_queue("amqqp://localhost", namespace="ns", role="producer")
    text = str(info.value)
    assert "No such queue backend: 'amqqp'" in text
    assert "amqp, amqps, mqtt, mqtts, pubsub, redis, rediss, unix" in text
    assert "Did you mean 'amqp'?" in text
    with pytest.raises(ValueError, match="Did you mean 'mqtt'"):
        queue_scheme("mqt://x")


def test_missing_client_library_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pika", None)  # makes `import pika` raise ImportError
    monkeypatch.delitem(sys.modules, "srl.runner.distribution.queues.rabbitmq", raising=False)
    with pytest.raises(MissingBackendLibraryError, match=r'pip install "srl\[rabbitmq\]"') as info:
        open_queue("amqp://localhost", namespace="ns", role="producer")
    assert isinstance(info.value, ImportError)


def test_core_import_pulls_no_client_library() -> None:
    code = ("import sys; import srl.runner.distribution.queues as q; "
            "q.queue_scheme('amqp://x'); q.describe_queue('mqtt://h'); "
            "print(sorted(m for m in ('pika', 'paho', 'google.cloud.pubsub_v1') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_urls_become_parameters() -> None:
    r = RabbitMQParameters(url="amqps://bob:pw@rabbit.example:5671/prod")
    assert (r.host, r.port, r.username, r.password, r.virtual_host, r.ssl) == (
        "rabbit.example", 5671, "bob", "pw", "prod", True)
    assert "pw" not in r.describe()
    m = MQTTParameters(url="mqtts://u:pw@broker:8884/exp/topic?client_id=me")
    assert (m.host, m.port, m.tls, m.topic_name, m.client_id) == ("broker", 8884, True, "exp/topic", "me")
    assert "pw" not in m.describe()
    g = GCPParameters(url="pubsub://my-proj/my-topic?subscription=my-sub&emulator_host=h:1")
    assert (g.project_id, g.topic_name, g.subscription_name, g.emulator_host) == (
        "my-proj", "my-topic", "my-sub", "h:1")
    assert queue_scheme(None) == "redis" and queue_scheme(RedisParameters(host="h")) == "redis"
    assert queue_scheme("rediss://h") == "redis" and queue_scheme(r) == "amqp"
    assert queue_scheme(m) == "mqtt" and queue_scheme("pubsub://p") == "pubsub"


@pytest.mark.parametrize("url, expected", [
    ("amqp://host:notaport/", "port"),
    ("amqp:///vhost", "needs a host"),
    ("mqtt://", "needs a host"),
    ("pubsub:///topic", "names the project"),
    ("pubsub://proj/a/b", "at most one path segment"),
    ("pubsub://proj/t?colour=red", "unknown option"),
    ("localhost:5672", "queue URL was expected"),
])
def test_malformed_urls_say_what_was_expected(url: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected) as info:
        open_queue(url, namespace="ns", role="producer")
    assert url.split("?")[0][:12] in str(info.value) or url in str(info.value)


def test_unknown_option_is_named() -> None:
    with pytest.raises(TypeError, match="prefetchh"):
        open_queue("amqp://localhost", namespace="ns", role="producer", options={"prefetchh": 3})


# ---------------------------------------------------------------- broker restarts (private instances)
@pytest.fixture()
def private_redis() -> Iterator[PrivateRedis]:
    with running(PrivateRedis()) as server:
        yield server


@pytest.fixture()
def private_mosquitto() -> Iterator[PrivateMosquitto]:
    with running(PrivateMosquitto()) as server:
        yield server


def _put_while_down(queue: ExperienceQueue, data: bytes) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            queue.put(data)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _waiting_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is now inside ``function`` (its stack names it): a put blocked on a broker away."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def test_redis_queue_survives_a_redis_restart(private_redis: PrivateRedis, namespace: str) -> None:
    url = private_redis.url
    with open_queue(url, namespace=namespace, role="producer") as producer, \
            open_queue(url, namespace=namespace, role="consumer") as consumer:
        producer.put(b"before")
        [m] = drain(consumer, 1)
        m.ack()
        private_redis.stop()
        thread, errors = _put_while_down(producer, b"after")  # blocks, reconnecting
        wait_for(lambda: _waiting_in(thread, "call"), 10, "the put to wait in the queue's reconnect loop")
        private_redis.start()
        thread.join(15)
        assert not thread.is_alive() and errors == []
        got = drain(consumer, 1)  # the stream and group vanished with the data: created again
        assert [m.data for m in got] == [b"after"]
        consumer.ack_many(got)
        # tried again after the failure: counted as one that Redis may hold twice (here it did not)
        assert producer.republished == 1


def test_redis_gives_up_after_reconnect_timeout(private_redis: PrivateRedis, namespace: str) -> None:
    with open_queue(private_redis.url, namespace=namespace, role="producer",
                    options={"reconnect_timeout_s": 1.0}) as producer:
        private_redis.stop()
        started = time.monotonic()
        with pytest.raises(BrokerUnavailableError, match=f"127.0.0.1:{private_redis.port}.*did not come back"):
            producer.put(b"lost")
        assert time.monotonic() - started < 5


def test_a_redis_stream_keeps_every_unread_entry_however_many(namespace: str) -> None:
    """What the stream holds is bounded by the actors' backpressure (``queue_capacity`` may be a million, and
    each actor may put a read's worth past it), never by trimming: 12,000 entries put and not yet read, singly
    and in pipelines, are all there, all read, and gone once acked."""
    broker = _redis()
    count = 12_000
    # entries held a long while are not taken over again: this consumer holds them all until it acks
    with broker.open(namespace, "producer") as producer, \
            broker.open(namespace, "consumer", claim_min_idle_s=600.0, claim_interval_s=600.0) as consumer:
        try:
            producer.put(b"0")
            for start in range(1, count - 1, 1_000):
                producer.put_many([b"%d" % i for i in range(start, min(start + 1_000, count - 1))])
            assert producer.put_many_then_backlog([b"%d" % (count - 1)]) == count
            assert producer.depth() == count
            got = drain(consumer, count, timeout=300, max_messages=4_096)
            assert sorted(int(m.data) for m in got) == list(range(count))
            consumer.ack_many(got)
            consumer.send_acks()
            assert producer.depth() == 0 and producer.backlog() == 0  # acked entries are deleted: no trim needed
        finally:
            consumer.destroy()


def test_the_redis_backlog_leaves_out_what_the_trainer_read_and_a_put_learns_it_in_its_round_trip(
        private_redis: PrivateRedis, namespace: str) -> None:
    """Backpressure counts what waits for the trainer: entries read and not yet acked sit in its buffer (it
    read them only as far as it had room), so ``backlog()`` is XLEN less the group's pending entries, while
    ``depth()`` (the run's accounts) still counts them; a put's pipeline carries the backlog back."""
    import redis

    raw = redis.Redis.from_url(private_redis.url)
    with open_queue(private_redis.url, namespace=namespace, role="producer") as producer:
        assert producer.backlog() == 0  # no stream, no group yet
        producer.put_many([b"1", b"2", b"3", b"4", b"5"])
        assert producer.backlog() == 5
        consumer = open_queue(private_redis.url, namespace=namespace, role="consumer", consumer_name="c")
        first = drain(consumer, 3, max_messages=3)
        assert (producer.depth(), producer.backlog()) == (5, 2)
        raw.config_resetstat()
        assert producer.put_many_then_backlog([b"6"]) == 3
        stats = raw.info("commandstats")
        assert stats["cmdstat_xadd"]["calls"] == 1 and "cmdstat_xlen" in stats and "cmdstat_xpending" in stats
        consumer.ack_many(first)
        consumer.send_acks()
        assert (producer.depth(), producer.backlog()) == (3, 3)
        consumer.close()  # its unacked entries (none) go back; the three left were never read
    # a Redis user that may not run scripts: the backlog is XLEN (never less than the real one), no error
    raw.acl_setuser("noscript", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                    commands=["+@all", "-eval"])
    url = private_redis.url.replace("redis://", "redis://noscript:pw@")
    with open_queue(url, namespace=namespace, role="producer") as limited:
        consumer = open_queue(private_redis.url, namespace=namespace, role="consumer", consumer_name="c2")
        drain(consumer, 1, max_messages=1)
        assert limited.put_many_then_backlog([b"7"]) is None  # the entry went; only the count did not
        assert limited.backlog() == limited.depth() == 4  # one of them read
        consumer.close()
    raw.close()


def test_a_redis_read_expecting_more_waits_for_them_in_the_same_round_trip(private_redis: PrivateRedis,
                                                                         namespace: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Sync PPO's actors send a version's segments about together; a read returns at the first. Expecting
    two, the read is followed in its pipeline by one that waits in Redis: the second message, put once the
    first was delivered, comes back in the same call. Expecting one, it does not."""
    import redis

    # the follow-up read waits 50 ms in Redis: a loaded machine can take longer to schedule the thread that
    # puts the second message, which would then come a call later. The wait is widened, not the behaviour
    monkeypatch.setattr("srl.runner.distribution.queues.redis_stream._GATHER_S", 10.0)
    raw = redis.Redis.from_url(private_redis.url)

    def put_second_once_first_is_delivered(producer: ExperienceQueue, consumer_name: str) -> None:
        producer.put(b"first")
        deadline = time.monotonic() + 60  # a budget for a loaded machine, not a speed
        while time.monotonic() < deadline:
            pending = raw.xpending(stream_key_for(namespace), "trainer")
            if pending["pending"] and any(c["name"] == consumer_name.encode() for c in pending["consumers"]):
                break
            time.sleep(0.0005)
        producer.put(b"second")

    with open_queue(private_redis.url, namespace=namespace, role="producer") as producer:
        for expect, name, wanted in ((2, "c2", [b"first", b"second"]), (1, "c1", [b"first"])):
            with open_queue(private_redis.url, namespace=namespace, role="consumer", consumer_name=name) as consumer:
                assert consumer.get_many(4, timeout=0.0) == []  # the group exists, nothing waits
                second = threading.Thread(target=put_second_once_first_is_delivered, args=(producer, name))
                second.start()
                got = consumer.get_expecting(4, 5.0, expect)
                second.join()
                assert [m.data for m in got] == wanted
                got += drain(consumer, 1) if len(got) < 2 else []
                consumer.ack_many(got)
    raw.close()


def test_a_redis_ack_goes_with_the_next_command_and_survives_a_lost_connection(private_redis: PrivateRedis,
                                                                              namespace: str) -> None:
    """An ack is sent in the round trip of the consumer's next read (one XACK, no command of its own),
    again after a connection lost before it went, and by close(): nothing acked is delivered again."""
    import redis

    raw = redis.Redis.from_url(private_redis.url)
    with open_queue(private_redis.url, namespace=namespace, role="producer") as producer:
        producer.put_many([b"1", b"2", b"3", b"4", b"5"])
        consumer = open_queue(private_redis.url, namespace=namespace, role="consumer", consumer_name="c")
        first = drain(consumer, 2)
        consumer.ack_many(first)
        assert producer.depth() == 5  # held back
        raw.config_resetstat()
        second = consumer.get_many(2, timeout=1)
        stats = raw.info("commandstats")
        assert stats["cmdstat_xack"]["calls"] == 1 and stats["cmdstat_xreadgroup"]["calls"] == 1
        assert producer.depth() == 3  # the first two went with that read
        consumer.ack_many(second)
        consumer._client.set_retry(Retry(NoBackoff(), 0))  # type: ignore[attr-defined]  # srl's own retry, not redis-py's
        raw.client_kill_filter(_type="normal", skipme=True)  # every connection but raw's: the acks are not sent
        third = consumer.get_many(1, timeout=1)  # reconnects; the held acks go with the retried read
        assert producer.depth() == 1 and [m.data for m in first + second + third] == [b"1", b"2", b"3", b"4", b"5"]
        consumer.ack_many(third)
        consumer.close()  # sends the last ack
        assert producer.depth() == 0
    with open_queue(private_redis.url, namespace=namespace, role="consumer", consumer_name="next",
                    options={"claim_min_idle_s": 0.1}) as after:
        assert after.get_many(5, timeout=0.5) == []  # nothing acked comes again
    raw.close()


def test_a_refused_redis_ack_is_raised_and_closing_does_not_wait_for_a_redis_that_is_away(
        private_redis: PrivateRedis, namespace: str) -> None:
    """An XACK Redis refuses (a user without the right) is an error, not silently dropped: entries never
    acked would fill the queue; a refusal, not an outage, so the trainer stops instead of waiting. A consumer
    closed while Redis is down returns at once, acks unsent."""
    import redis

    raw = redis.Redis.from_url(private_redis.url)
    raw.acl_setuser("noack", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                    commands=["+@all", "-xack"])
    url = private_redis.url.replace("redis://", "redis://noack:pw@")
    with open_queue(private_redis.url, namespace=namespace, role="producer") as producer:
        producer.put_many([b"1", b"2"])
    with open_queue(url, namespace=namespace, role="consumer") as consumer:
        consumer.ack_many(drain(consumer, 1))
        with pytest.raises(CredentialsError, match=r"permission denied by Redis .* the 'xack' command"):
            consumer.get_many(1, timeout=0.1)
    with open_queue(private_redis.url, namespace=namespace, role="producer") as producer:
        producer.put_many([b"3", b"4"])
    consumer = open_queue(private_redis.url, namespace=namespace, role="consumer")
    taken = drain(consumer, 2)
    assert sorted(m.data for m in taken) == [b"3", b"4"]
    consumer.ack_many(taken)  # held until the next command: close's
    private_redis.stop()
    started = time.monotonic()
    consumer.close()  # once: through the queue's reconnecting path it would wait reconnect_timeout_s (60 s)
    assert time.monotonic() - started < 2
    raw.close()


@pytest.mark.parametrize("binary", redis_server_binaries())
def test_redis_takeover_by_xautoclaim(binary: str, namespace: str) -> None:
    """A dead consumer's entries go to the next one, on every Redis version here (6.2 and 7.x replies)."""
    server = PrivateRedis(binary)
    try:
        server.start()
        options = {"claim_min_idle_s": 0.3, "claim_interval_s": 0.1}
        with open_queue(server.url, namespace=namespace, role="producer") as producer:
            producer.put_many([b"p1", b"p2", b"p3"])
        dead = open_queue(server.url, namespace=namespace, role="consumer", consumer_name="dead", options=options)
        assert len(drain(dead, 3)) == 3  # and never acked nor closed: it "died"
        with open_queue(server.url, namespace=namespace, role="consumer", consumer_name="next",
                        options=options) as survivor:
            got = drain(survivor, 3, timeout=5)
            assert sorted(m.data for m in got) == [b"p1", b"p2", b"p3"]
            assert all("redelivered" in m.source for m in got)
            survivor.ack_many(got)
            assert survivor.depth() == 0
    finally:
        server.cleanup()


def test_the_lease_holders_consumer_takes_a_dead_consumers_entries_on_its_first_read(
    redis_url: str, namespace: str
) -> None:
    """The trainer holding the lease is the queue's only rightful reader (any other consumer was fenced off):
    it takes what a killed trainer read and never acked on its first read, not ``claim_min_idle_s`` later,
    where a consumer not told so still waits for that idle time."""
    options = {"claim_min_idle_s": 600.0, "claim_interval_s": 600.0}
    with open_queue(redis_url, namespace=namespace, role="producer") as producer:
        producer.put_many([b"p1", b"p2", b"p3"])
    dead = open_queue(redis_url, namespace=namespace, role="consumer", consumer_name="dead", options=options)
    assert len(drain(dead, 3)) == 3  # never acked nor closed: it was SIGKILLed
    with open_queue(redis_url, namespace=namespace, role="consumer", consumer_name="waits",
                    options=options) as other:
        assert other.get_many(10, timeout=0.2) == []  # not idle for 600 s yet
    with open_queue(redis_url, namespace=namespace, role="consumer", consumer_name="holder",
                    options=options) as holder:
        holder.take_over()
        got = holder.get_many(10, timeout=0)
        assert sorted(m.data for m in got) == [b"p1", b"p2", b"p3"]
        assert all("redelivered" in m.source for m in got)
        holder.ack_many(got)
        assert holder.depth() == 0
    dead.close()


@pytest.mark.parametrize("binary", redis_server_binaries())
def test_a_redis_read_keeps_no_more_than_the_read_limit(binary: str, namespace: str) -> None:
    """Entries another writer shaped (a payload over the limit, thousands of fields, a large field
    before the payload, no payload) come back refused, with what was sent beside them intact; the
    large parts are dropped as they are read, never held, and the connection stays in step."""
    import tracemalloc

    import redis

    server = PrivateRedis(binary)
    try:
        server.start()
        limit = 1000
        # ?protocol=3 in the URL does not swap the bounded (RESP2) parser out
        with open_queue(server.url + "?protocol=3", namespace=namespace, role="consumer",
                        max_read_bytes=limit) as consumer:
            raw = redis.Redis.from_url(server.url)
            entries: list[dict[bytes, bytes]] = [
                {b"d": b"first" * 100},
                {b"d": b"\1" * (3 * 2**20)},  # 3 MiB: many socket reads to drop
                {f"f{i}".encode(): b"x" * 2048 for i in range(5000)},  # 10 MB in more fields than a reply keeps
                {f"f{i}".encode(): b"y" * 60_000 for i in range(300)},  # 18 MB in fields each over the room
                {b"junk": b"j" * 4500, b"d": b"h" * limit},  # over the limit (and its slack) together
                {b"other": b"field"},
                {b"junk": b"j" * (limit + 5000), b"d": b"small"},  # dropped junk beside a payload
                {b"d": b"last" * 250},
            ]
            for fields in entries:
                raw.xadd(consumer.key, fields)  # type: ignore[attr-defined]
            tracemalloc.start()
            got = consumer.get_many(10, timeout=5)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < 4 * 2**20, f"the read held {peak} bytes at its peak (31 MB were sent)"
            assert [m.data for m in got] == [b"first" * 100, b"", b"", b"", b"", b"", b"small", b"last" * 250]
            reasons = [m.refused for m in got]
            assert reasons[0] == reasons[6] == reasons[7] == ""
            assert f"payload of {3 * 2**20} bytes is over the {limit}-byte read limit" in reasons[1]
            assert "entry has 5000 fields" in reasons[2]
            assert "entry has no b'd' field" in reasons[3]
            assert "other fields) is over the read limit" in reasons[4]
            assert "entry has no b'd' field" in reasons[5]
            consumer.ack_many(got)
            assert consumer.depth() == 0
            raw.xadd(consumer.key, {b"d": b"after"})  # type: ignore[attr-defined]
            after = drain(consumer, 1)
            assert [m.data for m in after] == [b"after"]
            consumer.ack_many(after)
            # more group members than a reply keeps: the next consumer still opens and reads
            pipe = raw.pipeline(transaction=False)
            for i in range(5000):
                pipe.execute_command("XGROUP", "CREATECONSUMER", consumer.key, "trainer", f"member-{i}")  # type: ignore[attr-defined]
            pipe.execute()
        with open_queue(server.url, namespace=namespace, role="consumer", max_read_bytes=limit) as consumer:
            raw.xadd(consumer.key, {b"d": b"next"})  # type: ignore[attr-defined]
            assert [m.data for m in drain(consumer, 1)] == [b"next"]
            raw.close()
    finally:
        server.cleanup()


@pytest.mark.parametrize("binary", redis_server_binaries())
def test_an_idle_redis_read_waits_in_redis_and_takes_what_comes(binary: str, namespace: str) -> None:
    """A read with a timeout waits in one XREADGROUP BLOCK (not a poll every few ms); an entry put
    while it waits is what it returns; the stream deleted under it is created again, not an error."""
    import redis

    server = PrivateRedis(binary)
    try:
        server.start()
        raw = redis.Redis.from_url(server.url)
        with open_queue(server.url, namespace=namespace, role="producer") as producer, \
                open_queue(server.url, namespace=namespace, role="consumer") as consumer:
            consumer.get_many(1, timeout=0)  # the takeover look at start, out of the count below
            raw.config_resetstat()
            assert consumer.get_many(4, timeout=0.5) == []
            reads = raw.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0)
            assert 1 <= reads <= 2, f"{reads} reads while idle for 0.5 s"

            def when_blocked(action: Callable[[], object]) -> threading.Thread:
                def run() -> None:
                    wait_for(lambda: raw.info("clients")["blocked_clients"] >= 1, 10, "the read waiting in Redis")
                    action()
                thread = threading.Thread(target=run)
                thread.start()
                return thread

            putter = when_blocked(lambda: producer.put(b"while waiting"))
            got = consumer.get_many(4, timeout=30)
            putter.join()
            assert [m.data for m in got] == [b"while waiting"]
            consumer.ack_many(got)
            deleter = when_blocked(lambda: raw.delete(consumer.key))  # type: ignore[attr-defined]
            assert consumer.get_many(4, timeout=1.0) == []
            deleter.join()
            producer.put(b"after")
            assert [m.data for m in drain(consumer, 1)] == [b"after"]
        raw.close()
    finally:
        server.cleanup()


def test_mqtt_queue_survives_a_broker_restart(private_mosquitto: PrivateMosquitto, namespace: str) -> None:
    url = private_mosquitto.url
    with open_queue(url, namespace=namespace, role="producer") as producer, \
            open_queue(url, namespace=namespace, role="consumer") as consumer:
        producer.put(b"held")
        [held] = drain(consumer, 1)  # not acked across the restart
        private_mosquitto.stop()  # SIGTERM: mosquitto saves its sessions
        thread, errors = _put_while_down(producer, b"after")
        wait_for(lambda: _waiting_in(thread, "_publish_and_wait"), 10, "the put to wait for the broker")
        private_mosquitto.start()
        thread.join(20)
        assert not thread.is_alive() and errors == []
        got = drain(consumer, 2, timeout=15)
        assert sorted(m.data for m in got) == [b"after", b"held"]
        consumer.ack_many([*got, held])
        assert consumer.get(timeout=0.5) is None


def _a_second_message_joins_the_read(producer: ExperienceQueue, consumer: ExperienceQueue,
                                     read_has_first: Callable[[], object]) -> None:
    """With ``b"first"`` on its way, a second message put only once ``read_has_first()`` says the read
    holds the first comes back in that same read (the consumer lingers); then the queue is destroyed."""
    errors: list[BaseException] = []

    def put_second_once_the_read_has_the_first() -> None:
        try:  # this producer is used by this thread alone from here on
            wait_for(read_has_first, 10, "the read to take the first message", interval=0.001)
            producer.put(b"second")
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=put_second_once_the_read_has_the_first, daemon=True)
    thread.start()
    try:
        got = consumer.get_many(2, timeout=10)
        thread.join(10)
        assert errors == [] and [m.data for m in got] == [b"first", b"second"]  # one read, both
        consumer.ack_many(got)
    finally:
        consumer.destroy()


def test_an_mqtt_read_waits_its_linger_for_more_messages(namespace: str) -> None:
    """The broker pushes messages one by one: a read that has its first message waits up to
    ``read_linger_s`` for more, so the trainer pays its per-read costs once for several."""
    broker = _mqtt()
    with broker.open(namespace, "producer") as producer, \
            broker.open(namespace, "consumer", read_linger_s=30.0) as consumer:
        producer.put(b"first")
        inbox = consumer._inbox  # type: ignore[attr-defined]
        wait_for(lambda: not inbox.empty(), 10, "the broker to push the first message", interval=0.001)
        _a_second_message_joins_the_read(producer, consumer, inbox.empty)


def test_a_rabbitmq_read_waits_its_linger_for_more_messages(namespace: str) -> None:
    """After an ack the broker pushes the next messages at once: a read that has its first message waits
    up to ``read_linger_s`` for more, instead of taking only those already in the socket."""
    broker = _rabbitmq()
    with broker.open(namespace, "producer") as producer, \
            broker.open(namespace, "consumer", read_linger_s=30.0) as consumer:
        producer.put(b"first")  # delivered inside the read: pika reads the socket only then
        _a_second_message_joins_the_read(producer, consumer,
                                         lambda: consumer._buffer or consumer._held)  # type: ignore[attr-defined]


def _rabbitmqctl_close_connections(namespace: str) -> int:
    """Make RabbitMQ close this test's connections (CONNECTION_FORCED, as in a broker shutdown)."""
    listing = subprocess.run(["rabbitmqctl", "list_connections", "pid", "client_properties", "-q",
                              "--no-table-headers"], capture_output=True, text=True, timeout=30)
    pids = [line.split("\t")[0] for line in listing.stdout.splitlines() if namespace in line]
    for pid in pids:
        subprocess.run(["rabbitmqctl", "close_connection", pid, "srl test: simulated broker restart"],
                       capture_output=True, timeout=30, check=True)
    return len(pids)


def test_rabbitmq_queue_survives_a_forced_connection_close(namespace: str) -> None:
    """A private RabbitMQ takes ~7 s to start here, so the broker closes our connections instead."""
    b = _rabbitmq()
    require_tool("rabbitmqctl", "it comes with rabbitmq-server (scripts/services.sh installs it)")
    try:
        with b.open(namespace, "producer") as producer, b.open(namespace, "consumer") as consumer:
            producer.put(b"held")
            [held] = drain(consumer, 1)
            assert _rabbitmqctl_close_connections(namespace) == 2
            producer.put(b"after")  # reconnects
            got = drain(consumer, 2)  # reconnects; "held" went back to the queue with the old connection
            assert sorted(m.data for m in got) == [b"after", b"held"]
            held.ack()  # void: it came over the lost connection
            consumer.ack_many(got)
            producer.flush()
            assert producer.depth() == 0
    finally:
        with b.open(namespace, "consumer") as q:
            q.destroy()


def test_rabbitmq_capacity_refuses_and_reports_the_rejected(namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    b = _rabbitmq()
    try:
        with b.open(namespace, "producer", capacity=3) as producer:
            errors = _put_collecting_refusals(producer, [[b"1", b"2", b"3", b"4", b"5"]])
            assert errors and [data for e in errors for data in e.rejected] == [b"4", b"5"]
            assert "x-max-length=3" in str(errors[0])
            assert producer.depth() == 3
        # the queue exists with x-max-length 3: another capacity is explained, and the queue still used
        with caplog.at_level(logging.WARNING), b.open(namespace, "consumer", capacity=10) as consumer:
            assert "rabbitmqctl delete_queue" in caplog.text
            got = drain(consumer, 3)
            assert sorted(m.data for m in got) == [b"1", b"2", b"3"]
            consumer.ack_many(got)
    finally:
        with b.open(namespace, "consumer") as q:
            q.destroy()


# ---------------------------------------------------------------- RabbitMQ's window of publisher confirms
def _rabbitmq_producer(namespace: str, **options: Any) -> Any:
    """A RabbitMQ producer built directly: confirm_window is a constructor keyword, not a parameters field."""
    from srl.runner.distribution.queues.rabbitmq import CONFIRM_WINDOW, RabbitMQQueue

    window = options.pop("confirm_window", CONFIRM_WINDOW)
    params = RabbitMQParameters(url=_rabbitmq().url, **options)
    return RabbitMQQueue(params, namespace=namespace, role="producer", confirm_window=window)


def _put_collecting_refusals(producer: Any, groups: list[list[bytes]]) -> list[QueueFullError]:
    """put_many each group, then flush; the QueueFullErrors on the way (none of them stops the sending)."""
    errors: list[QueueFullError] = []
    for group in groups:
        try:
            producer.put_many(group)
        except QueueFullError as e:
            errors.append(e)
    try:
        producer.flush()
    except QueueFullError as e:
        errors.append(e)
    return errors


@pytest.fixture()
def rabbitmq_namespace(namespace: str) -> Iterator[str]:
    """The namespace of a RabbitMQ test; its queue is deleted afterwards."""
    b = _rabbitmq()
    yield namespace
    with b.open(namespace, "consumer") as q:
        q.destroy()


def _deaf_to_confirms(monkeypatch: pytest.MonkeyPatch, generations: set[int] | None = None) -> None:
    """Make producers ignore the broker's confirms on their connections number ``generations`` (None: all)."""
    from srl.runner.distribution.queues.rabbitmq import RabbitMQQueue

    heard = RabbitMQQueue._on_confirm

    def on_confirm(self: RabbitMQQueue, frame: Any) -> None:
        if generations is None or self._generation in generations:
            return
        heard(self, frame)

    monkeypatch.setattr(RabbitMQQueue, "_on_confirm", on_confirm)


def test_rabbitmq_single_puts_return_before_confirms_and_close_delivers_all(rabbitmq_namespace: str) -> None:
    payloads = [f"single-{i}".encode() * 100 for i in range(300)]
    producer = _rabbitmq_producer(rabbitmq_namespace, confirm_window=8)
    most_unconfirmed = 0
    for p in payloads:
        producer.put(p)
        most_unconfirmed = max(most_unconfirmed, producer.unconfirmed)
    assert 1 < most_unconfirmed <= 8  # put did not wait for its confirm, and the window held
    producer.close()
    assert producer.unconfirmed == 0
    b = _rabbitmq()
    with b.open(rabbitmq_namespace, "consumer", prefetch=1000) as consumer:  # drain acks nothing
        got = drain(consumer, len(payloads), max_messages=64)
        assert sorted(m.data for m in got) == sorted(payloads)  # each exactly once
        consumer.ack_many(got)
        assert consumer.get(timeout=0.3) is None


def test_rabbitmq_refusals_at_capacity_are_returned_not_lost(rabbitmq_namespace: str) -> None:
    sent = [f"capped-{i}".encode() for i in range(20)]
    producer = _rabbitmq_producer(rabbitmq_namespace, capacity=2, confirm_window=4)
    errors = _put_collecting_refusals(producer, [[p] for p in sent])
    rejected = [data for e in errors for data in e.rejected]
    assert errors and all(e.rejected for e in errors)
    assert all("x-max-length=2" in str(e) for e in errors)
    b = _rabbitmq()
    with b.open(rabbitmq_namespace, "consumer") as consumer:
        delivered = drain(consumer, len(sent))
        assert len(delivered) == 2
        assert sorted([m.data for m in delivered] + rejected) == sorted(sent)  # nothing lost, nothing twice
        assert rejected == [p for p in sent if p in set(rejected)]  # in the order they were put
        consumer.ack_many(delivered)
        # the caller's part: back off, then put the refused ones again
        assert _put_collecting_refusals(producer, [rejected[:2]]) == []
        again = drain(consumer, 2)
        assert [m.data for m in again] == rejected[:2]
        consumer.ack_many(again)
    producer.close()


def test_rabbitmq_republishes_unconfirmed_after_a_forced_connection_close(
    rabbitmq_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_tool("rabbitmqctl", "it comes with rabbitmq-server (scripts/services.sh installs it)")
    _deaf_to_confirms(monkeypatch, generations={1})  # the first connection's confirms never arrive
    payloads = [f"unconfirmed-{i}".encode() for i in range(50)]
    producer = _rabbitmq_producer(rabbitmq_namespace, confirm_window=1000)
    for p in payloads:
        producer.put(p)
    assert producer.unconfirmed == len(payloads)
    assert _rabbitmqctl_close_connections(rabbitmq_namespace) == 1
    assert producer.republished == 0
    producer.flush()  # finds the connection gone, reconnects, publishes all 50 again, waits for their confirms
    assert producer.unconfirmed == 0 and producer._generation == 2
    # counted, so a run's accounts can say why the queue holds more than the actors sent
    assert producer.republished == len(payloads)
    b = _rabbitmq()
    with b.open(rabbitmq_namespace, "consumer", prefetch=1000) as consumer:  # drain acks nothing
        got = drain(consumer, 2 * len(payloads), max_messages=64)
        counts = {p: 0 for p in payloads}
        for m in got:
            counts[m.data] += 1
        assert all(n >= 1 for n in counts.values())  # at least once (here twice: the broker had them all)
        assert len(got) - len(payloads) <= producer.republished  # no copy beyond those it republished
        consumer.ack_many(got)
    producer.close()


def test_rabbitmq_flush_and_close_give_up_when_nothing_is_confirmed(
    rabbitmq_namespace: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from srl.runner.distribution.queues import QueueError

    _deaf_to_confirms(monkeypatch)
    producer = _rabbitmq_producer(rabbitmq_namespace, confirm_window=3, confirm_timeout_s=0.5)
    producer.put_many([b"a", b"b", b"c"])  # fills the window without waiting
    started = time.monotonic()
    with pytest.raises(QueueError, match=r"put: .*confirmed none of the 3 .*\(1 more wait.*confirm_timeout_s"):
        producer.put(b"d")  # no room, and no confirm comes
    with pytest.raises(QueueError, match=r"flush: .*confirmed none of the 3"):
        producer.flush()
    with caplog.at_level(logging.ERROR), pytest.raises(QueueError, match=r"flush: .*confirmed none"):
        producer.close()
    assert time.monotonic() - started < 5
    assert "4 message(s) the broker never confirmed" in caplog.text


def test_rabbitmq_message_to_a_deleted_queue_is_an_error(rabbitmq_namespace: str) -> None:
    from srl.runner.distribution.queues import QueueError

    producer = _rabbitmq_producer(rabbitmq_namespace)
    with _rabbitmq().open(rabbitmq_namespace, "consumer") as other:
        other.destroy()
    with pytest.raises(QueueError, match="could not be routed"):
        producer.put(b"nowhere")
        producer.flush()
    producer.close()


def test_rabbitmq_close_logs_refusals_it_does_not_resend(
    rabbitmq_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    producer = _rabbitmq_producer(rabbitmq_namespace, capacity=1)
    producer.put_many([b"kept", b"refused"])  # returns before the broker's answer
    with caplog.at_level(logging.WARNING):
        producer.close()
    assert "refused 1 message(s)" in caplog.text and "flush() before close()" in caplog.text
    assert producer.unconfirmed == 0
