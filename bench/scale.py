"""How many actors one board and one trainer take: simulated actors, N = 16 .. 1,024.

    python bench/scale.py                 # N = 16, 64, 256, 1024; 20 s windows (about 6 minutes)
    python bench/scale.py --quick         # N = 16, 64, 256; 6 s windows (under 3 minutes)
    python bench/scale.py --actors 100 --seconds 30

For each N, on an embedded Redis: one real trainer process (``srl trainer``, DQN on CartPole-v1,
no rate limit) and N simulated actors in this process. A simulated actor has no env: it holds a
real actor lease (``claim_actor_slot``), heartbeats as an actor does (stats and counters in the
one round trip, at the default interval), polls the params version at the actor's default
interval and pulls the params when it changes, waits while the queue is full (backpressure), and
sends valid signed-format batches (real CartPole rows, a fresh sequence number each) at
``--batch-rate`` batches per second. Measured per N:

  claim s        time until all N slots are held
  trainer cmds/s the trainer's Redis commands per second alone, over up to 5 s before the actors
                 start (INFO commandstats; it idles then, with no rows to read, ack or count)
  own cmds/s/actor
                 the actors' own Redis commands per second per actor over the window: all
                 commands less the trainer's rate alone, / N (the trainer does more once rows
                 come, so this is an upper bound)
  ops/s/actor    heartbeats, params polls and sends per second per actor (operations, not Redis
                 commands: one may take several)
  redis cpu      Redis's CPU (user + sys) over the window, as a share of one core
  lease losses   heartbeats that found the lease gone (must be 0)
  takeover s     after killing 10% of the actors without releasing their leases, until standbys
                 hold every slot again (the lease TTL bounds it)
  sent/received  batches the actors sent and the trainer received once the queue drained
                 (a difference is a lost batch; must be 0); trainer ingest rows/s, train steps/s
  stalled        share of the actors' time spent waiting on a full queue

Exits 1 if a lease was lost or a batch went missing. Redis counts the commands a Lua script runs
(a heartbeat is one round trip but several commands). When the simulated actors in this one Python
process cannot keep their own cadence (heartbeats or sends below 90% of the set rate), the row says
so: beyond that N the figures describe this bench's client, not the board. Everything shares this machine's cores: the
N actor threads, Redis and the trainer; the trainer's rates drop as N grows for that reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srl
from srl.algorithms import dqn
from srl.base.env import EnvConfig
from srl.base.rollout import Rollout
from srl.runner.distribution.actor.run import ActorOptions
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.client.embedded import start_embedded_redis
from srl.runner.distribution.node.serve import NodeOptions
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.wire.codec import BatchHeader, Codec, params_message_bytes

ROWS_PER_BATCH = 32
CAPACITY = 64


def task_config() -> tuple[dqn.Config, dict[str, Any]]:
    config = dqn.Config(env_steps_per_train=None, warmup_size=256, seed=0)
    config.hidden_block.set_mlp((64, 64))
    return config, srl.Runner("CartPole-v1", config).task_config()


def template_rows(config: dqn.Config, count: int = ROWS_PER_BATCH) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """``count`` real CartPole rows from the algorithm's own worker (what the codec and the trainer check)."""
    runner = srl.Runner("CartPole-v1", config)
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    with Rollout(EnvConfig("CartPole-v1"), worker, config.envs_per_actor, seed=0) as rollout:
        while worker.pending() < count:
            rollout.step()
    rows = worker.take()
    assert rows is not None
    rows = {k: v[:count] for k, v in rows.items()}
    return rows, worker.initial_priorities(rows)


@dataclass
class Tally:
    lease_losses: int = 0
    sent: int = 0
    heartbeats: int = 0
    polls: int = 0
    pulls: int = 0
    stalled_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **deltas: float) -> None:
        with self.lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)


