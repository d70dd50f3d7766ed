"""Checking what ``train_distribution`` was asked, before anything is written or started.

Owns: :class:`TaskRequest` (the arguments of one call), their checks (a wrong type or range says what was
expected and what came), whether the experience queue answers and takes this client's credentials, and how a
running task's config differs from this one. Must never: write to the board or start a process: a check
that fails leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from srl.base.config import config_from_dict, shown, unknown_setting_message
from srl.runner.distribution.board.board import MAX_ACTORS, MAX_INFERENCE_SERVERS
from srl.runner.distribution.queues import BrokerUnavailableError, describe_queue, open_queue
from srl.runner.distribution.settings.options import ActorOptions, InferenceOptions, TrainerOptions
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import INFERENCE_MODES, MAX_QUEUE_CAPACITY


@dataclass(frozen=True)
class TaskRequest:
    """The arguments of one ``train_distribution`` call (each is documented there), typed as declared but
    as given: only :func:`check_request` makes sure they are what they claim."""

    redis_params: RedisParameters
    queue_params: Any
    actor_num: int
    max_train_count: int | None
    max_steps: int | None
    timeout: float | None
    progress_interval: float | None
    overwrite: bool
    attach: bool | None
    queue_capacity: int
    secret: str | None
    local_processes: bool | None
    actor_options: dict[str, Any] | None
    trainer_options: dict[str, Any] | None
    delete_task: bool
    log_dir: str | os.PathLike[str] | None
    eval_interval: float | None
    eval_every: int | None
    eval_episodes: int
    checkpoint_interval: float
    keep_checkpoints: int
    checkpoint_memory: bool
    resume_from: str | os.PathLike[str] | None
    inference: str
    inference_options: dict[str, Any] | None
    elastic_actors: bool
    inference_servers: int = 1
    double_buffer: bool = False


def check_request(r: TaskRequest) -> None:
    """Every argument checked before anything is written or started: a wrong type or range says what was
    expected and what came (with its type: ``1000.0 (a float)``)."""
    if not isinstance(r.redis_params, RedisParameters):
        raise TypeError(f"redis_params must be RedisParameters(...), got {shown(r.redis_params)}")
    describe_queue(r.queue_params)  # a malformed URL or an unknown scheme fails here
    if r.max_train_count is None and r.max_steps is None and r.timeout is None:
        raise ValueError("train_distribution() needs a limit: max_train_count=, max_steps= or timeout=")
    check_count("actor_num", r.actor_num, 1, MAX_ACTORS)
    for name in ("max_train_count", "max_steps"):
        value = getattr(r, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an integer or None, got {shown(value)}"
                            + (f": write {int(value)}" if isinstance(value, float) and value.is_integer() else ""))
        if value is not None:
            check_count(name, value, 1, 2**62)
    for name in ("timeout", "progress_interval", "eval_interval"):
        check_seconds(name, getattr(r, name), optional=True)
    check_seconds("checkpoint_interval", r.checkpoint_interval, optional=False)
    check_count("queue_capacity", r.queue_capacity, 1, MAX_QUEUE_CAPACITY)
    check_count("eval_episodes", r.eval_episodes, 1, 1_000_000)
    check_count("keep_checkpoints", r.keep_checkpoints, 1, 1_000_000)
    if r.eval_every is not None:
        check_count("eval_every", r.eval_every, 1, 2**62)
    if r.secret is not None and not isinstance(r.secret, str):
        raise TypeError(f"secret must be text or None, got {type(r.secret).__name__}")
    for name in ("overwrite", "delete_task", "checkpoint_memory", "elastic_actors", "double_buffer"):
        if not isinstance(getattr(r, name), bool):
            raise TypeError(f"{name} must be True or False, got {shown(getattr(r, name))}")
    for name in ("attach", "local_processes"):
        value = getattr(r, name)
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True, False or None, got {shown(value)}")
    for name in ("log_dir", "resume_from"):
        value = getattr(r, name)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"{name} must be a path (str or pathlib.Path) or None, got {shown(value)}")
    if r.inference not in INFERENCE_MODES:
        raise ValueError(f"inference must be one of {list(INFERENCE_MODES)}, got {shown(r.inference)}")
    check_count("inference_servers", r.inference_servers, 1, MAX_INFERENCE_SERVERS)
    if r.double_buffer and r.inference != "central":
        raise ValueError("double_buffer halves each actor's envs to overlap central inference's round trips: give "
                         "inference='central' too")
    if r.inference_servers > 1 and r.inference != "central":
        raise ValueError(f"inference_servers={r.inference_servers} shares the actors among central inference "
                         "servers: give inference='central' too")
    for name, cls in (("actor_options", ActorOptions), ("trainer_options", TrainerOptions),
                      ("inference_options", InferenceOptions)):
        _check_options(name, getattr(r, name), cls)


def _check_options(name: str, options: Any, cls: type[ActorOptions | TrainerOptions | InferenceOptions]) -> None:
    if options is None:
        return
    if not isinstance(options, dict):
        raise TypeError(f"{name} must be a dict of {cls.__name__} fields, got {shown(options)}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in options:
        if key not in known:
            raise TypeError(f"{name}: {unknown_setting_message(cls, str(key))}")
    checked = config_from_dict(cls, options, where=name)  # the values too: a local node would exit on them
    try:
        checked.validate()
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def check_count(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer in {low}..{high}, got {shown(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value}")


def check_seconds(name: str, value: Any, *, optional: bool) -> None:
    expected = f"{name} must be a number > 0" + (" or None" if optional else "")
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{expected}, got {shown(value)}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{expected}, got {value}")


QUEUE_CHECK_S = 10.0
"""how long the client waits for an experience queue that does not answer before it gives up submitting"""


def check_queue(queue_params: Any, redis_params: RedisParameters) -> None:
    """The experience queue answers and takes this client's credentials: checked before the task is written,
    so a wrong password or an unreachable broker fails here, not on every node after submitting."""
    deadline = time.monotonic() + QUEUE_CHECK_S
    while True:
        try:
            with open_queue(queue_params, namespace=redis_params.task_name, role="producer",
                            redis_params=redis_params):
                return
        except BrokerUnavailableError:  # CredentialsError is not one: it is raised at once
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def config_differences(running: dict[str, Any], ours: dict[str, Any]) -> str:
    """The top-level fields (and the algorithm's settings) in which two task configs differ, as text."""
    names = []
    for key in sorted(set(running) | set(ours)):
        if running.get(key) == ours.get(key):
            continue
        mine, theirs = ours.get(key), running.get(key)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            names += [f"{key}.{k}" for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        else:
            names.append(key)
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
