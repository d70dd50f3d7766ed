"""Distributed Pendulum-v1 DQN, measured in one run and printed as a table.

    python bench/distribution.py [--seconds 15] [--target -200] [--max-wait 120]

Rows (ours, the baseline measured in the same run, their ratio):
  Rows 1-3 come from a run with the actors flat out (no rate limit).
  1. trainer train steps/s while ingesting ÷ the same trainer alone on a filled
     memory (pure learning, no env) and ÷ single-process Runner.train   (goal >= 0.9)
  2. actor env steps/s while sending ÷ bare collection with the same policy (goal >= 0.9):
     once beside the trainer (two processes, two cores) and once with the
     queue drained by a consumer that only decodes and acks
  3. Redis commands per transition, from INFO commandstats and the sent
     transitions read at both edges of the sampling window           (goal <= 0.05)
  4. wall time until the evaluation mean >= target with one actor     (goal <= 60 s),
     with the actors' default rate limit and flat out

Everything runs on this machine: an embedded Redis, one trainer process and
one actor process. On two cores the trainer and the actor each take one, so
rows 1 and 2 include that contention; the baselines run on an idle machine.
The evaluator (a thread here: it pulls the params and plays episodes every 3 s)
starts only after the sampling window, so it loads neither rates nor commands:
row 4's wall time is therefore at least the window's end (--seconds + 2 s after
the trainer first reports a rate) plus the evaluator's first 3 s wait.

Not measured here: figures once noted for the reference framework (22-63 train
steps/s distributed against 349 alone, ~3 Redis commands per transition,
evaluation -954 after 240 s), with no date, config or budget recorded; they are
not comparable with this table.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np

import srl
from srl.algorithms import dqn
from srl.base.rollout import Rollout
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.client.embedded import start_embedded_redis
from srl.runner.distribution.wire.codec import Codec


def pendulum_config(env_steps_per_train: float | None = 1.0) -> dqn.Config:
    rl_config = dqn.Config(seed=0, env_steps_per_train=env_steps_per_train)
    rl_config.hidden_block.set_mlp((64, 64))
    rl_config.memory.set_proportional_memory()
    rl_config.memory.capacity = 5000
    return rl_config


def trainer_alone(seconds: float) -> float:
    """Train steps/s of the DQN trainer on a memory already full, nothing else running."""
    runner = srl.Runner("Pendulum-v1", pendulum_config())
    runner.train(max_steps=5_000, progress_interval=None)  # fills the memory (and trains a little)
    trainer = runner._learner
    assert trainer is not None
    start, t0 = trainer.train_count, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        trainer.train()
    return (trainer.train_count - start) / (time.perf_counter() - t0)


def runner_train_rate(train_count: int) -> float:
    """Train steps/s of single-process Runner.train (env stepping included), past warmup."""
    runner = srl.Runner("Pendulum-v1", pendulum_config())
    runner.train(max_train_count=200, progress_interval=None)
    t0 = time.perf_counter()
    runner.train(max_train_count=train_count, progress_interval=None)
    return train_count / (time.perf_counter() - t0)


def bare_collection(seconds: float) -> float:
    """Env steps/s of the same worker stepping the env and building transitions, sending nothing."""
    runner = srl.Runner("Pendulum-v1", pendulum_config())
    config = runner.rl_config
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    steps, t0 = 0, time.perf_counter()
    with Rollout(runner.env_config, worker, config.envs_per_actor, seed=0) as rollout:
        while time.perf_counter() - t0 < seconds:
            rollout.step()
            steps += rollout.num_envs
            if worker.pending() >= 256:
                cols = worker.take()
                assert cols is not None
                worker.initial_priorities(cols)
    return steps / (time.perf_counter() - t0)


def actor_with_drain(seconds: float) -> tuple[float, float]:
    """Env steps/s of a real actor process whose queue is drained (decode + ack, no learning),
    so the actor's own sending overhead is measured without a trainer competing for a core."""
    from srl.runner.distribution.client import local_nodes
    from srl.runner.distribution.queues import open_queue

    server = start_embedded_redis()
    params = server.parameters.replace(task_name="bench-actor")
    board = Board(params.connect(), params.task_name)
    runner = srl.Runner("Pendulum-v1", pendulum_config(None))  # flat out: no trainer grants train credit here
    board.create_task({**runner.task_config(), "actor_num": 1, "timeout": seconds + 60,
                       "queue": {"scheme": "redis", "describe": "the board's Redis", "capacity": 64}})
    board.set_active()
    # no trainer here, and an actor acts from the first params published: publish the initial ones as the
    # trainer would (its lease, its epoch)
    epoch = board.claim_trainer("bench-drain", int((seconds + 60) * 1000))
    assert epoch is not None, "the trainer lease of a new task is free"
    blob = Codec(task=params.task_name).encode_params(
        runner.parameter.to_arrays(), {"epoch": epoch, "version": 1, "train_count": 0, "algorithm": "dqn"})
    if not board.publish_params("bench-drain", epoch, 1, blob, 0):
        raise RuntimeError("the board refused the bench's initial params")
    proc = local_nodes.start("actor", params, None, {"run_once": True})
    stop = threading.Event()

    def drain() -> None:
        codec = Codec(task=params.task_name)
        with open_queue(None, namespace=params.task_name, role="consumer", redis_params=params) as queue:
            while not stop.is_set():
                messages = queue.get_many(32, timeout=0.2)
                for m in messages:
                    codec.decode_batch(m.data)
                queue.ack_many(messages)

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    rates: list[float] = []
    deadline = time.monotonic() + seconds + 4
    while time.monotonic() < deadline:
        time.sleep(1.0)
        rate = float(board.get_all_stats().get("actor:0", {}).get("env_steps_per_s", 0) or 0)
        if rate > 0 and time.monotonic() > deadline - seconds:
            rates.append(rate)
    stalled = float(board.get_all_stats().get("actor:0", {}).get("backpressure_wait_s", 0) or 0)
    board.end_task("END", "bench done")
    proc.wait(timeout=30)
    stop.set()
    drainer.join()
    server.stop()
    return (statistics.median(rates) if rates else float("nan")), stalled


