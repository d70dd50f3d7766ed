"""The fault matrix: every algorithm × every queue × every fault, each cell a short run of real ``srl``
processes that must end on its own with nothing lost.

    python bench/faults.py --list                                  # every cell and whether it is built
    python bench/faults.py --cell dqn/redis/trainer-kill --seed 7  # one cell, replayed
    python bench/faults.py --algorithms dqn,sac --queues redis     # a slice of the matrix
    python bench/faults.py                                         # the whole matrix (hours on 2 cores)

A cell is ``algorithm/queue/fault``. It starts a private Redis (the board; the queue too for ``redis``),
a trainer, two actor slots (and a central inference server for the ``-central`` algorithms) as
``srl`` processes (tests/nodes.py), and a client in a thread that trains a small budget of a small env
(CartPole-v1; Pendulum-v1 for SAC). When the train count reaches a point of the run's middle drawn from
the seed, the cell's injector strikes. The checks, from the board and the logs:

* the client returns and the task ends END;
* the accounts balance: ``sent (+ messages injected) = received + refused + still queued``; where the
  broker cannot tell its depth (MQTT, Pub/Sub) the rest must not be negative; a surplus is allowed
  only where the trainer named duplicates, or up to the batches a sender published again after a lost
  connection (the broker may hold a copy of each);
* no node's log (nor the client's) holds a Traceback;
* the train count and the params (epoch, version) only move forward (sampled every 0.1 s);
* the fault's cost: seconds from the injection until the train count moved past where it stood;
* the final params' evaluation (mean of ``EVAL_EPISODES`` greedy episodes, by the client that loaded them:
  with ``client-attach``, the call made again; "-" for a cell that failed first); with ``--spread N`` each
  algorithm x queue runs the no-fault cell N times first, and a cell whose evaluation falls below their
  lowest fails. The cells' budgets are small, so the spread says the run's result is not worse than a run
  without the fault, not that either learned.

Each cell prints one row: cell, seed, verdict (``pass`` or ``FAIL: reason``), fault cost, wall seconds,
evaluation.
Cells that cannot apply are ``n/a`` with the reason; faults whose injector is not written yet are
``not built yet``; cells failing on a known srl defect are listed in :data:`KNOWN_FAILING` with it and
are kept out of the test suite's sample (tests/test_faults.py) until the defect is fixed.

Owns the matrix, the injectors and the checks. Must never touch the shared brokers' state beyond a
task's own namespace (a broker is stopped or starved only when it is the cell's private one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import redis  # noqa: E402

import srl  # noqa: E402
from srl.algorithms import impala, ppo, r2d2, sac  # noqa: E402
from srl.base.rl import RLConfig  # noqa: E402
from srl.rl.memories import MemoryConfig  # noqa: E402
from srl.runner.distribution import RedisParameters  # noqa: E402
from srl.runner.distribution.board.board import Board, TaskState  # noqa: E402
from srl.runner.distribution.queues import open_queue  # noqa: E402
from srl.runner.distribution.sending.in_flight import batches_given_back  # noqa: E402
from tests.nodes import (  # noqa: E402
    ClientThread,
    Node,
    board_for,
    kill_all,
    lease_holder_pid,
    sigkill,
    tiny_config,
    uid_pid,
    wait_for,
)
from tests.partitions import LogLines  # noqa: E402
from tests.queue_fixtures import PrivateMosquitto, PrivateRabbitMQ, PrivateRedis, redis_refusing  # noqa: E402
from tests.wan_proxy import WanProxy  # noqa: E402

PUBSUB_HOST = os.environ.get("PUBSUB_EMULATOR_HOST", "127.0.0.1:8085")
INFERENCE_ARGS = ("--listen", "127.0.0.1:0", "--batch-max-age", "0.2")
LEASE_TTL_S = 2.0
"""the lease TTL tests/nodes.py gives every node"""
PARTITION_S = 20.0
REFUSAL_S = 10.0
EVAL_EPISODES = 5
"""greedy episodes of a cell's final evaluation (its budget is small: the spread of its no-fault runs is what
it is judged against, not a learning target)"""
RUN_TIMEOUT_S = 300.0
"""the longest a cell waits for a stage of its run (a budget a slow machine meets, not a measurement)"""
ENDED_BEFORE = "the run ended before"
"""how the note of a run begins that reached its budget before the fault's recovery was over (a standby taking a
slot, a joining actor stepping): the run ended well, but the recovery was not seen"""
STRETCHES = (1, 3, 9)
"""the budgets a cell runs at, in turn, as multiples of its own, while each ends before its fault's recovery: a
takeover waits for a lease to lapse (seconds) whatever the budget, and a cell is judged on the recovery it names"""


# --------------------------------------------------------------------------------------------- algorithms
def _small_r2d2() -> r2d2.Config:
    return r2d2.Config(envs_per_actor=2, sequence_length=8, overlap=4, burn_in=2, n_step=2, batch_size=4,
                       warmup_size=8, env_steps_per_train=4.0, recurrent_size=16, publish_every=5, seed=1,
                       memory=MemoryConfig(capacity=200, alpha=0.9, beta_initial=0.6))


def _small_sac() -> sac.Config:
    config = sac.Config(batch_size=32, warmup_size=64, seed=0)
    config.hidden_block.set_mlp((32, 32))
    config.memory = MemoryConfig(kind="replay", capacity=2000)
    return config


@dataclass(frozen=True)
class Algorithm:
    env: str
    make: Callable[[], RLConfig]
    budget: int
    """max_train_count of a cell's run"""
    central: bool = False
    not_applicable: str = ""
    """why no cell of this algorithm can run ("": they can)"""


