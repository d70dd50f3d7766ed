"""``trainer_run_forever``: hold the trainer lease, ingest experience, learn, publish params.

Owns: the trainer process — taking the lease (which increments the epoch that fences every params
write) and wiring one run's parts (:class:`TrainerRun`): the ingest thread (``ingest.py``), the version
gate (``versions.py``), publication (``publisher.py``), what the run starts from and leaves
(``checkpoints.py``), what its heartbeats report (``stats.py``), its buffer's memory bound (``sizing.py``);
its own are the board thread (heartbeat, the task's state, the lease taken back after an outage), the
publish thread (each version written as soon as it is handed over) and the main thread's loop, which ends
the task at its limits with the final params written first. It follows the algorithm's ``DataPath`` and
never branches on the algorithm. Must never: ack a batch before it is in the buffer, let one message stop
it, or give up on a board that is away for a while.

The loop::

    epoch = claim_trainer()                      # SET NX PX + INCR, atomically
    checkpoints.resume() or checkpoints.restore()  # a client's checkpoint, or the board's params: train_count goes on
    gate.first_version(board's)                  # sync: one past it (a killed trainer may have taken its segments)
    ingest thread: get_many → decode(schema) → dedupe → gate (version policy) → buffer.add → count → ack
                   (a full buffer is not read into: the queue fills and actors wait)
    board thread:  heartbeat (renew lease, stats, the task's state)
    publish thread: publisher.flush() (the latest params blob, as soon as it is handed over)
    main thread:   while not done:
                       sync: once every actor's segments of this version are in → train → publish
                       else: train; publish as the data path says (every ``publish_every`` train steps)
    publish final params; end_task(END, reason)

Every row carries the params version it was acted with: the trainer refuses
rows its data path does not accept (sync: another version; ``max_policy_lag``:
too old; any: a version not yet published), counts them as stale, and reports the lag of what it accepts in
versions and in train steps (p50/p95/max).

After a board outage longer than the lease TTL the lease has lapsed: the
trainer takes it back with its own epoch (``Board.reclaim_trainer``) and keeps
its memory and ``train_count``; only another trainer having taken the lease in
between (the epoch moved) fences it off, and the log names that trainer.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Literal

import torch

from srl.base.env import allowed_env_modules, env_spec
from srl.base.rl import Buffer, seed_everything
from srl.base.schema import Schema
from srl.runner.distribution.board.board import Board, Heartbeat, actor_slot
from srl.runner.distribution.node.liveness import Beat, BoardWork, LeaseGuard, Liveness, keep_lease
from srl.runner.distribution.node.retry import with_retry
from srl.runner.distribution.node.serve import BUDGET_BEAT_S, apply_overrides, remove_orphans, require_remote, serve
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.queues import ExperienceQueue, check_queue, open_queue
from srl.runner.distribution.settings.options import TrainerOptions
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import TASK_GONE, TASK_REPLACED, TaskSpec, max_message_rows
from srl.runner.distribution.trainer.checkpoints import TrainerCheckpoints
from srl.runner.distribution.trainer.ingest import Ingest
from srl.runner.distribution.trainer.publisher import Publisher
from srl.runner.distribution.trainer.sizing import check_memory_fits, memory_limit, read_window
from srl.runner.distribution.trainer.stats import RunStats
from srl.runner.distribution.trainer.versions import VersionGate
from srl.runner.distribution.wire.codec import batch_message_bytes, params_message_bytes, short, task_tag
from srl.runner.progress import ensure_logging

logger = logging.getLogger("srl.trainer")


class TrainerRun:
    """One trainer working on one task under one epoch: its parts, wired in one place.

    - ``ingest`` (:class:`~srl.runner.distribution.trainer.ingest.Ingest`, its own thread): queue → buffer, counted,
      acked;
    - ``gate`` (:class:`~srl.runner.distribution.trainer.versions.VersionGate`): the params version and the rows
      the data path takes at it;
    - ``publisher`` (:class:`~srl.runner.distribution.trainer.publisher.Publisher`): weights → board, fenced;
    - ``checkpoints`` (:class:`~srl.runner.distribution.trainer.checkpoints.TrainerCheckpoints`): what it starts
      from, what it leaves;
    - ``stats`` (:class:`~srl.runner.distribution.trainer.stats.RunStats`): what its heartbeats report;
    - this class: the board thread (heartbeat = lease renewal and stats, the task's state, the lease taken
      back after an outage) and the main thread's loop (``run``: train, publish, checkpoint, end).
    """

    def __init__(
        self,
        board: Board,
        redis_params: RedisParameters,
        queue_params: Any,
        task: TaskSpec,
        epoch: int,
        options: TrainerOptions,
    ) -> None:
        self.board = board
        self.task = task
        self.epoch = epoch
        self.options = options
        self.lease_guard = LeaseGuard(board, "trainer", options.uid, options.lease_ttl, options.heartbeat_interval)
        self.redis_params = redis_params
        self.queue_params = queue_params
        self.stop = StopFlag()
        config = task.rl_config
        torch.set_num_threads(max(1, config.torch_threads))
        seed_everything(config.seed)
        self.spec = env_spec(task.env_config, allowed_env_modules(options.allow_env_modules))
        config.check_spec(self.spec)
        self.data_path = config.resolved(self.spec).data_path()
        self.schema: Schema = config.schema(self.spec)
        max_rows = max_message_rows(task)
        self.device = config.resolve_device()
        self.parameter = config.make_parameter(self.spec, self.device)
        params_bytes = params_message_bytes(self.parameter.to_arrays())
        self.codec = options.codec(board.task_name, max_bytes=max(batch_message_bytes(self.schema, max_rows),
                                                                  params_bytes))
        self.buffer: Buffer = config.make_buffer(self.spec, task.actor_num)
        limit = memory_limit(options)
        check_memory_fits(self.buffer, self.schema, limit)  # the arrays are reserved, not yet touched
        self.learner = config.make_learner(self.spec, self.parameter, self.buffer, task.actor_num)
        self.gate = VersionGate(self.data_path)
        self.publisher = Publisher(board, self.codec, options.uid, epoch, self.parameter, config.algorithm, self.gate,
                                   options.min_publish_interval, self.take_lease_back, options.params_float16,
                                   self.learner.takeover_state)
        self.ingest = Ingest(board, self.codec, self.schema, self.buffer, self.gate, self.stop, options, max_rows,
                             task_tag(board.task_id), self.open_consumer, self._messages_expected,
                             read_window(self.buffer, self.data_path.sync, limit, max_rows), self.lease_guard.lapsed)
        self.checkpoints = TrainerCheckpoints(board, self.codec, task, options, epoch, self.parameter, self.learner,
                                              self.buffer, self.gate, self.publisher, params_bytes)
        self._train_base = 0  # train_count when this run began
        self.env_steps_total = 0
        self.live_slots: list[int] | None = [] if task.elastic_actors and self.data_path.sync else None
        """elastic actors, sync: the actor slots held at the last heartbeat (None: every slot is waited for)"""
        self.task_started_at: float | None = None
        self.board_work = BoardWork("trainer", self.stop, "training goes on, retrying")
        self.liveness = Liveness(board, "trainer", options.uid, options.lease_ttl, self.stop, self.lease_guard,
                                 self.board_work, self)
        self.fenced = False  # another trainer took the lease over
        self.stats = RunStats(options.uid, epoch, self.device, self.learner, self.buffer, self.gate, self.ingest,
                              options.heartbeat_interval)
        # the budget coming near
        self._steps_seen: tuple[int, float] | None = None  # the run's env steps at a heartbeat, and when
        self._near = False  # max_steps is near (it only comes nearer): heartbeats every BUDGET_BEAT_S
        # server clock: Redis TIME at the last heartbeat, and our monotonic clock then
        self._server_time = (time.time(), time.monotonic())
        self._taking_back = threading.Lock()
        self.resumed = self.checkpoints.resume()

    def open_consumer(self) -> ExperienceQueue:
        """The task's experience queue, opened as this trainer's consumer: the lease holder's, so what a trainer
        before it read and never acked (it was killed, or fenced off) comes to it on its first read."""
        queue = open_queue(self.queue_params, namespace=self.redis_params.task_name, role="consumer",
                           redis_params=self.redis_params, consumer_name=self.options.uid,
                           max_read_bytes=self.codec.max_bytes, prefetch=self.options.prefetch)
        queue.take_over()
        return queue

    # ------------------------------------------------------------ board thread
    def server_now(self) -> float:
        """Redis's clock, extrapolated from the last heartbeat."""
        server, mono = self._server_time
        return server + (time.monotonic() - mono)

    # ------------------------------------------------------------ heartbeats (node.liveness.Liveness's hooks)
    def report(self) -> Beat:
        """Stats (with the rates since the last heartbeat), and the refused messages noted on the board first."""
        stats = self.stats.beat()
        self.ingest.refused.report(self.board, self.options.uid)
        return Beat(stats, total_of="env_steps")

    def heard(self, answer: Heartbeat) -> None:
        self._server_time = (answer.server_time, time.monotonic())

    def in_order(self, answer: Heartbeat) -> None:
        self.env_steps_total = int(answer.total or 0)
        if self.live_slots is not None:
            self.live_slots = [slot for name in self.board.held_leases(self.task.actor_num)
                               if (slot := actor_slot(name)) is not None]

    def pause(self, answer: Literal["ok", "away"]) -> None:
        opts = self.options
        wait = min(opts.heartbeat_interval, 1.0) if answer == "away" else opts.heartbeat_interval
        now = time.monotonic()
        if answer == "ok" and not self._near and self.task.max_steps is not None:
            if self._steps_seen is None:  # the first count this trainer read (one taking over: the run's so far)
                self._steps_seen = (self.env_steps_total, now)
            elif now - self._steps_seen[1] >= opts.heartbeat_interval / 2:
                rate = (self.env_steps_total - self._steps_seen[0]) / (now - self._steps_seen[1])
                self._near = self.env_steps_total + 2 * rate * opts.heartbeat_interval >= self.task.max_steps
                self._steps_seen = (self.env_steps_total, now)
        self.stop.wait(min(wait, BUDGET_BEAT_S) if self._near else wait)

    def _publish_loop(self) -> None:
        """Writes each version as soon as the main thread hands it over. Its own thread: a publication never
        waits behind a heartbeat (over a long link, one or two round trips of a sync version's handoff)."""
        wake = self.publisher.wake
        while not self.stop.is_set():
            wake.wait(self.options.heartbeat_interval)
            wake.clear()
            answer = self.board_work.run(self.publisher.flush, "publish")
            if answer == "stop":
                break
            if answer == "away":  # the blob is kept: try again in a while
                self.stop.wait(min(self.options.heartbeat_interval, 1.0))
                wake.set()

    def take_lease_back(self) -> bool:
        """The lease lapsed: take it back if no other trainer took over (else stop, fenced). The heartbeat
        and a publication may both find out: one at a time."""
        with self._taking_back:
            return self._take_lease_back_locked()

    def _take_lease_back_locked(self) -> bool:
        opts = self.options
        if self.fenced:  # the heartbeat and the publisher may both find out: say it once
            return False
        answer = self.board.reclaim_trainer(opts.uid, self.epoch, int(opts.lease_ttl * 1000))
        if answer == "gone":
            self.liveness.task_left(TASK_GONE, gone=True)
            return False
        if answer == "replaced":
            self.liveness.task_left(TASK_REPLACED)
            return False
        if answer == "taken":
            away = self.lease_guard.since_renewed()  # a cut link raises nothing: its commands just hang
            text = (f"trainer {opts.uid} took its lapsed lease back (epoch {self.epoch}, {away:.0f}s without the "
                    f"board); buffer ({len(self.buffer)} rows) and train_count {self.learner.train_count} kept")
            logger.warning("%s", text)
            self.board.log_event(text, level="WARNING", source=opts.uid)
            return True
        status = self.board.get_status()
        newer = ("another trainer" if status is None or not status.trainer_uid
                 else f"trainer {status.trainer_uid} (epoch {status.trainer_epoch})")
        self.fenced = True
        self.stop.set(f"fenced off: {newer} took the trainer lease over from epoch {self.epoch}")
        self.board.log_event(f"trainer {opts.uid} (epoch {self.epoch}) fenced off by {newer}", level="WARNING",
                             source=opts.uid)
        return False

    # ------------------------------------------------------------ the end
    def _publish_and_wait(self) -> bool:
        """Publish the final weights and wait until they are on the board (False if stopped first)."""
        self.publisher.request_final(self.learner.train_count)
        return self.publisher.wait(self.stop)

    def _flush_final(self) -> None:
        """Write what is still pending once the board thread stopped."""
        live = self.liveness
        if not self.publisher.pending() or self.fenced or live.task_replaced or live.task_gone:
            return
        before = self.publisher.published_version
        try:
            self.publisher.flush()
        except Exception as e:
            logger.warning("could not publish the final params: %s", short(e))
            return
        if self.publisher.published_version > before:
            logger.info("final params published: version %d, train_count %d", self.publisher.published_version,
                        self.learner.train_count)

    def _finish_ended_task(self, board_threads: list[threading.Thread]) -> None:
        """The task was ended on the board (a client's cancel): the board thread has stopped its heartbeats,
        so the lease guard renews the lease while the last weights go (first: the client waits for them) and
        then the last checkpoint; the client loads both once this trainer lets go."""
        for thread in board_threads:  # its heartbeats have stopped; the publish thread's last write is done
            thread.join(timeout=self.options.heartbeat_interval + 5)
        self.publisher.request_final(self.learner.train_count)
        self._flush_final()
        self.checkpoints.keep(self.env_steps_total)

    def _messages_expected(self) -> int:
        """Messages the next update waits for: sync, one from each awaited actor not yet heard from this
        version (they come about together); else 1."""
        if not self.data_path.sync:
            return 1
        return max(1, self.gate.missing(self._awaited_slots()))

    def _awaited_slots(self) -> list[int]:
        """Sync: the actor slots whose segments an update waits for: every slot, or with elastic actors the
        slots held at the last heartbeat (an actor that left is not waited for, one that came is)."""
        if self.live_slots is None:
            return list(range(self.task.actor_num))
        return self.live_slots

    def _limit_reached(self) -> str | None:
        task = self.task
        if task.max_train_count is not None and self.learner.train_count >= task.max_train_count:
            return f"max_train_count {task.max_train_count} reached"
        if task.max_steps is not None and self.env_steps_total >= task.max_steps:
            return f"max_steps {task.max_steps} reached"
        if task.timeout is not None and self.task_started_at is not None:
            if self.server_now() - self.task_started_at >= task.timeout:
                return f"timeout {task.timeout:g}s reached"
        return None

    # ------------------------------------------------------------ the loop
    def _update(self) -> bool:
        """One update on the main thread (False: not enough data yet); publishes as the data path says."""
        path, gate, learner = self.data_path, self.gate, self.learner
        if path.sync:
            slots = self._awaited_slots()
            needed = path.update_segments(max(1, len(slots)), self.task.rl_config.envs_per_actor)
            if not gate.sync_ready(len(self.buffer), needed, slots):
                return False
            with gate.lock:  # no row of the old version slips in between training and moving the version
                stats = learner.train()
                if stats is not None:
                    gate.version = path.next_version(gate.version, learner.train_count)
                    gate.updated()
            if stats is not None:  # no row of the new version comes before its params are out, so none is
                # taken before the publication resets who delivered (under the lock)
                self.publisher.request(learner.train_count)
        else:
            stats = None if self._ahead_of_data() else learner.train()
            if stats is not None:
                with gate.lock:
                    gate.version = path.next_version(gate.version, learner.train_count)
            if self.publisher.due():  # waiting for rows too: actors pace themselves by the published train_count
                self.publisher.request(learner.train_count)
        if stats is None:
            return False
        self.stats.learned(stats.scalars())
        return True

    def _ahead_of_data(self) -> bool:
        """Off-policy: this run made ``train_ahead`` times the train steps the replay ratio gives the rows it
        received (after the warmup's), and one publication interval more: it waits for new rows instead of
        replaying the same memory without end (a queue or board that stopped delivering, actors gone).
        Actors keep to the ratio itself, so a trainer they keep up with never waits here."""
        path = self.data_path
        if path.sync or path.env_steps_per_train is None:
            return False
        rows = self.checkpoints.rows_base + self.ingest.received_transitions
        allowed = path.train_steps_allowed(rows, self.options.train_ahead) + max(1, path.publish_every)
        return self.learner.train_count - self._train_base >= allowed

    def run(self) -> str:
        opts = self.options
        # params of hundreds of MB over a slow link can outlast the TTL: the lease is kept until heartbeats start
        with keep_lease(self.board, "trainer", opts.uid, opts.lease_ttl, opts.heartbeat_interval, opts.max_start_s):
            status = with_retry(self.board.get_status, "reading the task")
            self.task_started_at = status.started_at if status is not None else None
            self._server_time = (with_retry(self.board.server_time, "reading the server clock"), time.monotonic())
            self.checkpoints.restore(self.resumed)
            self.env_steps_total = self.checkpoints.run_env_steps()
            self.ingest.recall_counted_batches()
        self._train_base = self.learner.train_count
        on_board = self.publisher.published_version
        first = self.gate.first_version(on_board)  # before the ingest starts: no row is taken at the old one
        if self.data_path.sync and 0 < on_board < first:
            logger.info("sync: the trainer before this one may have taken version %d's segments and died training on "
                        "them; its weights go out again as version %d, so that every actor acts again", on_board, first)
        board_threads = [threading.Thread(target=self.liveness.run, name="srl-trainer-board", daemon=True),
                         threading.Thread(target=self._publish_loop, name="srl-trainer-publish", daemon=True)]
        self.lease_guard.start()  # renews while a heartbeat is late (a slow board); before the ingest asks it
        self.ingest.start()
        for thread in board_threads:
            thread.start()
        logger.info("trainer %s holds the lease at epoch %d on %s (learner: %s); train_count %d", opts.uid,
                    self.epoch, self.device, getattr(self.learner, "compute", "plain"), self.learner.train_count)
        self.learner.plan(self.task.max_steps, self.task.max_train_count, self.env_steps_total)
        self.publisher.request(self.learner.train_count)  # actors act with this trainer's weights from the start
        end_reason: str | None = None
        self.checkpoints.schedule()
        try:
            while not self.stop.is_set():
                end_reason = self._limit_reached()
                if end_reason:
                    break
                if not self._update():
                    self.ingest.data_arrived.wait(0.05)
                    self.ingest.data_arrived.clear()
                self.checkpoints.keep_when_due(self.env_steps_total)
            live = self.liveness
            if live.task_ended and not (self.fenced or live.task_gone or live.task_replaced):
                self._finish_ended_task(board_threads)
            elif not live.task_replaced:  # whatever ended the task, keep where it got to (not into the new one's)
                self.checkpoints.keep(self.env_steps_total)
            # final params first, then END: a client that sees END finds them
            if end_reason and not self.stop.is_set() and self._publish_and_wait():
                with_retry(lambda: self.board.end_task("END", end_reason or ""), "ending the task")
                self.stop.set(f"task END: {end_reason}")
        finally:
            self.stop.set(self.stop.reason or "trainer stopping")
            self.publisher.wake.set()
            for thread in board_threads:
                thread.join(timeout=opts.heartbeat_interval + 5)
            # the lease is renewed until the ingest's last counts are written (a read it took while the queue
            # reconnected, reads given back): counts from a trainer whose lease lapsed are refused
            self.ingest.join(timeout=10)
            self.lease_guard.stop()
            self._flush_final()  # a publication the publish thread had not written yet
            try:
                # a fenced trainer's stats would overwrite its successor's: it only lets go
                stats = None if self.fenced else self.stats.record()
                self.board.heartbeat("trainer", opts.uid, int(opts.lease_ttl * 1000), "trainer", stats)
                self.board.release_lease("trainer", opts.uid)
            except Exception as e:
                logger.warning("could not report the end of trainer %s: %s", opts.uid, short(e))
            if self.liveness.task_gone:
                remove_orphans(self.board)
        refused = self.ingest.refused_by or self.board_work.refused_by
        if refused is not None:
            raise refused
        fatal = self.ingest.fatal or self.board_work.fatal
        if fatal:
            raise RuntimeError(fatal)
        return self.stop.reason

    def summary(self) -> str:
        ingest = self.ingest
        return (f"epoch {self.epoch}, train_count {self.learner.train_count}, received {ingest.received_batches} "
                f"batches, {ingest.bad_messages} bad, {ingest.duplicates} duplicates, {ingest.stale_rows} stale rows")