class Evaluator(threading.Thread):
    """Every few seconds: fetch the params from the board, evaluate, note (wall, train_count, mean)."""

    def __init__(self, board: Board, target: float, started: float) -> None:
        super().__init__(daemon=True)
        self.board, self.target, self.started = board, target, started
        self.runner = srl.Runner("Pendulum-v1", pendulum_config())
        self.history: list[tuple[float, int, float]] = []
        self.reached: tuple[float, int, float] | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        last_version = -1
        codec = Codec(task=self.board.task_name)
        while not self.stop.wait(3.0):
            record = self.board.get_params()
            if record is None or record.version == last_version:
                continue
            wall = time.monotonic() - self.started
            last_version, train_count = record.version, record.train_count
            _, arrays = codec.decode_params(record.blob)
            self.runner.set_parameter_arrays(arrays, record.version, train_count)
            mean = float(np.mean(self.runner.evaluate(max_episodes=5, seed=123)))
            self.history.append((wall, train_count, mean))
            if mean >= self.target:
                confirm = float(np.mean(self.runner.evaluate(max_episodes=10, seed=456)))
                if confirm >= self.target:
                    self.reached = (wall, train_count, confirm)
                    return


def commands_and_transitions(board: Board) -> tuple[int, float]:
    """Redis commands so far (INFO commandstats) and the transitions the actors sent (their counters,
    written with each heartbeat): read at both edges of the sampling window, commands per transition is
    the window's alone, without the warm-up or the evaluator that runs after it."""
    calls = sum(int(v["calls"]) for k, v in board.client.info("commandstats").items() if k.startswith("cmdstat_"))
    return calls, float(board.get_counters().get("sent_transitions", 0.0))


