"""Memory: what a recurrent core costs an actor, against the feed-forward actor with the same encoder.

    python bench/recurrent.py                     # every row, 20,000 env steps each
    python bench/recurrent.py --steps 50000 --repeat 3

What is timed is an actor's own work without a broker: ``Rollout.step()`` (the envs and the worker's
``act``/``observe``: with a core, one cell step per env step and the state kept per env), taking the
rows and encoding them as an actor sends them (``Codec.encode_batch``; zstd for images). 8 envs, torch
threads 1, after 200 untimed steps; the median of ``--repeat`` windows.

Rows: PPO feed-forward against PPO with an LSTM (``recurrent="lstm"``, 128 units; and 64) on
srl/CartPoleNoVel-v1 (the MLP encoder) and on MinAtar Breakout (the MinAtar CNN); DQN against R2D2
(the same encoder, an LSTM of 128 and a dueling head; R2D2's rows are sequences) on MinAtar Breakout.
The ratio is recurrent ÷ feed-forward, measured in the same run. Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srl.algorithms import dqn, ppo, r2d2
from srl.base.env import EnvConfig, env_spec
from srl.base.rl import RLConfig
from srl.base.rollout import Rollout
from srl.runner.distribution.wire.codec import BatchHeader, Codec

MINATAR = "MinAtar/Breakout-v1"
NOVEL = "srl/CartPoleNoVel-v1"
ENVS = 8


def actor_rate(env: str, make: Callable[[], RLConfig], steps: int) -> float:
    """Env steps/s of an actor's work (see the module docstring)."""
    config = make()
    spec = env_spec(EnvConfig(env))
    worker = config.make_worker(spec, config.make_parameter(spec, torch.device("cpu")), 0, 1, 0)
    codec = Codec(compress=spec.image)
    seq = 0
    with Rollout(EnvConfig(env), worker, ENVS, seed=0) as rollout:
        for _ in range(200 // ENVS):
            rollout.step()
        worker.take()
        t0, start = time.perf_counter(), rollout.env_steps
        while rollout.env_steps - start < steps:
            rollout.step()
            if worker.pending() >= (256 if isinstance(config, dqn.Config) else 1):
                rows = worker.take()
                assert rows is not None
                codec.encode_batch(BatchHeader("bench", 0, 1, seq, 1, len(rows["version"]), time.time()), rows,
                                   worker.initial_priorities(rows))
                seq += 1
        return (rollout.env_steps - start) / (time.perf_counter() - t0)


ROWS: list[tuple[str, str, Callable[[], RLConfig], Callable[[], RLConfig]]] = [
    # the MLP before the cell (cell_first=False), as these rows were measured; the preset now puts the cell first
    ("PPO, MLP encoder", NOVEL, lambda: ppo.Config(seed=0, envs_per_actor=ENVS),
     lambda: ppo.Config(seed=0, envs_per_actor=ENVS, recurrent="lstm", cell_first=False)),
    ("PPO, MLP encoder, LSTM of 64", NOVEL, lambda: ppo.Config(seed=0, envs_per_actor=ENVS),
     lambda: ppo.Config(seed=0, envs_per_actor=ENVS, recurrent="lstm", recurrent_size=64, cell_first=False)),
    ("PPO, MinAtar CNN", MINATAR, lambda: ppo.Config(seed=0, envs_per_actor=ENVS),
     lambda: ppo.Config(seed=0, envs_per_actor=ENVS, recurrent="lstm")),
    ("DQN / R2D2, MinAtar CNN", MINATAR, lambda: dqn.Config(seed=0, envs_per_actor=ENVS),
     lambda: r2d2.Config(seed=0, envs_per_actor=ENVS)),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20_000, help="env steps per timed window (default 20,000)")
    parser.add_argument("--repeat", type=int, default=1, help="windows per row, the median printed (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    np.seterr(all="ignore")
    print(f"## actor env steps/s, {ENVS} envs, CPU, torch threads 1; torch {torch.__version__}\n")
    print("| encoder | env | feed-forward | with an LSTM | ratio (target >= 0.7) |")
    print("|---|---|---|---|---|")
    for label, env, plain, recurrent in ROWS:
        rates = [(actor_rate(env, plain, args.steps), actor_rate(env, recurrent, args.steps))
                 for _ in range(args.repeat)]
        ff = statistics.median(r[0] for r in rates)
        lstm = statistics.median(r[1] for r in rates)
        print(f"| {label} | {env} | {ff:,.0f} | {lstm:,.0f} | {lstm / ff:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