ALGORITHMS: dict[str, Algorithm] = {
    "dqn": Algorithm("CartPole-v1", lambda: tiny_config(), 600),
    "ppo": Algorithm("CartPole-v1", lambda: ppo.Config(envs_per_actor=2, segment_length=32, seed=0), 120),
    "ppo-async": Algorithm("CartPole-v1", lambda: ppo.Config(sync=False, envs_per_actor=2, segment_length=32,
                                                             seed=0), 200),
    "impala": Algorithm("CartPole-v1", lambda: impala.Config(envs_per_actor=2, segment_length=8, seed=0), 150),
    "r2d2": Algorithm("CartPole-v1", _small_r2d2, 200),
    "sac": Algorithm("Pendulum-v1", _small_sac, 1500),
}
for _name in ("dqn", "ppo-async", "impala", "r2d2", "sac"):
    _a = ALGORITHMS[_name]
    ALGORITHMS[f"{_name}-central"] = Algorithm(_a.env, _a.make, _a.budget, central=True)
ALGORITHMS["ppo-central"] = Algorithm(
    "CartPole-v1", lambda: ppo.Config(), 0, central=True,
    not_applicable="sync PPO's actors wait in lockstep for each params version; central inference refuses it")

QUEUES: dict[str, str | None] = {
    "redis": None,  # the queue lives in the board's Redis
    "amqp": "amqp://guest:guest@127.0.0.1:5672/",
    "mqtt": "mqtt://127.0.0.1:1883",
    "pubsub": f"pubsub://srl-test?emulator_host={PUBSUB_HOST}",
}
EXACT_DEPTH = {"redis", "amqp"}
"""queues whose broker tells its depth: their accounts must balance to the batch"""


# --------------------------------------------------------------------------------------------- one run
@dataclass
class Samples:
    """The board's train count and params head, sampled through the run."""

    times: list[tuple[float, int]] = field(default_factory=list)
    backwards: list[str] = field(default_factory=list)


class Run:
    """What an injector gets: the cell's Redis, board, nodes, client and queue."""

    def __init__(self, cell: Cell, work: Path, seed: int, scaled: bool = True, stretch: int = 1) -> None:
        self.cell = cell
        self.scaled = scaled
        """the fault's ``budget_scale`` applies (False: the algorithm's budget, as the test suite's sample runs)"""
        self.stretch = stretch
        """the budget's multiple (``STRETCHES``): more than 1 where a shorter run ended before the recovery"""
        self.work = work
        self.rng = random.Random(seed)
        self.task = f"faults-{uuid.uuid4().hex[:10]}"
        self.nodes: list[Node] = []
        self.redis = PrivateRedis(persistent=cell.fault == "broker-restart" and cell.queue == "redis")
        self.broker: PrivateMosquitto | PrivateRabbitMQ | None = None
        """the cell's private broker for the queue (one the fault restarts); None: the shared one"""
        self.proxy: WanProxy | None = None
        self.joining: Node | None = None
        """the elastic fault's third actor, imported and waiting at its gate"""
        self.killed: list[str] = []
        """the uids of the lease holders the injector SIGKILLed"""
        self.injected = 0
        """messages the injector put into the queue itself (not sent by an actor)"""
        self.client: ClientThread | None = None
        self.runner: srl.Runner | None = None
        self.client_process: subprocess.Popen[bytes] | None = None
        """the client in a process of its own (the attach fault kills it)"""
        self.client_logs: list[Path] = []
        self.client_lines: list[str] = []
        """what the client logged (srl.client)"""
        self.notes: list[str] = []

    @property
    def url(self) -> str:
        return self.redis.url

    @property
    def budget(self) -> int:
        """The cell's train steps: its algorithm's, times its fault's ``budget_scale`` where ``scaled``, times
        ``stretch``."""
        scale = FAULTS[self.cell.fault].budget_scale if self.scaled else 1
        return ALGORITHMS[self.cell.algorithm].budget * scale * self.stretch

    @property
    def queue_url(self) -> str | None:
        if self.broker is not None:
            return self.broker.url
        return QUEUES[self.cell.queue]

    @property
    def redis_params(self) -> RedisParameters:
        return RedisParameters(url=self.url, task_name=self.task)

    def board(self) -> Board:
        return board_for(self.url, self.task)

    def node(self, role: str, url: str | None = None, gated: bool = False) -> Node:
        extra: tuple[str, ...] = () if self.queue_url is None else ("--queue-url", self.queue_url)
        if role == "inference":
            extra = (*extra, *INFERENCE_ARGS)
        started = Node(role, url or self.url, self.task, self.work, *extra, gated=gated)
        self.nodes.append(started)
        return started

    def node_of(self, pid: int | None) -> Node | None:
        return next((n for n in self.nodes if n.proc.pid == pid), None)

    def client_kwargs(self) -> dict[str, Any]:
        algorithm = ALGORITHMS[self.cell.algorithm]
        kwargs: dict[str, Any] = {"queue_params": self.queue_url, "actor_num": 2,
                                  "max_train_count": self.budget, "progress_interval": 5.0}
        if algorithm.central:
            kwargs["inference"] = "central"
        if self.cell.fault == "elastic":
            kwargs.update(elastic_actors=True, actor_num=3)
        return kwargs


def client_call(algorithm: str, redis_url: str, task: str, kwargs_repr: str) -> None:
    """The client's call, in a process of its own (the attach fault kills it and makes it again)."""
    import ast

    kwargs = ast.literal_eval(kwargs_repr)
    a = ALGORITHMS[algorithm]
    runner = srl.Runner(a.env, a.make())
    runner.train_distribution(RedisParameters(url=redis_url, task_name=task), **kwargs)


