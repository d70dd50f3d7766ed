"""The client: submit a task, watch it, fetch the final params.

Owns: ``train_distribution`` as its phases, each a function below, in the order they run: check -> submit
or attach -> start local nodes -> go live -> watch -> finish -> conclude; one finish for both endings (the
task's end, and a cancel on Ctrl-C or SIGTERM on the client that submitted it; one that attached detaches);
and :class:`ClientRun`, what the phases hand on, released however the call ends. Must never: spin without
telling the user what it waits for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from srl.base.rl import budget_note
from srl.runner.distribution.board.board import BOARD_AWAY, Board, TaskStatus
from srl.runner.distribution.client import local_nodes
from srl.runner.distribution.client.check import TaskRequest, check_queue, check_request
from srl.runner.distribution.client.embedded import EmbeddedRedis, resolve
from srl.runner.distribution.client.evaluator import Evaluator, record_history
from srl.runner.distribution.client.protocol import Runner
from srl.runner.distribution.client.report import NodeHints, progress_lines, queue_depth, summary_lines, task_elapsed
from srl.runner.distribution.client.submit import (
    Terminated,
    announce,
    attach_to,
    clear_leftover_experience,
    detach,
    sigterm_as_interrupt,
    task_config,
)
from srl.runner.distribution.client.weights import (
    BoardCheckpoints,
    Checkpoint,
    await_trainer_end,
    load_final_params,
    own_resume,
    read_resume,
    resume_blob,
)
from srl.runner.distribution.node.retry import Throttle, with_retry
from srl.runner.distribution.queues import describe_queue
from srl.runner.distribution.sending.in_flight import batches_in_flight
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import TASK_GONE, TASK_REPLACED, TaskConfigError, check_central
from srl.runner.distribution.wire.codec import Codec, short
from srl.runner.progress import ensure_logging
from srl.runner.run_log import RunLog

logger = logging.getLogger("srl.client")

TIMEOUT_GRACE_S = 30.0
"""how long past ``timeout`` the client waits for the trainer to end the task before it does"""
SETTLE_S = 30.0
"""after END, how long the client waits for nodes elsewhere to flush their last counts and release their leases
(a node keeps its lease while a broker confirms its last batches, which outlasts a short broker restart)"""
SETTLE_NOTE_S = 2.0
"""after END, when the client says which nodes it still waits for"""
LATE_COUNTS_S = 10.0
"""once every lease is free, how long the client waits for counts still on their way while more batches arrived
than the senders counted as sent: a sender whose lease lapsed in an outage of the board (it stopped, or waits to
take it back) counts what it sent once the board answers again, which may be after the task ended"""


class TaskFailedError(RuntimeError):
    """The distributed task ended FAILED; the message carries the reason a node gave."""


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
    inference_servers: int = 1,
    double_buffer: bool = False,
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
        inference_servers: central inference servers that share the actor slots (an actor goes to server
            ``slot % inference_servers``, to another when that one is missing, and back once it is served again):
            on a machine whose cores one Python server cannot keep busy. Servers beyond these stand by; local
            processes start this many.
        double_buffer: with central inference, each actor steps its envs in two halves that alternate, so
            one half steps while the other's request is on its way (Sample Factory's double-buffered sampling;
            ``envs_per_actor`` even). It pays where an actor would otherwise wait for its replies with a core idle.

    With an embedded Redis (``RedisParameters()``), the actors and trainer are started
    here as local processes and stopped at the end. Ctrl-C or SIGTERM on the client that submitted the task
    ends it as "cancelled" and still loads the latest params; on a client that attached to it, it only
    detaches (the task goes on; ``srl stop`` ends it). A FAILED task raises :class:`TaskFailedError`.
    """
    request, resume = _check(runner, TaskRequest(
        redis_params, queue_params, actor_num=actor_num, max_train_count=max_train_count, max_steps=max_steps,
        timeout=timeout, progress_interval=progress_interval, overwrite=overwrite, attach=attach,
        queue_capacity=queue_capacity, secret=secret, local_processes=local_processes, actor_options=actor_options,
        trainer_options=trainer_options, delete_task=delete_task, log_dir=log_dir, eval_interval=eval_interval,
        eval_every=eval_every, eval_episodes=eval_episodes, checkpoint_interval=checkpoint_interval,
        keep_checkpoints=keep_checkpoints, checkpoint_memory=checkpoint_memory, resume_from=resume_from,
        inference=inference, inference_options=inference_options, elastic_actors=elastic_actors,
        inference_servers=inference_servers, double_buffer=double_buffer,
    ))
    run_log = RunLog(log_dir) if log_dir is not None else None
    resolved, embedded = resolve(redis_params)
    run = ClientRun(runner, request, resolved, embedded, Codec(secret=secret, task=resolved.task_name), run_log,
                    resume)
    try:
        with sigterm_as_interrupt():
            task = _submit_or_attach(run)
            _start_local_nodes(run)
            _go_live(run, task)
            ended = _watch(run)
            _finish(run, ended)
            _conclude(run, ended)
    except Exception as e:
        _fail_unstarted(run, e)
        raise
    except KeyboardInterrupt as interrupt:
        _cancel_or_detach(run, interrupt)
        if isinstance(interrupt, Terminated):
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        _release(run)


