"""What every node process (actor, trainer, inference server) shares: the serve loop, the lease kept while a
heartbeat is late, counter deltas.

Owns: ``serve`` — wait for an ACTIVE task, check and build it, claim a lease, run, repeat — and
``LeaseGuard``, ``BoardWork``, ``CounterDeltas`` and ``InTransit``, with the rules every role follows
(its options are ``settings/options.py``'s ``NodeOptions``):

* the board is untrusted: a malformed record is waited out, an unsigned or
  mis-signed config (when this node has a secret) is refused and said so;
* a task no node could build (unknown algorithm, bad field, an env module
  this node does not allow, a memory larger than it may allocate) ends
  FAILED with the reason, never a traceback, never left ACTIVE;
* a just-claimed lease is released at once if building the run fails or the
  node is stopped (Ctrl-C) while claiming or building;
* Redis being away, or refusing for a while (full, read-only after a failover, busy), is waited out, with a
  line every few seconds that names it;
* a bug inside a run (not a message, not an outage) ends the task FAILED and
  the process with a clear error (:class:`NodeCrashedError`).

Must never: know what an actor or a trainer does inside a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from srl.base.env import allowed_env_modules
from srl.runner.distribution.board.board import BOARD_AWAY, Board, BoardError, count_token
from srl.runner.distribution.node.liveness import keep_lease
from srl.runner.distribution.node.retry import Throttle, with_retry
from srl.runner.distribution.settings.credentials import CredentialsError
from srl.runner.distribution.settings.options import NodeOptions
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import (
    QueueMismatchError,
    TaskConfigError,
    TaskSpec,
    TaskTrustError,
    build_task,
    check_queue_matches,
)
from srl.runner.distribution.wire.codec import short

logger = logging.getLogger("srl.node")


REFUSAL_NOTE_INTERVAL_S = 10.0
"""while a node refuses a task, how often it renews its note on the board (the client shows recent ones)"""

BUDGET_BEAT_S = 0.05
"""a node's heartbeat interval once the task's ``max_steps`` is less than two heartbeats' steps away: actors
count their last steps (and hold at the budget) and the trainer sees the total reach it within this"""

OptionsT = TypeVar("OptionsT")
AnswerT = TypeVar("AnswerT")


class NodeCrashedError(RuntimeError):
    """A node's run failed from a bug (not a message, not an outage); the task was ended FAILED."""


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


