"""What an actor and a trainer process share: options, counter deltas and the serve loop.

Owns: ``NodeOptions`` (liveness, polling, signing, trust, run-once),
``CounterDeltas`` and ``serve`` — wait for an ACTIVE task, check and build it,
claim a lease, run, repeat — with the rules both roles follow:

* the board is untrusted: a malformed record is waited out, an unsigned or
  mis-signed config (when this node has a secret) is refused and said so;
* a task no node could build (unknown algorithm, bad field, an env module
  this node does not allow, a memory larger than it may allocate) ends
  FAILED with the reason, never a traceback, never left ACTIVE;
* a just-claimed lease is released at once if building the run fails or the
  node is stopped (Ctrl-C) while claiming or building;
* Redis being away is waited out, with a line every few seconds;
* a bug inside a run (not a message, not an outage) ends the task FAILED and
  the process with a clear error (:class:`NodeCrashedError`).

Must never: know what an actor or a trainer does inside a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from srl.base.env import allowed_env_modules
from srl.runner.distribution.board import Board, BoardError
from srl.runner.distribution.codec import short
from srl.runner.distribution.options import NodeOptions
from srl.runner.distribution.redis_parameters import RedisParameters
from srl.runner.distribution.retry import TRANSIENT_ERRORS, Throttle, with_retry
from srl.runner.distribution.task import (
    QueueMismatchError,
    TaskConfigError,
    TaskSpec,
    TaskTrustError,
    build_task,
    check_queue_matches,
)

logger = logging.getLogger("srl.node")

OptionsT = TypeVar("OptionsT")


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


@contextlib.contextmanager
def lease_kept(board: Board, name: str, uid: str, ttl_s: float, interval_s: float,
               max_s: float = float("inf")) -> Iterator[None]:
    """Renew lease ``name`` every ``interval_s`` in a thread while the block runs, for ``max_s`` at most:
    between claiming a lease and a run's first heartbeat, building the run (torch's imports, a replay
    memory of gigabytes, a CUDA context) can take longer than the lease's TTL on a busy machine, and a
    lease that lapses then hands the task to a standby while this node is still building it. Past
    ``max_s`` the lease is left to lapse: a start that hangs must not hold the slot for ever."""
    done = threading.Event()
    ttl_ms = int(ttl_s * 1000)
    give_up_at = time.monotonic() + max_s

    def keep() -> None:
        failed = False
        while not done.wait(interval_s):
            if time.monotonic() >= give_up_at:
                logger.warning("%s has not started its run within %.0f s of taking lease %s; no longer renewing "
                               "it, so a standby can take over (max_start_s)", uid, max_s, name)
                return
            try:
                if not board.renew_lease(name, uid, ttl_ms):
                    return  # lost all the same: the run finds out at its first heartbeat
            except Exception as e:  # a blip, a failover (READONLY), a full Redis: the next renewal retries
                if not failed:
                    logger.warning("renewing lease %s while the run starts failed (%s); retrying", name, short(e))
                failed = True

    thread = threading.Thread(target=keep, name=f"srl-lease-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


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
    note = _Notes()
    codec = options.codec(board.task_name)
    allow_modules = allowed_env_modules(options.allow_env_modules)
    refused = ""  # the config last refused (one event for it, not one per poll)
    uid = options.uid

    def fail(reason: str, config_json: str) -> None:
        logger.error("%s", reason)
        # only the task whose config this was: a client may have replaced it meanwhile
        if not with_retry(lambda: board.end_task("FAILED", reason, config=config_json), "ending the task FAILED"):
            return
        with contextlib.suppress(*TRANSIENT_ERRORS, BoardError):
            board.log_event(f"task FAILED: {reason}", level="ERROR", source=uid)

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
            config_json, signature = with_retry(board.get_task_config_raw, "reading the task config")
            task = build_task(config_json, signature, codec, allow_modules)
            check_queue_matches(task, queue_params, role)
        except (TaskTrustError, QueueMismatchError) as e:
            # not the client's config, not our secret, or not the queue this node was given: whether the
            # task or this node is wrong, running it would do harm: refuse, say so, wait for a good one
            note(f"refused: {e}", "%s %s refuses the task on %s: %s", role, uid, where, e, level=logging.ERROR)
            if config_json != refused:
                refused = config_json
                with contextlib.suppress(*TRANSIENT_ERRORS, BoardError):
                    board.log_event(f"{role} {uid} refuses the task: {e}", level="ERROR", source=uid)
            time.sleep(options.task_poll_interval)
            continue
        except TaskConfigError as e:  # unknown algorithm, bad field: no node could run it
            fail(f"{role} {uid} cannot build the task: {e}", config_json)
            if options.run_once:
                return
            continue
        except BoardError as e:
            note(f"bad: {e}", "%s %s cannot read the task config: %s", role, uid, short(e), level=logging.WARNING)
            time.sleep(options.task_poll_interval)
            continue
        try:
            claimed = with_retry(lambda: claim(task), f"claiming a {role} lease")  # noqa: B023 - called at once
        except BaseException:  # stopped mid-claim: the board may have granted a lease this node never learned of
            with contextlib.suppress(*TRANSIENT_ERRORS, BoardError):
                board.release_leases_of(uid, task.actor_num)
            raise
        if claimed is None:
            note("standby", "%s", standby_note(task))
            time.sleep(min(options.task_poll_interval, options.lease_ttl / 4))
            continue
        try:
            note.reset()
            with contextlib.suppress(*TRANSIENT_ERRORS, BoardError):
                board.log_event(f"{role} {uid} took lease {lease_name(claimed)} ({role} {claimed})", source=uid)
            with lease_kept(board, lease_name(claimed), uid, options.lease_ttl, options.heartbeat_interval,
                            options.max_start_s):
                run = build_run(task, claimed)
        except Exception as e:  # an env, network, memory or device this task cannot have here
            with contextlib.suppress(*TRANSIENT_ERRORS, BoardError):
                board.release_lease(lease_name(claimed), uid)
            logger.debug("building the run failed", exc_info=True)
            fail(f"{role} {uid} cannot build the task: {type(e).__name__}: {short(e, 400)}", config_json)
            if options.run_once:
                return
            continue
        except BaseException:
            with contextlib.suppress(*TRANSIENT_ERRORS, BoardError):
                board.release_lease(lease_name(claimed), uid)  # free it now, not when it expires
            raise
        try:
            reason = run.run()
        except Exception as e:  # a bug: say so loudly, end the task, stop this process
            logger.exception("%s %s crashed", role, uid)
            message = f"{role} {uid} crashed: {type(e).__name__}: {short(e, 400)}"
            fail(message, config_json)
            raise NodeCrashedError(message) from e
        except BaseException:  # Ctrl-C, also before the run's own end-of-run release (a trainer restoring)
            with contextlib.suppress(*TRANSIENT_ERRORS, BoardError):
                board.release_lease(lease_name(claimed), uid)
            raise
        logger.info("%s %s stopped: %s (%s)", role, uid, reason, run.summary())
        with contextlib.suppress(*TRANSIENT_ERRORS, BoardError):
            board.log_event(f"{role} {uid} stopped: {reason} ({run.summary()})", source=uid)
        if options.run_once and _task_over(board):
            return
        # run_once still serves the same task after losing a lease (a pause longer than the TTL)
        time.sleep(options.task_poll_interval)


def _task_over(board: Board) -> bool:
    """The task this node served has ended (or is gone): a run-once node may return."""
    try:
        status = with_retry(board.get_status, "reading the task status")
    except BoardError:
        return False
    return status is None or status.status.finished