@dataclass
class ClientRun:
    """What one ``train_distribution`` call holds across its phases; :func:`_release` lets go of it."""

    runner: Runner
    request: TaskRequest
    """the arguments, checked, with the budget counted from the resumed checkpoint"""
    resolved: RedisParameters
    """where the board is (an embedded Redis's address once started)"""
    embedded: EmbeddedRedis | None
    codec: Codec
    run_log: RunLog | None
    resume: Checkpoint | None
    """the checkpoint the run starts from (None: weights as built)"""
    board: Board | None = None
    """bound to the task once it is written (or attached to)"""
    attached: bool = False
    """watching a task another client submitted: an interrupt detaches, it does not cancel"""
    submitted: bool = False
    """the task is ACTIVE and watched (or attached to)"""
    procs: list[local_nodes.LocalNode] = field(default_factory=list)
    evaluator: Evaluator | None = None
    checkpoints: BoardCheckpoints | None = None


def _check(runner: Runner, request: TaskRequest) -> tuple[TaskRequest, Checkpoint | None]:
    """Check: the arguments, the algorithm's config and the env (built once here: a misspelled env or an
    unusable space fails here, not on a node), before anything is written or started; the config settled so
    every node gets the same values; the checkpoint to resume from, applied to the runner, and the budget
    counted from where it got to."""
    check_request(request)
    runner.rl_config.validate()  # it may have changed since the Runner was made (config.lr = "0.001")
    if request.inference == "central":
        try:
            check_central(runner.rl_config, request.actor_num, request.double_buffer)
        except TaskConfigError as e:
            raise ValueError(str(e)) from None
    ensure_logging()
    runner.spec  # noqa: B018 - builds the env once
    runner.rl_config = runner.rl_config.settled(runner.env_config)
    resume = read_resume(runner, request.resume_from) if request.resume_from is not None else own_resume(runner)
    if resume is not None:
        max_train_count, max_steps = request.max_train_count, request.max_steps
        request = dataclasses.replace(
            request, max_train_count=None if max_train_count is None else runner.train_count + max_train_count,
            max_steps=None if max_steps is None else runner.env_steps + max_steps)
    if (note := budget_note(runner.rl_config, request.max_steps, request.max_train_count)) is not None:
        logger.info("%s", note)
    return request, resume


