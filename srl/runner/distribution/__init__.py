"""Distributed training: actors and a trainer that meet on a Redis blackboard and an experience queue.

``RedisParameters`` says where the board lives; ``RabbitMQParameters``,
``MQTTParameters`` and ``GCPParameters`` move the experience queue elsewhere
(None keeps it in the board's Redis). ``actor_run_forever`` and
``trainer_run_forever`` serve tasks; ``Runner.train_distribution`` submits one.
"""

from srl.runner.distribution.actor import ActorOptions, actor_run_forever
from srl.runner.distribution.queue_parameters import GCPParameters, MQTTParameters, RabbitMQParameters
from srl.runner.distribution.redis_parameters import RedisParameters
from srl.runner.distribution.trainer import TrainerOptions, trainer_run_forever

__all__ = [
    "ActorOptions",
    "GCPParameters",
    "MQTTParameters",
    "RabbitMQParameters",
    "RedisParameters",
    "TrainerOptions",
    "actor_run_forever",
    "trainer_run_forever",
]
