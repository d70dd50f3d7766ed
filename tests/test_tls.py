"""TLS end to end, against private TLS servers: verification is on, a custom CA works, a wrong one is refused.

Every server here is a private one (``tests/tls_fixtures.py``) presenting a
certificate from a CA this module generated: a client verifies it only when
told that CA (``ssl_ca_certs`` / ``tls_ca_certs``, as a field or a URL query),
and refuses it with the wrong CA or with the system CAs alone.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import redis

import srl
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import Board, TaskState
from srl.runner.distribution.queues import BrokerUnavailableError, ExperienceQueue, Message, QueueParameters, open_queue
from srl.runner.distribution.settings.queue_parameters import MQTTParameters, RabbitMQParameters
from tests.nodes import ClientThread, Node, tiny_config
from tests.queue_fixtures import PrivateServer
from tests.tls_fixtures import TLSFiles, TLSMosquitto, TLSRabbitMQ, TLSRedis, make_tls_files

VERIFY_FAILED = r"TLS certificate verification failed.*certificate verify failed"


ServerT = TypeVar("ServerT", bound=PrivateServer)


def _start_or_give_up(server: ServerT) -> ServerT:
    """Start a private server; skip (locally) or fail (in CI) when it cannot start here."""
    try:
        server.start()
    except (OSError, RuntimeError) as e:
        server.cleanup()
        message = f"the private TLS {server.name} did not start: {e}"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {message}")
        pytest.skip(message)
    return server


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_redis(tls: TLSFiles) -> Iterator[TLSRedis]:
    server = _start_or_give_up(TLSRedis(tls))
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def tls_mosquitto(tls: TLSFiles) -> Iterator[TLSMosquitto]:
    server = _start_or_give_up(TLSMosquitto(tls))
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def tls_rabbitmq(tls: TLSFiles) -> Iterator[TLSRabbitMQ]:
    server = _start_or_give_up(TLSRabbitMQ(tls))
    yield server
    server.cleanup()


@dataclass
class TLSBroker:
    """One TLS queue backend under test: its server, and its CA option in both forms."""

    scheme: str
    server_url: str
    ca_option: str
    """the name of the CA option, as a URL query key and a parameters field"""
    params: Callable[[Path | None], QueueParameters]
    """the parameters dataclass with the CA as a field (None: the system CAs)"""

    def url(self, ca: Path) -> str:
        return f"{self.server_url}?{self.ca_option}={ca}"


@pytest.fixture(params=["rediss", "mqtts", "amqps"])
def tls_broker(request: pytest.FixtureRequest, namespace: str) -> TLSBroker:
    scheme = request.param
    if scheme == "rediss":
        server = request.getfixturevalue("tls_redis")
        return TLSBroker(scheme, server.url, "ssl_ca_certs",
                         lambda ca: RedisParameters(url=server.url, ssl_ca_certs=None if ca is None else str(ca),
                                                    task_name=namespace))
    if scheme == "mqtts":
        server = request.getfixturevalue("tls_mosquitto")
        return TLSBroker(scheme, server.url, "tls_ca_certs",
                         lambda ca: MQTTParameters(host="127.0.0.1", port=server.port, tls=True,
                                                   tls_ca_certs=None if ca is None else str(ca)))
    server = request.getfixturevalue("tls_rabbitmq")
    return TLSBroker(scheme, server.url, "ssl_ca_certs",
                     lambda ca: RabbitMQParameters(host="127.0.0.1", port=server.port, ssl=True,
                                                   ssl_ca_certs=None if ca is None else str(ca)))


def _drain(consumer: ExperienceQueue, n: int, timeout: float = 10.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {len(got)} of {n} payloads from {consumer.source_name}"
        got += consumer.get_many(n - len(got), timeout=0.2)
    return got


# ---------------------------------------------------------------- (a), (b), (c): right CA
def test_tls_queue_moves_payloads_with_verification_on(tls_broker: TLSBroker, tls: TLSFiles, namespace: str) -> None:
    """The CA as a URL query (producer) and as a field (consumer): both verify and both work."""
    payloads = [b"\x00tls\xff", b"x" * 50_000, bytes(range(256)), b"last"]
    with open_queue(tls_broker.url(tls.ca), namespace=namespace, role="producer") as producer, \
            open_queue(tls_broker.params(tls.ca), namespace=namespace, role="consumer") as consumer:
        producer.put_many(payloads)
        got = _drain(consumer, len(payloads))
        assert sorted(m.data for m in got) == sorted(payloads)
        consumer.ack_many(got)


def test_board_over_rediss_creates_a_task(tls_redis: TLSRedis, tls: TLSFiles, namespace: str) -> None:
    params = RedisParameters(url=tls_redis.url, ssl_ca_certs=str(tls.ca), task_name=namespace)
    board = Board(params.connect(), namespace)
    created = board.create_task({"algorithm": "dqn", "fields": {"batch_size": 32}}, actor_num=1)
    assert created.status == TaskState.INIT
    status = board.get_status()
    assert status is not None and status.status == TaskState.INIT
    # the same server through the URL query and through host/port with the field
    query_board = Board(RedisParameters(url=f"{tls_redis.url}?ssl_ca_certs={tls.ca}").connect(), namespace)
    assert query_board.get_status() is not None
    host_params = RedisParameters(host="127.0.0.1", port=tls_redis.port, ssl_ca_certs=str(tls.ca))
    assert Board(host_params.connect(), namespace).get_status() is not None
    assert board.delete_task() > 0


# ---------------------------------------------------------------- (d): wrong CA, or none
@pytest.mark.parametrize("trust", ["wrong CA", "system CAs"])
def test_tls_queue_refuses_a_broker_its_ca_did_not_sign(
    tls_broker: TLSBroker, tls: TLSFiles, namespace: str, trust: str
) -> None:
    ca = tls.wrong_ca if trust == "wrong CA" else None
    with pytest.raises(BrokerUnavailableError, match=f"{VERIFY_FAILED}.*set {tls_broker.ca_option}") as caught:
        open_queue(tls_broker.params(ca), namespace=namespace, role="producer")
    assert "the CA that signed the" in str(caught.value)


def test_board_over_rediss_refuses_the_wrong_ca(tls_redis: TLSRedis, tls: TLSFiles, namespace: str) -> None:
    params = RedisParameters(url=tls_redis.url, ssl_ca_certs=str(tls.wrong_ca), task_name=namespace)
    with pytest.raises(redis.ConnectionError, match=f"{VERIFY_FAILED}.*set ssl_ca_certs") as caught:
        Board(params.connect(), namespace).ping()
    assert f"127.0.0.1:{tls_redis.port}" in str(caught.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_mqtts_checks_the_host_name(tls_mosquitto: TLSMosquitto, tls: TLSFiles, namespace: str, host: str) -> None:
    """A certificate from the right CA for another host name is refused: the host name is checked."""
    params = MQTTParameters(url=f"mqtts://{host}:{tls_mosquitto.wrong_name_port}?tls_ca_certs={tls.ca}")
    with pytest.raises(BrokerUnavailableError, match=f"{VERIFY_FAILED}.*(IP address|[Hh]ostname) mismatch"):
        open_queue(params, namespace=namespace, role="producer")


def test_a_ca_option_without_tls_is_refused(tls: TLSFiles) -> None:
    with pytest.raises(ValueError, match=re.escape("is not a TLS URL; use amqps://")):
        RabbitMQParameters(url=f"amqp://127.0.0.1:5672/?ssl_ca_certs={tls.ca}")
    with pytest.raises(ValueError, match="tls_ca_certs is set but tls is False"):
        MQTTParameters(tls_ca_certs=str(tls.ca))
    with pytest.raises(ValueError, match=re.escape("is not a TLS URL; use rediss://")):
        RedisParameters(url="redis://127.0.0.1:6379/0", ssl_ca_certs=str(tls.ca)).connect()


# ---------------------------------------------------------------- (e): a whole run over TLS
@pytest.mark.slow
def test_distributed_run_with_the_board_on_rediss_and_experience_on_amqps(
    tls_redis: TLSRedis, tls_rabbitmq: TLSRabbitMQ, tls: TLSFiles, namespace: str, tmp_path: Path
) -> None:
    """``srl trainer`` and ``srl actor`` processes and a client: every connection verifies the test CA."""
    queue_url = f"amqps://127.0.0.1:{tls_rabbitmq.port}/?ssl_ca_certs={tls.ca}"
    redis_params = RedisParameters(url=tls_redis.url, ssl_ca_certs=str(tls.ca), task_name=namespace)
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, redis_params, queue_params=queue_url, actor_num=1, max_train_count=300)
    client.start()
    nodes = [Node(role, tls_redis.url, namespace, tmp_path, "--ssl-ca-certs", str(tls.ca), "--queue-url", queue_url,
                  "--run-once") for role in ("trainer", "actor")]
    try:
        client.join(45)
        assert not client.is_alive(), "the client did not finish within 45 s:\n" + "\n".join(
            n.output()[-2000:] for n in nodes)
        assert client.error is None, repr(client.error)
        for node in nodes:
            assert node.proc.wait(20) == 0, f"the {node.role} did not end well:\n" + node.output()[-3000:]
    finally:
        for node in nodes:
            node.stop()
    assert runner.train_count == 300
    board = Board(redis_params.connect(), namespace)
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    counters = board.get_counters()
    assert counters["received_transitions"] >= tiny_config().warmup_size
    assert counters.get("bad_messages", 0) == 0
    board.delete_task()