def _submit_or_attach(run: ClientRun) -> dict[str, Any]:
    """Submit or attach: attach to a task of this name that runs this very config (see ``attach``), or
    check the queue, write the task (INIT until :func:`_go_live`), empty its queue and put the resume
    checkpoint on the board. The task's config, as written or matched."""
    r, resolved = run.request, run.resolved
    unbound = Board(resolved.connect(), resolved.task_name)
    task = task_config(run.runner, r, with_checkpoints=run.run_log is not None)
    with_retry(unbound.ping, f"connecting to {resolved.describe()}", max_wait=10)
    config_json = json.dumps(task, separators=(",", ":"))
    run.board = attach_to(unbound, task, r.overwrite, r.attach)
    run.attached = run.board is not None
    if run.board is None:
        check_queue(r.queue_params, resolved)  # a refused login or an unreachable broker: before submitting
        status = unbound.create_task(config_json, overwrite=r.overwrite,
                                     signature=run.codec.config_signature(config_json))
        run.board = board = unbound.bound(status.task_id)
        clear_leftover_experience(r.queue_params, resolved)
        if run.resume is not None:
            board.set_resume(resume_blob(run.codec, run.runner, *run.resume))
            board.incr_counters("client", env_steps=run.runner.env_steps, episodes=run.runner.episodes)
    elif run.resume is not None:
        logger.warning("%s not used: the client attached to a task that runs already, whose final "
                       "params the runner takes", "resume_from is" if r.resume_from is not None
                       else "this runner's own weights are")
    return task


def _start_local_nodes(run: ClientRun) -> None:
    """Start local nodes: the trainer, an inference server (central inference) and the actors as processes
    here, when ``local_processes`` says so (by default: with an embedded Redis only)."""
    r = run.request
    start_local = run.embedded is not None if r.local_processes is None else r.local_processes
    if start_local:
        run.procs = local_nodes.start_all(run.resolved, r.queue_params, r.actor_num, r.secret, r.actor_options or {},
                                          r.trainer_options or {},
                                          r.inference_options or {} if r.inference == "central" else None,
                                          r.inference_servers)


def _go_live(run: ClientRun, task: dict[str, Any]) -> None:
    """Go live: the task ACTIVE and announced, the evaluator started; from here an error no longer marks
    the task FAILED (it runs: its nodes go on), and the trainer's checkpoints are kept in ``log_dir``."""
    board, r = _board(run), run.request
    announce(board, run.resolved, task, run.runner, run.attached)
    if r.eval_interval is not None or r.eval_every is not None:
        run.evaluator = Evaluator(run.runner, board, run.codec, r.eval_interval, r.eval_every, r.eval_episodes,
                                  run.run_log)
        run.evaluator.start()
    run.submitted = True
    if run.run_log is not None:
        run.checkpoints = BoardCheckpoints(board, run.codec, run.runner, run.run_log, r.keep_checkpoints,
                                           r.checkpoint_memory)


def _watch(run: ClientRun) -> TaskStatus:
    """Watch until the task ends (its status, END or FAILED): a progress line every ``progress_interval``,
    a history row every interval (5 s when quiet), the trainer's new checkpoints kept. The client ends the
    task itself when the local trainer process died, or ``TIMEOUT_GRACE_S`` after a timeout no trainer
    applied; a board that is away is waited out. A task gone or replaced raises TaskFailedError."""
    board, r = _board(run), run.request
    hints = NodeHints.of(run.resolved, None if r.queue_params is None else describe_queue(r.queue_params))
    start = time.monotonic()
    next_line = start + (r.progress_interval or 0)
    log_every = r.progress_interval or 5.0
    next_row = start + log_every
    away_note = Throttle()
    while True:
        status = with_retry(board.get_status, "watching the task")
        if status is None or status.task_id != board.task_id:
            raise TaskFailedError(TASK_GONE if status is None else TASK_REPLACED)
        if status.status in ("END", "FAILED"):
            return status
        try:
            if run.procs and run.procs[0].poll() not in (None, 0):
                board.end_task("FAILED", f"the local trainer process exited with code {run.procs[0].returncode}")
                continue
            now = time.monotonic()
            if r.timeout is not None and task_elapsed(board, status) > r.timeout + TIMEOUT_GRACE_S:
                # the trainer applies the timeout; with no trainer alive to do it, the client does
                board.end_task("END", f"timeout {r.timeout:g}s reached (ended by the client: no trainer ended it)")
                continue
            if r.progress_interval is not None and now >= next_line:
                next_line = now + r.progress_interval
                for line in progress_lines(board, status, task_elapsed(board, status), r.max_train_count,
                                           r.max_steps, r.timeout, hints):
                    logger.info("%s", line)
            if now >= next_row:  # the history: on the board for dashboards, in log_dir when there is one
                next_row = now + log_every
                record_history(board, run.run_log, run.evaluator)
            if run.checkpoints is not None:
                run.checkpoints.fetch()
        except BOARD_AWAY as e:  # a reset connection, a blip: the next look at the task waits for the board
            if away_note.ready():
                logger.warning("the board did not answer while watching (%s); watching goes on", short(e))
        time.sleep(0.2)