class SimActor(threading.Thread):
    """An actor without an env: lease, heartbeat, params polls and pulls, backpressure, sends."""

    def __init__(self, index: int, board: Board, board_params: Any, open_producer: Any, codec: Codec,
                 rows: dict[str, np.ndarray], priorities: np.ndarray | None, actor_num: int, batch_rate: float,
                 tally: Tally, stop: threading.Event, max_params_bytes: int) -> None:
        super().__init__(daemon=True, name=f"sim-actor-{index}")
        self.uid = f"sim-{os.getpid()}-{index}-{random.getrandbits(24):06x}"
        self.board, self.open_producer, self.codec = board, open_producer, codec
        self.board_params = board_params
        self.queue: Any = None
        self.rows, self.priorities = rows, priorities
        self.actor_num, self.batch_rate, self.tally = actor_num, batch_rate, tally
        self.stop_all = stop
        self.killed = threading.Event()
        self.max_params_bytes = max_params_bytes
        node, actor = NodeOptions(), ActorOptions()
        self.ttl_ms = int(node.lease_ttl * 1000)
        self.heartbeat_interval = node.heartbeat_interval
        self.poll_interval = actor.params_poll_interval
        self.slot: int | None = None
        self.claimed_at: float | None = None
        self.seq = 0

    def _claim(self) -> None:
        while self.slot is None and not self._stopping():
            self.slot = self.board.claim_actor_slot(self.uid, self.actor_num, self.ttl_ms)
            if self.slot is None:
                self.stop_all.wait(0.2)  # standby: the actor's task poll, shortened for the takeover row
        self.claimed_at = time.monotonic()

    def _stopping(self) -> bool:
        return self.stop_all.is_set() or self.killed.is_set()

    def run(self) -> None:
        try:
            # its own board client and queue connection, as a real actor process has
            self.board = Board(self.board_params.connect(), self.board.task_name)
            self.queue = self.open_producer()
            self._run()
        except Exception as e:  # noted, and the bench fails on it
            self.tally.errors.append(f"{self.uid}: {type(e).__name__}: {e}")
        finally:
            if self.queue is not None:
                self.queue.close()
            self.board.client.close()

    def _run(self) -> None:
        self._claim()
        rng = random.Random(self.uid)
        now = time.monotonic()
        next_beat = now + rng.uniform(0, self.heartbeat_interval)
        next_poll = now + rng.uniform(0, self.poll_interval)
        next_send = now + rng.uniform(0, 1.0 / self.batch_rate)
        version = -1
        pending = {"sent_batches": 0, "sent_transitions": 0}
        while not self._stopping():
            now = time.monotonic()
            if now >= next_beat:
                name = f"actor:{self.slot}"
                hb = self.board.heartbeat(name, self.uid, self.ttl_ms, name,
                                          {"uid": self.uid, "slot": self.slot, "sent_batches": self.seq},
                                          pending)
                pending = {"sent_batches": 0, "sent_transitions": 0}
                self.tally.add(heartbeats=1)
                if not hb.lease_held:
                    self.tally.add(lease_losses=1)
                    self.slot = None
                    self._claim()
                next_beat = now + self.heartbeat_interval
            if now >= next_poll:
                head = self.board.get_params_version()
                self.tally.add(polls=1)
                if head is not None and head[1] != version:
                    record = self.board.get_params(self.max_params_bytes)
                    version = record.version if record is not None else version
                    self.tally.add(pulls=1)
                next_poll = now + self.poll_interval
            if now >= next_send:
                waited = time.monotonic()
                while (depth := self.queue.depth()) is not None and depth >= CAPACITY and not self._stopping():
                    self.stop_all.wait(0.05)
                if self._stopping():
                    break
                self.tally.add(stalled_s=time.monotonic() - waited)
                header = BatchHeader(self.uid, int(self.slot or 0), 1, self.seq, max(version, 0), ROWS_PER_BATCH,
                                     time.time())
                rows = dict(self.rows)
                if "version" in rows:
                    rows["version"] = np.full_like(rows["version"], max(version, 0))
                self.queue.put(self.codec.encode_batch(header, rows, self.priorities))
                self.seq += 1
                self.tally.add(sent=1)
                pending["sent_batches"] += 1
                pending["sent_transitions"] += ROWS_PER_BATCH
                next_send = max(next_send + 1.0 / self.batch_rate, time.monotonic() - 1.0)
            wake = min(next_beat, next_poll, next_send) - time.monotonic()
            if wake > 0:
                self.stop_all.wait(wake)
        if not self.killed.is_set() and self.slot is not None:
            name = f"actor:{self.slot}"
            self.board.heartbeat(name, self.uid, self.ttl_ms, name, None, pending)  # the last counts
            self.board.release_lease(name, self.uid)


