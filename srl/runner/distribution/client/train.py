"""The client: submit a task, watch it, fetch the final params.

Owns: ``train_distribution`` — writing the task to the board (refusing to
clobber an active one unless told to), progress lines that say what the run
waits for, Ctrl-C as "cancelled" on the client that submitted the task (one
that attached to watch it detaches), loading the final params into the Runner,
and, on an embedded Redis, starting and stopping local actor and trainer
processes. Must never: spin without telling the user what it waits for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from srl.base.checkpoint import split_checkpoint
from srl.base.config import config_from_dict, shown, unknown_setting_message
from srl.base.env import EnvConfig, EnvSpec
from srl.base.rl import Parameter, RLConfig
from srl.runner.distribution.board.board import (
    BOARD_AWAY,
    MAX_ACTORS,
    Board,
    BoardError,
    Refusal,
    TaskExistsError,
    TaskNotFoundError,
    TaskStatus,
)
from srl.runner.distribution.client import local_nodes
from srl.runner.distribution.client.embedded import EmbeddedRedis, resolve
from srl.runner.distribution.node.retry import Throttle, with_retry
from srl.runner.distribution.node.stats import (
    ActorStats,
    EvaluatorStats,
    InferenceStats,
    NodeStats,
    Reports,
    TrainerStats,
)
from srl.runner.distribution.queues import (
    BrokerUnavailableError,
    describe_queue,
    discard_leftovers,
    open_queue,
    queue_scheme,
)
from srl.runner.distribution.sending.in_flight import batches_in_flight, batches_refused
from srl.runner.distribution.settings.options import ActorOptions, InferenceOptions, TrainerOptions
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import (
    INFERENCE_MODES,
    MAX_QUEUE_CAPACITY,
    TASK_GONE,
    TASK_REPLACED,
    TaskConfigError,
    check_central,
)
from srl.runner.distribution.wire.codec import (
    Codec,
    DecodeError,
    checkpoint_message_bytes,
    params_message_bytes,
    short,
)
from srl.runner.progress import ensure_logging, eta, format_seconds, reward_summary
from srl.runner.run_log import RunLog, latest_checkpoint, write_checkpoint

logger = logging.getLogger("srl.client")


class Runner(Protocol):
    """What the client needs of an ``srl.Runner`` (the runner module calls the client, never the reverse)."""

    env_config: EnvConfig
    rl_config: RLConfig
    env_steps: int
    episodes: int

    @property
    def spec(self) -> EnvSpec: ...

    @property
    def parameter(self) -> Parameter: ...

    @property
    def train_count(self) -> int: ...

    def task_config(self) -> dict[str, Any]: ...

    def replica(self) -> Runner: ...

    def evaluate(self, max_episodes: int = 10, seed: int | None = None) -> list[float]: ...

    def save(self, path: str | os.PathLike[str]) -> None: ...

    def own_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None: ...

    def load_checkpoint(self, meta: dict[str, Any], arrays: dict[str, np.ndarray], source: str = ...) -> None: ...

    def set_parameter_arrays(self, arrays: dict[str, np.ndarray], version: int, train_count: int) -> None: ...


TIMEOUT_GRACE_S = 30.0
"""how long past ``timeout`` the client waits for the trainer to end the task before it does"""
SETTLE_S = 5.0
"""after END, how long the client waits for nodes elsewhere to flush their last counts and release their leases"""


class TaskFailedError(RuntimeError):
    """The distributed task ended FAILED; the message carries the reason a node gave."""


def _describe_queue(queue_params: Any) -> dict[str, Any]:
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
    attach: bool | None = None,
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
    checkpoint_memory: bool = False,
    resume_from: str | os.PathLike[str] | None = None,
    inference: str = "local",
    inference_options: dict[str, Any] | None = None,
    elastic_actors: bool = False,
) -> None:
    """Run ``runner``'s task on actors and a trainer that meet on ``redis_params``' board.

    Args:
        queue_params: where experience flows (None: the board's Redis; or RabbitMQParameters,
            MQTTParameters, GCPParameters, or a URL). Actors and trainer must be given the same.
        actor_num: actor slots; actor i of N explores with the algorithm's per-actor schedule.
        elastic_actors: ``actor_num`` is a maximum, not a count to wait for: actors that come take the next
            free slot (and its exploration), ones that leave are not waited for (sync PPO updates on the
            segments of the actors there), and free slots are not reported missing. Scaling actors is then
            starting or stopping them (``kubectl scale``).
        max_train_count, max_steps, timeout: the end rule (at least one); the trainer applies it:
            gradient steps, env steps (all actors together), seconds.
        progress_interval: seconds between progress lines (None: quiet).
        overwrite: replace a task of the same name that is still INIT/ACTIVE (its nodes drop it and
            serve the new one).
        attach: watch a task of this name that runs already, to its end, and load its final params,
            instead of submitting one. None (default): attach when it runs this very config (the same
            call again, after a client was killed), else refuse (TaskExistsError). True: attach, or load
            the final params of a task of this config that ended; there must be one. False: never.
        queue_capacity: batches allowed in the queue before actors wait (backpressure). How fast
            actors may go otherwise is the algorithm's data path (DQN: ``env_steps_per_train``).
        secret: shared secret signing every message (default: env SRL_SECRET).
        local_processes: start the trainer and actors here (default: only with an embedded Redis).
        actor_options, trainer_options: ActorOptions / TrainerOptions fields for local processes.
        delete_task: remove every key of the task at the end (default: keep, so ``srl status``
            shows how it ended; a new task of the same name replaces an ended one).
        log_dir: keep ``history.csv`` (a row per progress interval: counters, rewards, losses, rates,
            lag, stalls), ``eval.csv``, TensorBoard events and ``final.safetensors`` there, and the
            trainer's checkpoints (``checkpoints/<task>/``, every ``checkpoint_interval`` seconds and at
            the end, the newest ``keep_checkpoints``): they come through the board, whichever machine
            trains, so ``resume_from=log_dir`` works after the trainer's disk is gone.
        checkpoint_memory: the checkpoints carry the replay memory too (a resumed run goes on without
            refilling it), when it fits the board's bound.
        eval_interval, eval_every: evaluate the latest params every so many seconds / train steps,
            here in the client (the trainer is not slowed), ``eval_episodes`` episodes each time.
        resume_from: a checkpoint file (or a log_dir holding checkpoints: the newest) to start from:
            weights, optimizer state, train_count and env steps go on; ``max_train_count`` and
            ``max_steps`` count from there. Without it, a runner that trained here (``runner.train()``) or
            loaded weights (``runner.load``, an earlier distributed run) is started from in the same way;
            a runner with its weights as built starts fresh.
        inference: "local" (each actor runs the network and fetches params) or "central" (SEED RL: an
            inference server, ``srl inference``, acts for every actor in batches; actors only step their
            envs and fetch no params). Local processes include the server; elsewhere start one with
            ``srl inference`` (a second one stands by). Not for sync PPO (its actors act in lockstep).
        inference_options: InferenceOptions fields for a local inference server.

    With an embedded Redis (``RedisParameters()``), the actors and trainer are started
    here as local processes and stopped at the end. Ctrl-C or SIGTERM on the client that submitted the task
    ends it as "cancelled" and still loads the latest params; on a client that attached to it, it only
    detaches (the task goes on; ``srl stop`` ends it). A FAILED task raises :class:`TaskFailedError`.
    """
    _check_arguments(redis_params, queue_params, actor_num=actor_num, max_train_count=max_train_count,
                     max_steps=max_steps, timeout=timeout, progress_interval=progress_interval,
                     queue_capacity=queue_capacity, secret=secret, actor_options=actor_options,
                     trainer_options=trainer_options, eval_interval=eval_interval, eval_every=eval_every,
                     eval_episodes=eval_episodes, checkpoint_interval=checkpoint_interval,
                     keep_checkpoints=keep_checkpoints, overwrite=overwrite, attach=attach,
                     local_processes=local_processes, delete_task=delete_task, checkpoint_memory=checkpoint_memory,
                     log_dir=log_dir, resume_from=resume_from, inference=inference,
                     inference_options=inference_options, elastic_actors=elastic_actors)
    runner.rl_config.validate()  # it may have changed since the Runner was made (config.lr = "0.001")
    if inference == "central":
        try:
            check_central(runner.rl_config, actor_num)
        except TaskConfigError as e:
            raise ValueError(str(e)) from None
    ensure_logging()
    runner.spec  # noqa: B018 - builds the env once: a misspelled env or unusable space fails here, not on a node
    runner.rl_config = runner.rl_config.settled(runner.env_config)  # here, so every node gets the same values
    resume = _read_resume(runner, resume_from) if resume_from is not None else _own_resume(runner)
    if resume is not None:  # the budget counts from where the checkpoint got to
        max_train_count = None if max_train_count is None else runner.train_count + max_train_count
        max_steps = None if max_steps is None else runner.env_steps + max_steps
    run_log = RunLog(log_dir) if log_dir is not None else None
    resolved, embedded = resolve(redis_params)
    procs: list[local_nodes.LocalNode] = []
    evaluator: Evaluator | None = None
    checkpoints: BoardCheckpoints | None = None
    board: Board | None = None
    submitted = False  # the task is ACTIVE and watched (or attached to)
    attached = False  # watching a task another client submitted: an interrupt detaches, it does not cancel
    codec = Codec(secret=secret, task=resolved.task_name)
    try:
        with _sigterm_as_interrupt():
            unbound = Board(resolved.connect(), resolved.task_name)
            task = {
                **runner.task_config(),
                "actor_num": actor_num,
                "max_train_count": max_train_count,
                "max_steps": max_steps,
                "timeout": timeout,
                "queue": {**_describe_queue(queue_params), "capacity": queue_capacity},
                "checkpoints": {"interval": checkpoint_interval, "memory": checkpoint_memory} if run_log else None,
                **({"inference": inference} if inference != "local" else {}),
                **({"elastic_actors": True} if elastic_actors else {}),
            }
            with_retry(unbound.ping, f"connecting to {resolved.describe()}", max_wait=10)
            config_json = json.dumps(task, separators=(",", ":"))
            watched = _attach(unbound, task, overwrite, attach)
            attached = watched is not None
            board = watched
            if board is None:
                _check_queue(queue_params, resolved)  # a refused login or an unreachable broker: before submitting
                status = unbound.create_task(config_json, overwrite=overwrite,
                                             signature=codec.config_signature(config_json))
                board = unbound.bound(status.task_id)
                _clear_leftover_experience(queue_params, resolved)
                if resume is not None:
                    board.set_resume(_resume_blob(codec, runner, *resume))
                    board.incr_counters("client", env_steps=runner.env_steps, episodes=runner.episodes)
            elif resume is not None:
                logger.warning("%s not used: the client attached to a task that runs already, whose final "
                               "params the runner takes", "resume_from is" if resume_from is not None
                               else "this runner's own weights are")
            start_local = embedded is not None if local_processes is None else local_processes
            if start_local:
                procs = local_nodes.start_all(resolved, queue_params, actor_num, secret, actor_options or {},
                                              trainer_options or {},
                                              inference_options or {} if inference == "central" else None)
            if attached:
                board.set_active()  # a task its client left INIT (killed while starting it) starts now
                board.log_event("a client attached to the task", source="client")
            else:
                board.set_active()
                board.log_event(f"task submitted: {task['algorithm']} on {runner.env_config}, {actor_num} actor(s)",
                                source="client")
                logger.info("task %r submitted to %s: %s on %s, %d actor(s)", resolved.task_name,
                            resolved.describe(), task["algorithm"], runner.env_config, actor_num)
            if eval_interval is not None or eval_every is not None:
                evaluator = Evaluator(runner, board, codec, eval_interval, eval_every, eval_episodes, run_log)
                evaluator.start()
            submitted = True
            hints = NodeHints.of(resolved, None if queue_params is None else describe_queue(queue_params))
            checkpoints = (BoardCheckpoints(board, codec, runner, run_log, keep_checkpoints, checkpoint_memory)
                           if run_log is not None else None)
            status = _watch(board, runner, progress_interval, max_train_count, max_steps, timeout, procs, run_log,
                            evaluator, hints, checkpoints)
            if evaluator is not None:
                evaluator.stop()
            _await_trainer_end(board, announce_after=1.0)
            _load_final_params(board, runner, codec)
            if resume is not None:  # the board's counters went on from the checkpoint's
                runner.env_steps = runner.episodes = 0
            _note_totals(board, runner, procs, actor_num)
            if checkpoints is not None:
                with_retry(lambda: checkpoints.fetch(now=True), "fetching the last checkpoint")  # the trainer's final
                kept_on_board = with_retry(board.get_checkpoint_train_count, "reading the last checkpoint")
                if checkpoints.kept == kept_on_board:  # in log_dir: Redis need not hold it
                    with_retry(board.clear_checkpoint, "clearing the last checkpoint")
            _record_history(board, run_log, evaluator)  # where it ended
            if progress_interval is not None:
                depth = _queue_depth(queue_params, resolved)
                for line in with_retry(lambda: summary_lines(board, status, task_elapsed(board, status), depth),
                                       "reading the run's summary"):
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
    except Exception as e:
        if board is not None and not submitted:  # written but never started: it would stay INIT for ever
            with contextlib.suppress(Exception):
                board.end_task("FAILED", f"the client could not start it: {type(e).__name__}: {short(e, 300)}")
        raise
    except KeyboardInterrupt as interrupt:
        terminated = isinstance(interrupt, Terminated)
        if board is not None and attached:
            _detach(board, resolved, "terminated (SIGTERM)" if terminated else "interrupted")
        elif board is not None:
            logger.warning("%s: ending task %r as cancelled", "terminated (SIGTERM)" if terminated else "interrupted",
                           resolved.task_name)
            try:
                board.end_task("END", "cancelled")
                if submitted:
                    _await_trainer_end(board)
                _load_final_params(board, runner, codec)
                if checkpoints is not None:
                    checkpoints.fetch(now=True)  # the one the trainer wrote as it stopped
                if run_log is not None:
                    runner.save(run_log.dir / "final.safetensors")
            except Exception as e:  # a board that is away: the interrupt still ends this client
                logger.warning("could not end the task as cancelled: %s", short(e))
        if terminated:
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        if evaluator is not None:
            evaluator.stop()
        if run_log is not None:
            run_log.close()
        local_nodes.stop_all(procs)
        if isinstance(embedded, EmbeddedRedis):
            embedded.stop()


def _detach(board: Board, redis_params: RedisParameters, why: str) -> None:
    """An interrupted client that attached to a task leaves it running (another client submitted it). Its
    runner keeps its weights: the same call again attaches anew and loads the final ones."""
    logger.warning("%s: detaching from task %r, which goes on (its submitting client's Ctrl-C or `%s` ends it)",
                   why, redis_params.task_name, NodeHints.of(redis_params).command("stop"))
    with contextlib.suppress(Exception):  # a board that is away: the interrupt still ends this client
        board.log_event("a client detached from the task", source="client")


class Terminated(KeyboardInterrupt):
    """SIGTERM reached a client (``timeout``, ``kill``, ``docker stop``, a closed notebook): it ends the task
    as Ctrl-C does, then the process exits with 143."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
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