def _finish(run: ClientRun, ended: TaskStatus | None) -> None:
    """Finish, the one way a run ends here: ``ended`` is the task's final status, or None when this client
    cancelled it. In this order: the evaluator stops; the trainer's last params are awaited (when the task
    went live) and loaded into the runner; an ended task's totals go to the runner once its nodes let go;
    the trainer's last checkpoint is kept in ``log_dir``; an ended task's last history row and summary; its
    final evaluation; ``final.safetensors``. A cancel skips what an ended task adds: it waits on nothing
    but the trainer, and does not clear the board's checkpoint."""
    board, runner, run_log = _board(run), run.runner, run.run_log
    if run.evaluator is not None:
        run.evaluator.stop()
    if run.submitted:
        await_trainer_end(board, announce_after=0.0 if ended is None else 1.0)
    load_final_params(board, runner, run.codec)
    if ended is not None:
        if run.resume is not None:  # the board's counters went on from the checkpoint's
            runner.env_steps = runner.episodes = 0
        _note_totals(run)
    if run.checkpoints is not None:
        _keep_last_checkpoint(board, run.checkpoints, clear=ended is not None)
    if ended is not None:
        record_history(board, run_log, run.evaluator)  # where it ended
        if run.request.progress_interval is not None:
            depth = queue_depth(run.request.queue_params, run.resolved)
            for line in with_retry(lambda: summary_lines(board, ended, task_elapsed(board, ended), depth),
                                   "reading the run's summary"):
                logger.info("%s", line)
    if run_log is not None:
        if ended is not None and run.evaluator is not None:
            run.evaluator.evaluate_now(final=True)
        runner.save(run_log.dir / "final.safetensors")


def _note_totals(run: ClientRun) -> None:
    """Leave the run's env steps and episodes on the runner, as ``Runner.train`` does. Nodes flush their
    last counts and stats as they stop, then release their leases: wait for that (local processes to
    exit; nodes elsewhere up to ``SETTLE_S``, a dead one's lease lapses meanwhile or is left)."""
    board = _board(run)
    local_nodes.stop_all(run.procs)
    started = time.monotonic()
    noted = False
    while held := with_retry(lambda: board.held_leases(run.request.actor_num, run.request.inference_servers),
                             "reading the leases", max_wait=10):
        waited = time.monotonic() - started
        if waited >= SETTLE_S:
            logger.warning("%s still held after %.0fs: the summary goes on without their last counts",
                           ", ".join(held), waited)
            break
        if waited >= SETTLE_NOTE_S and not noted:
            noted = True
            logger.info("waiting up to %.0fs for %s to report their last counts and let go", SETTLE_S,
                        ", ".join(held))
        time.sleep(0.05)
    counters = settle_counters(lambda: with_retry(board.get_counters, "reading the run's counters", max_wait=10))
    run.runner.env_steps += int(counters.get("env_steps", 0))
    run.runner.episodes += int(counters.get("episodes", 0))