# --------------------------------------------------------------------------------------------- injectors
# Each injector strikes once, mid-run, and returns when the fault is over (the run goes on by itself).
def until(run: Run, predicate: Callable[[], Any], timeout: float, what: str) -> bool:
    """Wait for ``predicate`` as ``wait_for`` does, or for the task to end first: a run that reaches its
    budget before a recovery is over has ended on its own with the fault in it (noted, not failed)."""
    board = run.board()

    def done() -> str:
        if predicate():
            return "met"
        status = board.get_status()
        return "ended" if status is not None and status.status.finished else ""

    if wait_for(done, timeout, what) == "ended":
        run.notes.append(f"the run ended before {what}")
        return False
    return True


def inject_none(run: Run) -> None:
    """The baseline: nothing happens."""


def _kill_holder(run: Run, lease: str) -> None:
    board = run.board()
    uid: str = wait_for(lambda: board.lease_holder(lease)[0], 60, f"a holder of the {lease} lease")
    pid = uid_pid(uid)
    run.killed.append(uid)  # the uid read with its pid: the one whose ledger explains a surplus
    sigkill(pid)
    until(run, lambda: (lease_holder_pid(board, lease) or pid) != pid, 60 + 3 * LEASE_TTL_S,
          f"a standby took the {lease} lease")


def inject_trainer_kill(run: Run) -> None:
    """SIGKILL the trainer; the standby takes the lease over."""
    _kill_holder(run, "trainer")


def inject_actor_kill(run: Run) -> None:
    """SIGKILL the actor of slot 0; the standby actor takes the slot."""
    _kill_holder(run, "actor:0")


def inject_inference_kill(run: Run) -> None:
    """SIGKILL the inference server; the standby server takes the lease."""
    _kill_holder(run, "inference")


def inject_zombie(run: Run) -> None:
    """SIGSTOP the actor of slot 0 until the standby holds its slot, then SIGCONT it: a zombie that wakes
    to find its slot taken must stand down without writing into the run."""
    board = run.board()
    pid = wait_for(lambda: lease_holder_pid(board, "actor:0"), 60, "a holder of slot 0")
    node = run.node_of(pid)
    assert node is not None, f"slot 0 is held by pid {pid}, not one of this cell's actors"
    node.signal(signal.SIGSTOP)
    try:
        until(run, lambda: (lease_holder_pid(board, "actor:0") or pid) != pid, 60 + 3 * LEASE_TTL_S,
              "the standby took the stopped actor's slot")
    finally:
        node.signal(signal.SIGCONT)


MALFORMED = 10
"""messages the malformed fault puts: more than a queue holds at the client's default capacity (8 batches),
so that a refused message keeping its place in the queue's accounts (a backpressure leak) would stall the
actors, not pass unseen"""


def inject_malformed(run: Run) -> None:
    """Put messages that are no batch into the task's queue; the trainer must count each, log it, ack it
    and go on, and the actors must not lose their room in the queue to them."""
    with open_queue(run.queue_url, namespace=run.task, role="producer", redis_params=run.redis_params) as queue:
        queue.put_many([b"not an srl batch: " + os.urandom(16) for _ in range(MALFORMED)])
    run.injected += MALFORMED
    board = run.board()
    until(run, lambda: board.get_counters().get("bad_messages", 0) >= MALFORMED, 60,
          f"the trainer refused the {MALFORMED} messages")


def inject_elastic(run: Run) -> None:
    """An elastic task of up to 3 actors with 2 there: a third joins, works, and leaves. The third was started
    with the others and waits, imported, at its gate: it arrives at the fault's moment, not the seconds its
    imports take later (a short run had ended before)."""
    board = run.board()
    joined = run.joining
    assert joined is not None, "the elastic cell starts its joining actor (gated) with the others"
    joined.open_gate()
    if until(run, lambda: lease_holder_pid(board, "actor:2") == joined.proc.pid, 90, "the joining actor took slot 2") \
            and until(run, lambda: (board.get_all_stats().get("actor:2") or {}).get("env_steps", 0) > 0, 90,
                      "the joining actor stepped its envs"):
        joined.stop()
        until(run, lambda: board.lease_holder("actor:2")[0] is None, 30, "the leaving actor's slot was free")


def inject_client_attach(run: Run) -> None:
    """SIGKILL the client; the same call again attaches to the task and watches it to its end. A task that
    ended while no client watched is replaced by the same call (attach=None submits a new task of this
    config over an ended one, as documented): the cell notes it, and the new task's counts start over."""
    assert run.client_process is not None
    run.client_process.kill()
    run.client_process.wait(10)
    status = run.board().get_status()
    if status is not None and status.status.finished:
        run.notes.append("the run ended before the same call came again, which submitted a new run over it")
    run.client = _thread_client(run)
    run.client.start()


def redis_refusing_for(refusal: str) -> Callable[[Run], None]:
    """An injector: the board's Redis refuses with ``refusal`` for 10 s, then answers again. OOM: every
    write (maxmemory 1 byte, noeviction), as a full Redis; READONLY: every write, as a primary a failover
    demoted to a replica (of a primary that never answers); BUSY: everything, as a Redis running a slow
    script (a script spinning past lua-time-limit, then SCRIPT KILL)."""

    def inject(run: Run) -> None:
        admin = redis.Redis.from_url(run.url)
        try:
            with redis_refusing(admin, refusal):
                time.sleep(REFUSAL_S)  # the fault is the time passing
        finally:
            admin.close()

    inject.__doc__ = f"The board's Redis answers {refusal} for {REFUSAL_S:g} s."
    return inject


