"""Actors flat out against one learner: does the learner keep up, or does backpressure hold the actors?

    python bench/throughput.py                          # impala, appo, ppo (sync), dqn; 2 actors over Redis
    python bench/throughput.py --algorithms impala --queue amqp --seconds 30

Each algorithm runs CartPole-v1 with ``--actors`` actor processes and one trainer process on an
embedded Redis (experience over ``--queue``) for ``--seconds`` after the first update, sampling the
board every second. DQN runs with ``env_steps_per_train=None`` (no rate limit: Ape-X flat out).

Columns: env steps/s the actors produced and the learner consumed (rows received x steps per row),
"in flight": batches in the queue (its depth, as the actors' backpressure reads it) at the start and
the end of the window (a backlog that grows is the learner falling behind; the queue's capacity
bounds it), the share of the actors' time spent waiting on a
full queue (backpressure) or on the next version (sync PPO), the policy lag the trainer saw
(versions behind, p50/p95/max), one actor's env steps/s while it is not waiting (its own
``busy_s`` clock: stepping, acting, sending and loading params count, waiting does not) divided by the same
worker stepping its envs in this process and sending nothing ("bare", measured after the run on
an idle machine for ``--seconds`` too), and the verdict:

  keeps up          in flight stays low and the actors hardly wait
  backpressure      the queue is full and the actors wait: the learner sets the pace
  sync              the actors wait for each version by design (sync PPO)
  falling behind    in flight grows through the window (should not happen: the queue is bounded)

On two cores the actors and the trainer share the CPUs: the numbers say what this machine does,
ratios between algorithms say more than absolute rates. Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srl
from srl.algorithms import dqn, impala, ppo
from srl.base.rl import RLConfig
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.client.embedded import start_embedded_redis
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.sending.in_flight import batches_in_flight

QUEUES = {
    "redis": None,
    "amqp": "amqp://guest:guest@127.0.0.1:5672/",
    "mqtt": "mqtt://127.0.0.1:1883",
}


def configs(envs_per_actor: int | None = None) -> dict[str, tuple[RLConfig, int]]:
    """Each algorithm's config and the env steps one row carries (``envs_per_actor``: instead of each
    algorithm's default)."""
    table = [("impala", impala.Config()), ("appo", ppo.Config(sync=False)), ("ppo", ppo.Config()),
             ("dqn", dqn.Config(env_steps_per_train=None))]
    if envs_per_actor is not None:
        for _, config in table:
            config.envs_per_actor = envs_per_actor
    return {name: (config, steps_per_row(config)) for name, config in table}


def steps_per_row(config: RLConfig) -> int:
    """Env steps one row carries: a segment's length as the run resolves it (PPO's depends on the env's
    action space), 1 for a transition; read from the config so that a changed default cannot skew the
    consumed rate."""
    if isinstance(config, ppo.Config):
        config = config.resolved(srl.Runner("CartPole-v1", config).spec)
    return int(getattr(config, "segment_length", None) or 1)


def bare_rate(config: RLConfig, seconds: float) -> float:
    """Env steps/s of the same worker stepping its vector env in this process, sending nothing, over
    ``seconds``: the run's measuring window, so both rates average over as long a time."""
    from srl.base.env import EnvConfig
    from srl.base.rollout import Rollout

    runner = srl.Runner("CartPole-v1", config)
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    steps = 0
    with Rollout(EnvConfig("CartPole-v1"), worker, config.envs_per_actor, 0, config.vectorization) as rollout:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            rollout.step()
            steps += rollout.num_envs
            if worker.pending():
                worker.take()
        return steps / (time.perf_counter() - started)


