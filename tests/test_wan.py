"""The WAN proxy itself (tests/wan_proxy.py): latency, a bandwidth cap, partitions that hold and heal,
resets; Redis through it; and a distributed run with every node 50 ms of round trip from Redis and
from each queue backend."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest
import redis

import srl
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import TaskState
from tests.nodes import ClientThread, Node, board_for, start, tiny_config, wait_for
from tests.test_queues import Broker, broker  # noqa: F401 - the parametrized broker fixture
from tests.wan_proxy import WanProxy


@pytest.fixture()
def echo() -> Iterator[int]:
    """A TCP echo server on loopback; yields its port."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield port
    stop.set()
    thread.join()
    server.close()


def connect(proxy: WanProxy, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def round_trip(sock: socket.socket, payload: bytes = b"ping") -> float:
    started = time.monotonic()
    sock.sendall(payload)
    assert recv_exactly(sock, len(payload)) == payload
    return time.monotonic() - started


def test_each_direction_is_delayed_and_a_change_applies_to_what_follows(echo: int) -> None:
    with WanProxy("127.0.0.1", echo) as proxy, connect(proxy) as sock:
        assert round_trip(sock) < 0.06  # no delay configured: nothing waits (a loose bound, not a benchmark)
        proxy.set_delay(0.05)
        assert round_trip(sock) >= 0.1  # 50 ms each way
        proxy.set_delay(0.0)
        round_trip(sock)  # bytes stamped before the change may still be in flight
        assert round_trip(sock) < 0.06


def test_bandwidth_is_capped(echo: int) -> None:
    payload = bytes(range(256)) * 800  # 200 KiB
    with WanProxy("127.0.0.1", echo, rate=1_000_000) as proxy, connect(proxy) as sock:
        took = round_trip(sock, payload)
    assert took >= len(payload) / 1_000_000 * 0.95  # 1 MB/s each way (the echo overlaps the two)
    assert proxy.stats.bytes_up == proxy.stats.bytes_down == len(payload)


def test_a_partition_holds_traffic_and_healing_delivers_it_in_order(echo: int) -> None:
    with WanProxy("127.0.0.1", echo) as proxy, connect(proxy) as sock:
        round_trip(sock)
        proxy.partition()
        sock.sendall(b"one,")
        sock.sendall(b"two")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):  # silence, not a closed connection
            sock.recv(16)
        late = socket.create_connection(("127.0.0.1", proxy.port), timeout=0.3)  # the kernel accepts...
        late.sendall(b"new")
        with pytest.raises(TimeoutError):  # ...and nothing gets through
            late.recv(16)
        proxy.heal()
        sock.settimeout(5.0)
        late.settimeout(5.0)
        assert recv_exactly(sock, 7) == b"one,two"
        assert recv_exactly(late, 3) == b"new"
        late.close()


def test_a_reset_aborts_open_connections_and_new_ones_work(echo: int) -> None:
    with WanProxy("127.0.0.1", echo) as proxy:
        with connect(proxy) as sock:
            round_trip(sock)
            deadline = time.monotonic() + 60  # a budget for a loaded machine, not a speed
            while proxy.open_connections < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proxy.reset() == 1
            with pytest.raises((ConnectionResetError, ConnectionError, BrokenPipeError)):
                round_trip(sock)
                round_trip(sock)  # a write may land before the RST is seen; the next one cannot
        with connect(proxy) as again:
            assert round_trip(again) >= 0.0
        assert proxy.stats.resets == 1 and proxy.stats.connections == 2


def test_redis_answers_through_the_proxy_at_its_delay(redis_url: str) -> None:
    target = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    with WanProxy(target["host"], target["port"], delay_s=0.025) as proxy:
        client = redis.Redis(host="127.0.0.1", port=proxy.port, db=target.get("db", 0), socket_timeout=5)
        client.ping()
        started = time.monotonic()
        for _ in range(4):
            client.ping()
        assert (time.monotonic() - started) / 4 >= 0.05
        pipe = client.pipeline(transaction=False)
        for _ in range(50):
            pipe.ping()
        started = time.monotonic()
        assert all(pipe.execute())
        assert time.monotonic() - started < 25 * 0.05  # a pipeline pays one round trip, not fifty
        client.close()