def inject_broker_restart(run: Run) -> None:
    """Restart the cell's private broker (SIGTERM, then start on the same port and data directory)."""
    if run.cell.queue in ("mqtt", "amqp"):  # its persistence: the queue and its messages come back
        assert run.broker is not None
        run.broker.restart()
    else:  # redis with its append-only file: the board and the queue come back
        run.redis.restart()


def inject_partition(run: Run) -> None:
    """Cut the trainer off from Redis for 20 s (traffic held, connections kept); a standby takes over,
    and the first finds itself fenced once healed."""
    assert run.proxy is not None
    board = run.board()
    run.proxy.partition()
    try:
        took = until(run, lambda: (s := board.get_status()) is not None and s.trainer_epoch >= 2,
                     3 * LEASE_TTL_S + PARTITION_S + 30, "the standby took the trainer lease over")
        remaining = PARTITION_S - (time.monotonic() - run.proxy.partitioned_at)
        if took and remaining > 0:
            time.sleep(remaining)  # the rest of the cut: the time passing is the fault
    finally:
        run.proxy.heal()


@dataclass(frozen=True)
class Fault:
    inject: Callable[[Run], None] | None
    """None: not built yet"""
    standby: str = ""
    """the role started twice (one stands by)"""
    queues: tuple[str, ...] = tuple(QUEUES)
    """the queues it is built for (others: not built yet)"""
    central_only: bool = False
    not_for: dict[str, str] = field(default_factory=dict)
    """queue -> why the fault cannot apply there"""
    kills_receiver: bool = False
    """SIGKILLs the trainer: the reads it counted but had not acked yet are received and queued again until its
    successor reads them (named by the killed trainer's ledger on the board), so a surplus up to its ledger is
    no loss"""
    kills_sender: bool = False
    """SIGKILLs a node that sends batches: what it sent after its last report is received but was never
    counted as sent (the client's summary names this surplus), so more received than sent is no loss"""
    budget_scale: int = 1
    """times the algorithm's budget a cell of this fault runs: a recovery that waits for a lease to lapse and a
    standby to start (or a broker to come back) lands inside the run, and the fault's cost is measured"""


FAULTS: dict[str, Fault] = {
    "none": Fault(inject_none),
    "trainer-kill": Fault(inject_trainer_kill, standby="trainer", kills_receiver=True),
    "actor-kill": Fault(inject_actor_kill, standby="actor", kills_sender=True, budget_scale=3),
    "zombie": Fault(inject_zombie, standby="actor", budget_scale=3),
    "malformed": Fault(inject_malformed),
    "elastic": Fault(inject_elastic, budget_scale=3),
    "client-attach": Fault(inject_client_attach),
    "redis-oom": Fault(redis_refusing_for("OOM")),
    "redis-readonly": Fault(redis_refusing_for("READONLY")),
    "redis-busy": Fault(redis_refusing_for("BUSY")),
    "broker-restart": Fault(inject_broker_restart, queues=("redis", "mqtt", "amqp"), budget_scale=3, not_for={
        "pubsub": "the Pub/Sub emulator keeps nothing across a restart (topics, subscriptions and messages go), "
                  "and Google's service has no restart a client sees: its outage is the partition's fault"}),
    "partition": Fault(inject_partition, standby="trainer"),
    "inference-kill": Fault(inject_inference_kill, standby="inference", central_only=True, kills_sender=True,
                            budget_scale=3),
}

KNOWN_FAILING: dict[str, str] = {}
"""cell pattern (a regular expression over ``algorithm/queue/fault``) -> the srl defect it fails on; these
cells run here but stay out of the test suite's sample until the defect is fixed"""


# --------------------------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class Cell:
    algorithm: str
    queue: str
    fault: str

    @property
    def name(self) -> str:
        return f"{self.algorithm}/{self.queue}/{self.fault}"

    @staticmethod
    def parse(name: str) -> Cell:
        parts = name.split("/")
        if len(parts) != 3 or parts[0] not in ALGORITHMS or parts[1] not in QUEUES or parts[2] not in FAULTS:
            raise ValueError(f"a cell is algorithm/queue/fault with algorithm in {', '.join(ALGORITHMS)}, queue in "
                             f"{', '.join(QUEUES)}, fault in {', '.join(FAULTS)}; got {name!r}")
        return Cell(*parts)

    def not_applicable(self) -> str:
        """Why this cell cannot apply ("": it can)."""
        algorithm, fault = ALGORITHMS[self.algorithm], FAULTS[self.fault]
        if algorithm.not_applicable:
            return algorithm.not_applicable
        if fault.central_only and not algorithm.central:
            return "local inference: there is no inference server to kill"
        return fault.not_for.get(self.queue, "")

    def not_built(self) -> str:
        fault = FAULTS[self.fault]
        if fault.inject is None:
            return "no injector yet"
        if self.queue not in fault.queues:
            return f"built for {', '.join(fault.queues)} only"
        return ""

    def known_failing(self) -> str:
        return next((why for pattern, why in KNOWN_FAILING.items() if re.fullmatch(pattern, self.name)), "")


def all_cells() -> list[Cell]:
    return [Cell(a, q, f) for a in ALGORITHMS for q in QUEUES for f in FAULTS]


def runnable(cell: Cell) -> bool:
    return not cell.not_applicable() and not cell.not_built()


