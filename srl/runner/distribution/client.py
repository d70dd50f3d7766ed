"""The client: submit a task, watch it, fetch the final params.

Owns: ``train_distribution`` — writing the task to the board (refusing to
clobber an active one unless told to), progress lines that say what the run
waits for, Ctrl-C as "cancelled", loading the final params into the Runner,
and, on an embedded Redis, starting and stopping local actor and trainer
processes. Must never: spin without telling the user what it waits for.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from srl.base.config import shown, unknown_setting_message
from srl.runner.distribution import local_nodes
from srl.runner.distribution.board import MAX_ACTORS, Board, TaskStatus, actor_slot
from srl.runner.distribution.codec import Codec, params_message_bytes, short
from srl.runner.distribution.options import ActorOptions, TrainerOptions
from srl.runner.distribution.redis_parameters import RedisParameters
from srl.runner.distribution.retry import with_retry
from srl.runner.distribution.task import MAX_QUEUE_CAPACITY
from srl.runner.progress import ensure_logging, eta, format_seconds
from srl.runner.run_log import CHECKPOINT_DIR, RunLog, latest_checkpoint
from srl.runner.runner import reward_summary

if TYPE_CHECKING:
    from srl.runner.runner import Runner

logger = logging.getLogger("srl.client")


TIMEOUT_GRACE_S = 30.0
"""how long past ``timeout`` the client waits for the trainer to end the task before it does"""
SETTLE_S = 5.0
"""after END, how long the client waits for nodes elsewhere to flush their last counts and release their leases"""


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
    log_dir: str | os.PathLike[str] | None = None,
    eval_interval: float | None = None,
    eval_every: int | None = None,
    eval_episodes: int = 5,
    checkpoint_interval: float = 600.0,
    keep_checkpoints: int = 5,
    resume_from: str | os.PathLike[str] | None = None,
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
        log_dir: keep ``history.csv`` (a row per progress interval: counters, rewards, losses, rates,
            lag, stalls), ``eval.csv``, TensorBoard events and ``final.safetensors`` there; a local
            trainer also writes ``checkpoints/<task>/`` every ``checkpoint_interval`` seconds (the
            newest ``keep_checkpoints``); a remote one does with ``--checkpoint-dir``.
        eval_interval, eval_every: evaluate the latest params every so many seconds / train steps,
            here in the client (the trainer is not slowed), ``eval_episodes`` episodes each time.
        resume_from: a checkpoint file (or a log_dir holding checkpoints: the newest) to start from:
            weights, optimizer state, train_count and env steps go on; ``max_train_count`` and
            ``max_steps`` count from there.

    With an embedded Redis (``RedisParameters()``), the actors and trainer are started
    here as local processes and stopped at the end. Ctrl-C ends the task as "cancelled"
    and still loads the latest params. A FAILED task raises :class:`TaskFailedError`.
    """
    _check_arguments(redis_params, queue_params, actor_num=actor_num, max_train_count=max_train_count,
                     max_steps=max_steps, timeout=timeout, progress_interval=progress_interval,
                     queue_capacity=queue_capacity, secret=secret, actor_options=actor_options,
                     trainer_options=trainer_options, eval_interval=eval_interval, eval_every=eval_every,
                     eval_episodes=eval_episodes, checkpoint_interval=checkpoint_interval,
                     keep_checkpoints=keep_checkpoints)
    runner.rl_config.validate()  # it may have changed since the Runner was made (config.lr = "0.001")
    ensure_logging()
    runner.spec  # noqa: B018 - builds the env once: a misspelled env or unusable space fails here, not on a node
    runner.rl_config = runner.rl_config.settled(runner.env_config)  # here, so every node gets the same values
    from srl.runner.distribution.embedded import EmbeddedRedis

    resume = _read_resume(runner, resume_from) if resume_from is not None else None
    if resume is not None:  # the budget counts from where the checkpoint got to
        max_train_count = None if max_train_count is None else runner.train_count + max_train_count
        max_steps = None if max_steps is None else runner.env_steps + max_steps
    run_log = RunLog(log_dir) if log_dir is not None else None
    trainer_options = dict(trainer_options or {})
    if log_dir is not None:
        trainer_options.setdefault("checkpoint_dir", str(Path(log_dir) / CHECKPOINT_DIR))
        trainer_options.setdefault("checkpoint_interval", checkpoint_interval)
        trainer_options.setdefault("keep_checkpoints", keep_checkpoints)
    resolved, embedded = redis_params.resolve()
    procs: list[local_nodes.LocalNode] = []
    evaluator: Evaluator | None = None
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
        _clear_leftover_experience(queue_params, resolved)
        if resume is not None:
            board.set_resume(_resume_blob(codec, runner, *resume))
            board.incr_counters("client", env_steps=runner.env_steps, episodes=runner.episodes)
        start_local = embedded is not None if local_processes is None else local_processes
        if start_local:
            procs = local_nodes.start_all(resolved, queue_params, actor_num, secret, actor_options or {},
                                          trainer_options or {})
        board.set_active()
        board.log_event(f"task submitted: {task['algorithm']} on {runner.env_config}, {actor_num} actor(s)",
                        source="client")
        logger.info("task %r submitted to %s: %s on %s, %d actor(s)", resolved.task_name, resolved.describe(),
                    task["algorithm"], runner.env_config, actor_num)
        if eval_interval is not None or eval_every is not None:
            evaluator = Evaluator(runner, board, codec, eval_interval, eval_every, eval_episodes, run_log)
            evaluator.start()
        watch_started = time.monotonic()
        status = _watch(board, runner, progress_interval, max_train_count, max_steps, timeout, procs, run_log,
                        evaluator)
        if evaluator is not None:
            evaluator.stop()
        _load_final_params(board, runner, codec)
        if resume is not None:  # the board's counters went on from the checkpoint's
            runner.env_steps = runner.episodes = 0
        _note_totals(board, runner, procs, actor_num)
        _record_history(board, run_log, evaluator)  # where it ended
        if progress_interval is not None:
            for line in summary_lines(board, status, time.monotonic() - watch_started):
                logger.info("%s", line)
        if run_log is not None:
            if evaluator is not None:
                evaluator.evaluate_now(final=True)
            runner.save(run_log.dir / "final.safetensors")
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
        if evaluator is not None:
            evaluator.stop()
        if run_log is not None:
            run_log.close()
        local_nodes.stop_all(procs)
        if isinstance(embedded, EmbeddedRedis):
            embedded.stop()