def test_entries_whose_read_reply_a_reset_took_come_at_once_not_at_takeover(redis_url: str, namespace: str) -> None:
    """A read executed in Redis whose reply is lost with its connection leaves the entries pending for this
    consumer, delivered to no one: the read after the reconnect brings them (a sync learner would otherwise
    wait ``claim_min_idle_s`` for its actors' segments)."""
    from srl.runner.distribution.queues import open_queue

    raw = redis.Redis.from_url(redis_url)
    target = raw.connection_pool.connection_kwargs
    with WanProxy(target["host"], target["port"]) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/{target.get('db', 0)}"
        with open_queue(redis_url, namespace=namespace, role="producer") as producer, \
                open_queue(url, namespace=namespace, role="consumer") as consumer:
            assert consumer.get_many(4, 0.0) == []  # its first takeover look done
            producer.put_many([b"segment"])
            key = consumer.key  # type: ignore[attr-defined]
            proxy.set_delay(1.0)  # a reply takes a second: time to lose it
            got: list[list] = []
            reader = threading.Thread(target=lambda: got.append(consumer.get_many(4, 30.0)))
            reader.start()
            wait_for(lambda: raw.xpending(key, "trainer")["pending"] == 1, 10.0, "the read to run in Redis")
            assert proxy.reset() >= 1  # its reply is still on its way: lost
            proxy.set_delay(0.0)  # what follows need not crawl
            reader.join(timeout=25.0)  # within the read's timeout, not at takeover (30 s)
            assert not reader.is_alive() and [m.data for m in got[0]] == [b"segment"]
            assert "redelivered" in got[0][0].source
            consumer.ack_many(got[0])
            assert consumer.get_many(4, 0.0) == []  # and once only
            assert raw.xpending(key, "trainer")["pending"] == 0
    raw.close()