def ci_sample(seed: int) -> list[Cell]:
    """A sample drawn from ``seed``: at least one cell per built fault (the baseline ``none`` is no fault)
    and per algorithm (central variants count with their algorithm, and one central cell at least),
    across the queues; known failing cells left out."""
    rng = random.Random(seed)
    pool = [c for c in all_cells() if runnable(c) and not c.known_failing()]
    rng.shuffle(pool)
    faults = {c.fault for c in pool} - {"none"}
    algorithms = {c.algorithm.removesuffix("-central") for c in pool}
    queues = {c.queue for c in pool}
    chosen: list[Cell] = []

    def gain(c: Cell) -> int:
        return ((c.fault in faults) * 4 + (c.algorithm.removesuffix("-central") in algorithms) * 2
                + (c.queue in queues))

    while faults or algorithms:
        best = max(pool, key=gain)
        chosen.append(best)
        pool.remove(best)
        faults.discard(best.fault)
        algorithms.discard(best.algorithm.removesuffix("-central"))
        queues.discard(best.queue)
    if not any(ALGORITHMS[c.algorithm].central for c in chosen):
        chosen.append(next(c for c in pool if ALGORITHMS[c.algorithm].central))
    return chosen


# --------------------------------------------------------------------------------------------- running
@dataclass
class Result:
    cell: str
    seed: int
    verdict: str
    cost_s: float | None
    wall_s: float
    accounts: str = ""
    logs: str = ""
    """where a failing cell's logs were kept"""
    evaluation: float | None = None
    """the final params' mean return over ``EVAL_EPISODES`` (None: not evaluated)"""
    stretch: int = 1
    """the multiple of its budget the cell ran at last (``STRETCHES``)"""

    @property
    def missed_recovery(self) -> bool:
        """It passed, but its run reached its budget before the fault's recovery was over."""
        return missed_recovery(self.verdict)

    def row(self) -> str:
        cost = "-" if self.cost_s is None else f"{self.cost_s:.1f}"
        evaluation = "-" if self.evaluation is None else f"{self.evaluation:.1f}"
        return f"{self.cell:36} {self.seed:>10} {self.verdict:60} {cost:>7} {self.wall_s:>7.1f} {evaluation:>8}"

    def below(self, spread: tuple[float, float, int] | None) -> Result:
        """This result failed where its evaluation fell below ``spread`` (lowest, highest, runs) of the no-fault
        runs of its algorithm and queue."""
        if spread is None or self.evaluation is None or self.evaluation >= spread[0] \
                or not self.verdict.startswith("pass"):
            return self
        low, high, runs = spread
        why = f"FAIL: evaluation {self.evaluation:.1f} below the no-fault spread {low:.1f}..{high:.1f} ({runs} runs)"
        return dataclasses.replace(self, verdict=why)


def _thread_client(run: Run) -> ClientThread:
    algorithm = ALGORITHMS[run.cell.algorithm]
    run.runner = srl.Runner(algorithm.env, algorithm.make())
    return ClientThread(run.runner, run.redis_params, **run.client_kwargs())


def _sampler(run: Run, samples: Samples, stop: threading.Event) -> None:
    board = run.board()
    last, task_id = (0, 0, 0), ""
    while not stop.wait(0.1):
        try:
            status = board.get_status()
        except redis.RedisError:
            continue  # the board away (a restart, OOM does not refuse reads): sampled again next time
        if status is None:
            continue
        if status.task_id != task_id:  # a new task of this name (client-attach after the end): its own counts
            if task_id and not any("new run" in note for note in run.notes):
                run.notes.append("a new run of this name replaced the ended one")
            last, task_id = (0, 0, 0), status.task_id
        now = (status.train_count, status.params_epoch, status.params_version)
        samples.times.append((time.monotonic(), status.train_count))
        if now[0] < last[0]:
            samples.backwards.append(f"train_count {last[0]} -> {now[0]}")
        if now[1:] < last[1:]:
            samples.backwards.append(f"params (epoch, version) {last[1:]} -> {now[1:]}")
        last = now


def _tracebacks(run: Run) -> list[str]:
    found = []
    for path in [n.log_path for n in run.nodes] + run.client_logs:
        if path.exists() and "Traceback" in path.read_text(errors="replace"):
            found.append(path.name)
    return found


def _queue_depth(run: Run) -> int | None:
    try:
        with open_queue(run.queue_url, namespace=run.task, role="producer", redis_params=run.redis_params) as q:
            return q.depth()
    except Exception:  # the depth is not known: the balance is checked as "nothing negative"
        return None


def balance(run: Run) -> tuple[bool, str]:
    """``sent + injected = received + refused + still queued``, from the board's counters."""
    counters = run.board().get_counters()
    sent = int(counters.get("sent_batches", 0)) + run.injected
    received = int(counters.get("received_batches", 0)) - int(batches_given_back(counters))  # those are queued
    refused = int(counters.get("bad_messages", 0))
    duplicates = int(counters.get("duplicates", 0))
    depth = _queue_depth(run) if run.cell.queue in EXACT_DEPTH else None
    text = (f"sent {sent} (injected {run.injected}) = received {received} + refused {refused} + queued "
            f"{'?' if depth is None else depth}, duplicates {duplicates}")
    rest = sent - received - refused - (depth or 0)
    fault = FAULTS[run.cell.fault]
    if fault.kills_receiver and rest < 0:
        counted = sum(len(keys) for uid, keys in run.board().get_ledgers().items() if uid in run.killed)
        text += f", the killed trainer's ledger names {counted}"
        if -rest <= counted:
            return True, text
    if depth is None:
        return rest >= 0 or fault.kills_sender, text
    republished = int(counters.get("republished_batches", 0))  # the broker may hold a copy of each
    if republished:
        text += f", republished {republished}"
    surplus_named = duplicates > 0 or fault.kills_sender or -rest <= republished
    return rest == 0 or (rest < 0 and surplus_named), text


