"""Putting a task on the board, or attaching to the one that runs it already; leaving it on an interrupt.

Owns: the task's config as the client writes it, the choice between submitting and attaching (and the
errors that say what to do when neither fits), emptying the queue a new task starts with, the events that
say a task was submitted or attached to, detaching, and SIGTERM taken as Ctrl-C. Must never: replace a
running task unless told to (``overwrite``), nor end a task an attached client did not submit.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from srl.runner.distribution.board.board import Board, TaskExistsError, TaskNotFoundError
from srl.runner.distribution.client.check import TaskRequest, config_differences
from srl.runner.distribution.client.protocol import Runner
from srl.runner.distribution.client.report import NodeHints
from srl.runner.distribution.node.retry import with_retry
from srl.runner.distribution.queues import describe_queue, discard_leftovers, queue_scheme
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.wire.codec import short

logger = logging.getLogger("srl.client")


class Terminated(KeyboardInterrupt):
    """SIGTERM reached a client (``timeout``, ``kill``, ``docker stop``, a closed notebook): it ends the task
    as Ctrl-C does, then the process exits with 143."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs in the main thread, SIGTERM raises :class:`Terminated` there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def task_config(runner: Runner, request: TaskRequest, with_checkpoints: bool) -> dict[str, Any]:
    """The task as the board holds it: the runner's algorithm and env, the end rule, the queue, and what
    differs from the defaults (central inference, elastic actors)."""
    r = request
    return {
        **runner.task_config(),
        "actor_num": r.actor_num,
        "max_train_count": r.max_train_count,
        "max_steps": r.max_steps,
        "timeout": r.timeout,
        "queue": {"scheme": queue_scheme(r.queue_params), "describe": describe_queue(r.queue_params),
                  "capacity": r.queue_capacity},
        "checkpoints": {"interval": r.checkpoint_interval, "memory": r.checkpoint_memory} if with_checkpoints
        else None,
        **({"inference": r.inference} if r.inference != "local" else {}),
        **({"inference_servers": r.inference_servers} if r.inference_servers != 1 else {}),
        **({"double_buffer": True} if r.double_buffer else {}),
        **({"elastic_actors": True} if r.elastic_actors else {}),
    }


def attach_to(board: Board, task: dict[str, Any], overwrite: bool, attach: bool | None) -> Board | None:
    """The board bound to a task of this name to watch instead of submitting one (see ``attach``), or None
    to submit. Raises TaskExistsError / TaskNotFoundError / ValueError saying what to do."""
    status = with_retry(board.get_status, "reading the task", max_wait=10)
    if status is None:
        if attach:
            raise TaskNotFoundError(f"no task {board.task_name!r} on this Redis to attach to; drop attach=True to "
                                    "submit one")
        return None
    if overwrite or attach is False or (status.status.finished and not attach):
        return None  # create_task refuses a running one unless overwrite
    differs = config_differences(board.get_task_config(), task)
    if differs:
        if status.status.finished:  # attach=True
            raise ValueError(f"the task {board.task_name!r} that ended ({status.status.value}) ran another config "
                             f"({differs}): its params do not fit this runner; drop attach=True to submit a new one")
        raise TaskExistsError(
            f"task {board.task_name!r} is {status.status.value} with another config ({differs}); wait for it to "
            "end, pick another task_name, or pass overwrite=True to replace it (its actors and trainer drop it "
            "and serve the new one)"
        )
    logger.info("task %r is %s with this very config: attaching to it (overwrite=True would replace it)",
                board.task_name, status.status.value)
    return board.bound(status.task_id)


def clear_leftover_experience(queue_params: Any, redis_params: RedisParameters) -> None:
    """A new task starts with an empty queue. A Redis stream left without its task record, a RabbitMQ
    queue, a Pub/Sub topic or an MQTT session outlives its task, and batches actors sent after an
    earlier task of this name ended would otherwise reach the new trainer (accepted when the schema
    matches: same columns, and without a secret nothing tells the tasks apart)."""
    try:
        depth = discard_leftovers(queue_params, namespace=redis_params.task_name, redis_params=redis_params)
    except Exception as e:
        logger.warning("could not empty the task's %s queue before starting (%s): batches an earlier task of this "
                       "name left there may reach the trainer", queue_scheme(queue_params), short(e))
        return
    if depth:
        logger.info("removed %d batch(es) an earlier task of this name left in the %s queue", depth,
                    queue_scheme(queue_params))


def announce(board: Board, redis_params: RedisParameters, task: dict[str, Any], runner: Runner, attached: bool
             ) -> None:
    """Make the task ACTIVE (one its client left INIT, killed while starting it, starts now too) and say
    who started watching it: on the board's events, and in the log for a submitted one."""
    board.set_active()
    if attached:
        board.log_event("a client attached to the task", source="client")
        return
    actor_num = task["actor_num"]
    board.log_event(f"task submitted: {task['algorithm']} on {runner.env_config}, {actor_num} actor(s)",
                    source="client")
    logger.info("task %r submitted to %s: %s on %s, %d actor(s)", redis_params.task_name,
                redis_params.describe(), task["algorithm"], runner.env_config, actor_num)


def detach(board: Board, redis_params: RedisParameters, why: str) -> None:
    """An interrupted client that attached to a task leaves it running (another client submitted it). Its
    runner keeps its weights: the same call again attaches anew and loads the final ones."""
    logger.warning("%s: detaching from task %r, which goes on (its submitting client's Ctrl-C or `%s` ends it)",
                   why, redis_params.task_name, NodeHints.of(redis_params).command("stop"))
    with contextlib.suppress(Exception):  # a board that is away: the interrupt still ends this client
        board.log_event("a client detached from the task", source="client")
