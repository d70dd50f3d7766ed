"""What a distributed task is, as data: the algorithm, its settings, the env and the limits.

Owns: building the pieces (config, env spec) a node needs from a task's JSON,
after checking its signature and every bound, with errors that say exactly
what is missing. Must never: touch Redis, import a module the node did not
allow, or accept a field it cannot bound.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from srl.algorithms import UnknownAlgorithmError, config_class
from srl.base.config import ConfigError, config_from_dict
from srl.base.env import EnvConfig, EnvError
from srl.base.rl import RLConfig
from srl.rl.networks import check_module_allowed
from srl.runner.distribution.board import values as board_values
from srl.runner.distribution.board.board import MAX_ACTORS, MAX_CONFIG_BYTES, MAX_INFERENCE_SERVERS
from srl.runner.distribution.board.values import BoardValueError
from srl.runner.distribution.wire.codec import MAX_MESSAGE_ROWS, Codec, DecodeError, short

MAX_QUEUE_CAPACITY = 1_000_000
"""most batches a task may allow in its queue"""
MAX_CENTRAL_ACTORS = 1020
"""most actor slots a task with central inference may have: its server holds a connection (a file descriptor) per
actor, and 1,024 descriptors is a common limit of a process (a few are kept spare for an actor whose new
connection opens while its old one closes)"""
TASK_GONE = ("the task is gone from the board: deleted, or Redis restarted without persistence (run it with "
             "appendonly yes for long tasks)")
"""why a node stops when its task vanished"""
TASK_REPLACED = "the task was replaced by a new task of the same name (a client submitted with overwrite=True)"
"""why a node stops when another task took its task's name"""


class TaskConfigError(ValueError):
    """A node cannot build the task it was given (the task is at fault: it ends FAILED)."""


class TaskTrustError(ValueError):
    """The task's config is unsigned or its signature does not match: the node refuses to run it."""


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
    """scheme and description of the experience queue the client chose, and its capacity"""
    checkpoint_interval: float | None = None
    """seconds between the checkpoints the trainer keeps on the board for the client (None: none)"""
    checkpoint_memory: bool = False
    """those checkpoints carry the replay memory too (when it fits)"""
    elastic_actors: bool = False
    """``actor_num`` is a maximum: the trainer waits for the actors there, not for every slot"""
    inference: str = "local"
    """where actions are chosen: "local" (each actor runs the network) or "central" (an inference node acts
    for every actor, which then only steps its envs; see ``srl.runner.distribution.inference.run``)"""
    inference_servers: int = 1
    """central inference's servers: the actor slots are shared among them (a dead one's actors move)"""
    double_buffer: bool = False
    """with central inference, each actor's envs are two halves that alternate: one half steps while the
    other's request is on its way"""

    @property
    def halves(self) -> int:
        """The parts an actor's envs act in: 2 when double-buffered, else 1."""
        return 2 if self.double_buffer else 1

    @property
    def queue_capacity(self) -> int:
        capacity = self.queue.get("capacity", 8)
        return capacity if isinstance(capacity, int) and not isinstance(capacity, bool) else 8


def _bounded(data: dict[str, Any], key: str, kind: type[int] | type[float], high: int | float,
             default: Any = None) -> Any:
    """``data[key]`` (else ``default``) as ``kind`` in 0..high, or None; TaskConfigError otherwise."""
    value = data.get(key, default)
    if value is None:
        return None
    if board_values.finite(value) is None or (kind is int and not isinstance(value, int)) or not 0 <= value <= high:
        raise TaskConfigError(f"task field {key!r} must be {'an integer' if kind is int else 'a number'} in "
                              f"0..{high:g} or null, found {board_values.shown(value)}")
    return kind(value)


