"""Learning speed: Pendulum-v1 DQN (hidden 64x64, proportional memory, capacity 5000), single process.

    python bench/learning.py [--train-count 20000] [--seeds 1]

Prints wall time, env steps/s, train steps/s and the evaluation mean over 10
episodes, one row per seed. Target: evaluation mean >= -150. For scale, the
reference framework on this kind of machine reaches -122 in 57 s at ~350 train steps/s.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import srl
from srl.algorithms import dqn


def pendulum_config(seed: int | None) -> dqn.Config:
    rl_config = dqn.Config(seed=seed)
    rl_config.hidden_block.set_mlp((64, 64))
    rl_config.memory.set_proportional_memory()
    rl_config.memory.capacity = 5000
    return rl_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-count", type=int, default=20_000)
    parser.add_argument("--seeds", type=int, default=1, help="runs with seeds 0..N-1")
    args = parser.parse_args()

    rows = []
    for seed in range(args.seeds):
        runner = srl.Runner("Pendulum-v1", pendulum_config(seed))
        t0 = time.perf_counter()
        runner.train(max_train_count=args.train_count, progress_interval=10.0)
        wall = time.perf_counter() - t0
        rewards = runner.evaluate(max_episodes=10)
        rows.append((seed, wall, runner.env_steps / wall, runner.train_count / wall, float(np.mean(rewards))))

    print()
    print(f"Pendulum-v1 DQN, {args.train_count} train steps, single process")
    print(f"{'seed':>4} {'wall s':>8} {'env steps/s':>12} {'train/s':>8} {'eval mean':>10}")
    for seed, wall, env_rate, train_rate, ev in rows:
        print(f"{seed:>4} {wall:>8.1f} {env_rate:>12.0f} {train_rate:>8.0f} {ev:>10.1f}")
    evals = [r[4] for r in rows]
    print(f"eval mean over seeds: {np.mean(evals):.1f} (target >= -150); "
          f"train/s vs reference 350: {np.mean([r[3] for r in rows]) / 350:.2f}x")


if __name__ == "__main__":
    main()
