"""A soak: one long distributed run with nodes killed and replaced, every node's memory sampled.

    python bench/soak.py                          # 1 h, 4 actors, an actor SIGKILLed every 5 min, the trainer once
    python bench/soak.py --minutes 20 --kill-every 120 --out /tmp/soak

A DQN task on CartPole-v1 (replay of ``--capacity`` transitions, which fills during the warm-up) runs on
an embedded Redis with a trainer and ``--actors`` actor processes (``srl trainer`` / ``srl actor``, the
default lease settings). Every ``--kill-every`` seconds one actor, in turn, is SIGKILLed and a new one
started; halfway through, the trainer is SIGKILLed and a new one takes the lease over (its buffer starts
empty: the lease, not the data, is what moves). The RSS of every node (``/proc/<pid>/status``) is sampled
every ``--sample`` seconds into ``rss.csv`` and plotted in ``rss.png``.

The table gives, per node process, its RSS after the warm-up (or after its own first
``--warmup`` seconds, for a node started later) and at its end, and the growth between; then the
client's end-of-run accounts of the batches (a SIGKILLed actor cannot report the sends of its last
heartbeat interval, so ``sent`` may fall short of ``received`` by a few batches per kill; the
accounts line says so).
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srl
from srl.algorithms import dqn
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.client.embedded import start_embedded_redis
from tests.nodes import ClientThread, Node

DEFAULT_NODE = ("--lease-ttl", "5", "--heartbeat-interval", "1", "--task-poll-interval", "1")
"""srl's default lease settings (tests/nodes.py starts nodes with faster ones)"""
DEFAULT_ACTOR = ("--batch-size", "128", "--batch-max-age", "1", "--params-poll-interval", "0.1")
"""srl's default actor settings"""


@dataclass
class Process:
    role: str
    node: Node
    started: float
    samples: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the soak began, RSS MiB)"""
    killed: bool = False

    @property
    def name(self) -> str:
        return f"{self.role} {self.node.proc.pid}"


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, task: str, log_dir: Path) -> None:
        self.args, self.url, self.task, self.log_dir = args, url, task, log_dir
        self.processes: list[Process] = []
        self.began = time.monotonic()
        self._lock = threading.Lock()

    def start(self, role: str) -> Process:
        extra = DEFAULT_NODE + (DEFAULT_ACTOR if role == "actor" else ())
        process = Process(role, Node(role, self.url, self.task, self.log_dir, *extra), time.monotonic())
        with self._lock:
            self.processes.append(process)
        return process

    def kill(self, process: Process) -> None:
        process.node.proc.kill()
        process.node.proc.wait(30)
        process.killed = True
        print(f"{self.now():7.0f}s  SIGKILL {process.name}", flush=True)

    def now(self) -> float:
        return time.monotonic() - self.began

    def sample(self) -> None:
        with self._lock:
            live = [p for p in self.processes if p.node.alive()]
        for p in live:
            value = rss_mib(p.node.proc.pid)
            if value is not None:
                p.samples.append((self.now(), value))

    def live(self, role: str) -> list[Process]:
        return [p for p in self.processes if p.role == role and p.node.alive()]


def growth_rows(soak: Soak, warmup: float) -> list[tuple[str, str, float, float, float]]:
    """(process, lived, RSS after its warm-up, RSS at its end, growth %) for processes that outlived warm-up."""
    rows = []
    for p in soak.processes:
        start = max(warmup, p.started - soak.began + warmup)
        after = [(t, v) for t, v in p.samples if t >= start]
        if len(after) < 2:
            continue
        first, last = after[0][1], after[-1][1]
        lived = f"{p.samples[0][0]:.0f}-{p.samples[-1][0]:.0f}s{' (killed)' if p.killed else ''}"
        rows.append((p.name, lived, first, last, 100 * (last - first) / first))
    return rows


def plot(soak: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for p in soak.processes:
        if p.samples:
            t, v = zip(*p.samples, strict=True)
            ax.plot([x / 60 for x in t], v, label=p.name, color="C0" if p.role == "trainer" else None,
                    linewidth=2 if p.role == "trainer" else 1)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("srl soak: RSS of every node")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds between actor kills")
    parser.add_argument("--warmup", type=float, default=300.0, help="seconds before RSS counts as steady")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--capacity", type=int, default=50_000, help="the replay's transitions")
    parser.add_argument("--out", default="soak-out", help="directory for rss.csv and rss.png")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING)
    duration = args.minutes * 60
    accounts: list[str] = []

    class Accounts(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("  batches: sent") or record.getMessage().startswith("run "):
                accounts.append(record.getMessage().strip())

    client_log = logging.getLogger("srl.client")
    client_log.addHandler(Accounts())
    client_log.setLevel(logging.INFO)
    config = dqn.Config(seed=0)
    config.memory.set_proportional_memory(capacity=args.capacity)
    with start_embedded_redis() as server, tempfile.TemporaryDirectory() as tmp:
        url = f"redis://127.0.0.1:{server.port}/0"
        soak = Soak(args, url, f"soak-{uuid.uuid4().hex[:6]}", Path(tmp))
        soak.start("trainer")
        for _ in range(args.actors):
            soak.start("actor")
        client = ClientThread(srl.Runner("CartPole-v1", config), RedisParameters(url=url, task_name=soak.task),
                              actor_num=args.actors, timeout=duration, progress_interval=60.0)
        client.start()
        next_kill = args.kill_every
        trainer_killed = False
        victim = 0
        try:
            while client.is_alive():
                soak.sample()
                now = soak.now()
                if now >= next_kill and now < duration - args.kill_every / 2:
                    actors = soak.live("actor")
                    if actors:
                        soak.kill(actors[victim % len(actors)])
                        victim += 1
                        soak.start("actor")
                    next_kill += args.kill_every
                if not trainer_killed and now >= duration / 2:
                    for trainer in soak.live("trainer"):
                        soak.kill(trainer)
                    soak.start("trainer")
                    trainer_killed = True
                client.join(args.sample)
        finally:
            for p in soak.processes:
                p.node.stop()
        if client.error is not None:
            print(f"the client failed: {client.error!r}")
    with open(out / "rss.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["process", "t_s", "rss_mib"])
        for p in soak.processes:
            writer.writerows((p.name, f"{t:.0f}", f"{v:.1f}") for t, v in p.samples)
    plot(soak, out / "rss.png")
    print(f"\nsoak: {args.minutes:g} min, {args.actors} actors, an actor SIGKILLed every {args.kill_every:g} s, the "
          f"trainer at {duration / 2:.0f} s; RSS after {args.warmup:g} s of each process's life (or of the soak)")
    print("| process | lived | RSS after warm-up (MiB) | RSS at end (MiB) | growth |")
    print("|---|---|---|---|---|")
    for name, lived, first, last, pct in growth_rows(soak, args.warmup):
        print(f"| {name} | {lived} | {first:.0f} | {last:.0f} | {pct:+.1f}% |")
    for line in accounts:
        print(line)
    print(f"samples: {out / 'rss.csv'}, plot: {out / 'rss.png'}")


if __name__ == "__main__":
    main()