def _attach(board: Board, task: dict[str, Any], overwrite: bool, attach: bool | None) -> Board | None:
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
    differs = _config_differences(board.get_task_config(), task)
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


def _config_differences(running: dict[str, Any], ours: dict[str, Any]) -> str:
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


def _check_arguments(redis_params: Any, queue_params: Any, **arguments: Any) -> None:
    """Every argument of ``train_distribution`` checked before anything is written or started: a wrong
    type or range says what was expected and what came (with its type: ``1000.0 (a float)``)."""
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
    for name in ("overwrite", "delete_task", "checkpoint_memory", "elastic_actors"):
        if not isinstance(a[name], bool):
            raise TypeError(f"{name} must be True or False, got {shown(a[name])}")
    for name in ("attach", "local_processes"):
        if a[name] is not None and not isinstance(a[name], bool):
            raise TypeError(f"{name} must be True, False or None, got {shown(a[name])}")
    for name in ("log_dir", "resume_from"):
        if a[name] is not None and not isinstance(a[name], (str, os.PathLike)):
            raise TypeError(f"{name} must be a path (str or pathlib.Path) or None, got {shown(a[name])}")
    if a["inference"] not in INFERENCE_MODES:
        raise ValueError(f"inference must be one of {list(INFERENCE_MODES)}, got {shown(a['inference'])}")
    for name, cls in (("actor_options", ActorOptions), ("trainer_options", TrainerOptions),
                      ("inference_options", InferenceOptions)):
        options = a[name]
        if options is None:
            continue
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