def _cleanup_queue(run: Run) -> None:
    if run.queue_url is None or run.broker is not None:
        return  # in the private Redis/broker, which goes with the cell
    try:
        with open_queue(run.queue_url, namespace=run.task, role="consumer", redis_params=run.redis_params) as q:
            q.destroy()
    except Exception as e:  # a leftover on a shared broker is untidy, not a failure of the cell
        logging.getLogger(__name__).debug("could not remove the queue of %s: %s", run.task, e)


def missed_recovery(verdict: str) -> bool:
    """A passing verdict whose run reached its budget before the fault's recovery was over."""
    return verdict.startswith("pass") and ENDED_BEFORE in verdict


def run_cell(cell: Cell, seed: int, scaled: bool = True) -> Result:
    """Run one cell with ``seed``; never raises for what the cell finds (the verdict says). ``scaled`` False: at
    its algorithm's budget whatever the fault (the test suite's sample keeps to minutes). A run that passes but
    ends before its fault's recovery is over runs again with the same seed at the next of ``STRETCHES``; the
    result is the last run's, its wall time every run's."""
    spent = 0.0
    for stretch in STRETCHES:
        result = run_cell_at(cell, seed, stretch, scaled)
        spent += result.wall_s
        if not result.missed_recovery:
            break
    if stretch == STRETCHES[0]:
        return result
    note = f"at {stretch}x its budget: a shorter run was over before the recovery"
    verdict = result.verdict[:-1] + f"; {note})" if result.verdict.endswith(")") else f"{result.verdict} ({note})"
    return dataclasses.replace(result, verdict=verdict, wall_s=spent, stretch=stretch)


def run_cell_at(cell: Cell, seed: int, stretch: int, scaled: bool = True) -> Result:
    """One run of ``cell`` with ``seed`` at ``stretch`` times its budget, in a directory of its own (kept where it
    fails)."""
    started = time.monotonic()
    if why := cell.not_applicable():
        return Result(cell.name, seed, f"n/a: {why}", None, 0.0)
    if why := cell.not_built():
        return Result(cell.name, seed, f"not built yet: {why}", None, 0.0)
    with tempfile.TemporaryDirectory(prefix="srl-faults-") as tmp:
        run = Run(cell, Path(tmp), seed, scaled, stretch)
        evaluation: float | None = None
        try:
            verdict, cost, accounts, evaluation = _run(run)
        except Exception as e:
            verdict, cost, accounts = f"FAIL: {type(e).__name__}: {e}", None, ""
            (run.work / "bench-error.txt").write_text(traceback.format_exc())  # kept with the logs below
        finally:
            (run.work / "client.log").write_text("\n".join(run.client_lines) + "\n")
            kill_all(run.nodes)
            if run.client_process is not None and run.client_process.poll() is None:
                run.client_process.kill()
                run.client_process.wait()
            _cleanup_queue(run)
            if run.proxy is not None:
                run.proxy.stop()
            if run.broker is not None:
                run.broker.cleanup()
            run.redis.cleanup()
        kept = ""
        if verdict.startswith("FAIL"):  # the logs outlive the cell, to read why
            kept = str(Path(tempfile.gettempdir()) / "srl-faults" / f"{cell.name.replace('/', '-')}-{seed}-x{stretch}")
            shutil.copytree(run.work, kept, dirs_exist_ok=True)
        return Result(cell.name, seed, verdict, cost, time.monotonic() - started, accounts, kept, evaluation, stretch)


