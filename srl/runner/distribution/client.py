"""The client: submit a task, watch it, fetch the final params.

Owns: ``train_distribution`` — writing the task to the board (refusing to
clobber an active one unless told to), progress lines that say what the run
waits for, Ctrl-C as "cancelled", loading the final params into the Runner,
and, on an embedded Redis, starting and stopping local actor and trainer
processes. Must never: spin without telling the user what it waits for.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from typing import TYPE_CHECKING, Any

from srl.runner.distribution import local_nodes
from srl.runner.distribution.board import Board, TaskStatus
from srl.runner.distribution.codec import Codec, params_message_bytes
from srl.runner.distribution.redis_parameters import RedisParameters
from srl.runner.distribution.retry import with_retry
from srl.runner.progress import ensure_logging, eta, format_seconds

if TYPE_CHECKING:
    from srl.runner.runner import Runner

logger = logging.getLogger("srl.client")


TIMEOUT_GRACE_S = 30.0
"""how long past ``timeout`` the client waits for the trainer to end the task before it does"""


class TaskFailedError(RuntimeError):
    """The distributed task ended FAILED; the message carries the reason a node gave."""


def _describe_queue(queue_params: Any) -> dict[str, Any]:
    from srl.runner.distribution.queues import describe_queue, queue_scheme

    return {"scheme": queue_scheme(queue_params), "describe": describe_queue(queue_params)}


def train_distribution(
    runner: Runner,
    redis_params: RedisParameters,
    queue_params: Any = None,
    *,
    actor_num: int = 1,
    max_train_count: int | None = None,
    max_steps: int | None = None,
    timeout: float | None = None,
    progress_interval: float | None = 5.0,
    overwrite: bool = False,
    queue_capacity: int = 8,
    secret: str | None = None,
    local_processes: bool | None = None,
    actor_options: dict[str, Any] | None = None,
    trainer_options: dict[str, Any] | None = None,
    delete_task: bool = False,
) -> None:
    """Run ``runner``'s task on actors and a trainer that meet on ``redis_params``' board.

    Args:
        queue_params: where experience flows (None: the board's Redis; or RabbitMQParameters,
            MQTTParameters, GCPParameters, or a URL). Actors and trainer must be given the same.
        actor_num: actor slots; actor i of N explores with the algorithm's per-actor schedule.
        max_train_count, max_steps, timeout: the end rule (at least one); the trainer applies it:
            gradient steps, env steps (all actors together), seconds.
        progress_interval: seconds between progress lines (None: quiet).
        overwrite: replace a task of the same name that is still INIT/ACTIVE.
        queue_capacity: batches allowed in the queue before actors wait (backpressure). How fast
            actors may go otherwise is the algorithm's data path (DQN: ``env_steps_per_train``).
        secret: shared secret signing every message (default: env SRL_SECRET).
        local_processes: start the trainer and actors here (default: only with an embedded Redis).
        actor_options, trainer_options: ActorOptions / TrainerOptions fields for local processes.
        delete_task: remove every key of the task at the end (default: keep, so ``srl status``
            shows how it ended; a new task of the same name replaces an ended one).

    With an embedded Redis (``RedisParameters()``), the actors and trainer are started
    here as local processes and stopped at the end. Ctrl-C ends the task as "cancelled"
    and still loads the latest params. A FAILED task raises :class:`TaskFailedError`.
    """
    if max_train_count is None and max_steps is None and timeout is None:
        raise ValueError("train_distribution() needs a limit: max_train_count=, max_steps= or timeout=")
    if actor_num < 1:
        raise ValueError(f"actor_num must be >= 1, got {actor_num}")
    ensure_logging()
    runner.spec  # noqa: B018 - builds the env once: a misspelled env or unusable space fails here, not on a node
    from srl.runner.distribution.embedded import EmbeddedRedis

    resolved, embedded = redis_params.resolve()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        board = Board(resolved.connect(), resolved.task_name)
        task = {
            **runner.task_config(),
            "actor_num": actor_num,
            "max_train_count": max_train_count,
            "max_steps": max_steps,
            "timeout": timeout,
            "queue": {**_describe_queue(queue_params), "capacity": queue_capacity},
        }
        with_retry(lambda: board.ping(), f"connecting to {resolved.describe()}", max_wait=10)
        codec = Codec(secret=secret, task=resolved.task_name)
        config_json = json.dumps(task, separators=(",", ":"))
        board.create_task(config_json, overwrite=overwrite, signature=codec.config_signature(config_json))
        start_local = embedded is not None if local_processes is None else local_processes
        if start_local:
            procs = local_nodes.start_all(resolved, queue_params, actor_num, secret, actor_options or {},
                                          trainer_options or {})
        board.set_active()
        board.log_event(f"task submitted: {task['algorithm']} on {runner.env_config}, {actor_num} actor(s)",
                        source="client")
        logger.info("task %r submitted to %s: %s on %s, %d actor(s)", resolved.task_name, resolved.describe(),
                    task["algorithm"], runner.env_config, actor_num)
        status = _watch(board, runner, progress_interval, max_train_count, max_steps, timeout, procs)
        _load_final_params(board, runner, codec)
        _note_totals(board, runner, procs)
        if status.status == "FAILED":
            raise TaskFailedError(f"task {resolved.task_name!r} FAILED: {status.end_reason}")
        logger.info("task %r ended: %s", resolved.task_name, status.end_reason)
        if delete_task:
            local_nodes.stop_all(procs)  # let local nodes see END before their keys vanish
            procs = []
            board.delete_task()
    except KeyboardInterrupt:
        logger.warning("interrupted: ending task %r as cancelled", resolved.task_name)
        try:
            board.end_task("END", "cancelled")
            _load_final_params(board, runner, codec)
        finally:
            raise
    finally:
        local_nodes.stop_all(procs)
        if isinstance(embedded, EmbeddedRedis):
            embedded.stop()


def _note_totals(board: Board, runner: Runner, procs: list[subprocess.Popen[bytes]]) -> None:
    """Leave the run's env steps and episodes on the runner, as ``Runner.train`` does (local actors
    flush their last counts as they stop: wait for them first)."""
    local_nodes.stop_all(procs)
    counters = with_retry(board.get_counters, "reading the run's counters", max_wait=10)
    runner.env_steps += int(counters.get("env_steps", 0))
    runner.episodes += int(counters.get("episodes", 0))


def _load_final_params(board: Board, runner: Runner, codec: Codec) -> None:
    record = board.get_params(params_message_bytes(runner.parameter.to_arrays()))
    if record is None:
        logger.warning("no params on the board: the runner keeps its current weights")
        return
    _, arrays = codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
    runner.set_parameter_arrays(arrays, record.version, record.train_count)
    logger.info("loaded final params (epoch %d, version %d, train_count %d)", record.epoch, record.version,
                record.train_count)


def _watch(
    board: Board,
    runner: Runner,
    progress_interval: float | None,
    max_train_count: int | None,
    max_steps: int | None,
    timeout: float | None,
    procs: list[subprocess.Popen[bytes]],
) -> TaskStatus:
    start = time.monotonic()
    next_line = start + (progress_interval or 0)
    while True:
        status = with_retry(board.get_status, "watching the task")
        if status is None:
            raise TaskFailedError("the task vanished from the board (deleted, or Redis restarted without persistence)")
        if status.status in ("END", "FAILED"):
            return status
        if procs and procs[0].poll() not in (None, 0):
            board.end_task("FAILED", f"the local trainer process exited with code {procs[0].returncode}")
            continue
        now = time.monotonic()
        if timeout is not None and now - start > timeout + TIMEOUT_GRACE_S:
            # the trainer applies the timeout; with no trainer alive to do it, the client does
            board.end_task("END", f"timeout {timeout:g}s reached (ended by the client: no trainer ended it)")
            continue
        if progress_interval is not None and now >= next_line:
            next_line = now + progress_interval
            for line in progress_lines(board, status, now - start, max_train_count, max_steps, timeout):
                logger.info("%s", line)
        time.sleep(0.2)


def progress_lines(
    board: Board,
    status: TaskStatus,
    elapsed: float,
    max_train_count: int | None = None,
    max_steps: int | None = None,
    timeout: float | None = None,
) -> list[str]:
    """The client's (and ``srl status``') view of a task: one line for the task, one per node."""
    stats = board.get_all_stats()
    counters = board.get_counters()
    task_config = board.get_task_config()
    actor_num = int(task_config.get("actor_num", 1))
    trainer = stats.get("trainer", {})
    train_count = int(trainer.get("train_count", 0) or 0)
    env_steps = int(counters.get("env_steps", 0))
    etas = [eta(train_count, max_train_count, elapsed), eta(env_steps, max_steps, elapsed),
            None if timeout is None else timeout - elapsed]
    known = [e for e in etas if e is not None]
    sent, received = counters.get("sent_batches", 0), counters.get("received_batches", 0)
    stale = counters.get("stale_rows", 0)
    lines = [
        f"task {status.status.value} {format_seconds(elapsed)} elapsed, "
        f"ETA {format_seconds(min(known) if known else None)}"
        f" | train {train_count}{'/' + str(max_train_count) if max_train_count else ''} | env steps {env_steps}"
        f" | batches sent {sent:.0f} received {received:.0f} (in flight ~{max(0.0, sent - received):.0f})"
        f" | bad {counters.get('bad_messages', 0):.0f}" + (f" | stale rows refused {stale:.0f}" if stale else "")
    ]
    holder, _ = board.lease_holder("trainer")
    latest_version = int(trainer.get("params_version", 0) or 0)
    if holder is None:
        lines.append(f"  trainer: MISSING for {format_seconds(_missing_for(stats, 'trainer', elapsed))} — "
                     "start one: srl trainer --host HOST (or trainer_run_forever(...))")
    else:
        lag = ""
        if "lag_steps_p50" in trainer or "lag_p50" in trainer:
            lag = (f", policy lag {_g(trainer.get('lag_steps_p50'))}/{_g(trainer.get('lag_steps_p95'))} train steps "
                   f"(p50/p95; {_g(trainer.get('lag_p50'))}/{_g(trainer.get('lag_p95'))} versions)")
        waiting = f" — WAITING for segments from actor slot(s) {trainer['waiting_for']}" \
            if trainer.get("waiting_for") else ""
        lines.append(
            f"  trainer {holder} (epoch {trainer.get('epoch', '?')}, {trainer.get('device', '?')}): "
            f"{trainer.get('train_per_s', 0)} train/s, buffer {trainer.get('memory', 0)}, "
            f"ingest {trainer.get('received_per_s', 0)} rows/s, loss {trainer.get('loss', '-')}, "
            f"params v{trainer.get('params_version', 0)}{lag}{waiting}"
        )
    for i in range(actor_num):
        holder, _ = board.lease_holder(f"actor:{i}")
        s = stats.get(f"actor:{i}", {})
        if holder is None:
            lines.append(f"  actor {i}: MISSING for {format_seconds(_missing_for(stats, f'actor:{i}', elapsed))} — "
                         "start one: srl actor --host HOST (or actor_run_forever(...))")
            continue
        versions_behind = max(0, latest_version - int(s.get("params_version", 0) or 0))
        stalled_now = float(s.get("stalled_now_s", 0) or 0)
        waiting = f" — WAITING on a full queue for {format_seconds(stalled_now)}" if stalled_now >= 1 else ""
        sync = f", sync-waited {s.get('sync_wait_s')}s" if s.get("sync_wait_s") else ""
        lines.append(
            f"  actor {i} {holder}: {s.get('env_steps_per_s', 0)} steps/s ({s.get('envs', 1)} env(s)), "
            f"{s.get('episodes', 0)} episodes, reward {s.get('reward') or '-'}, params v{s.get('params_version', '?')} "
            f"({versions_behind} behind), stalled {s.get('backpressure_wait_s', 0)}s, "
            f"rate-limited {s.get('rate_limited_s', 0)}s{sync}{waiting}"
        )
    return lines


def _g(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def _missing_for(stats: dict[str, dict[str, Any]], role: str, elapsed: float) -> float:
    """Seconds since ``role`` last reported, or since the task started when it never did."""
    last = stats.get(role, {}).get("updated_at")
    if isinstance(last, (int, float)):
        return max(0.0, time.time() - float(last))
    return elapsed
