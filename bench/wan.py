"""srl over a slow network: each node reaches Redis (the board and the experience queue) through a TCP
proxy that delays each direction by half the round trip, against loopback measured in the same run.

    python bench/wan.py                                  # DQN, IMPALA, sync PPO at 0, 20 and 100 ms RTT
    python bench/wan.py --algos dqn --rtt 0,100 --seconds 30
    python bench/wan.py --queue amqp                     # the queue on RabbitMQ, behind its own proxy
    python bench/wan.py --algos impala --queue-capacity 32 --set buffer_segments=256 --actor send_ahead=0
    python bench/wan.py --algos dqn --rtt 100 --seconds 600 --reset-rate 0.01   # 1% of connections reset a second
    python bench/wan.py --algos ppo --trainer-near       # Redis beside the trainer: only the actors far away

Each cell is one distributed run (a trainer and ``--actors`` actor processes on an embedded Redis) of
``--seconds``; its rates are taken from the run's history between ``--warmup`` seconds and the end
(so starting, which pays round trips of its own, is left out): the trainer's train steps per second
(sync PPO: an update per train step) and every actor's env steps per second together. The proxy is
``tests/wan_proxy.py`` (latency only here: no bandwidth cap, no loss). With ``--trainer-near`` the
trainer reaches Redis directly (Redis on the trainer's machine or beside it in one cloud zone, the
actors elsewhere), so a sync version's handoff pays one round trip instead of two. Run nothing else
meanwhile: rates are wall-clock, and the ratios are what to quote.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srl
from srl.algorithms import dqn, impala, ppo
from srl.base.rl import RLConfig
from srl.runner.distribution import RedisParameters, local_nodes
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.client.embedded import start_embedded_redis
from tests.wan_proxy import WanProxy

ALGOS: dict[str, tuple[str, Any]] = {
    "dqn": ("CartPole-v1", dqn.Config),
    "impala": ("CartPole-v1", impala.Config),
    "ppo": ("CartPole-v1", ppo.Config),
}
QUEUES = {"redis": None, "amqp": ("127.0.0.1", 5672, "amqp://guest:guest@{}/"),
          "mqtt": ("127.0.0.1", 1883, "mqtt://{}")}
TARGETS = {  # (algo, rtt ms): (train/s ratio, env steps/s ratio), the targets srl aims at
    ("dqn", 20): (0.95, 0.95), ("dqn", 100): (0.8, 0.8),
    ("impala", 20): (None, 0.95), ("impala", 100): (None, 0.8),
    ("ppo", 20): (0.8, None), ("ppo", 100): (0.5, None),
}


@dataclass
class Cell:
    algo: str
    rtt_ms: float
    train_per_s: float
    env_steps_per_s: float
    window_s: float
    resets: int = 0
    """connections the proxies reset (``--reset-rate``)"""
    leases_lost: int = 0
    """leases live nodes lost and took back, or lost to another node (the event log's lapsed/fenced lines)"""
    status: str = ""


class Resetter:
    """Resets each proxied connection with probability ``rate`` every second, in a thread."""

    def __init__(self, proxies: list[WanProxy], rate: float) -> None:
        self.proxies, self.rate = proxies, rate
        self.resets = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Resetter:
        if self.rate > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(1.0):
            self.resets += sum(p.reset(self.rate) for p in self.proxies)


def rates(history: Path, warmup: float) -> tuple[float, float, float]:
    """(train steps/s, env steps/s, window seconds) between the first row at ``warmup`` s or later and the last."""
    with open(history) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_count") and r.get("env_steps")]
    window = [r for r in rows if float(r["wall_s"]) >= warmup]
    if len(window) < 2:
        raise RuntimeError(f"{history}: fewer than 2 history rows after {warmup}s; run longer (--seconds)")
    first, last = window[0], window[-1]
    span = float(last["wall_s"]) - float(first["wall_s"])
    return ((float(last["train_count"]) - float(first["train_count"])) / span,
            (float(last["env_steps"]) - float(first["env_steps"])) / span, span)


def run_cell(algo: str, rtt_ms: float, seconds: float, warmup: float, actors: int, queue: str,
             changes: dict[str, Any], actor_options: dict[str, Any], queue_capacity: int,
             reset_rate: float = 0.0, trainer_near: bool = False) -> Cell:
    env, make = ALGOS[algo]
    config: RLConfig = make()
    config.seed = 0
    for name, value in changes.items():
        if not hasattr(config, name):
            raise SystemExit(f"--set {name}: {algo} has no such field")
        setattr(config, name, value)
    config.validate()
    with start_embedded_redis() as server, WanProxy("127.0.0.1", server.port, delay_s=rtt_ms / 2000) as board_proxy, \
            tempfile.TemporaryDirectory() as log_dir:
        queue_params: str | None = None
        queue_proxy = None
        if queue != "redis":
            host, port, template = QUEUES[queue]  # type: ignore[misc]
            queue_proxy = WanProxy(host, port, delay_s=rtt_ms / 2000).start()
            queue_params = template.format(f"127.0.0.1:{queue_proxy.port}")
        proxies = [board_proxy] + ([queue_proxy] if queue_proxy is not None else [])
        nodes: list[local_nodes.LocalNode] = []
        try:
            runner = srl.Runner(env, config)
            redis_params = RedisParameters(url=board_proxy.url("redis", "/0"))
            direct = RedisParameters(url=f"redis://127.0.0.1:{server.port}/0")
            if trainer_near:  # the nodes started here: the trainer on Redis directly, the actors through the proxy
                nodes.append(local_nodes.start("trainer", direct, None, {"run_once": True}))
                nodes += [local_nodes.start("actor", redis_params, None, {"run_once": True, **actor_options})
                          for _ in range(actors)]
            with Resetter(proxies, reset_rate) as resetter:
                runner.train_distribution(direct if trainer_near else redis_params, queue_params, actor_num=actors,
                                          timeout=seconds, progress_interval=None, log_dir=log_dir,
                                          local_processes=not trainer_near, queue_capacity=queue_capacity,
                                          actor_options=None if trainer_near else actor_options)
            train, steps, span = rates(Path(log_dir) / "history.csv", warmup)
            board = Board(direct.connect(), redis_params.task_name)
            lost = [e.text for e in board.get_events(1000) if "lapsed" in e.text or "fenced off by" in e.text]
            status = board.get_status()
        finally:
            if nodes:
                local_nodes.stop_all(nodes)
            if queue_proxy is not None:
                queue_proxy.stop()
    for text in lost:
        print(f"  lease event: {text}", flush=True)
    return Cell(algo, rtt_ms, train, steps, span, resetter.resets, len(lost),
                "" if status is None else f"{status.status.value}: {status.end_reason}")


def assignments(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """``NAME=JSON`` items as a dict; a value that is not JSON is the parser's error."""
    out: dict[str, Any] = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            parser.error(f"expected NAME=JSON (buffer_segments=256, send_ahead=0), not {item!r}")
    return out


def row(values: tuple[str, ...], widths: tuple[int, ...]) -> str:
    """The first column left-aligned, the rest right-aligned."""
    return " ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, w) in enumerate(zip(values, widths, strict=True)))


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base > 0 else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", default="dqn,impala,ppo", help=f"comma-separated among {', '.join(ALGOS)}")
    parser.add_argument("--rtt", default="0,20,100", help="round trips in ms, comma-separated (0: loopback, "
                        "the baseline: always run first)")
    parser.add_argument("--seconds", type=float, default=40.0, help="each run's length")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of each run left out of its rates")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--queue", default="redis", choices=sorted(QUEUES))
    parser.add_argument("--queue-capacity", type=int, default=8, help="batches in the queue before actors wait")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="an algorithm config field for every run (repeatable)")
    parser.add_argument("--actor", action="append", default=[], metavar="OPTION=JSON",
                        help="an ActorOptions field for every actor (repeatable): send_ahead=0")
    parser.add_argument("--reset-rate", type=float, default=0.0,
                        help="every second, reset each proxied connection with this probability (0.01: 1%%); the "
                             "table then counts resets and the leases live nodes lost")
    parser.add_argument("--trainer-near", action="store_true",
                        help="the trainer reaches Redis directly, only the actors through the proxy (--queue redis)")
    parser.add_argument("--no-loopback", action="store_true",
                        help="skip the loopback baseline (no ratios: for --reset-rate runs, where leases count)")
    args = parser.parse_args()
    changes, actor_options = assignments(parser, args.set), assignments(parser, args.actor)
    if args.trainer_near and args.queue != "redis":
        parser.error("--trainer-near puts the trainer beside the run's Redis: use it with --queue redis")
    logging.getLogger("srl").setLevel(logging.WARNING)
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    if unknown := [a for a in algos if a not in ALGOS]:
        parser.error(f"unknown algorithm(s) {unknown}; known: {', '.join(ALGOS)}")
    rtts = sorted({*([] if args.no_loopback else [0.0]), *(float(r) for r in args.rtt.split(",") if r.strip())})
    cells: list[Cell] = []
    for algo in algos:
        for rtt in rtts:
            cell = run_cell(algo, rtt, args.seconds, args.warmup, args.actors, args.queue, changes, actor_options,
                            args.queue_capacity, args.reset_rate, args.trainer_near)
            cells.append(cell)
            print(f"{algo} at {rtt:g} ms RTT: {cell.train_per_s:.1f} train steps/s, {cell.env_steps_per_s:.0f} "
                  f"env steps/s over {cell.window_s:.0f}s; {cell.resets} connection resets, {cell.leases_lost} "
                  f"leases lost; task {cell.status}", flush=True)
    where = (("the actors" if args.trainer_near else "each node") + " behind a proxy delaying each direction by "
             "RTT/2" + (", the trainer beside Redis" if args.trainer_near else ""))
    print(f"\nsrl over a WAN ({args.actors} actors, queue {args.queue} of capacity {args.queue_capacity}; {where}; "
          f"{args.seconds:g} s runs, rates after {args.warmup:g} s; "
          f"ratios ÷ loopback){' ' + ' '.join(args.set + args.actor) if args.set or args.actor else ''}")
    columns = ("algo", "RTT ms", "train/s", "÷ loop", "target", "env/s", "÷ loop", "target", "resets", "leases lost")
    widths = (7, 6, 8, 7, 7, 8, 7, 7, 7, 11)
    line = row(columns, widths)
    print(line)
    print("-" * len(line))
    for cell in cells:
        base = next((c for c in cells if c.algo == cell.algo and c.rtt_ms == 0.0), Cell(cell.algo, 0.0, 0.0, 0.0, 0.0))
        train_target, env_target = TARGETS.get((cell.algo, int(cell.rtt_ms)), (None, None))
        values = (cell.algo, f"{cell.rtt_ms:g}", f"{cell.train_per_s:.1f}", ratio(cell.train_per_s, base.train_per_s),
                  f"≥ {train_target}" if train_target else "", f"{cell.env_steps_per_s:.0f}",
                  ratio(cell.env_steps_per_s, base.env_steps_per_s), f"≥ {env_target}" if env_target else "",
                  str(cell.resets), str(cell.leases_lost))
        print(row(values, widths))


if __name__ == "__main__":
    main()
