"""What an actor and a trainer process share: options, counter deltas and the serve loop.

Owns: ``NodeOptions`` (liveness, polling, signing, run-once), ``CounterDeltas``
and ``serve`` — wait for an ACTIVE task, build it, claim a lease, run, repeat —
with the rules both roles follow: a task no node could build is FAILED with the
reason; a just-claimed lease is released at once if building the run fails or
is interrupted. Must never: know what an actor or a trainer does inside a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from srl.base.env import EnvError
from srl.runner.distribution.board import Board
from srl.runner.distribution.redis_parameters import RedisParameters
from srl.runner.distribution.retry import TRANSIENT_ERRORS, with_retry
from srl.runner.distribution.task import TaskConfigError, TaskSpec, build_task, check_queue_matches

logger = logging.getLogger("srl.node")

OptionsT = TypeVar("OptionsT")


@dataclass
class NodeOptions:
    """Settings every node (actor or trainer) has."""

    heartbeat_interval: float = 1.0
    """seconds between lease renewals (each also reports stats)"""
    lease_ttl: float = 5.0
    """seconds a lease stays held without a renewal"""
    task_poll_interval: float = 1.0
    """seconds between looks for a task while idle"""
    secret: str | None = None
    """shared secret that signs messages (default: env SRL_SECRET)"""
    run_once: bool = False
    """return once the task it served has ended, instead of waiting for the next (after losing its
    lease, e.g. to a pause longer than the TTL, it stands by for the same task)"""
    uid: str = ""
    """this process's name on the board (default: role-host-pid-random)"""

    def set_default_uid(self, role: str) -> None:
        if not self.uid:
            self.uid = f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def apply_overrides(options: OptionsT, overrides: dict[str, Any], caller: str) -> OptionsT:
    """Set dataclass fields from keyword arguments; an unknown one names the known ones."""
    known = {f.name for f in dataclasses.fields(options)}  # type: ignore[arg-type]
    for key, value in overrides.items():
        if key not in known:
            raise TypeError(f"{caller}() got an unknown option {key!r}; {type(options).__name__} has {sorted(known)}")
        setattr(options, key, value)
    return options


def require_remote(redis_params: RedisParameters, caller: str) -> None:
    if redis_params.is_embedded:
        raise ValueError(
            f"{caller} needs the address of the board's Redis (RedisParameters(host=...) or url=...); "
            "an embedded Redis exists only inside the client process that started it"
        )


class CounterDeltas:
    """Counter increments the work threads add and the heartbeat takes (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deltas: dict[str, float] = {}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                if v:
                    self._deltas[k] = self._deltas.get(k, 0.0) + v

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._deltas = self._deltas, {}
        return out

    @contextlib.contextmanager
    def taken(self) -> Iterator[dict[str, float]]:
        """The deltas for one write to the board; put back if that write fails (nothing is lost
        to a Redis hiccup; a write whose reply was lost may count twice)."""
        deltas = self.take()
        try:
            yield deltas
        except BaseException:
            self.add(**deltas)
            raise


class Run(Protocol):
    """One node working on one task under one lease."""

    def run(self) -> str:
        """Work until the task ends or the lease is lost; why it stopped."""

    def summary(self) -> str:
        """A short account of the work done, for the log."""


def serve(
    role: str,
    board: Board,
    where: str,
    options: NodeOptions,
    queue_params: Any,
    claim: Callable[[TaskSpec], int | None],
    lease_name: Callable[[int], str],
    standby_note: Callable[[TaskSpec], str],
    build_run: Callable[[TaskSpec, int], Run],
) -> None:
    """Wait for an ACTIVE task, claim a lease with ``claim``, build and run, repeat (or return once)."""
    waiting = ""

    def note(state: str, message: str, *args: Any) -> None:
        nonlocal waiting
        if state != waiting:
            logger.info(message, *args)
            waiting = state

    while True:
        status = with_retry(board.get_status, f"reading the task on {where}")
        if status is None or status.status != "ACTIVE":
            state = "no task" if status is None else f"task {status.status.value}"
            note(state, "%s %s waiting for an ACTIVE task on %s (now: %s)", role, options.uid, where, state)
            time.sleep(options.task_poll_interval)
            continue
        try:
            task = build_task(board.get_task_config())
        except TaskConfigError as e:  # unknown algorithm, bad field: no node could run it
            logger.error("cannot build the task: %s", e)
            board.end_task("FAILED", f"{role} {options.uid}: {e}")
            board.log_event(f"task FAILED: {e}", level="ERROR", source=options.uid)
            if options.run_once:
                return
            continue
        check_queue_matches(task, queue_params, role)
        claimed = with_retry(lambda: claim(task), f"claiming a {role} lease")  # noqa: B023 - called at once
        if claimed is None:
            note("standby", "%s", standby_note(task))
            time.sleep(min(options.task_poll_interval, options.lease_ttl / 4))
            continue
        waiting = ""
        board.log_event(f"{role} {options.uid} took lease {lease_name(claimed)} ({role} {claimed})", source=options.uid)
        try:
            run = build_run(task, claimed)
        except (EnvError, ValueError, RuntimeError) as e:  # an env, network or device this task cannot have
            board.release_lease(lease_name(claimed), options.uid)
            logger.error("%s cannot build the task: %s", role, e)
            board.end_task("FAILED", f"{role} {options.uid} cannot build the task: {e}")
            board.log_event(f"task FAILED: {role} cannot build the task: {e}", level="ERROR", source=options.uid)
            if options.run_once:
                return
            continue
        except BaseException:
            board.release_lease(lease_name(claimed), options.uid)  # free it now, not when it expires
            raise
        reason = run.run()
        logger.info("%s %s stopped: %s (%s)", role, options.uid, reason, run.summary())
        with contextlib.suppress(*TRANSIENT_ERRORS):
            board.log_event(f"{role} {options.uid} stopped: {reason} ({run.summary()})", source=options.uid)
        if options.run_once and _task_over(board):
            return
        # run_once still serves the same task after losing a lease (a pause longer than the TTL)
        time.sleep(options.task_poll_interval)


def _task_over(board: Board) -> bool:
    """The task this node served has ended (or is gone): a run-once node may return."""
    status = with_retry(board.get_status, "reading the task status")
    return status is None or status.status.finished
