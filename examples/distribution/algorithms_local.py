"""Each algorithm's own data path, distributed on this machine: PPO, asynchronous PPO, IMPALA on CartPole-v1.

An embedded Redis, one trainer and two actors started by the client; experience over
Redis Streams (or --queue amqp://... / mqtt://... / pubsub://...):

    python examples/distribution/algorithms_local.py ppo       # sync: actors wait for each version
    python examples/distribution/algorithms_local.py appo      # asynchronous PPO: nobody waits, lag bounded
    python examples/distribution/algorithms_local.py impala    # V-trace corrects the actors' lag

The budget is env steps of all actors together (``max_steps``); each line of progress shows
the params lag the trainer sees (versions behind, p50/p95/max).
"""

import argparse

import numpy as np

import srl
from srl.algorithms import impala, ppo
from srl.base.rl import RLConfig
from srl.runner.distribution import RedisParameters

CONFIGS: dict[str, tuple[RLConfig, int]] = {
    "ppo": (ppo.Config(), 100_000),
    "appo": (ppo.Config(sync=False), 200_000),
    "impala": (impala.Config(), 300_000),
}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("algorithm", choices=sorted(CONFIGS))
parser.add_argument("--actors", type=int, default=2)
parser.add_argument("--queue", default=None, help="a queue URL (default: Redis Streams on the board's Redis)")
parser.add_argument("--max-steps", type=int, default=None, help="env steps, all actors (default: per algorithm)")
args = parser.parse_args()

rl_config, budget = CONFIGS[args.algorithm]
runner = srl.Runner("CartPole-v1", rl_config)
runner.train_distribution(RedisParameters(), args.queue, actor_num=args.actors, max_steps=args.max_steps or budget)
rewards = runner.evaluate()
print(f"{args.algorithm}: {runner.env_steps} env steps, {runner.train_count} train steps; "
      f"evaluation mean over {len(rewards)} episodes: {np.mean(rewards):.1f}")