class InTransit:
    """What a link carries while its commands are on their way, for the windows that must not throttle a
    long link (an actor's queue and outbox, a learner's FIFO).

    Fed each command's time (``timed``) and what it moved (``moved``), it tells once a second ``2 × rate ×
    round trip``: what is on its way, and what waits a round trip for the other side to look again. The round
    trip is the second's fastest command, one that did not wait for data; a second without one keeps the
    last. On loopback that is a fraction of one item."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.round_trip: float | None = None
        self.rate = 0.0
        """items moved a second, over the last second"""
        self._since = clock()
        self._moved = 0
        self._fastest = math.inf

    def timed(self, seconds: float) -> None:
        self._fastest = min(self._fastest, seconds)

    def moved(self, items: int) -> float | None:
        """Count ``items``; once a second, what two round trips carry at the rate (None between, and before
        a command was timed)."""
        self._moved += items
        now = self.clock()
        if now - self._since < 1.0:
            return None
        self.rate = self._moved / (now - self._since)
        self._since, self._moved = now, 0
        if self._fastest < math.inf:
            self.round_trip, self._fastest = self._fastest, math.inf
        return None if self.round_trip is None else 2 * self.rate * self.round_trip


class CounterDeltas:
    """Counter increments the work threads add and the heartbeat takes (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deltas: dict[str, float] = {}
        self._unconfirmed: tuple[dict[str, float], str] | None = None
        """deltas taken for a write that failed, and their count token: the next write sends them again"""

    def add(self, **deltas: float) -> None:
        """Add ``deltas``; a delta that is not a finite number is refused here, in the thread that made it: on
        the board it could not be added, and the heartbeat that carried it would fail, put back, again and again."""
        for k, v in deltas.items():
            try:
                ok = math.isfinite(v)
            except (OverflowError, TypeError):  # an int beyond a float's range; not a number
                ok = False
            if not ok:
                raise ValueError(f"counter {k!r} delta must be a finite number, found {v!r}")
        with self._lock:
            for k, v in deltas.items():
                if v:
                    self._deltas[k] = self._deltas.get(k, 0.0) + v

    def send(self, write: Callable[[dict[str, float], str], AnswerT]) -> AnswerT:
        """Write the deltas to the board as ``write(deltas, token)`` (a :func:`count_token`) and return its
        answer. A write that fails keeps them with their token, and the next send writes them again first:
        nothing is lost to a Redis hiccup, and a write whose reply was lost (Redis ran it) adds nothing the
        second time. What was added meanwhile follows in a second write (under their token it would be
        dropped with them where the lost write had landed), so that each send brings every delta."""
        for _ in range(2):
            with self._lock:
                kept = self._unconfirmed is not None
                if self._unconfirmed is None:
                    self._unconfirmed = (self._deltas, count_token())
                    self._deltas = {}
                deltas, token = self._unconfirmed
            answer = write(deltas, token)  # a failed write raises here, and they stay kept
            with self._lock:
                self._unconfirmed = None
            if not kept:
                break
        return answer


class Run(Protocol):
    """One node working on one task under one lease."""

    def run(self) -> str:
        """Work until the task ends or the lease is lost; why it stopped."""

    def summary(self) -> str:
        """A short account of the work done, for the log."""


class _Notes:
    """One log line per change of what the node waits for (and a reminder every minute)."""

    def __init__(self) -> None:
        self.state = ""
        self._reminder = Throttle(60.0)

    def __call__(self, state: str, message: str, *args: Any, level: int = logging.INFO) -> None:
        if state != self.state:
            self.state = state
            self._reminder.ready()
            logger.log(level, message, *args)
        elif self._reminder.ready():
            logger.log(level, "still: " + message, *args)

    def reset(self) -> None:
        self.state = ""


def serve(
    role: str,
    board: Board,
    where: str,
    options: NodeOptions,
    queue_params: Any,
    claim: Callable[[Board, TaskSpec], int | None],
    lease_name: Callable[[int], str],
    standby_note: Callable[[Board, TaskSpec], str],
    build_run: Callable[[Board, TaskSpec, int], Run],
) -> None:
    """Wait for an ACTIVE task, claim a lease with ``claim``, build and run, repeat (or return once).

    ``claim``, ``standby_note`` and ``build_run`` get the board bound to the task they serve (its id):
    a run whose task was replaced by another of the same name stops, and the next loop builds the new one.
    Refused credentials (a password, a permission) end the node with :class:`CredentialsError`; the task
    stays for nodes that can serve it."""
    note = _Notes()
    codec = options.codec(board.task_name)
    allow_modules = allowed_env_modules(options.allow_env_modules)
    refused = ""  # the task and reason last refused (one event for them, not one per poll)
    refusal_note = Throttle(REFUSAL_NOTE_INTERVAL_S)
    uid = options.uid

    def fail(task_board: Board, reason: str) -> None:
        logger.error("%s", reason)
        # only the task this was (the bound board): a client may have replaced it meanwhile
        if not with_retry(lambda: task_board.end_task("FAILED", reason), "ending the task FAILED"):
            return
        with contextlib.suppress(*BOARD_AWAY):
            task_board.log_event(f"task FAILED: {reason}", level="ERROR", source=uid)

    def refuse(task_board: Board, reason: str) -> None:
        """Say on the board that this node refuses the task and why: the client shows it."""
        nonlocal refused
        with contextlib.suppress(*BOARD_AWAY):
            if f"{task_board.task_id} {reason}" != refused:
                refused = f"{task_board.task_id} {reason}"
                task_board.log_event(f"{role} {uid} refuses the task: {reason}", level="ERROR", source=uid)
                refusal_note.ready()
            elif not refusal_note.ready():
                return
            task_board.note_refusal(uid, role, reason)

    def release(task_board: Board, claimed: int) -> None:
        with contextlib.suppress(*BOARD_AWAY):
            task_board.release_lease(lease_name(claimed), uid)  # free it now, not when it expires

    while True:
        try:
            status = with_retry(board.get_status, f"reading the task on {where}")
        except BoardError as e:  # a malformed record or another board format: wait for a good one
            note(f"bad: {e}", "%s %s cannot read the task on %s: %s", role, uid, where, short(e), level=logging.WARNING)
            time.sleep(options.task_poll_interval)
            continue
        if status is None or status.status != "ACTIVE":
            state = "no task" if status is None else f"task {status.status.value}"
            note(state, "%s %s waiting for an ACTIVE task on %s (now: %s)", role, uid, where, state)
            time.sleep(options.task_poll_interval)
            continue
        try:
            record = with_retry(board.get_task_record, "reading the task config")
            task_board = board.bound(record.task_id)
            task = build_task(record.config_json, record.signature, codec, allow_modules)
            check_queue_matches(task, queue_params, role)
        except (TaskTrustError, QueueMismatchError) as e:
            # not the client's config, not our secret, or not the queue this node was given: whether the
            # task or this node is wrong, running it would do harm: refuse, say so, wait for a good one
            note(f"refused: {e}", "%s %s refuses the task on %s: %s", role, uid, where, e, level=logging.ERROR)
            refuse(task_board, str(e))
            time.sleep(options.task_poll_interval)
            continue
        except TaskConfigError as e:  # unknown algorithm, bad field: no node could run it
            fail(task_board, f"{role} {uid} cannot build the task: {e}")
            if options.run_once:
                return
            continue
        except BoardError as e:
            note(f"bad: {e}", "%s %s cannot read the task config: %s", role, uid, short(e), level=logging.WARNING)
            time.sleep(options.task_poll_interval)
            continue
        try:
            claimed = with_retry(lambda: claim(task_board, task), f"claiming a {role} lease")  # noqa: B023
        except BaseException:  # stopped mid-claim: the board may have granted a lease this node never learned of
            with contextlib.suppress(*BOARD_AWAY):
                task_board.release_leases_of(uid, task.actor_num, task.inference_servers)
            raise
        if claimed is None:
            note("standby", "%s", standby_note(task_board, task))
            time.sleep(min(options.task_poll_interval, options.lease_ttl / 4))
            continue
        try:
            note.reset()
            refused = ""
            with contextlib.suppress(*BOARD_AWAY):
                task_board.clear_refusal(uid)
                task_board.log_event(f"{role} {uid} took lease {lease_name(claimed)} ({role} {claimed})", source=uid)
            with keep_lease(task_board, lease_name(claimed), uid, options.lease_ttl, options.heartbeat_interval,
                            options.max_start_s):
                run = build_run(task_board, task, claimed)
        except CredentialsError as e:  # the queue refused this node: the task is fine, this node is not
            release(task_board, claimed)
            refuse(task_board, f"its credentials were refused: {e}")
            raise
        except Exception as e:  # an env, network, memory or device this task cannot have here
            release(task_board, claimed)
            logger.debug("building the run failed", exc_info=True)
            fail(task_board, f"{role} {uid} cannot build the task: {type(e).__name__}: {short(e, 400)}")
            if options.run_once:
                return
            continue
        except BaseException:
            release(task_board, claimed)
            raise
        try:
            reason = run.run()
        except CredentialsError as e:  # a password changed or a permission revoked mid-run
            release(task_board, claimed)
            refuse(task_board, f"its credentials were refused: {e}")
            raise
        except Exception as e:  # a bug: say so loudly, end the task, stop this process
            logger.exception("%s %s crashed", role, uid)
            message = f"{role} {uid} crashed: {type(e).__name__}: {short(e, 400)}"
            fail(task_board, message)
            raise NodeCrashedError(message) from e
        except BaseException:  # Ctrl-C, also before the run's own end-of-run release (a trainer restoring)
            release(task_board, claimed)
            raise
        logger.info("%s %s stopped: %s (%s)", role, uid, reason, run.summary())
        with contextlib.suppress(*BOARD_AWAY):
            task_board.log_event(f"{role} {uid} stopped: {reason} ({run.summary()})", source=uid)
        if options.run_once and _task_over(board):
            return
        # run_once still serves the same task after losing a lease (a pause longer than the TTL), and the
        # task that replaced it
        time.sleep(options.task_poll_interval)


def remove_orphans(board: Board) -> None:
    """After a run whose task vanished from the board: remove what it (and its queue, where that lives in
    the board's Redis) wrote back under the task's prefix as it stopped, unless a new task took the name."""
    try:
        removed = board.delete_orphans()
    except BOARD_AWAY as e:
        logger.warning("could not remove the keys left of the vanished task %r: %s", board.task_name, short(e))
        return
    if removed:
        logger.info("removed %d key(s) written back under the vanished task %r", removed, board.task_name)


def _task_over(board: Board) -> bool:
    """The task this node served has ended (or is gone): a run-once node may return."""
    try:
        status = with_retry(board.get_status, "reading the task status")
    except BoardError:
        return False
    return status is None or status.status.finished
