"""Each algorithm's own data path, distributed on this machine: PPO, asynchronous PPO, IMPALA on CartPole-v1,
SAC on Pendulum-v1.

An embedded Redis, one trainer and two actors started by the client; experience over
Redis Streams (or --queue amqp://... / mqtt://... / pubsub://...):

    python examples/distribution/algorithms_local.py ppo       # sync: actors wait for each version
    python examples/distribution/algorithms_local.py appo      # asynchronous PPO: nobody waits, lag bounded
    python examples/distribution/algorithms_local.py impala    # V-trace corrects the actors' lag
    python examples/distribution/algorithms_local.py sac       # Box actions, off a replay, Ape-X style

The budget is env steps of all actors together (``max_steps``), or train steps for SAC
(``max_train_count``: actors are rate-limited to the trainer); each line of progress shows the params
lag the trainer sees (versions behind, p50/p95/max).
"""

import argparse

import numpy as np

import srl
from srl.algorithms import impala, ppo, sac
from srl.base.rl import RLConfig
from srl.runner.distribution import RedisParameters

CONFIGS: dict[str, tuple[str, RLConfig, dict[str, int]]] = {
    "ppo": ("CartPole-v1", ppo.Config(), {"max_steps": 100_000}),
    "appo": ("CartPole-v1", ppo.Config(sync=False), {"max_steps": 200_000}),
    "impala": ("CartPole-v1", impala.Config(), {"max_steps": 300_000}),
    "sac": ("Pendulum-v1", sac.Config(), {"max_train_count": 20_000}),
}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("algorithm", choices=sorted(CONFIGS))
parser.add_argument("--actors", type=int, default=2)
parser.add_argument("--queue", default=None, help="a queue URL (default: Redis Streams on the board's Redis)")
parser.add_argument("--max-steps", type=int, default=None, help="env steps, all actors (default: per algorithm)")
args = parser.parse_args()

env, rl_config, budget = CONFIGS[args.algorithm]
runner = srl.Runner(env, rl_config)
runner.train_distribution(RedisParameters(), args.queue, actor_num=args.actors,
                          **({"max_steps": args.max_steps} if args.max_steps else budget))
rewards = runner.evaluate()
print(f"{args.algorithm}: {runner.env_steps} env steps, {runner.train_count} train steps; "
      f"evaluation mean over {len(rewards)} episodes: {np.mean(rewards):.1f}")