@contextlib.contextmanager
def far(url: str, delay_s: float) -> Iterator[str]:
    """``url`` with its server behind a :class:`WanProxy` of ``delay_s`` one way (Pub/Sub: its emulator)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if "emulator_host" in query:
        host, _, port = query["emulator_host"].rpartition(":")
    else:
        host, port = parts.hostname or "127.0.0.1", str(parts.port)
    with WanProxy(host, int(port), delay_s=delay_s) as proxy:
        where = f"127.0.0.1:{proxy.port}"
        if "emulator_host" in query:
            yield urlunsplit(parts._replace(query=urlencode({**query, "emulator_host": where})))
        else:
            userinfo = parts.netloc.rpartition("@")[0]
            yield urlunsplit(parts._replace(netloc=f"{userinfo}@{where}" if userinfo else where))


@pytest.mark.slow
def test_a_run_with_every_node_50ms_from_redis_and_the_queue_ends_with_an_evaluation(
    broker: Broker, redis_url: str, namespace: str  # noqa: F811
) -> None:
    with far(redis_url, 0.025) as board_url, far(broker.url, 0.025) as queue_url:
        runner = srl.Runner("CartPole-v1", tiny_config())
        runner.train_distribution(
            RedisParameters(url=board_url, task_name=namespace), queue_url, actor_num=2, max_train_count=200,
            progress_interval=None, local_processes=True, actor_options={"batch_size": 64, "batch_max_age": 0.2},
        )
        assert runner.train_count == 200
        assert len(runner.evaluate(max_episodes=2)) == 2
    board = board_for(redis_url, namespace)
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    counters = board.get_counters()
    assert counters.get("bad_messages", 0) == 0 and counters["received_transitions"] >= tiny_config().warmup_size
    board.delete_task()


def test_a_sender_with_batches_ahead_hands_them_over_while_the_link_is_cut_and_close_sends_them(
    redis_url: str, namespace: str
) -> None:
    """``ahead`` 2: two batches go to the sending thread at once though the broker is out of reach (the
    acting loop goes on); the third waits for room in the outbox; healed, every batch arrives once, in order,
    the last of them sent by ``close``."""
    from srl.base.rollout import Rollout
    from srl.runner.distribution.board.board import Board
    from srl.runner.distribution.node.serve import CounterDeltas
    from srl.runner.distribution.node.stop import StopFlag
    from srl.runner.distribution.queues import open_queue
    from srl.runner.distribution.sending.sender import RowSender
    from srl.runner.distribution.wire.codec import Codec

    config = tiny_config()
    runner = srl.Runner("CartPole-v1", config)
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    with Rollout(runner.env_config, worker, config.envs_per_actor, seed=0) as rollout:
        while worker.pending() < 24:
            rollout.step()
    rows = worker.take()
    assert rows is not None
    priorities = worker.initial_priorities(rows)
    schema = config.schema(runner.spec)
    codec = Codec(task=namespace)
    direct = RedisParameters(url=redis_url, task_name=namespace)
    target = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    with WanProxy(target["host"], target["port"], delay_s=0.005) as proxy:
        params = RedisParameters(url=proxy.url("redis", "/0"), task_name=namespace)
        sender = RowSender(open_queue(None, namespace=namespace, role="producer", redis_params=params),
                           Board(params.connect(), namespace), "actor:0", codec, schema, max_rows=8, capacity=100,
                           sender="a.1", task_tag=0, stop=StopFlag(), counters=CounterDeltas(), ahead=2)
        consumer = open_queue(None, namespace=namespace, role="consumer", redis_params=direct)
        try:
            def send(i: int) -> None:
                chunk = {k: v[8 * i:8 * i + 8] for k, v in rows.items()}
                sender.send(chunk, None if priorities is None else priorities[8 * i:8 * i + 8], 0, 0, 1)

            proxy.partition()
            first = threading.Thread(target=lambda: (send(0), send(1)), daemon=True)
            first.start()
            first.join(5)
            assert not first.is_alive()  # both handed over: the thread waits on the cut link with them
            third = threading.Thread(target=send, args=(2,), daemon=True)
            third.start()
            third.join(0.3)
            assert third.is_alive()  # the outbox is full: the caller waits (its backpressure)
            proxy.heal()
            third.join(10)
            assert not third.is_alive()
            sender.close()  # sends what the thread still holds
            assert sender.sent_batches == 3
            got = []
            deadline = time.monotonic() + 60  # a budget for a loaded machine, not a speed
            while len(got) < 3 and time.monotonic() < deadline:
                got += consumer.get_many(3 - len(got), timeout=0.5)
            assert [codec.decode_batch(m.data, schema)[0].seq for m in got] == [0, 1, 2]
            assert consumer.get_many(1, timeout=0.2) == []
        finally:
            consumer.destroy()
            consumer.close()


def test_a_sender_lets_through_what_a_round_trip_carries_at_its_rate_and_nothing_more_on_a_lan(
        redis_url: str, namespace: str) -> None:
    """Over a long link two of a put's round trips carry 2 × rate × RTT batches (on their way, and waiting for
    the trainer's next read): that many more may wait in the queue and the outbox than ``capacity`` and
    ``ahead`` say, measured each second; a LAN's fraction of a batch adds none, and an outbox never grows
    past 8 times the capacity."""
    from srl.runner.distribution.board.board import Board
    from srl.runner.distribution.node.serve import CounterDeltas, InTransit
    from srl.runner.distribution.node.stop import StopFlag
    from srl.runner.distribution.queues import open_queue
    from srl.runner.distribution.sending.sender import RowSender
    from srl.runner.distribution.wire.codec import Codec

    config = tiny_config()
    runner = srl.Runner("CartPole-v1", config)
    params = RedisParameters(url=redis_url, task_name=namespace)
    sender = RowSender(open_queue(None, namespace=namespace, role="producer", redis_params=params),
                       Board(params.connect(), namespace), "actor:0", Codec(task=namespace),
                       config.schema(runner.spec), max_rows=8, capacity=4, sender="a.1", task_tag=0, stop=StopFlag(),
                       counters=CounterDeltas(), ahead=2)
    now = [0.0]
    sender.link = InTransit(clock=lambda: now[0])

    def second_of_puts(round_trip: float, batches: int) -> int:
        """The sending thread's puts of one second: ``batches`` of them, each taking ``round_trip``."""
        start = now[0]
        for k in range(1, batches + 1):
            now[0] = start + k / batches  # the last put ends the second
            sender._note_put(round_trip, 1)
        return sender.in_transit

    try:
        assert second_of_puts(0.0005, 300) == 0  # loopback: 2 × 300 batches/s × 0.5 ms
        assert second_of_puts(0.1, 65) == 13  # 100 ms: 2 × 65 batches/s × 0.1 s
        assert second_of_puts(1.0, 300) == 32  # bounded: 8 × capacity
        assert second_of_puts(0.0005, 300) == 0  # the link got short again: nothing more
    finally:
        sender.close()


