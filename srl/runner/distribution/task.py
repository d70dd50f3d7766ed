"""What a distributed task is, as data: the algorithm, its settings, the env and the limits.

Owns: building the pieces (config, env spec) a node needs from a task's JSON,
with errors that say exactly what is missing. Must never: touch Redis.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from srl.algorithms import config_class
from srl.base.config import ConfigError, config_from_dict
from srl.base.env import EnvConfig
from srl.base.rl import RLConfig


class TaskConfigError(ValueError):
    """A node cannot build the task it was given."""


@dataclass
class TaskSpec:
    """A task as a node builds it."""

    rl_config: RLConfig
    env_config: EnvConfig
    actor_num: int
    max_train_count: int | None
    max_steps: int | None
    timeout: float | None
    queue: dict[str, Any]
    """scheme and description of the experience queue the client chose"""
    env_steps_per_train: float | None = None
    """past warmup, all actors together step at most this many env steps per trainer train step
    (each actor its 1/actor_num share); None: actors step as fast as they can"""


def build_task(data: dict[str, Any]) -> TaskSpec:
    """Build a :class:`TaskSpec` from the JSON the client wrote; raises :class:`TaskConfigError`."""
    try:
        algorithm = data["algorithm"]
        cls = config_class(algorithm)
        rl_config = config_from_dict(cls, data.get("rl_config", {}), where=f"{algorithm}.Config")
        rl_config.validate()
        env_config = EnvConfig.from_dict(data["env"])
        return TaskSpec(
            rl_config=rl_config,
            env_config=env_config,
            actor_num=int(data.get("actor_num", 1)),
            max_train_count=data.get("max_train_count"),
            max_steps=data.get("max_steps"),
            timeout=data.get("timeout"),
            queue=dict(data.get("queue") or {}),
            env_steps_per_train=data.get("env_steps_per_train"),
        )
    except KeyError as e:
        raise TaskConfigError(f"task config lacks {e.args[0]!r}; it was written by an incompatible client") from e
    except (ConfigError, ValueError) as e:
        raise TaskConfigError(f"cannot build the task's algorithm config: {e}") from e


class StopFlag:
    """Why a node should stop working on its task; the first reason wins."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


def check_queue_matches(task: TaskSpec, queue_params: Any, role: str) -> None:
    """A node whose queue differs from the task's would send into (or read from) the void."""
    from srl.runner.distribution.queues import queue_scheme

    expected = task.queue.get("scheme")
    mine = queue_scheme(queue_params)
    if expected and expected != mine:
        given = "queue_params=None (the board's Redis)" if queue_params is None else repr(queue_params)
        raise TaskConfigError(
            f"the task sends experience over {task.queue.get('describe', expected)!r} but this {role} was given "
            f"a {mine!r} queue: {given}; start the {role} with the same queue parameters as the client"
        )