def distributed(seconds: float, target: float, max_wait: float, inserts: float | None) -> dict[str, Any]:
    server = start_embedded_redis()
    params = server.parameters.replace(task_name="bench")
    board = Board(params.connect(), "bench")
    board.client.config_resetstat()
    runner = srl.Runner("Pendulum-v1", pendulum_config(inserts))
    result: dict[str, Any] = {}
    client_error: list[BaseException] = []

    def client() -> None:
        try:
            runner.train_distribution(params, actor_num=1, timeout=max_wait, progress_interval=10.0,
                                      local_processes=True)
        except BaseException as e:
            client_error.append(e)

    started = time.monotonic()
    client_thread = threading.Thread(target=client, daemon=True)
    client_thread.start()
    evaluator = Evaluator(board, target, started)  # started once the sampling window is over
    train_rates: list[float] = []
    actor_rates: list[float] = []
    sample_until = None
    edges: list[tuple[int, float]] = []  # (Redis commands, sent transitions) where the window starts and ends
    while client_thread.is_alive():
        time.sleep(1.0)
        stats = board.get_all_stats()
        trainer, actor = stats.get("trainer", {}), stats.get("actor:0", {})
        if sample_until is None and float(trainer.get("train_per_s", 0) or 0) > 0:
            sample_until = time.monotonic() + seconds + 2
        if sample_until is not None and time.monotonic() < sample_until:
            if time.monotonic() > sample_until - seconds:  # skip the first seconds after warmup
                if not edges:
                    edges.append(commands_and_transitions(board))
                train_rates.append(float(trainer.get("train_per_s", 0) or 0))
                actor_rates.append(float(actor.get("env_steps_per_s", 0) or 0))
        elif sample_until is not None and evaluator.ident is None:  # the window is over: evaluate from now on
            if len(edges) == 1:
                edges.append(commands_and_transitions(board))
            evaluator.start()
        if evaluator.reached is not None or (evaluator.ident is not None and not evaluator.is_alive()):
            board.end_task("END", "bench done")
    evaluator.stop.set()
    client_thread.join()
    (calls0, sent0), (calls1, sent1) = edges if len(edges) == 2 else [(0, float("nan"))] * 2
    result.update(
        train_rate=statistics.median(train_rates) if train_rates else float("nan"),
        actor_rate=statistics.median(actor_rates) if actor_rates else float("nan"),
        transitions=sent1 - sent0,
        redis_calls=calls1 - calls0,
        reached=evaluator.reached,
        history=evaluator.history,
        error=client_error[0] if client_error else None,
    )
    server.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0, help="measuring window for each rate")
    parser.add_argument("--target", type=float, default=-200.0, help="evaluation mean to reach")
    parser.add_argument("--max-wait", type=float, default=120.0, help="give up on the target after this")
    parser.add_argument("--env-steps-per-train", type=float, default=1.0,
                        help="DQN's replay ratio for the rate-limited run (env steps per train step); 0: none")
    args = parser.parse_args()

    print("measuring baselines (single process, idle machine) ...", flush=True)
    alone = trainer_alone(args.seconds)
    runner_rate = runner_train_rate(5_000)
    bare = bare_collection(args.seconds)
    print("measuring one actor process with a drain-only consumer ...", flush=True)
    actor_drained, drained_stall = actor_with_drain(args.seconds)
    print("measuring the distributed run, actors flat out (embedded Redis, 1 trainer + 1 actor process) ...",
          flush=True)
    d = distributed(args.seconds, args.target, args.max_wait, None)
    limit = args.env_steps_per_train or None
    print(f"measuring the distributed run with the actors' rate limit env_steps_per_train={limit} ...", flush=True)
    d_limited = distributed(args.seconds, args.target, args.max_wait, limit)
    for run in (d, d_limited):
        if run["error"] is not None:
            print(f"a distributed run failed: {run['error']!r}")

    per_transition = d["redis_calls"] / d["transitions"] if d["transitions"] > 0 else float("nan")
    print()
    print("Pendulum-v1 DQN (64x64, proportional, capacity 5000), 1 actor, embedded Redis, this machine")
    print(f"{'measure':<52} {'ours':>10} {'baseline':>10} {'ratio':>7} {'goal':>8}")
    print(f"{'trainer train steps/s ingesting vs trainer alone':<52} {d['train_rate']:>10.0f} {alone:>10.0f} "
          f"{d['train_rate'] / alone:>7.2f} {'>= 0.9':>8}")
    print(f"{'trainer train steps/s ingesting vs Runner.train':<52} {d['train_rate']:>10.0f} {runner_rate:>10.0f} "
          f"{d['train_rate'] / runner_rate:>7.2f} {'>= 0.9':>8}")
    print(f"{'  the same, actor rate-limited (a core left free)':<52} {d_limited['train_rate']:>10.0f} {alone:>10.0f} "
          f"{d_limited['train_rate'] / alone:>7.2f} {'>= 0.9':>8}")
    print(f"{'actor env steps/s sending vs bare collection':<52} {d['actor_rate']:>10.0f} {bare:>10.0f} "
          f"{d['actor_rate'] / bare:>7.2f} {'>= 0.9':>8}")
    print(f"{'actor env steps/s sending, queue drained, no trainer':<52} {actor_drained:>10.0f} {bare:>10.0f} "
          f"{actor_drained / bare:>7.2f} {'>= 0.9':>8}   (actor stalled {drained_stall:.1f}s on a full queue)")
    print(f"{'Redis commands per transition':<52} {per_transition:>10.4f} {'':>10} {'':>7} {'<= 0.05':>8}")
    for name, run in ((f"env_steps_per_train={limit}", d_limited), ("actors flat out", d)):
        reached = run["reached"]
        label = f"wall s until eval >= {args.target:g}, {name}"
        if reached is not None:
            print(f"{label:<52} {reached[0]:>10.1f} {'':>10} {'':>7} {'<= 60':>8}   "
                  f"(train_count {reached[1]}, eval {reached[2]:.1f})")
        else:
            print(f"{label:<52} {'not in ' + str(args.max_wait):>10}")
    print()
    for name, run in ((f"env_steps_per_train={limit}", d_limited), ("actors flat out", d)):
        print(f"evaluations during the run, {name} (wall s, train_count, mean of 5 episodes):")
        print("  " + ", ".join(f"({w:.0f}s, {c}, {m:.0f})" for w, c, m in run["history"]))
    print(f"flat out, in the sampling window: transitions sent {d['transitions']:.0f}, Redis commands "
          f"{d['redis_calls']}")


if __name__ == "__main__":
    main()