QUEUE_CHECK_S = 10.0
"""how long the client waits for an experience queue that does not answer before it gives up submitting"""


def _check_queue(queue_params: Any, redis_params: RedisParameters) -> None:
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


class BoardCheckpoints:
    """Keeps in ``log_dir`` the checkpoints the trainer puts on the board, wherever the trainer runs (a
    notebook's disk vanishes with it): ``log_dir/checkpoints/<task>/ckpt-<train_count>.safetensors``, the
    newest ``keep``. Each is checked like a resume (bounded, signed when a secret is set, weights that fit
    this runner) before it is written."""

    def __init__(self, board: Board, codec: Codec, runner: Runner, run_log: RunLog, keep: int,
                 with_memory: bool) -> None:
        self.board = board
        self.runner = runner
        self.directory = run_log.checkpoint_dir / board.task_name
        self.keep = keep
        self.max_bytes = checkpoint_message_bytes(runner.parameter.to_arrays(), with_memory)
        self.codec = codec.with_max_bytes(self.max_bytes)
        self.kept = -1  # train_count of the last one written (or refused)
        self._look = Throttle(1.0)
        self._complaint = Throttle()

    def fetch(self, now: bool = False) -> Path | None:
        """Write the board's checkpoint if it is newer than the last one kept (looked for once a second
        unless ``now``); its path, or None."""
        if not (now or self._look.ready()):
            return None
        try:
            head = self.board.get_checkpoint_train_count()
            if head is None or head == self.kept:
                return None
            found = self.board.get_checkpoint(self.max_bytes)
            if found is None:
                return None
            train_count, blob = found
            self.kept = train_count
            envelope, arrays = self.codec.decode_params(blob)
            meta = envelope.get("checkpoint")
            if not isinstance(meta, dict):
                raise DecodeError("the checkpoint message carries no checkpoint meta")
            split_checkpoint(meta, arrays, self.runner.rl_config, "the trainer's checkpoint")
            path = write_checkpoint(self.directory, train_count, arrays, meta, self.keep)
        except (DecodeError, BoardError, ValueError, OSError) as e:  # a damaged or forged one: the next may do
            self._complain(e)
            return None
        logger.info("kept the trainer's checkpoint of train_count %d: %s", train_count, path)
        return path

    def _complain(self, error: BaseException) -> None:
        if self._complaint.ready():
            logger.warning("the trainer's checkpoint on the board cannot be kept: %s", short(error))


