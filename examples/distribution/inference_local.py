"""Central inference on this machine (SEED RL's way): one inference server acts for every actor in
batches; the actors only step their envs and fetch no params.

An embedded Redis, one trainer, one inference server and the actors, all started by the client;
experience over Redis Streams (or --queue amqp://... / mqtt://... / pubsub://...):

    python examples/distribution/inference_local.py impala          # CartPole, 4 actors x 8 envs
    python examples/distribution/inference_local.py dqn             # Ape-X DQN: epsilon by slot, on the server
    python examples/distribution/inference_local.py r2d2 --env srl/CartPoleNoVel-v1   # the LSTM state on the server
    python examples/distribution/inference_local.py impala --env MinAtar/Breakout-v1 --max-steps 1000000

The progress lines show the server (actors connected, actions/s, envs per forward pass, the wait
of a request for its batch). Across machines, run `srl inference` beside the trainer instead.
"""

import argparse

import numpy as np

import srl
from srl.algorithms import dqn, impala, ppo, r2d2
from srl.base.rl import RLConfig
from srl.runner.distribution import RedisParameters

CONFIGS: dict[str, tuple[RLConfig, dict[str, int]]] = {
    "impala": (impala.Config(), {"max_steps": 300_000}),
    "appo": (ppo.Config(sync=False), {"max_steps": 200_000}),
    "dqn": (dqn.Config(), {"max_train_count": 20_000}),
    "r2d2": (r2d2.Config(lr=5e-4, target_update_interval=500), {"max_steps": 300_000}),
}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("algorithm", choices=sorted(CONFIGS))
parser.add_argument("--env", default="CartPole-v1")
parser.add_argument("--actors", type=int, default=4)
parser.add_argument("--queue", default=None, help="a queue URL (default: Redis Streams on the board's Redis)")
parser.add_argument("--max-steps", type=int, default=None, help="env steps, all actors (default: per algorithm)")
args = parser.parse_args()

rl_config, budget = CONFIGS[args.algorithm]
if args.max_steps is not None:
    budget = {"max_steps": args.max_steps}
runner = srl.Runner(args.env, rl_config)
runner.train_distribution(RedisParameters(), args.queue, actor_num=args.actors, inference="central", **budget)
rewards = runner.evaluate()
print(f"{args.algorithm} with central inference: {runner.env_steps} env steps, {runner.train_count} train steps; "
      f"evaluation mean over {len(rewards)} episodes: {np.mean(rewards):.1f}")