@pytest.mark.slow
def test_leases_hold_while_params_crawl_over_a_slow_link(redis_url: str, namespace: str) -> None:
    """Params of ~1 MB over a 200 kB/s link take five seconds each way, more than twice the lease's TTL: the
    trainer's publications and the actors' fetches run in the threads that also send the heartbeats, and
    the lease guards renew meanwhile, so no node's lease lapses (each would take it back, and say so)."""
    config = tiny_config()
    config.hidden_block.set_mlp((512, 512))
    target = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    with WanProxy(target["host"], target["port"], delay_s=0.01, rate=200_000) as proxy:
        runner = srl.Runner("CartPole-v1", config)
        node = {"lease_ttl": 2.0, "heartbeat_interval": 0.5}
        runner.train_distribution(
            RedisParameters(url=proxy.url("redis", "/0"), task_name=namespace), None, actor_num=1,
            max_train_count=150, timeout=240, progress_interval=None, local_processes=True,
            actor_options={**node, "batch_size": 64}, trainer_options=node,
        )
        assert runner.train_count == 150
        assert proxy.stats.bytes_down > 3 * 1_000_000  # params went several times
    board = board_for(redis_url, namespace)
    lapsed = [e.text for e in board.get_events(1000) if "lapsed" in e.text]
    assert lapsed == []
    board.delete_task()


@pytest.mark.slow
def test_a_client_whose_connections_are_reset_again_and_again_watches_the_run_to_its_end(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """Every connection of the client, 20 ms of round trip from Redis, is reset (TCP RST) twice a second
    while it watches, reports progress and loads the final params: a read cut in flight is retried on a new
    connection, none ends the client (a reset while a connection sits idle in the pool is repaired by
    redis-py before its next use; one in flight was not)."""
    start(nodes, "trainer", redis_url, namespace, tmp_path)
    start(nodes, "actor", redis_url, namespace, tmp_path)
    target = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    with WanProxy(target["host"], target["port"], delay_s=0.01) as proxy:
        done = threading.Event()
        board = board_for(redis_url, namespace)

        def resets() -> None:  # from the moment the task runs: what is reset is the watching, not the submitting
            while not done.is_set() and not ((status := board.get_status()) and status.status == TaskState.ACTIVE):
                done.wait(0.05)
            while not done.wait(0.5):
                proxy.reset()

        resetter = threading.Thread(target=resets, daemon=True)
        client = ClientThread(srl.Runner("Pendulum-v1", tiny_config()),
                              RedisParameters(url=proxy.url("redis", "/0"), task_name=namespace),
                              max_train_count=1500, progress_interval=0.3)
        client.start()
        resetter.start()
        client.join(180)
        done.set()
        resetter.join()
        assert not client.is_alive() and client.error is None, client.error
        assert proxy.stats.resets > 5
    status = board.get_status()
    assert status is not None and status.status == TaskState.END
    assert client.runner.train_count == status.train_count >= 1500