def _clear_leftover_experience(queue_params: Any, redis_params: RedisParameters) -> None:
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


FINAL_PARAMS_WAIT_S = 15.0
"""seconds a cancelling client waits for the trainer to publish its last weights and let go of its lease"""


def _await_trainer_end(board: Board, max_wait: float = FINAL_PARAMS_WAIT_S, announce_after: float = 0.0) -> None:
    """After the task ended: wait (bounded; Ctrl-C again skips) until the trainer has seen the end at its next
    heartbeat, written its checkpoint, published the weights it trained up to and released its lease, so the
    runner gets those weights instead of the last periodic ones (a task ended by a cancel, by another client
    or by ``srl stop``; a trainer that ended it published first and lets go at once). The wait is said
    once it has lasted ``announce_after``."""
    holder, _ = with_retry(lambda: board.lease_holder("trainer"), "reading the trainer lease")
    if holder is None:
        return
    started = time.monotonic()
    deadline = started + max_wait
    announced = False
    try:
        while with_retry(lambda: board.lease_holder("trainer"), "reading the trainer lease")[0] is not None:
            if not announced and time.monotonic() - started >= announce_after:
                announced = True
                logger.info("waiting up to %.0fs for trainer %s to publish its final params (Ctrl-C again to skip)",
                            max_wait, holder)
            if time.monotonic() >= deadline:
                logger.warning("trainer %s did not let go within %.0fs: loading the last params it published",
                               holder, max_wait)
                return
            time.sleep(0.1)
    except KeyboardInterrupt:  # only the wait is skipped: the params on the board are loaded all the same
        logger.warning("not waiting for trainer %s: loading the last params it published", holder)


def _load_final_params(board: Board, runner: Runner, codec: Codec) -> None:
    max_bytes = params_message_bytes(runner.parameter.to_arrays())
    record = with_retry(lambda: board.get_params(max_bytes), "reading the final params")
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


