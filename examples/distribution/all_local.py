"""The whole distributed system on one machine, no Docker: an embedded Redis,
a local trainer process and local actor processes, started and stopped by the client.

    python examples/distribution/all_local.py [--max-train-count 20000] [--actors 1]
"""

import argparse

import numpy as np

import srl
from srl.algorithms import dqn
from srl.runner.distribution import RedisParameters

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--max-train-count", type=int, default=20_000)
parser.add_argument("--actors", type=int, default=1)
parser.add_argument("--seed", type=int, default=None)
args = parser.parse_args()

rl_config = dqn.Config(seed=args.seed)
rl_config.hidden_block.set_mlp((64, 64))
rl_config.memory.set_proportional_memory()
rl_config.memory.capacity = 5000

runner = srl.Runner("Pendulum-v1", rl_config)
runner.train_distribution(RedisParameters(), actor_num=args.actors, max_train_count=args.max_train_count)
rewards = runner.evaluate()
print("evaluation rewards:", [round(r, 1) for r in rewards])
print(f"evaluation mean over {len(rewards)} episodes: {np.mean(rewards):.1f}")