def measure(name: str, config: RLConfig, steps_per_row: int, actors: int, queue: str | None,
            seconds: float) -> dict[str, Any]:
    server = start_embedded_redis()
    task = f"throughput-{name}"
    params = server.parameters.replace(task_name=task)
    board = Board(params.connect(), task)
    runner = srl.Runner("CartPole-v1", config)
    errors: list[BaseException] = []

    def client() -> None:
        try:
            runner.train_distribution(params, queue, actor_num=actors, timeout=seconds + 120,
                                      progress_interval=None, local_processes=True)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    probe = None  # a producer handle on the task's queue: its depth() is what the actors' backpressure reads
    samples: list[dict[str, Any]] = []
    window_start: float | None = None
    while thread.is_alive():
        time.sleep(1.0)
        stats, counters = board.get_all_stats(), board.get_counters()
        trainer = stats.get("trainer", {})
        if window_start is None and int(trainer.get("train_count", 0) or 0) > 0:
            window_start = time.monotonic()
            probe = open_queue(queue, namespace=task, role="producer", redis_params=params)
        if window_start is None or probe is None:
            continue
        depth = probe.depth()
        waits = [float(s.get("backpressure_wait_s", 0) or 0) + float(s.get("sync_wait_s", 0) or 0)
                 for k, s in stats.items() if k.startswith("actor:")]
        samples.append({"t": time.monotonic(), "env": counters.get("env_steps", 0),
                        "rows": counters.get("received_transitions", 0),
                        "in_flight": depth if depth is not None else max(0.0, batches_in_flight(counters)),
                        "wait": sum(waits), "sync": sum(float(s.get("sync_wait_s", 0) or 0)
                                                        for k, s in stats.items() if k.startswith("actor:")),
                        "lag": (trainer.get("lag_p50"), trainer.get("lag_p95"), trainer.get("lag_max")),
                        # each actor's own clock: env steps and seconds not waiting, in one snapshot
                        "actors": {k: (float(v.get("env_steps", 0) or 0), float(v.get("busy_s", 0) or 0))
                                   for k, v in stats.items() if k.startswith("actor:")},
                        "train": float(trainer.get("train_per_s", 0) or 0)})
        if time.monotonic() - window_start >= seconds:
            board.end_task("END", "bench window over")
    thread.join()
    if probe is not None:
        probe.close()
    server.stop()
    if errors:
        raise errors[0]
    if len(samples) < 3:
        raise RuntimeError(f"{name}: the run ended before a measuring window ({len(samples)} samples)")
    first, last = samples[1], samples[-1]  # the first second after the first update is warm-up
    dt = last["t"] - first["t"]
    produced = (last["env"] - first["env"]) / dt
    consumed = (last["rows"] - first["rows"]) * steps_per_row / dt
    wait_share = (last["wait"] - first["wait"]) / (dt * actors)
    sync_share = (last["sync"] - first["sync"]) / (dt * actors)
    head = statistics.mean(s["in_flight"] for s in samples[1:4])
    tail = statistics.mean(s["in_flight"] for s in samples[-3:])
    capacity = 8
    if sync_share > 0.2:
        verdict = "sync"
    elif tail > head + 2 and tail >= capacity - 1 and wait_share < 0.05:
        verdict = "falling behind"
    elif wait_share > 0.1 or tail >= capacity - 1:
        verdict = "backpressure"
    else:
        verdict = "keeps up"
    # one actor's env steps/s while it is not waiting, from the actors' own snapshots (steps and busy
    # seconds taken together), not from the board's batched counters
    steps = busy_s = 0.0
    for key, (steps1, busy1) in last["actors"].items():
        steps0, busy0 = first["actors"].get(key, (steps1, busy1))
        steps, busy_s = steps + steps1 - steps0, busy_s + busy1 - busy0
    busy = steps / busy_s if busy_s > 0 else float("nan")
    return {"name": name, "produced": produced, "consumed": consumed, "head": head, "tail": tail,
            "wait": wait_share, "lag": last["lag"], "verdict": verdict, "busy": busy,
            "train": statistics.median(x["train"] for x in samples[1:]),
            "bare": bare_rate(config, seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default="impala,appo,ppo,dqn")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--queue", default="redis", choices=sorted(QUEUES))
    parser.add_argument("--seconds", type=float, default=20.0, help="measuring window after the first update")
    parser.add_argument("--envs-per-actor", type=int, default=None,
                        help="envs each actor steps (default: each algorithm's own, DQN 2, the others 8)")
    args = parser.parse_args()
    import logging

    logging.getLogger("srl").setLevel(logging.WARNING)
    table = configs(args.envs_per_actor)
    results = []
    for name in [n.strip() for n in args.algorithms.split(",") if n.strip()]:
        if name not in table:
            parser.error(f"unknown algorithm {name!r}; known: {', '.join(table)}")
        config, steps_per_row = table[name]
        results.append(measure(name, config, steps_per_row, args.actors, QUEUES[args.queue], args.seconds))
        print(f"{name}: done", flush=True)
    envs = "each algorithm's default" if args.envs_per_actor is None else str(args.envs_per_actor)
    print(f"\n{args.actors} actors flat out (envs an actor: {envs}), CartPole-v1, queue {args.queue}, "
          f"{args.seconds:g}s window")
    header = (f"{'algorithm':<9} {'produced/s':>10} {'consumed/s':>10} {'consumed÷produced':>17} "
              f"{'in flight, batches':>18} {'actors waiting':>14} {'lag p50/p95/max':>16} "
              f"{'actor busy÷bare':>15} {'train/s':>7}  verdict")
    print(header)
    print("-" * len(header))
    for r in results:
        lag = "/".join("?" if v is None else f"{v:g}" for v in r["lag"])
        in_flight = f"{r['head']:.1f} → {r['tail']:.1f}"
        print(f"{r['name']:<9} {r['produced']:>10.0f} {r['consumed']:>10.0f} {r['consumed'] / r['produced']:>17.2f} "
              f"{in_flight:>18} {r['wait']:>14.0%} {lag:>16} "
              f"{r['busy'] / r['bare']:>15.2f} {r['train']:>7.0f}  "
              f"{r['verdict']}")


if __name__ == "__main__":
    main()