def build_task(
    config_json: str,
    signature: str = "",
    codec: Codec | None = None,
    allow_modules: Collection[str] | None = None,
) -> TaskSpec:
    """Build a :class:`TaskSpec` from the config JSON a client wrote.

    ``codec``: checks ``signature`` first (:class:`TaskTrustError` when it does
    not hold). ``allow_modules``: the modules a ``module:Env`` id may import
    here (None: any, for a user's own process). Raises :class:`TaskConfigError`
    for anything a node cannot build or bound.
    """
    if codec is not None:
        try:
            codec.check_config_signature(config_json, signature)
        except DecodeError as e:
            raise TaskTrustError(str(e)) from None
    try:  # the one bounded reader: a number no field could hold (1e400, a 400-digit integer) refuses it here
        data = board_values.json_config(config_json, "task config", MAX_CONFIG_BYTES)
    except BoardValueError as e:
        raise TaskConfigError(f"{short(e, 300)}; a client of this srl writes finite numbers within 64 bits only") \
            from None
    try:
        algorithm = data["algorithm"]
        if not isinstance(algorithm, str):
            raise TaskConfigError(f"task field 'algorithm' must be text, found {short(repr(algorithm), 60)}")
        cls = config_class(algorithm)
        rl_config = config_from_dict(cls, data.get("rl_config", {}), where=f"{algorithm}.Config")
        rl_config.validate()
        unsettled = rl_config.unsettled()
        if unsettled:
            raise TaskConfigError(
                f"task field(s) {', '.join(unsettled)} of {algorithm}.Config are not set: a client sets them from the "
                "env before writing the task (Runner.train_distribution does; a hand-written task needs them)"
            )
        env_config = EnvConfig.from_dict(data["env"])
        env_config.check_allowed(allow_modules)
        for module in rl_config.imported_modules():
            check_module_allowed(module, allow_modules)
        actor_num = _bounded(data, "actor_num", int, MAX_ACTORS, 1)
        if actor_num < 1:
            raise TaskConfigError("task field 'actor_num' must be at least 1")
        queue = data.get("queue") or {}
        if not isinstance(queue, dict) or not all(isinstance(k, str) for k in queue):
            raise TaskConfigError("task field 'queue' must be an object")
        queue = {k: v for k, v in queue.items() if k in ("scheme", "describe", "capacity")}
        if "capacity" in queue:
            queue["capacity"] = _bounded(queue, "capacity", int, MAX_QUEUE_CAPACITY)
        for key in ("scheme", "describe"):
            if key in queue and not (isinstance(queue[key], str) and len(queue[key]) <= 300):
                raise TaskConfigError(f"task field 'queue.{key}' must be short text")
        checkpoints = data.get("checkpoints") or {}
        if not isinstance(checkpoints, dict) or not isinstance(checkpoints.get("memory", False), bool):
            raise TaskConfigError("task field 'checkpoints' must be an object {interval: seconds, memory: bool}")
        elastic_actors = data.get("elastic_actors", False)
        if not isinstance(elastic_actors, bool):
            raise TaskConfigError(f"task field 'elastic_actors' must be true or false, found "
                                  f"{short(repr(elastic_actors), 60)}")
        inference = data.get("inference", "local")
        if inference not in INFERENCE_MODES:
            raise TaskConfigError(f"task field 'inference' must be one of {list(INFERENCE_MODES)}, found "
                                  f"{short(repr(inference), 60)}")
        servers = _bounded(data, "inference_servers", int, MAX_INFERENCE_SERVERS, 1)
        if servers < 1:
            raise TaskConfigError("task field 'inference_servers' must be at least 1")
        double_buffer = data.get("double_buffer", False)
        if not isinstance(double_buffer, bool):
            raise TaskConfigError(f"task field 'double_buffer' must be true or false, found "
                                  f"{short(repr(double_buffer), 60)}")
        if inference == "central":
            check_central(rl_config, actor_num, double_buffer)
        return TaskSpec(
            inference=inference,
            inference_servers=servers,
            double_buffer=double_buffer,
            rl_config=rl_config,
            env_config=env_config,
            actor_num=actor_num,
            elastic_actors=elastic_actors,
            max_train_count=_bounded(data, "max_train_count", int, 2**62),
            max_steps=_bounded(data, "max_steps", int, 2**62),
            timeout=_bounded(data, "timeout", float, 1e9),
            queue=queue,
            checkpoint_interval=_bounded(checkpoints, "interval", float, 1e9),
            checkpoint_memory=checkpoints.get("memory", False),
        )
    except KeyError as e:
        raise TaskConfigError(
            f"task config lacks {short(e.args[0], 60)!r}; it was written by an incompatible client"
        ) from None
    except TaskConfigError:
        raise
    except (ConfigError, UnknownAlgorithmError, EnvError, ValueError, TypeError, ArithmeticError, RecursionError) as e:
        raise TaskConfigError(f"cannot build the task's config: {short(e, 400)}") from None


INFERENCE_MODES = ("local", "central")


def check_central(rl_config: RLConfig, actor_num: int, double_buffer: bool = False) -> None:
    """Raise TaskConfigError when ``rl_config``'s algorithm cannot act with central inference, one server
    cannot serve ``actor_num`` actors (elastic or not: every slot may connect), or its envs cannot be halved
    for ``double_buffer``."""
    if double_buffer and (rl_config.envs_per_actor < 2 or rl_config.envs_per_actor % 2):
        raise TaskConfigError(f"double_buffer halves each actor's envs: envs_per_actor must be even, found "
                              f"{rl_config.envs_per_actor}")
    most = MAX_CENTRAL_ACTORS // 2 if double_buffer else MAX_CENTRAL_ACTORS
    if actor_num > most:
        raise TaskConfigError(
            f"central inference serves at most {most} actors (its server holds a connection for each"
            f"{', two when double-buffered' if double_buffer else ''}), got actor_num={actor_num}; run fewer "
            "actors with more envs each (envs_per_actor), or inference='local'"
        )
    if rl_config.data_path().sync:
        raise TaskConfigError(
            f"{rl_config.algorithm} with sync=True cannot run with central inference: its actors wait in "
            "lockstep for each params version, which a server acting for all of them does not; use "
            "sync=False (asynchronous PPO), or inference='local'"
        )


def max_message_rows(task: TaskSpec) -> int:
    """Most rows one batch message of ``task`` may carry (actors split more; the trainer refuses more):
    an actor's segments of one vector step, or ``MAX_MESSAGE_ROWS`` transitions."""
    if task.rl_config.data_path().rows == "segments":
        return max(1, task.rl_config.envs_per_actor)
    return MAX_MESSAGE_ROWS


def batch_rows(task: TaskSpec, batch_size: int) -> int:
    """Rows a worker's finished rows are sent at (an actor's, or the inference server's for an actor): a
    segment as soon as it is complete; transitions ``batch_size`` at a time, within the message bound."""
    if task.rl_config.data_path().rows == "segments":
        return 1
    return max(1, min(batch_size, max_message_rows(task)))


class QueueMismatchError(TaskConfigError):
    """This node was given another experience queue than the task's (the node is at fault)."""


def check_queue_matches(task: TaskSpec, queue_params: Any, role: str) -> None:
    """A node whose queue differs from the task's would send into (or read from) the void."""
    from srl.runner.distribution.queues import describe_queue, queue_scheme

    expected = task.queue.get("scheme")
    mine = queue_scheme(queue_params)
    if expected and expected != mine:
        given = "queue_params=None (the board's Redis)" if queue_params is None else describe_queue(queue_params)
        raise QueueMismatchError(
            f"the task sends experience over {task.queue.get('describe', expected)!r} but this {role} was given "
            f"a {mine!r} queue: {given}; start the {role} with the same queue parameters as the client"
        )
