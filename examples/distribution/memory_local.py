"""Policies with memory, distributed on this machine: recurrent PPO, recurrent IMPALA and R2D2 on
srl/CartPoleNoVel-v1 (CartPole with its velocities hidden: a feed-forward policy cannot balance it).

An embedded Redis, one trainer and two actors started by the client; experience over Redis Streams
(or --queue amqp://... / mqtt://... / pubsub://...):

    python examples/distribution/memory_local.py ppo       # an LSTM per head; actors send its state
    python examples/distribution/memory_local.py impala    # the same core, V-trace
    python examples/distribution/memory_local.py r2d2      # sequences of 80 with burn-in 40, replayed

The configs are the ones the benchmarks measured on this env (docs/benchmarks.md).
"""

import argparse

import numpy as np

import srl
from srl.algorithms import impala, ppo, r2d2
from srl.base.rl import RLConfig
from srl.runner.distribution import RedisParameters

CONFIGS: dict[str, tuple[RLConfig, int]] = {
    "ppo": (ppo.Config(recurrent="lstm"), 100_000),  # over Discrete vectors: RL Zoo ppo_lstm's network, a preset
    "impala": (impala.Config(recurrent="lstm"), 300_000),
    "r2d2": (r2d2.Config(lr=5e-4, target_update_interval=500), 300_000),
}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("algorithm", choices=sorted(CONFIGS))
parser.add_argument("--actors", type=int, default=2)
parser.add_argument("--queue", default=None, help="a queue URL (default: Redis Streams on the board's Redis)")
parser.add_argument("--max-steps", type=int, default=None, help="env steps, all actors (default: per algorithm)")
args = parser.parse_args()

rl_config, budget = CONFIGS[args.algorithm]
runner = srl.Runner("srl/CartPoleNoVel-v1", rl_config)
runner.train_distribution(RedisParameters(), args.queue, actor_num=args.actors, max_steps=args.max_steps or budget)
rewards = runner.evaluate()
print(f"{args.algorithm}: {runner.env_steps} env steps, {runner.train_count} train steps; "
      f"evaluation mean over {len(rewards)} episodes: {np.mean(rewards):.1f}")