def _own_resume(runner: Runner) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """The checkpoint of what ``runner`` trained or loaded, to start the run from (None: weights as built):
    the distributed run goes on from there, as another ``train`` call would, instead of training fresh weights
    that replace the runner's at the end."""
    own = runner.own_checkpoint()
    if own is not None:
        logger.info("starting from this runner's own weights: train_count %d, env steps %d (the limits count "
                    "from there)", runner.train_count, runner.env_steps)
    return own


def _resume_blob(codec: Codec, runner: Runner, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    bound = checkpoint_message_bytes(runner.parameter.to_arrays(), with_memory=True)  # the trainer's bound too
    envelope = {"epoch": 0, "version": runner.parameter.version, "train_count": runner.train_count,
                "checkpoint": meta}
    return codec.with_max_bytes(bound).encode_params(arrays, envelope)


class Evaluator:
    """Evaluates the latest params on the board in a thread of the client (the trainer is not slowed):
    every ``interval`` seconds and/or every ``every`` train steps; rows into eval.csv and the board."""

    def __init__(self, runner: Runner, board: Board, codec: Codec, interval: float | None, every: int | None,
                 episodes: int, run_log: RunLog | None) -> None:
        self.copy = runner.replica()  # its own weights, env and worker
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
                    trainer = Reports.read(self.board).trainer
                    due = due or (trainer is not None and trainer.train_count >= next_count)
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
            self.board.put_stats("evaluator", EvaluatorStats.from_record(row).to_record())
            logger.info("evaluation of params v%d (train %d, env steps %d): %.1f (min %.1f, max %.1f, %d episodes)",
                        record.version, record.train_count, env_steps, row["eval_mean"], row["eval_min"],
                        row["eval_max"], len(rewards))
            return row


def history_row(board: Board, evaluator: Evaluator | None) -> dict[str, Any]:
    """One row of the run's history, from the board: counters, the trainer's stats (loss, the
    algorithm's own, rates, lag), each actor's rate, stalls and rewards, the latest evaluation."""
    reports = Reports.read(board)
    counters = board.get_counters()
    trainer, actors = reports.trainer, reports.actors
    row: dict[str, Any] = {
        "train_count": _train_count(trainer, board.get_params_head()),
        "env_steps": int(counters.get("env_steps", 0)),
        "episodes": int(counters.get("episodes", 0)),
    }
    means = [a.reward for a in actors.values() if a.reward is not None]
    row.update(reward_summary(means, "reward"))  # the actors' last 10 episodes: mean of their means...
    lows = [a.reward_min for a in actors.values() if a.reward_min is not None]
    highs = [a.reward_max for a in actors.values() if a.reward_max is not None]
    if lows and highs:  # ...and the extremes over all of them
        row["reward_min"], row["reward_max"] = min(lows), max(highs)
    row["eval_mean"] = evaluator.latest.get("eval_mean") if evaluator is not None else None
    row["env_steps_per_s"] = round(sum(a.env_steps_per_s for a in actors.values()), 2)
    row["queue_in_flight"] = max(0.0, batches_in_flight(counters))
    for name in ("sent_batches", "received_batches", "refused_batches", "bad_messages", "stale_rows", "duplicates"):
        row[name] = counters.get(name, 0)
    if trainer is not None:
        record = trainer.to_record()  # its numbers, by the names the stats dataclass gives them
        row.update({k: v for k, v in record.items()
                    if k not in _NOT_HISTORY and _num(v) is not None})
    if reports.inference is not None:
        server = reports.inference
        row.update({"inference_actions_per_s": server.agent_steps_per_s, "inference_batch_envs": server.batch_envs_mean,
                    "inference_wait_ms": server.batch_wait_ms_mean, "inference_refused": server.refused_requests})
    for slot, actor in actors.items():
        row.update({f"actor{slot}_env_steps_per_s": actor.env_steps_per_s,
                    f"actor{slot}_backpressure_wait_s": actor.backpressure_wait_s,
                    f"actor{slot}_rate_limited_s": actor.rate_limited_s,
                    f"actor{slot}_sync_wait_s": actor.sync_wait_s,
                    f"actor{slot}_params_lag": actor.params_lag})
    return row


_NOT_HISTORY = {"uid", "epoch", "train_count", "device", "waiting_for", "bad_messages", "duplicates", "stale_rows",
                "received_batches"}
"""trainer stats that are not history columns (the counters' totals are)"""


def _train_count(trainer: TrainerStats | None, head: tuple[int, int, int] | None) -> int:
    """The run's train_count: the trainer's stats, or the latest params head ``(epoch, version,
    train_count)`` when it is newer (params are published between heartbeats)."""
    return max(trainer.train_count if trainer is not None else 0, head[2] if head else 0)


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
    hints: NodeHints | None = None,
    checkpoints: BoardCheckpoints | None = None,
) -> TaskStatus:
    start = time.monotonic()
    next_line = start + (progress_interval or 0)
    log_every = progress_interval or 5.0
    next_row = start + log_every
    away_note = Throttle()
    while True:
        status = with_retry(board.get_status, "watching the task")
        if status is None or status.task_id != board.task_id:
            raise TaskFailedError(TASK_GONE if status is None else TASK_REPLACED)
        if status.status in ("END", "FAILED"):
            return status
        try:
            if procs and procs[0].poll() not in (None, 0):
                board.end_task("FAILED", f"the local trainer process exited with code {procs[0].returncode}")
                continue
            now = time.monotonic()
            if timeout is not None and task_elapsed(board, status) > timeout + TIMEOUT_GRACE_S:
                # the trainer applies the timeout; with no trainer alive to do it, the client does
                board.end_task("END", f"timeout {timeout:g}s reached (ended by the client: no trainer ended it)")
                continue
            if progress_interval is not None and now >= next_line:
                next_line = now + progress_interval
                for line in progress_lines(board, status, task_elapsed(board, status), max_train_count, max_steps,
                                           timeout, hints):
                    logger.info("%s", line)
            if now >= next_row:  # the history: on the board for dashboards, in log_dir when there is one
                next_row = now + log_every
                _record_history(board, run_log, evaluator)
            if checkpoints is not None:
                checkpoints.fetch()
        except BOARD_AWAY as e:  # a reset connection, a blip: the next look at the task waits for the board
            if away_note.ready():
                logger.warning("the board did not answer while watching (%s); watching goes on", short(e))
        time.sleep(0.2)