def _run(run: Run) -> tuple[str, float | None, str, float | None]:
    cell, algorithm, fault = run.cell, ALGORITHMS[run.cell.algorithm], FAULTS[run.cell.fault]
    run.redis.start()
    if cell.fault == "broker-restart" and cell.queue in ("mqtt", "amqp"):
        run.broker = PrivateMosquitto() if cell.queue == "mqtt" else PrivateRabbitMQ()
        run.broker.start()
    board = run.board()
    trainer_url = run.url
    if cell.fault == "partition":
        run.proxy = WanProxy("127.0.0.1", run.redis.port, delay_s=0.002).start()
        trainer_url = run.proxy.url("redis", "/0")
    first_trainer = run.node("trainer", trainer_url)
    for _ in range(2):
        run.node("actor")
    if algorithm.central:
        run.node("inference")
    if cell.fault == "elastic":
        run.joining = run.node("actor", gated=True)
    at = int(run.budget * run.rng.uniform(0.3, 0.6))
    lines = LogLines()
    run.client_lines = lines.lines
    client_log = logging.getLogger("srl.client")
    client_log.addHandler(lines)
    old_level = client_log.level
    client_log.setLevel(logging.INFO)
    samples, stop = Samples(), threading.Event()
    sampler = threading.Thread(target=_sampler, args=(run, samples, stop), daemon=True)
    try:
        if cell.fault == "client-attach":
            log = run.work / "client-killed.log"
            run.client_logs.append(log)
            code = ("import sys; sys.path.insert(0, sys.argv[1]); from bench.faults import client_call; "
                    "client_call(*sys.argv[2:])")
            with open(log, "wb") as out:
                run.client_process = subprocess.Popen(
                    [sys.executable, "-c", code, str(ROOT), cell.algorithm, run.url, run.task,
                     repr(run.client_kwargs())], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        else:
            run.client = _thread_client(run)
            run.client.start()
        sampler.start()
        if fault.standby == "trainer":  # the standby comes once the first holds the lease
            wait_for(lambda: lease_holder_pid(board, "trainer") == first_trainer.proc.pid, RUN_TIMEOUT_S,
                     "the first trainer to take the lease")
        if fault.standby:
            run.node(fault.standby)
        wait_for(lambda: (s := board.get_status()) is not None and s.train_count >= at, RUN_TIMEOUT_S,
                 f"train count {at} (the moment of the fault)")
        injected_at = time.monotonic()
        assert fault.inject is not None
        fault.inject(run)
        over_at = time.monotonic()
        assert run.client is not None
        run.client.join(RUN_TIMEOUT_S)
    finally:
        stop.set()
        client_log.removeHandler(lines)
        client_log.setLevel(old_level)
    cost = fault_cost(samples, injected_at, over_at)
    accounts_line = next((line.strip() for line in lines.lines if line.startswith("  batches: sent")), "")
    problems: list[str] = []
    if run.client.is_alive():
        problems.append(f"the client did not return within {RUN_TIMEOUT_S:.0f}s")
    elif run.client.error is not None:
        problems.append(f"the client raised {type(run.client.error).__name__}: {run.client.error}")
    status = board.get_status()
    if status is None or status.status != TaskState.END:
        problems.append(f"the task ended {status.status.value if status else 'nowhere'}"
                        f"{f' ({status.end_reason})' if status else ''}, not END")
    ok, accounts = balance(run)
    if not ok:
        problems.append(f"accounts do not balance: {accounts}")
    if tracebacks := _tracebacks(run):
        problems.append(f"Traceback in {', '.join(tracebacks)}")
    if samples.backwards:
        problems.append(f"went backwards: {'; '.join(samples.backwards[:3])}")
    notes = f" ({'; '.join(run.notes)})" if run.notes else ""
    verdict = ("pass" if not problems else "FAIL: " + "; ".join(problems)) + notes
    evaluation = None  # by the client that loaded the final params (the attach fault's: the call made again)
    if run.runner is not None and not problems:
        evaluation = float(np.mean(run.runner.evaluate(EVAL_EPISODES, seed=run.rng.randrange(2**31))))
    return verdict, cost, accounts_line or accounts, evaluation


def replay_command(cell: Cell, seed: int, scaled: bool = True) -> str:
    return f"python bench/faults.py --cell {cell.name} --seed {seed}" + ("" if scaled else " --unscaled")


def fault_cost(samples: Samples, injected_at: float, over_at: float) -> float | None:
    """Seconds from the injection until the train count moved past the highest it had reached when the
    injector returned (the fault over): what the fault cost the run, recovery included (None: it never
    moved again while sampled)."""
    seen = [count for t, count in samples.times if t <= over_at]
    high = max(seen) if seen else 0
    return next((t - injected_at for t, count in samples.times if t > over_at and count > high), None)


# --------------------------------------------------------------------------------------------- the command
def no_fault_spreads(cells: list[Cell], runs: int, seed: int | None) -> dict[tuple[str, str], tuple[float, float, int]]:
    """For each algorithm x queue of ``cells`` (a fault among them), ``runs`` runs of its no-fault cell, each row
    printed: the lowest and highest final evaluation and how many were evaluated."""
    spreads: dict[tuple[str, str], tuple[float, float, int]] = {}
    if runs < 1:
        return spreads
    for algorithm, queue in dict.fromkeys((c.algorithm, c.queue) for c in cells if c.fault != "none"):
        cell = Cell(algorithm, queue, "none")
        if cell.not_applicable() or cell.not_built():
            continue
        evaluations = []
        for k in range(runs):
            result = run_cell(cell, (seed if seed is not None else random.Random().randrange(10**9)) + k)
            print(result.row() + "  (spread)", flush=True)
            if result.evaluation is not None:
                evaluations.append(result.evaluation)
        if evaluations:
            spreads[(algorithm, queue)] = (min(evaluations), max(evaluations), len(evaluations))
    return spreads


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "-"
    except (OSError, subprocess.SubprocessError):
        return "-"


def write_record(path: Path, result: Result, scaled: bool) -> None:
    """One line of ``path`` per cell run: what the table and ``--passes`` read."""
    line = {"cell": result.cell, "seed": result.seed, "verdict": result.verdict, "cost_s": result.cost_s,
            "wall_s": round(result.wall_s, 1), "evaluation": result.evaluation, "scaled": scaled,
            "stretch": result.stretch,
            "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def read_record(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"{path}:{number}: not a result line, skipped", file=sys.stderr)
    return rows


def passed_seeds(rows: list[dict[str, Any]]) -> dict[str, set[int]]:
    """The seeds each cell passed with, its fault's recovery seen (a run over before it does not count)."""
    done: dict[str, set[int]] = {}
    for row in rows:
        verdict = str(row.get("verdict", ""))
        if verdict.startswith("pass") and not missed_recovery(verdict):
            done.setdefault(str(row["cell"]), set()).add(int(row["seed"]))
    return done


def record_table(rows: list[dict[str, Any]], cells: list[Cell]) -> str:
    """Algorithm x fault: runnable cells passed (by at least one and by two seeds) and failed, over the queues;
    then every failing run with its replay command."""
    passes = passed_seeds(rows)
    failed: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if not str(row.get("verdict", "")).startswith("pass"):
            failed.setdefault(str(row["cell"]), []).append(row)
    runnable_cells = [c for c in cells if not (c.not_applicable() or c.not_built())]
    algorithms = list(dict.fromkeys(c.algorithm for c in runnable_cells))
    faults = list(dict.fromkeys(c.fault for c in runnable_cells))

    def counts(mine: list[Cell]) -> tuple[int, int, int]:
        """Of ``mine``: passed once, passed with two seeds, failed and never passed."""
        seeds = [len(passes.get(c.name, ())) for c in mine]
        bad = sum(1 for c, n in zip(mine, seeds, strict=True) if c.name in failed and not n)
        return sum(n >= 1 for n in seeds), sum(n >= 2 for n in seeds), bad

    lines = ["cells passed once / twice (different seeds) / failing, of the runnable cells, over the queues", "",
             "| algorithm | " + " | ".join(f"`{f}`" for f in faults) + " |",
             "|---|" + "---|" * len(faults)]
    for algorithm in algorithms:
        cells_of: list[str] = []
        for fault in faults:
            mine = [c for c in runnable_cells if c.algorithm == algorithm and c.fault == fault]
            cells_of.append("/".join(map(str, counts(mine))) + f" of {len(mine)}" if mine else "n/a")
        lines.append(f"| {algorithm} | " + " | ".join(cells_of) + " |")
    once, twice, _ = counts(runnable_cells)
    missed = sum(1 for r in rows if missed_recovery(str(r.get("verdict", ""))))
    lines += ["", f"{once} of {len(runnable_cells)} runnable cells passed at least once, {twice} with two seeds; "
              f"{len(rows)} runs recorded, {sum(r['wall_s'] for r in rows) / 3600:.1f} h of wall time"
              + (f"; {missed} passing runs ended before their fault's recovery and do not count" if missed else "")
              + "."]
    names = {c.name for c in runnable_cells}
    for name, runs in sorted(failed.items()):
        if name not in names:
            continue
        for r in runs:
            lines.append(f"- `{name}` seed {r['seed']} ({r['commit']}, {r['date']}): {r['verdict']}; replay: "
                         f"`{replay_command(Cell.parse(name), int(r['seed']), bool(r.get('scaled', True)))}`")
    return "\n".join(lines)


def _exit_on_terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", action="append", default=[], help="algorithm/queue/fault (repeatable)")
    parser.add_argument("--seed", type=int, default=None, help="the seed of the moment of each fault "
                        "(default: a fresh one per cell, printed)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--queues", default=",".join(QUEUES))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--sample", type=int, default=None, help="run ci_sample(SEED) instead (tests/test_faults.py)")
    parser.add_argument("--list", action="store_true", help="list the cells and what stands in their way; run none")
    parser.add_argument("--verbose", action="store_true", help="show the client's progress as it runs")
    parser.add_argument("--unscaled", action="store_true",
                        help="every cell at its algorithm's budget, as the test suite's sample runs them")
    parser.add_argument("--record", type=Path, default=None, metavar="FILE",
                        help="append each cell's result to FILE (JSON lines) with the commit and the date, so the "
                        "matrix can be run in parts")
    parser.add_argument("--passes", type=int, default=0, metavar="N",
                        help="with --record: skip the cells FILE already holds N passes of with different seeds; "
                             "run those with fewest first")
    parser.add_argument("--table", action="store_true",
                        help="with --record: print FILE's results as a table (algorithm x fault); run none")
    parser.add_argument("--shuffle", action="store_true",
                        help="run the cells in a random order (a matrix stopped part way then covers all of it)")
    parser.add_argument("--spread", type=int, default=0, metavar="N",
                        help="run each algorithm x queue's no-fault cell N times first; a cell whose final evaluation "
                        "falls below their lowest fails")
    args = parser.parse_args()
    if not args.verbose:  # the client's lines are kept with each cell's logs, not printed among the rows
        logging.getLogger("srl").addHandler(logging.NullHandler())
        logging.getLogger("srl").setLevel(logging.INFO)
    if args.sample is not None:
        cells = ci_sample(args.sample)
    elif args.cell:
        cells = [Cell.parse(name) for name in args.cell]
    else:
        chosen = [set(getattr(args, what).split(",")) for what in ("algorithms", "queues", "faults")]
        cells = [c for c in all_cells() if c.algorithm in chosen[0] and c.queue in chosen[1] and c.fault in chosen[2]]
    if args.table:
        if args.record is None:
            parser.error("--table reads the results of --record FILE")
        print(record_table(read_record(args.record), cells))
        return
    if args.record is not None and args.passes:
        done = passed_seeds(read_record(args.record))
        cells = [c for c in cells if len(done.get(c.name, ())) < args.passes and not c.not_applicable()]
    picker = random.Random()  # its own: a run seeds the global one (seed_everything), which would repeat seeds
    if args.shuffle:
        picker.shuffle(cells)
    if args.record is not None and args.passes:  # fewest passes first: a part run covers the most cells
        cells.sort(key=lambda c: len(done.get(c.name, ())))
    if args.list:
        for c in cells:
            why = c.not_applicable() or c.not_built() or c.known_failing()
            state = ("n/a" if c.not_applicable() else "not built yet" if c.not_built()
                     else "known failing" if c.known_failing() else "runnable")
            print(f"{c.name:36} {state:14} {why}")
        return
    # SIGTERM (a `kill`, the end of a CI job) unwinds as Ctrl-C does: the running cell's nodes and brokers go with it
    signal.signal(signal.SIGTERM, _exit_on_terminate)
    print(f"{'cell':36} {'seed':>10} {'verdict':60} {'cost s':>7} {'wall s':>7} {'eval':>8}", flush=True)
    spreads = no_fault_spreads(cells, args.spread, args.seed)
    failed = 0
    for c in cells:
        seed = args.seed if args.seed is not None else picker.randrange(10**9)
        result = run_cell(c, seed, scaled=not args.unscaled).below(
            spreads.get((c.algorithm, c.queue)) if c.fault != "none" else None)
        failed += result.verdict.startswith("FAIL")
        print(result.row(), flush=True)
        if args.record is not None and not result.verdict.startswith("n/a"):
            write_record(args.record, result, scaled=not args.unscaled)
        if result.verdict.startswith("FAIL"):
            print(f"    accounts: {result.accounts}\n    logs: {result.logs}\n"
                  f"    replay: {replay_command(c, seed, not args.unscaled)}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