def redis_stats(board: Board) -> tuple[dict[str, int], float]:
    info = board.client.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}
    cpu = board.client.info("cpu")
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def command_rates(board: Board, seconds: float) -> dict[str, float]:
    """Redis commands per second by name over ``seconds``: before the actors start, the trainer's own (and
    this bench's INFO reads), which the window's are reduced by so that the per-actor figure is the actors'."""
    calls0, _ = redis_stats(board)
    t0 = time.monotonic()
    time.sleep(seconds)
    calls1, _ = redis_stats(board)
    window = time.monotonic() - t0
    return {k: (calls1.get(k, 0) - calls0.get(k, 0)) / window for k in calls1}


def measure(n: int, seconds: float, batch_rate: float) -> dict[str, Any]:
    server = start_embedded_redis()
    task_name = f"scale-{n}"
    params = server.parameters.replace(task_name=task_name)
    board = Board(params.connect(), task_name)
    config, task = task_config()
    board.create_task({**task, "actor_num": n, "queue": {"scheme": "redis", "capacity": CAPACITY},
                       "max_train_count": 10**9})
    board.set_active()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"srl-scale-trainer-{n}.log", "wb")
    trainer = subprocess.Popen([sys.executable, "-m", "srl.cli", "trainer", "--url", server.url, "--task-name",
                                task_name, "--once"], stdout=log, stderr=subprocess.STDOUT)
    rows, priorities = template_rows(config)
    codec = Codec(task=task_name)
    def open_producer() -> Any:
        return open_queue(None, namespace=task_name, role="producer", redis_params=params)

    runner = srl.Runner("CartPole-v1", config)
    max_params = params_message_bytes(runner.parameter.to_arrays())
    deadline = time.monotonic() + 60
    while "trainer" not in board.get_all_stats() and time.monotonic() < deadline:
        time.sleep(0.2)  # the trainer process is up, waiting for rows
    trainer_rates = command_rates(board, min(seconds, 5.0))
    tally, stop = Tally(), threading.Event()
    started = time.monotonic()
    actors = [SimActor(i, board, params, open_producer, codec, rows, priorities, n, batch_rate, tally, stop, max_params)
              for i in range(n)]
    for actor in actors:
        actor.start()
    while any(a.claimed_at is None for a in actors) and time.monotonic() - started < 120:
        time.sleep(0.05)
    claim_s = max(a.claimed_at or float("inf") for a in actors) - started
    calls0, cpu0 = redis_stats(board)
    tally0 = (tally.heartbeats, tally.polls, tally.sent, tally.stalled_s)
    t0 = time.monotonic()
    time.sleep(seconds)
    calls1, cpu1 = redis_stats(board)
    window = time.monotonic() - t0
    trainer_stats = board.get_all_stats().get("trainer", {})
    per = {k: ((calls1.get(k, 0) - calls0.get(k, 0)) / window - trainer_rates.get(k, 0.0)) / n for k in calls1}
    beats, polls, sent, stalled = (tally.heartbeats - tally0[0], tally.polls - tally0[1], tally.sent - tally0[2],
                                   tally.stalled_s - tally0[3])

    # takeover: 10% die without releasing; as many standbys wait to take their slots
    victims = actors[: max(1, n // 10)]
    for victim in victims:
        victim.killed.set()
    killed_at = time.monotonic()
    standbys = [SimActor(n + i, board, params, open_producer, codec, rows, priorities, n, batch_rate, tally, stop,
                         max_params) for i in range(len(victims))]
    for actor in standbys:
        actor.start()
    while any(a.claimed_at is None for a in standbys) and time.monotonic() - killed_at < 60:
        time.sleep(0.05)
    takeover_s = max(a.claimed_at or float("inf") for a in standbys) - killed_at

    stop.set()
    deadline = time.monotonic() + 120
    for actor in actors + standbys:
        actor.join(timeout=max(0.1, deadline - time.monotonic()))
    still = sum(a.is_alive() for a in actors + standbys)
    if still:
        tally.errors.append(f"{still} simulated actors still running after 120 s")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # drain: everything sent must reach the trainer
        received = board.get_counters().get("received_batches", 0)
        if received >= tally.sent:
            break
        time.sleep(0.5)
    counters = board.get_counters()
    board.end_task("END", "bench over")
    try:
        trainer.wait(timeout=30)
    except subprocess.TimeoutExpired:
        trainer.kill()
    log.close()
    server.stop()
    return {
        "n": n, "claim_s": claim_s, "trainer_cmds": sum(trainer_rates.values()), "cmds": sum(per.values()),
        "hb": beats / window / n, "poll": polls / window / n,
        "send": sent / window / n, "redis_cpu": (cpu1 - cpu0) / window, "losses": tally.lease_losses,
        "takeover_s": takeover_s, "sent": tally.sent, "received": int(counters.get("received_batches", 0)),
        "duplicates": int(counters.get("duplicates", 0)), "ingest": float(trainer_stats.get("received_per_s", 0)),
        "train": float(trainer_stats.get("train_per_s", 0)), "stalled": stalled / window / n,
        "errors": list(tally.errors), "top": sorted(per.items(), key=lambda kv: -kv[1])[:4],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 16, 64, 256 with 6 s windows")
    parser.add_argument("--actors", default="", help="comma-separated N (default 16,64,256,1024)")
    parser.add_argument("--seconds", type=float, default=None, help="measuring window per N (default 20; quick 6)")
    parser.add_argument("--batch-rate", type=float, default=0.5, help="batches per second per actor "
                        f"({ROWS_PER_BATCH} rows each)")
    args = parser.parse_args()
    logging.getLogger("srl").setLevel(logging.WARNING)
    sizes = [int(x) for x in args.actors.split(",") if x] or ([16, 64, 256] if args.quick else [16, 64, 256, 1024])
    seconds = args.seconds or (6.0 if args.quick else 20.0)
    results = []
    for n in sizes:
        result = measure(n, seconds, args.batch_rate)
        results.append(result)
        print(f"N={n}: done ({', '.join(f'{k} {v:.2f}' for k, v in result['top'])} own cmds/s/actor)", flush=True)
    node = NodeOptions()
    print(f"\nsimulated actors: heartbeat {node.heartbeat_interval:g}s, lease TTL {node.lease_ttl:g}s, params poll "
          f"{ActorOptions().params_poll_interval:g}s, {args.batch_rate:g} batches/s of {ROWS_PER_BATCH} rows; "
          f"window {seconds:g}s")
    header = (f"{'N':>5} {'claim s':>8} {'trainer cmds/s':>14} {'own cmds/s/actor':>16} "
              f"{'ops/s/actor (beat/poll/send)':>28} {'redis cpu':>9} "
              f"{'lease losses':>12} {'takeover s':>10} {'sent':>7} {'received':>8} {'ingest rows/s':>13} "
              f"{'train/s':>7} {'stalled':>7}")
    print(header)
    print("-" * len(header))
    failed = False
    for r in results:
        lost = r["sent"] - r["received"]
        failed = failed or r["losses"] > 0 or lost > 0 or bool(r["errors"])
        saturated = r["hb"] < 0.9 / node.heartbeat_interval or r["send"] < 0.9 * args.batch_rate
        ops = f"{r['hb']:.2f}/{r['poll']:.2f}/{r['send']:.2f}"
        print(f"{r['n']:>5} {r['claim_s']:>8.2f} {r['trainer_cmds']:>14.1f} {r['cmds']:>16.2f} "
              f"{ops:>28} {r['redis_cpu']:>9.0%} {r['losses']:>12} "
              f"{r['takeover_s']:>10.2f} {r['sent']:>7} {r['received']:>8} {r['ingest']:>13.0f} {r['train']:>7.0f} "
              f"{r['stalled']:>7.0%}" + ("  (this bench's client saturated: actors ran below their cadence)"
                                           if saturated else ""))
        for error in r["errors"][:3]:
            print(f"      error: {error}")
    if failed:
        print("\nFAILED: a lease was lost, a batch went missing, or an actor raised (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