def task_elapsed(board: Board, status: TaskStatus) -> float:
    """Seconds the task has run (since it became ACTIVE, or was created), by the Redis server's clock:
    to its end once it ended."""
    began = status.started_at or status.created_at
    until = status.ended_at if status.status.finished and status.ended_at else board.server_time()
    return max(0.0, until - began)


@dataclass(frozen=True)
class NodeHints:
    """How to start a node that reaches this task, for the lines that say one is missing."""

    board_args: str
    queue_args: str = ""

    @classmethod
    def of(cls, redis_params: RedisParameters, queue_describe: str | None = None) -> NodeHints:
        """From the board's parameters and the task's queue (its ``describe()``; None: the board's Redis)."""
        if redis_params.url is not None:
            board = f"--url {redis_params.describe()}"
        else:
            board = f"--host {redis_params.host or 'HOST'}"
            if redis_params.port != 6379:
                board += f" --port {redis_params.port}"
            if redis_params.db:
                board += f" --db {redis_params.db}"
        if redis_params.task_name != "srl":
            board += f" --task-name {redis_params.task_name}"
        if redis_params.password is not None or redis_params.password_file is not None:
            board += " --password-file FILE"
        queue = ""
        if queue_describe and "://" in queue_describe:
            queue = f" --queue-url {queue_describe}"
        return cls(board, queue)

    def command(self, role: str) -> str:
        return f"srl {role} {self.board_args}{self.queue_args}"


def _record_history(board: Board, run_log: RunLog | None, evaluator: Evaluator | None) -> None:
    row = with_retry(lambda: history_row(board, evaluator), "reading the run's stats")
    row = run_log.add_history(row) if run_log is not None else {"time": round(time.time(), 3), **row}
    try:
        with_retry(lambda: board.push_history(row), "keeping the run's history on the board")
    except ValueError as e:  # a row too large for the board (thousands of actors): the file has it all
        logger.debug("history row not put on the board: %s", e)