def _check_arguments(redis_params: Any, queue_params: Any, **arguments: Any) -> None:
    """Every argument of ``train_distribution`` checked before anything is written or started: a wrong
    type or range says what was expected and what came (with its type: ``1000.0 (a float)``)."""
    from srl.runner.distribution.queues import describe_queue

    if not isinstance(redis_params, RedisParameters):
        raise TypeError(f"redis_params must be RedisParameters(...), got {shown(redis_params)}")
    describe_queue(queue_params)  # a malformed URL or an unknown scheme fails here
    a = arguments
    if a["max_train_count"] is None and a["max_steps"] is None and a["timeout"] is None:
        raise ValueError("train_distribution() needs a limit: max_train_count=, max_steps= or timeout=")
    _check_count("actor_num", a["actor_num"], 1, MAX_ACTORS)
    for name in ("max_train_count", "max_steps"):
        if a[name] is not None and (isinstance(a[name], bool) or not isinstance(a[name], int)):
            raise TypeError(f"{name} must be an integer or None, got {shown(a[name])}"
                            + (f": write {int(a[name])}" if isinstance(a[name], float) and a[name].is_integer()
                               else ""))
        if a[name] is not None:
            _check_count(name, a[name], 1, 2**62)
    for name in ("timeout", "progress_interval", "eval_interval"):
        _check_seconds(name, a[name], optional=True)
    _check_seconds("checkpoint_interval", a["checkpoint_interval"], optional=False)
    _check_count("queue_capacity", a["queue_capacity"], 1, MAX_QUEUE_CAPACITY)
    _check_count("eval_episodes", a["eval_episodes"], 1, 1_000_000)
    _check_count("keep_checkpoints", a["keep_checkpoints"], 1, 1_000_000)
    if a["eval_every"] is not None:
        _check_count("eval_every", a["eval_every"], 1, 2**62)
    if a["secret"] is not None and not isinstance(a["secret"], str):
        raise TypeError(f"secret must be text or None, got {type(a['secret']).__name__}")
    for name, cls in (("actor_options", ActorOptions), ("trainer_options", TrainerOptions)):
        options = a[name]
        if options is None:
            continue
        if not isinstance(options, dict):
            raise TypeError(f"{name} must be a dict of {cls.__name__} fields, got {shown(options)}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in options:
            if key not in known:
                raise TypeError(f"{name}: {unknown_setting_message(cls, str(key))}")


def _check_count(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer in {low}..{high}, got {shown(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value}")


def _check_seconds(name: str, value: Any, *, optional: bool) -> None:
    expected = f"{name} must be a number > 0" + (" or None" if optional else "")
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{expected}, got {shown(value)}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{expected}, got {value}")


def _clear_leftover_experience(queue_params: Any, redis_params: RedisParameters) -> None:
    """A new task starts with an empty queue. A Redis stream left without its task record, a RabbitMQ
    queue, a Pub/Sub topic or an MQTT session outlives its task, and batches actors sent after an
    earlier task of this name ended would otherwise reach the new trainer (accepted when the schema
    matches: same columns, and without a secret nothing tells the tasks apart)."""
    from srl.runner.distribution.queues import open_queue, queue_scheme

    scheme = queue_scheme(queue_params)
    # MQTT queues for the trainer's persistent session: ending that session (as its consumer) drops them
    role: Literal["producer", "consumer"] = "consumer" if scheme == "mqtt" else "producer"
    try:
        with open_queue(queue_params, namespace=redis_params.task_name, role=role,
                        redis_params=redis_params) as queue:
            depth = queue.depth()
            queue.destroy()
    except Exception as e:
        logger.warning("could not empty the task's %s queue before starting (%s): batches an earlier task of this "
                       "name left there may reach the trainer", scheme, short(e))
        return
    if depth:
        logger.info("removed %d batch(es) an earlier task of this name left in the %s queue", depth, scheme)


def _note_totals(board: Board, runner: Runner, procs: list[local_nodes.LocalNode], actor_num: int) -> None:
    """Leave the run's env steps and episodes on the runner, as ``Runner.train`` does. Nodes flush their
    last counts and stats as they stop, then release their leases: wait for that (local processes to
    exit; nodes elsewhere up to ``SETTLE_S``, a dead one's lease lapses meanwhile or is left)."""
    local_nodes.stop_all(procs)
    deadline = time.monotonic() + SETTLE_S
    while with_retry(lambda: board.held_leases(actor_num), "reading the leases", max_wait=10) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
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


def _read_resume(runner: Runner, path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The checkpoint to resume from (a file, or the newest under a log_dir), applied to ``runner``."""
    from srl.base.arrays import load_arrays

    source = Path(path)
    if source.is_dir():
        found = latest_checkpoint(source)
        if found is None:
            raise FileNotFoundError(f"resume_from={str(path)!r}: no checkpoints/*/ckpt-*.safetensors in that "
                                    "directory; give a checkpoint file or a log_dir a run wrote")
        source = found
    if not source.exists():
        raise FileNotFoundError(f"resume_from={str(path)!r}: no such file")
    meta, arrays = load_arrays(source)
    runner.load_checkpoint(meta, arrays, str(source))
    logger.info("resuming from %s: train_count %d, env steps %d", source, runner.train_count, runner.env_steps)
    return meta, arrays


def _resume_blob(codec: Codec, runner: Runner, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    bound = 8 * params_message_bytes(runner.parameter.to_arrays()) + (1 << 20)  # the trainer's bound too
    envelope = {"epoch": 0, "version": runner.parameter.version, "train_count": runner.train_count,
                "checkpoint": meta}
    return codec.with_max_bytes(bound).encode_params(arrays, envelope)


class Evaluator:
    """Evaluates the latest params on the board in a thread of the client (the trainer is not slowed):
    every ``interval`` seconds and/or every ``every`` train steps; rows into eval.csv and the board."""

    def __init__(self, runner: Runner, board: Board, codec: Codec, interval: float | None, every: int | None,
                 episodes: int, run_log: RunLog | None) -> None:
        from srl.runner.runner import Runner

        self.copy = Runner(runner.env_config, runner.rl_config)  # its own weights, env and worker
        self.board = board
        self.codec = codec
        self.interval = interval
        self.every = every
        self.episodes = episodes
        self.run_log = run_log
        self.latest: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="srl-evaluator", daemon=True)
        self._lock = threading.Lock()
        self._evaluated_version = -1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        next_time = time.monotonic() + (self.interval or 0.0)
        next_count = self.every or 0
        while not self._stop.wait(0.5):
            try:
                due = self.interval is not None and time.monotonic() >= next_time
                if self.every is not None:
                    trainer = self.board.get_all_stats().get("trainer", {})
                    count = trainer.get("train_count")
                    due = due or (isinstance(count, int) and count >= next_count)
                if not due:
                    continue
                row = self.evaluate_now()
                next_time = time.monotonic() + (self.interval or 0.0)
                if self.every is not None and row is not None:
                    next_count = (int(row["train_count"]) // self.every + 1) * self.every
            except Exception as e:  # an evaluation must never stop the run it watches
                logger.warning("evaluation failed: %s", short(e))
                next_time = time.monotonic() + (self.interval or 5.0)

    def evaluate_now(self, final: bool = False) -> dict[str, Any] | None:
        """Evaluate the latest params (None when there are none yet, or they were evaluated already;
        ``final``: a run's last row, marked final, written even when the periodic evaluation already
        took these params: then its result is recorded again rather than measured twice)."""
        with self._lock:
            record = self.board.get_params(params_message_bytes(self.copy.parameter.to_arrays()))
            if record is None:
                return None
            if record.version == self._evaluated_version:
                if not final or not self.latest:
                    return None
                again: dict[str, Any] = {**self.latest, "final": 1}
                self.latest = again
                if self.run_log is not None:
                    self.run_log.add_eval(again)
                return again
            _, arrays = self.codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
            self.copy.set_parameter_arrays(arrays, record.version, record.train_count)
            rewards = self.copy.evaluate(max_episodes=self.episodes)
            self._evaluated_version = record.version
            env_steps = int(self.board.get_counters().get("env_steps", 0))
            row: dict[str, Any] = {"train_count": record.train_count, "env_steps": env_steps,
                                   "version": record.version, **reward_summary(rewards, "eval")}
            if final:
                row["final"] = 1
            self.latest = row
            if self.run_log is not None:
                self.run_log.add_eval(row)
            self.board.put_stats("evaluator", {**row, "updated_at": time.time()})
            logger.info("evaluation of params v%d (train %d, env steps %d): %.1f (min %.1f, max %.1f, %d episodes)",
                        record.version, record.train_count, env_steps, row["eval_mean"], row["eval_min"],
                        row["eval_max"], len(rewards))
            return row


def history_row(board: Board, evaluator: Evaluator | None) -> dict[str, Any]:
    """One row of the run's history, from the board: counters, the trainer's stats (loss, the
    algorithm's own, rates, lag), each actor's rate, stalls and rewards, the latest evaluation."""
    stats = board.get_all_stats()
    counters = board.get_counters()
    trainer = stats.get("trainer", {})
    head = board.get_params_head()
    row: dict[str, Any] = {
        "train_count": _train_count(trainer, head),
        "env_steps": int(counters.get("env_steps", 0)),
        "episodes": int(counters.get("episodes", 0)),
    }
    actors = {k: v for k, v in sorted(stats.items()) if k.startswith("actor:")}
    means = [r for r in (_num(a.get("reward")) for a in actors.values()) if r is not None]
    row.update(reward_summary(means, "reward"))  # the actors' last 10 episodes: mean of their means...
    lows = [r for r in (_num(a.get("reward_min")) for a in actors.values()) if r is not None]
    highs = [r for r in (_num(a.get("reward_max")) for a in actors.values()) if r is not None]
    if lows and highs:  # ...and the extremes over all of them
        row["reward_min"], row["reward_max"] = min(lows), max(highs)
    row["eval_mean"] = evaluator.latest.get("eval_mean") if evaluator is not None else None
    row["env_steps_per_s"] = round(sum(_num(a.get("env_steps_per_s")) or 0.0 for a in actors.values()), 2)
    row["queue_in_flight"] = max(0.0, counters.get("sent_batches", 0) - counters.get("received_batches", 0))
    for name in ("sent_batches", "received_batches", "bad_messages", "stale_rows", "duplicates"):
        row[name] = counters.get(name, 0)
    skip = {"uid", "epoch", "train_count", "device", "waiting_for", "updated_at", "bad_messages", "duplicates",
            "stale_rows", "received_batches"}
    row.update({k: v for k, v in trainer.items() if k not in skip and _num(v) is not None})
    for name, actor in actors.items():
        index = name.split(":", 1)[1]
        for key in ("env_steps_per_s", "backpressure_wait_s", "rate_limited_s", "sync_wait_s", "params_lag"):
            value = _num(actor.get(key))
            if value is not None:
                row[f"actor{index}_{key}"] = value
    return row


def _train_count(trainer: dict[str, Any], head: tuple[int, int, int] | None) -> int:
    """The run's train_count: the trainer's stats, or the latest params head ``(epoch, version,
    train_count)`` when it is newer (params are published between heartbeats)."""
    return max(int(_num(trainer.get("train_count")) or 0), head[2] if head else 0)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _watch(
    board: Board,
    runner: Runner,
    progress_interval: float | None,
    max_train_count: int | None,
    max_steps: int | None,
    timeout: float | None,
    procs: list[local_nodes.LocalNode],
    run_log: RunLog | None = None,
    evaluator: Evaluator | None = None,
) -> TaskStatus:
    start = time.monotonic()
    next_line = start + (progress_interval or 0)
    log_every = progress_interval or 5.0
    next_row = start + log_every
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
        if now >= next_row:  # the history: on the board for dashboards, in log_dir when there is one
            next_row = now + log_every
            _record_history(board, run_log, evaluator)
        time.sleep(0.2)


def _record_history(board: Board, run_log: RunLog | None, evaluator: Evaluator | None) -> None:
    row = with_retry(lambda: history_row(board, evaluator), "reading the run's stats")
    row = run_log.add_history(row) if run_log is not None else {"time": round(time.time(), 3), **row}
    try:
        board.push_history(row)
    except ValueError as e:  # a row too large for the board (thousands of actors): the file has it all
        logger.debug("history row not put on the board: %s", e)


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
        + (f" | eval {_g(evaluation.get('eval_mean'))} at train {_g(evaluation.get('train_count'))}"
           if (evaluation := stats.get("evaluator")) else "")
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


def summary_lines(board: Board, status: TaskStatus, elapsed: float) -> list[str]:
    """The end of a run in a few lines: totals and rates over the whole run, then each node as it last
    reported (its id, what it did), so even a run shorter than one progress interval says who did what."""
    stats = board.get_all_stats()
    counters = board.get_counters()
    trainer = stats.get("trainer", {})
    head = board.get_params_head()
    train_count = _train_count(trainer, head)
    env_steps = int(counters.get("env_steps", 0))
    per_s = 1.0 / elapsed if elapsed > 0 else 0.0
    lines = [
        f"run {status.status.value} after {format_seconds(elapsed)} ({status.end_reason or 'no reason given'}): "
        f"train {train_count} ({train_count * per_s:.0f}/s), env steps {env_steps} ({env_steps * per_s:.0f}/s), "
        f"episodes {counters.get('episodes', 0):.0f}, batches sent {counters.get('sent_batches', 0):.0f} "
        f"received {counters.get('received_batches', 0):.0f}, bad {counters.get('bad_messages', 0):.0f}, "
        f"duplicates {counters.get('duplicates', 0):.0f}, stale rows refused {counters.get('stale_rows', 0):.0f}"
    ]
    if trainer:
        lag = (f", policy lag p50 {_g(trainer.get('lag_steps_p50'))} train steps"
               if "lag_steps_p50" in trainer else "")
        lines.append(f"  trainer {trainer.get('uid', '?')} (epoch {trainer.get('epoch', '?')}, "
                     f"{trainer.get('device', '?')}): params v{head[1] if head else trainer.get('params_version', 0)}, "
                     f"last loss {trainer.get('loss', '-')}{lag}")
    else:
        lines.append("  trainer: never reported")
    actors = sorted((index, key) for key in stats if (index := actor_slot(key)) is not None)
    for index, key in actors:
        s = stats[key]
        lines.append(
            f"  actor {index} {s.get('uid', '?')}: {s.get('env_steps', 0)} env steps, "
            f"{s.get('episodes', 0)} episodes, last reward {s.get('reward') or '-'}, "
            f"stalled {s.get('backpressure_wait_s', 0)}s, rate-limited {s.get('rate_limited_s', 0)}s"
        )
    if not actors:
        lines.append("  actors: none reported")
    return lines


def _g(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def _missing_for(stats: dict[str, dict[str, Any]], role: str, elapsed: float) -> float:
    """Seconds since ``role`` last reported, or since the task started when it never did."""
    last = stats.get(role, {}).get("updated_at")
    if isinstance(last, (int, float)):
        return max(0.0, time.time() - float(last))
    return elapsed