def trainer_run_forever(
    redis_params: RedisParameters,
    queue_params: Any = None,
    run_once: bool = False,
    options: TrainerOptions | None = None,
    **option_overrides: Any,
) -> None:
    """Serve as the trainer: wait for a task, take the lease (new epoch), learn, publish, repeat.

    ``run_once=True`` returns after one task (the notebook use). Keyword overrides set
    :class:`TrainerOptions` fields.
    """
    ensure_logging()
    opts = apply_overrides(options or TrainerOptions(), option_overrides, "trainer_run_forever")
    opts.validate()
    opts.run_once = opts.run_once or run_once
    opts.set_default_uid("trainer")
    require_remote(redis_params, "trainer_run_forever")
    check_queue(queue_params)  # an unknown scheme, a malformed URL, a missing library: now, not when a task comes
    board = Board(redis_params.connect(), redis_params.task_name)
    where = f"{redis_params.describe()} task {redis_params.task_name!r}"
    logger.info("trainer %s ready (cuda available: %s); waiting for a task on %s", opts.uid,
                torch.cuda.is_available(), where)
    ttl_ms = int(opts.lease_ttl * 1000)

    def standby(task_board: Board, task: TaskSpec) -> str:
        holder = with_retry(lambda: task_board.lease_holder("trainer"), "reading the trainer lease")[0]
        return f"trainer lease held by {holder}; standing by to take over"

    try:
        serve(
            "trainer", board, where, opts, queue_params,
            claim=lambda task_board, task: task_board.claim_trainer(opts.uid, ttl_ms),
            lease_name=lambda epoch: "trainer",
            standby_note=standby,
            build_run=lambda task_board, task, epoch: TrainerRun(task_board, redis_params, queue_params, task, epoch,
                                                                 opts),
        )
    except KeyboardInterrupt:
        logger.info("trainer %s interrupted; exiting (its lease, if any, is released)", opts.uid)