def unreported_sends(counters: dict[str, float]) -> int:
    """Batches taken off the queue beyond those the senders counted as sent (the in-flight count below 0):
    counts of sends still on their way (or of a killed sender, never to come)."""
    return max(0, int(-batches_in_flight(counters)))


def settle_counters(read: Callable[[], dict[str, float]], wait_s: float = LATE_COUNTS_S,
                    clock: Callable[[], float] = time.monotonic, pause: Callable[[float], None] = time.sleep
                    ) -> dict[str, float]:
    """The run's counters once the senders' late counts are in: read again, for up to ``wait_s``, while
    more batches were taken off the queue than counted as sent (:func:`unreported_sends`); the last read
    after that (the summary then names the surplus)."""
    counters = read()
    if not (unreported := unreported_sends(counters)):
        return counters
    logger.info("%d batch(es) arrived that no sender has counted as sent yet: waiting up to %.0fs for their "
                "counts (a sender cut off from the board counts them once it answers again)", unreported, wait_s)
    deadline = clock() + wait_s
    while unreported_sends(counters) and clock() < deadline:
        pause(0.1)
        counters = read()
    return counters


def _keep_last_checkpoint(board: Board, checkpoints: BoardCheckpoints, clear: bool) -> None:
    """The checkpoint the trainer wrote as it stopped, into ``log_dir``; ``clear``: then off the board,
    which need not hold what ``log_dir`` has."""
    with_retry(lambda: checkpoints.fetch(now=True), "fetching the last checkpoint")
    if clear and checkpoints.kept == with_retry(board.get_checkpoint_train_count, "reading the last checkpoint"):
        with_retry(board.clear_checkpoint, "clearing the last checkpoint")


def _conclude(run: ClientRun, ended: TaskStatus) -> None:
    """Conclude an ended task: a FAILED one raises TaskFailedError; else its end is logged and, with
    ``delete_task``, its keys removed once local nodes have seen the end."""
    if ended.status == "FAILED":
        raise TaskFailedError(f"task {run.resolved.task_name!r} FAILED: {ended.end_reason}")
    logger.info("task %r ended: %s", run.resolved.task_name, ended.end_reason)
    if run.request.delete_task:
        local_nodes.stop_all(run.procs)  # let local nodes see END before their keys vanish
        run.procs = []
        _board(run).delete_task()


def _fail_unstarted(run: ClientRun, error: Exception) -> None:
    """A task written but never gone live would stay INIT for ever: it ends FAILED, saying why."""
    if run.board is not None and not run.submitted:
        with contextlib.suppress(Exception):
            run.board.end_task("FAILED", f"the client could not start it: {type(error).__name__}: "
                                         f"{short(error, 300)}")


def _cancel_or_detach(run: ClientRun, interrupt: KeyboardInterrupt) -> None:
    """Ctrl-C or SIGTERM: a client that attached detaches (the task goes on); one that submitted ends the task
    as cancelled and finishes as :func:`_finish` does (a board that is away: the interrupt still ends
    this client)."""
    why = "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted"
    if run.board is None:
        return
    if run.attached:
        detach(run.board, run.resolved, why)
        return
    logger.warning("%s: ending task %r as cancelled", why, run.resolved.task_name)
    try:
        run.board.end_task("END", "cancelled")
        _finish(run, None)
    except Exception as e:
        logger.warning("could not end the task as cancelled: %s", short(e))


def _release(run: ClientRun) -> None:
    """Whatever happened: the evaluator stopped, ``log_dir``'s files closed, local nodes and an embedded
    Redis stopped."""
    if run.evaluator is not None:
        run.evaluator.stop()
    if run.run_log is not None:
        run.run_log.close()
    local_nodes.stop_all(run.procs)
    if isinstance(run.embedded, EmbeddedRedis):
        run.embedded.stop()


def _board(run: ClientRun) -> Board:
    """The task's board, once the task is written or attached to."""
    assert run.board is not None, "the task is written (or attached to) before this phase"
    return run.board
