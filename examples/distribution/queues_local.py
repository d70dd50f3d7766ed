"""The distributed run with experience over RabbitMQ, MQTT or Pub/Sub; Redis holds only the board.

Brokers on this machine (scripts/services.sh starts them), an embedded Redis
for the board, and a local trainer and actor started by the client:

    python examples/distribution/queues_local.py rabbitmq
    python examples/distribution/queues_local.py mqtt
    python examples/distribution/queues_local.py pubsub      # the emulator on 127.0.0.1:8085

On real machines, give every node the same queue parameters, e.g.
    actor_run_forever(RedisParameters(host="board"), RabbitMQParameters(url="amqps://user:pw@mq/"))
    trainer_run_forever(RedisParameters(host="board"), RabbitMQParameters(url="amqps://user:pw@mq/"), run_once=True)
"""

import argparse
import os

import numpy as np

import srl
from srl.algorithms import dqn
from srl.runner.distribution import GCPParameters, MQTTParameters, RabbitMQParameters, RedisParameters

QUEUES = {
    "rabbitmq": lambda: RabbitMQParameters(url="amqp://guest:guest@127.0.0.1:5672/"),
    "mqtt": lambda: MQTTParameters(host="127.0.0.1", port=1883),
    "pubsub": lambda: GCPParameters(
        project_id="srl-local", emulator_host=os.environ.get("PUBSUB_EMULATOR_HOST", "127.0.0.1:8085")
    ),
}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("queue", choices=sorted(QUEUES))
parser.add_argument("--max-train-count", type=int, default=20_000)
args = parser.parse_args()

rl_config = dqn.Config()
rl_config.hidden_block.set_mlp((64, 64))
rl_config.memory.set_proportional_memory()
rl_config.memory.capacity = 5000

runner = srl.Runner("Pendulum-v1", rl_config)
runner.train_distribution(RedisParameters(), QUEUES[args.queue](), actor_num=1, max_train_count=args.max_train_count)
rewards = runner.evaluate()
print(f"evaluation mean over {len(rewards)} episodes: {np.mean(rewards):.1f}")
