"""The client: submit a Pendulum-v1 DQN task to the board, watch it, evaluate the result.

Start examples/distribution/trainer.py and examples/distribution/actor.py (any
order, any machines that reach Redis), then:

    python examples/distribution/client.py

SRL_REDIS_URL or SRL_REDIS_HOST (default localhost) with SRL_REDIS_PASSWORD, SRL_QUEUE_URL (default:
the board's Redis; e.g. amqp://srl:PASSWORD@rabbitmq:5672/), SRL_SECRET, SRL_ACTOR_NUM (default 1),
SRL_ELASTIC_ACTORS (1: SRL_ACTOR_NUM is a maximum, actors come and go) and SRL_MAX_TRAIN_COUNT (default
20000) change the setup; docker-compose.yaml and deploy/k8s set them.
"""

import os

import numpy as np

import srl
from srl.algorithms import dqn
from srl.runner.distribution import RedisParameters

rl_config = dqn.Config()
rl_config.hidden_block.set_mlp((64, 64))
rl_config.memory.set_proportional_memory()
rl_config.memory.capacity = 5000

runner = srl.Runner("Pendulum-v1", rl_config)
runner.train_distribution(
    RedisParameters.from_env(),
    os.environ.get("SRL_QUEUE_URL") or None,
    actor_num=int(os.environ.get("SRL_ACTOR_NUM", "1")),
    elastic_actors=os.environ.get("SRL_ELASTIC_ACTORS", "0") == "1",
    max_train_count=int(os.environ.get("SRL_MAX_TRAIN_COUNT", "20000")),
)
rewards = runner.evaluate()
print(rewards)
print(f"evaluation mean over {len(rewards)} episodes: {np.mean(rewards):.1f}")