def progress_lines(
    board: Board,
    status: TaskStatus,
    elapsed: float,
    max_train_count: int | None = None,
    max_steps: int | None = None,
    timeout: float | None = None,
    hints: NodeHints | None = None,
) -> list[str]:
    """The client's (and ``srl status``') view of a task: one line for the task, one per node. A node
    missing from a running task is said so with how to start one, or with why the nodes that tried
    refuse the task; an ended task's nodes are not asked for."""
    reports = Reports.read(board)
    counters = board.get_counters()
    config = board.get_task_config()
    actor_num = int(config.get("actor_num", 1))
    ended = status.status.finished
    trainer = reports.trainer
    train_count = trainer.train_count if trainer is not None else 0
    env_steps = int(counters.get("env_steps", 0))
    etas = [eta(train_count, max_train_count, elapsed), eta(env_steps, max_steps, elapsed),
            None if timeout is None else timeout - elapsed]
    known = [e for e in etas if e is not None]
    # actors report what they sent at their heartbeats, the trainer what it received as it comes: a batch
    # received (or refused) was sent, whatever the counts say yet
    received, refused = counters.get("received_batches", 0), batches_refused(counters)
    sent = max(counters.get("sent_batches", 0), received + refused)
    in_flight = max(0.0, batches_in_flight(counters))
    stale = counters.get("stale_rows", 0)
    when = f"ended after {format_seconds(elapsed)}" if ended else (
        f"{format_seconds(elapsed)} elapsed, ETA {format_seconds(min(known) if known else None)}")
    evaluation = reports.evaluator
    lines = [
        f"task {status.status.value} {when}"
        f" | train {train_count}{'/' + str(max_train_count) if max_train_count else ''} | env steps {env_steps}"
        f" | batches sent {sent:.0f} received {received:.0f}" + (f" refused {refused:.0f}" if refused else "")
        + f" (in flight ~{in_flight:.0f}) | bad {counters.get('bad_messages', 0):.0f}"
        + (f" | stale rows refused {stale:.0f}" if stale else "")
        + (f" | eval {_g(evaluation.eval_mean)} at train {evaluation.train_count}" if evaluation else "")
    ]
    hints = hints or NodeHints("--host HOST")
    refusals = {"trainer": [], "actor": [], "inference": []} if ended else _refusals_by_role(board)

    def missing(role: str, stats: NodeStats | None, label: str) -> str:
        if ended:
            return f"  {label}: none (the task has ended)"
        waited = f"MISSING for {format_seconds(_missing_for(stats, elapsed))}"
        if refusals[role]:
            refusal = refusals[role].pop(0)
            return f"  {label}: {waited} — {refusal.uid} refuses the task: {refusal.reason}"
        return f"  {label}: {waited} — start one: {hints.command(role)} (or {role}_run_forever(...))"

    # every lease in one MGET: a read per slot would cost a round trip each (1,000 slots at 20 ms: 20 s a line,
    # during which the client would see neither the task's end nor its own timeout)
    holders = board.lease_holders(["trainer", "inference", *(f"actor:{i}" for i in range(actor_num))])
    holder, inference_holder, actor_holders = holders[0], holders[1], holders[2:]
    latest_version = trainer.params_version if trainer is not None else 0
    if holder is None and (not ended or trainer is None):
        lines.append(missing("trainer", trainer, "trainer"))
    else:
        trainer = trainer or TrainerStats()  # a holder that has not reported yet
        lag = ""
        if trainer.lag_steps_p50 is not None or trainer.lag_p50 is not None:
            lag = (f", policy lag {_g(trainer.lag_steps_p50)}/{_g(trainer.lag_steps_p95)} train steps "
                   f"(p50/p95; {_g(trainer.lag_p50)}/{_g(trainer.lag_p95)} versions)")
        waiting = f" — WAITING for segments from actor slot(s) {trainer.waiting_for}" \
            if trainer.waiting_for and not ended else ""
        lines.append(
            f"  trainer {holder or trainer.uid or '?'} (epoch {trainer.epoch}, {trainer.device or '?'}): "
            f"{trainer.train_per_s} train/s, buffer {trainer.memory}{_buffer_size(trainer)}, "
            f"ingest {trainer.received_per_s} rows/s, "
            f"loss {_g(trainer.loss) if trainer.loss is not None else '-'}, params v{trainer.params_version}"
            f"{lag}{waiting}"
        )
    if config.get("inference") == "central":
        lines.append(_inference_line(board, inference_holder, reports.inference, ended, missing))
    elastic = config.get("elastic_actors") is True
    free: list[int] = []
    for i, holder in enumerate(actor_holders):
        s = reports.actor(i)
        if holder is None and (not ended or s is None):
            if elastic:
                free.append(i)
            else:
                lines.append(missing("actor", s, f"actor {i}"))
            continue
        s = s or ActorStats()  # a holder that has not reported yet
        versions_behind = max(0, latest_version - s.params_version)
        waiting = f" — WAITING on a full queue for {format_seconds(s.stalled_now_s)}" \
            if s.stalled_now_s >= 1 and not ended else ""
        sync = f", sync-waited {s.sync_wait_s}s" if s.sync_wait_s else ""
        lines.append(
            f"  actor {i} {holder or s.uid or '?'}: {s.env_steps_per_s} steps/s ({s.envs} env(s)), {s.episodes} "
            f"episodes, reward {_g(s.reward) if s.reward is not None else '-'}, params v{s.params_version} "
            f"({versions_behind} behind), stalled {s.backpressure_wait_s}s, rate-limited {s.rate_limited_s}s"
            f"{sync}{waiting}"
        )
    if free and not ended:
        there = actor_num - len(free)
        if there == 0:
            lines.append(missing("actor", None, f"actors (elastic, up to {actor_num})"))
        else:
            lines.append(f"  actor slot(s) {_ranges(free)}: free (elastic: {there} of up to {actor_num} actors)")
    return lines


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2, 5, 7-8``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _inference_line(board: Board, holder: str | None, stats: InferenceStats | None, ended: bool,
                    missing: Callable[[str, NodeStats | None, str], str]) -> str:
    """The central inference server's line: who holds the lease (``holder``), where it listens, how it
    batches."""
    if holder is None and (not ended or stats is None):
        return missing("inference", stats, "inference")
    stats = stats or InferenceStats()  # a holder that has not reported yet
    address = board.get_inference_address()
    where = f" at {address.address}{' (TLS)' if address.tls else ''}" if address is not None else ""
    refused = f", REFUSED {stats.refused_requests} request(s)" if stats.refused_requests else ""
    return (f"  inference {holder or stats.uid or '?'}{where}: {stats.sessions} actor(s) connected, "
            f"{stats.agent_steps_per_s} actions/s, {stats.batch_envs_mean} envs per batch, request wait "
            f"{stats.batch_wait_ms_mean} ms, params v{stats.params_version}, stalled {stats.backpressure_wait_s}s"
            f"{refused}")


REFUSAL_SHOWN_S = 30.0
"""a node's refusal of the task is shown while it is this fresh (nodes renew theirs while they refuse)"""


def _refusals_by_role(board: Board) -> dict[str, list[Refusal]]:
    found: dict[str, list[Refusal]] = {"trainer": [], "actor": [], "inference": []}
    for refusal in board.get_refusals(max_age_s=REFUSAL_SHOWN_S):
        found.setdefault(refusal.role, []).append(refusal)
    return found


