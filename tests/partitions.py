"""Partition cases on real processes, for tests/test_partitions.py and bench/partitions.py.

One node (an actor, the trainer, or the client) reaches Redis, which holds the board and the queue,
through a :class:`~tests.wan_proxy.WanProxy`; the others reach it directly. Mid-run the proxy holds that
node's traffic for ``cut_s`` (a dropped route: TCP keeps the connections, the peers hear nothing), then
heals, delivering what it held. Training goes on for a while, then the case ends the task as a client's
cancel does, and reads what the client's end of run says:

* ``actor``: its slot lapses during the cut and it takes the slot back after;
* ``trainer``: a standby trainer takes the lease over during the cut (epoch 2); healed, the first one finds
  itself fenced and stops, and every params write after the takeover is the standby's;
* ``client``: training goes on without it; healed, it watches the task to its end and loads the final
  params.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

import srl
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import Board, TaskState
from tests.nodes import ClientThread, Node, board_for, tiny_config, wait_for
from tests.wan_proxy import WanProxy

CASES = ("actor", "trainer", "client")


@dataclass
class PartitionResult:
    case: str
    cut_s: float
    lease_events: list[str] = field(default_factory=list)
    """the event log's lines about leases lapsing, taken back and fenced"""
    accounts: str = ""
    """the client's end-of-run line on batches (sent = received + refused + still queued)"""
    status: str = ""
    train_count: int = 0
    client_train_count: int = 0
    params_epoch: int = 0
    duplicates: int = 0
    client_error: str = ""

    @property
    def accounted(self) -> bool:
        return self.accounts.endswith(": all accounted for")


class LogLines(logging.Handler):
    """Keeps the messages of the log records it handles (INFO and above), in order."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _training(board: Board, at_least: int, timeout: float = 180) -> None:
    wait_for(lambda: (s := board.get_status()) is not None and s.train_count >= at_least, timeout, "training")


def train_count(board: Board) -> int:
    status = board.get_status()
    return 0 if status is None else status.train_count


def _events(board: Board) -> list[str]:
    return [e.text for e in board.get_events(1000)]


def run_case(case: str, redis_url: str, namespace: str, log_dir: Path, nodes: list[Node], cut_s: float,
             node_args: tuple[str, ...] = (), lease_ttl_s: float = 2.0, more_training: int = 300,
             config_changes: dict[str, object] | None = None) -> PartitionResult:
    """Run ``case`` (one of :data:`CASES`) once; the nodes started are appended to ``nodes`` (the caller
    stops them). ``node_args`` go to every node after tests/nodes.py's fast settings (``lease_ttl_s``:
    the TTL they make)."""
    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    target = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    board = board_for(redis_url, namespace)
    result = PartitionResult(case, cut_s)
    lines = LogLines()
    client_log = logging.getLogger("srl.client")
    client_log.addHandler(lines)
    old_level = client_log.level
    client_log.setLevel(logging.INFO)
    with WanProxy(target["host"], target["port"], delay_s=0.002) as proxy:
        far_url = proxy.url("redis", "/0")

        def node(role: str, url: str) -> Node:
            started = Node(role, url, namespace, log_dir, *node_args)
            nodes.append(started)
            return started

        try:
            node("trainer", far_url if case == "trainer" else redis_url)
            far_actor = node("actor", far_url if case == "actor" else redis_url)
            node("actor", redis_url)
            runner = srl.Runner("Pendulum-v1", tiny_config(**(config_changes or {})))
            client = ClientThread(runner, RedisParameters(url=far_url if case == "client" else redis_url,
                                                          task_name=namespace),
                                  actor_num=2, max_train_count=10**9,
                                  progress_interval=0.5 if case == "client" else 5.0)
            client.start()
            _training(board, 300)
            if case == "actor":
                slot = next(i for i in range(2)
                            if str(far_actor.proc.pid) in (board.lease_holder(f"actor:{i}")[0] or ""))
                proxy.partition()
                wait_for(lambda: board.lease_holder(f"actor:{slot}")[0] is None, 3 * lease_ttl_s + cut_s,
                         "the cut actor's slot to lapse")
                _sleep_until(proxy, cut_s)
                proxy.heal()
                wait_for(lambda: any(f"took its lapsed slot {slot} back" in t for t in _events(board)), 60 + cut_s,
                         "the actor to take its slot back")
            elif case == "trainer":
                node("trainer", redis_url)  # the standby
                proxy.partition()
                wait_for(lambda: (s := board.get_status()) is not None and s.trainer_epoch == 2,
                         3 * lease_ttl_s + cut_s + 30, "the standby to take the lease over")
                _sleep_until(proxy, cut_s)
                proxy.heal()
                wait_for(lambda: any("fenced off" in t for t in _events(board)), 60 + cut_s,
                         "the first trainer to find itself fenced")
            else:
                before = train_count(board)
                proxy.partition()
                wait_for(lambda: train_count(board) >= before + more_training, 60 + cut_s,
                         "training to go on without the client")
                _sleep_until(proxy, cut_s)
                proxy.heal()
            _training(board, train_count(board) + more_training)
            board.end_task("END", f"the {case} partition case is over")
            client.join(120 + cut_s)
            result.client_error = ("the client did not finish" if client.is_alive()
                                   else "" if client.error is None else repr(client.error))
            result.client_train_count = runner.train_count
        finally:
            client_log.removeHandler(lines)
            client_log.setLevel(old_level)
    status = board.get_status()
    result.status = "" if status is None else status.status.value
    result.train_count = 0 if status is None else status.train_count
    head = board.get_params_head()
    result.params_epoch = 0 if head is None else head[0]
    result.duplicates = int(board.get_counters().get("duplicates", 0))
    result.accounts = next((line.strip() for line in lines.lines if line.startswith("  batches: sent")), "")
    result.lease_events = [t for t in _events(board) if "lapsed" in t or "fenced" in t or "took lease" in t]
    return result


def _sleep_until(proxy: WanProxy, cut_s: float) -> None:
    """The rest of the cut (the time passing is the case under test)."""
    remaining = cut_s - (time.monotonic() - proxy.partitioned_at)
    if remaining > 0:
        time.sleep(remaining)


def check(result: PartitionResult) -> None:
    """What every case must show; an AssertionError names what did not."""
    assert result.client_error == "", result.client_error
    assert result.status == TaskState.END.value, result.status
    assert result.client_train_count == result.train_count > 0, (result.client_train_count, result.train_count)
    assert result.accounted, result.accounts
    if result.case == "actor":
        away = [int(m.group(1)) for t in result.lease_events
                if (m := re.search(r"lapsed slot \d+ back \((\d+)s without the board\)", t))]
        assert away and away[0] >= result.cut_s - 2, result.lease_events  # it says how long it was cut off
    if result.case == "trainer":
        assert result.params_epoch == 2, result.params_epoch  # every params write after the takeover: the standby's
        fenced = [t for t in result.lease_events if "fenced off by" in t]
        assert len(fenced) == 1, result.lease_events  # said once
