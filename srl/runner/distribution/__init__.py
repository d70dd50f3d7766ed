"""Distributed training: actors and a trainer that meet on a Redis blackboard and an experience queue.

``RedisParameters`` says where the board lives; ``RabbitMQParameters``,
``MQTTParameters`` and ``GCPParameters`` move the experience queue elsewhere
(None keeps it in the board's Redis). ``actor_run_forever``,
``trainer_run_forever`` and ``inference_run_forever`` (central inference) serve
tasks, with ``ActorOptions``, ``TrainerOptions`` and ``InferenceOptions``;
``Runner.train_distribution`` submits one. The three are imported when first
used (they load torch; ``srl status`` does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from srl.runner.distribution.settings.options import ActorOptions, InferenceOptions, TrainerOptions
from srl.runner.distribution.settings.queue_parameters import GCPParameters, MQTTParameters, RabbitMQParameters
from srl.runner.distribution.settings.redis_parameters import RedisParameters

if TYPE_CHECKING:
    from srl.runner.distribution.actor.run import actor_run_forever
    from srl.runner.distribution.inference.run import inference_run_forever
    from srl.runner.distribution.trainer.run import trainer_run_forever

__all__ = [
    "ActorOptions",
    "GCPParameters",
    "InferenceOptions",
    "MQTTParameters",
    "RabbitMQParameters",
    "RedisParameters",
    "TrainerOptions",
    "actor_run_forever",
    "inference_run_forever",
    "trainer_run_forever",
]


def __getattr__(name: str) -> Any:
    if name == "actor_run_forever":
        from srl.runner.distribution.actor.run import actor_run_forever

        return actor_run_forever
    if name == "trainer_run_forever":
        from srl.runner.distribution.trainer.run import trainer_run_forever

        return trainer_run_forever
    if name == "inference_run_forever":
        from srl.runner.distribution.inference.run import inference_run_forever

        return inference_run_forever
    raise AttributeError(f"module 'srl.runner.distribution' has no attribute {name!r}")