def summary_lines(board: Board, status: TaskStatus, elapsed: float, queued: int | None = None) -> list[str]:
    """The end of a run in a few lines: totals and rates over the whole run, the batches accounted for
    (sent = received + refused + still queued), then each node as it last reported (its id, what it
    did), so even a run shorter than one progress interval says who did what."""
    reports = Reports.read(board)
    counters = board.get_counters()
    trainer = reports.trainer
    head = board.get_params_head()
    train_count = _train_count(trainer, head)
    env_steps = int(counters.get("env_steps", 0))
    per_s = 1.0 / elapsed if elapsed > 0 else 0.0
    lines = [
        f"run {status.status.value} after {format_seconds(elapsed)} ({status.end_reason or 'no reason given'}): "
        f"train {train_count} ({train_count * per_s:.0f}/s), env steps {env_steps} ({env_steps * per_s:.0f}/s), "
        f"episodes {counters.get('episodes', 0):.0f}, duplicates {counters.get('duplicates', 0):.0f}, "
        f"stale rows refused {counters.get('stale_rows', 0):.0f}",
        "  " + batch_accounts(counters, queued),
    ]
    if trainer is not None:
        lag = f", policy lag p50 {_g(trainer.lag_steps_p50)} train steps" if trainer.lag_steps_p50 is not None else ""
        lines.append(f"  trainer {trainer.uid or '?'} (epoch {trainer.epoch}, {trainer.device or '?'}): "
                     f"params v{head[1] if head else trainer.params_version}, "
                     f"last loss {_g(trainer.loss) if trainer.loss is not None else '-'}{lag}")
    else:
        lines.append("  trainer: never reported")
    if reports.inference is not None:
        i = reports.inference
        lines.append(f"  inference {i.uid or '?'}: {i.agent_steps} actions in {i.batches} batches, "
                     f"{i.sent_batches} batches of rows sent, {i.refused_requests} request(s) refused, "
                     f"stalled {i.backpressure_wait_s}s")
    for index, s in reports.actors.items():
        lines.append(
            f"  actor {index} {s.uid or '?'}: {s.env_steps} env steps, {s.episodes} episodes, last reward "
            f"{_g(s.reward) if s.reward is not None else '-'}, stalled {s.backpressure_wait_s}s, rate-limited "
            f"{s.rate_limited_s}s"
        )
    if not reports.actors:
        lines.append("  actors: none reported")
    return lines


def batch_accounts(counters: dict[str, float], queued: int | None) -> str:
    """Where every batch the actors sent went: ``sent = received + refused + still queued``, or what does not
    add up, named. ``queued``: the queue's depth when the broker tells it (None: it cannot, and the rest
    is what the queue still holds or had in flight)."""
    text = _batch_accounts(counters, queued)
    replaced = int(counters.get("other_task_batches", 0))
    return text + (f" ({replaced} batches of the task this one replaced were dropped)" if replaced else "")


def _batch_accounts(counters: dict[str, float], queued: int | None) -> str:
    sent = int(counters.get("sent_batches", 0))
    received = int(counters.get("received_batches", 0))
    refused = int(batches_refused(counters))
    if queued is None:
        rest = sent - received - refused
        if rest >= 0:
            return (f"batches: sent {sent} = received {received} + refused {refused} + {rest} still queued or in "
                    "flight (this broker does not tell its queue's depth)")
        return (f"batches: sent {sent}, received {received} + refused {refused}: {-rest} more arrived than the "
                "actors counted as sent (an actor stopped before reporting its last sends)")
    missing = sent - received - refused - queued
    text = f"batches: sent {sent} = received {received} + refused {refused} + still queued {queued}"
    if missing == 0:
        return text + ": all accounted for"
    if missing > 0:
        return (f"batches: sent {sent}, received {received} + refused {refused} + still queued {queued}: "
                f"{missing} NOT ACCOUNTED FOR")
    return (f"batches: sent {sent}, received {received} + refused {refused} + still queued {queued}: {-missing} "
            "more than the actors counted as sent (an actor stopped before reporting its last sends, or a trainer "
            "died between counting a read and acking it: those batches count as received and as still queued "
            "until the next trainer takes them again)")


def _queue_depth(queue_params: Any, redis_params: RedisParameters) -> int | None:
    """Batches left in the task's queue, where the broker can tell (None where it cannot, or is away)."""
    try:
        with open_queue(queue_params, namespace=redis_params.task_name, role="producer",
                        redis_params=redis_params) as queue:
            return queue.depth()
    except Exception as e:  # the summary goes on without it
        logger.debug("could not read the queue's depth: %s", e)
        return None


def _buffer_size(trainer: TrainerStats) -> str:
    """`` (1.2 GiB, 7,590 B/row)``: what the trainer's buffer reserved, when it said."""
    if not trainer.memory_bytes:
        return ""
    per_row = f", {trainer.memory_bytes // trainer.memory_capacity:,} B/row" if trainer.memory_capacity else ""
    return f" ({trainer.memory_bytes / 2**30:.2f} GiB{per_row})"


def _g(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def _missing_for(stats: NodeStats | None, elapsed: float) -> float:
    """Seconds since the role last reported, or since the task started when it never did."""
    if stats is not None and stats.updated_at:
        return max(0.0, time.time() - stats.updated_at)
    return elapsed
