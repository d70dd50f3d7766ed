"""``trainer_run_forever``: hold the trainer lease, ingest experience, learn, publish params.

Owns: the trainer process — taking the lease (which increments the epoch that
fences every params write), restoring from the params on the board so
``train_count`` continues after a takeover, ingesting in a background thread
(decode against the algorithm's schema → dedupe → memory → ack: never ack
before the batch is in replay), training on the main thread, publishing
params from the board thread, and ending the task at its limits with the final
params written first. Must never: ack a batch before it is in memory, let one
message stop it (whatever a message does, it is counted, noted with its
source, acked and skipped), or give up on a board that is away for a while.

The loop::

    epoch = claim_trainer()                      # SET NX PX + INCR, atomically
    restore params (epoch, version) from board   # train_count goes on
    ingest thread: get_many → decode(schema) → dedupe → memory.add → ack_many
    board thread:  heartbeat (renew lease, stats) · publish the latest params blob
    main thread:   while not done: trainer.train(); every interval: hand a params blob to the board thread
    publish final params; end_task(END, reason)

After a board outage longer than the lease TTL the lease has lapsed: the
trainer takes it back with its own epoch (``Board.reclaim_trainer``) and keeps
its memory and ``train_count``; only another trainer having taken the lease in
between (the epoch moved) fences it off, and the log names that trainer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from srl.base.env import EnvAdapter, allowed_env_modules
from srl.base.schema import Schema
from srl.rl.memories import Memory
from srl.runner.distribution.board import Board, BoardError, DeadLetter
from srl.runner.distribution.codec import (
    MAX_MESSAGE_ROWS,
    DecodeError,
    batch_message_bytes,
    params_message_bytes,
    short,
)
from srl.runner.distribution.node import CounterDeltas, NodeOptions, apply_overrides, require_remote, serve
from srl.runner.distribution.queues import Message, QueueError, open_queue
from srl.runner.distribution.redis_parameters import RedisParameters
from srl.runner.distribution.retry import TRANSIENT_ERRORS, Throttle, with_retry
from srl.runner.distribution.task import StopFlag, TaskSpec
from srl.runner.progress import ensure_logging
from srl.runner.runner import seed_everything

logger = logging.getLogger("srl.trainer")

_BOARD_AWAY: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, BoardError)
_WAIT_OUT: tuple[type[BaseException], ...] = (*_BOARD_AWAY, QueueError)

MAX_INITIAL_PRIORITY = 1e6
"""initial priorities from actors are clipped here (one huge value would starve every other row)"""


@dataclass
class TrainerOptions(NodeOptions):
    """How a trainer process behaves (the task itself comes from the board)."""

    publish_interval: float = 1.0
    """seconds between params publications to the board"""
    ingest_max_messages: int = 16
    """batches fetched from the queue per round trip (with the task's message size, this bounds
    the bytes one read may bring)"""
    max_buffer_bytes: int = 0
    """largest replay memory this trainer allocates for a task (0: 75% of this machine's memory);
    a task asking for more ends FAILED with the reason"""


def machine_memory_bytes() -> int:
    """Physical memory of this machine (0 when it cannot be told)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class SeenBatches:
    """Which ``(actor, seq)`` batches were ingested, in bounded memory.

    Per actor: the highest seq seen and a bitmap of the ``window`` seqs below
    it. A seq at or below ``highest - window`` is refused as a replay (an
    actor's seqs only grow; a redelivery is never that late). At most
    ``max_actors`` actors are remembered (least recently heard from forgotten
    first): a run would need that many actor processes to go silent before a
    replay of one of theirs could pass.
    """

    def __init__(self, window: int = 4096, max_actors: int = 65_536) -> None:
        self.window = window
        self.max_actors = max_actors
        self._actors: OrderedDict[str, list[int]] = OrderedDict()  # actor -> [highest, bitmap]

    def is_new(self, actor_id: str, seq: int) -> bool:
        state = self._actors.get(actor_id)
        if state is None:
            return True
        highest, bitmap = state
        if seq > highest:
            return True
        back = highest - seq
        return back < self.window and not (bitmap >> back) & 1

    def mark(self, actor_id: str, seq: int) -> None:
        state = self._actors.get(actor_id)
        if state is None:
            self._actors[actor_id] = [seq, 1]
            while len(self._actors) > self.max_actors:
                self._actors.popitem(last=False)
            return
        self._actors.move_to_end(actor_id)
        highest, bitmap = state
        if seq > highest:
            bitmap = ((bitmap << (seq - highest)) | 1) & ((1 << self.window) - 1)
            state[0], state[1] = seq, bitmap
        else:
            state[1] = bitmap | (1 << (highest - seq))

    def __len__(self) -> int:
        return len(self._actors)


class TrainerRun:
    """One trainer working on one task under one epoch."""

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
        self.stop = StopFlag()
        config = task.rl_config
        torch.set_num_threads(max(1, config.torch_threads))
        seed_everything(config.seed)
        env = EnvAdapter(task.env_config, config.algorithm, config.action_bins,
                         allow_modules=allowed_env_modules(options.allow_env_modules))
        self.spec = env.spec
        env.close()
        self.schema: Schema = config.schema(self.spec)
        self._check_memory_fits(config.memory.capacity * self.schema.row_nbytes)
        self.device = config.resolve_device()
        self.parameter = config.make_parameter(self.spec, self.device)
        params_bytes = params_message_bytes(self.parameter.to_arrays())
        self.codec = options.codec(
            board.task_name, max_bytes=max(batch_message_bytes(self.schema, MAX_MESSAGE_ROWS), params_bytes)
        )
        self.max_params_bytes = params_bytes
        self.memory: Memory = config.make_memory(self.spec)
        self.trainer = config.make_trainer(self.spec, self.parameter, self.memory)
        self.queue_params = queue_params
        self.redis_params = redis_params
        self.data_arrived = threading.Event()
        self.seen = SeenBatches()
        self.counters = CounterDeltas()
        self.received_batches = 0
        self.received_transitions = 0
        self.bad_messages = 0
        self.duplicates = 0
        self.last_bad = ""
        self._bad_reported = 0
        self._dead_letters: deque[DeadLetter] = deque(maxlen=100)
        self._bad_log = Throttle(options.heartbeat_interval)
        self._queue_log = Throttle()
        self._board_log = Throttle()
        self.env_steps_total = 0
        self.loss: float | None = None
        self.task_started_at: float | None = None
        self.fatal: str | None = None
        # server clock: Redis TIME at the last heartbeat, and our monotonic clock then
        self._server_time = (time.time(), time.monotonic())
        # publishing: the main thread hands blobs over, the board thread writes them
        self.version = 0
        self._publish_lock = threading.Lock()
        self._pending: tuple[int, int, bytes] | None = None
        self._published_version = 0
        self._wake = threading.Event()
        self._lease_lost_at: float | None = None

    def _check_memory_fits(self, needed: int) -> None:
        limit = self.options.max_buffer_bytes or int(0.75 * machine_memory_bytes())
        if limit and needed > limit:
            raise MemoryError(
                f"the task's replay memory needs {needed / 2**30:.2f} GiB (memory.capacity "
                f"{self.task.rl_config.memory.capacity} x {self.schema.row_nbytes} bytes per row); this trainer "
                f"allows {limit / 2**30:.2f} GiB (--max-buffer-bytes); lower memory.capacity"
            )

    # ------------------------------------------------------------ restore
    def restore(self) -> None:
        """Continue from the params on the board (a takeover or a restart)."""
        try:
            record = with_retry(lambda: self.board.get_params(self.max_params_bytes), "reading params")
        except BoardError as e:
            logger.error("params on the board cannot be read (%s); starting from fresh weights", short(e))
            return
        if record is None:
            logger.info("no params on the board: starting from fresh weights")
            return
        try:
            _, arrays = self.codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
            self.parameter.from_arrays(arrays)
        except (DecodeError, ValueError) as e:
            logger.error("params on the board (epoch %d, version %d) cannot be restored: %s; starting fresh",
                         record.epoch, record.version, short(e))
            return
        self.version = record.version
        self._published_version = record.version
        self.parameter.version = record.version
        self.trainer.train_count = record.train_count
        self.trainer.on_parameters_loaded()
        logger.info("trainer at epoch %d restored the params of epoch %d version %d: train_count continues from %d",
                    self.epoch, record.epoch, record.version, record.train_count)

    # ------------------------------------------------------------ ingest thread
    def _ingest_loop(self) -> None:
        opts = self.options
        queue = None
        delay = 0.1
        try:
            while not self.stop.is_set():
                try:
                    if queue is None:
                        queue = open_queue(self.queue_params, namespace=self.redis_params.task_name,
                                           role="consumer", redis_params=self.redis_params, consumer_name=opts.uid,
                                           max_read_bytes=self.codec.max_bytes)
                    messages = queue.get_many(opts.ingest_max_messages, timeout=0.2)
                    delay = 0.1
                    if not messages:
                        continue
                    counts = self._ingest(messages)
                    queue.ack_many(messages)  # after every message is in memory (or refused)
                    self.data_arrived.set()
                    self.counters.add(**counts)
                    if not queue.reports_depth:  # actors read the queue depth from these counters: write now
                        with self.counters.taken() as deltas:
                            with_retry(lambda: self.board.incr_counters("trainer", **deltas),
                                       "counting received batches", should_stop=self.stop.is_set)
                except _WAIT_OUT as e:
                    if self._queue_log.ready():
                        logger.warning("experience queue unavailable (%s); retrying", short(e))
                    if queue is not None:
                        _close_quietly(queue)
                        queue = None
                    self.stop.wait(delay)
                    delay = min(delay * 2, 2.0)
        except Exception as e:  # a bug, not a message: stop the trainer instead of training on nothing
            logger.exception("ingest thread crashed")
            self.fatal = f"ingest thread crashed: {type(e).__name__}: {short(e)}"
            self.stop.set(self.fatal)
        finally:
            if queue is not None:
                _close_quietly(queue)

    def _ingest(self, messages: list[Message]) -> dict[str, float]:
        """Decode, dedupe and add to memory; the counts for the board. Never raises for a message."""
        received = transitions = bad = dups = 0
        for message in messages:
            try:
                if message.refused:
                    raise DecodeError(message.refused)
                header, columns, priorities = self.codec.decode_batch(message.data, self.schema)
                if not self.seen.is_new(header.actor_id, header.seq):
                    dups += 1
                    continue
                if priorities is not None:
                    priorities = np.minimum(priorities, MAX_INITIAL_PRIORITY)
                self.memory.add(columns, priorities)
                self.seen.mark(header.actor_id, header.seq)
                received += 1
                transitions += header.count
            except Exception as e:  # whatever one message causes stays that message's problem
                bad += 1
                self._note_bad(message, e)
        self.received_batches += received
        self.received_transitions += transitions
        self.bad_messages += bad
        self.duplicates += dups
        return {"received_batches": received, "received_transitions": transitions, "bad_messages": bad,
                "duplicates": dups}

    def _note_bad(self, message: Message, error: BaseException) -> None:
        source = short(getattr(message, "source", "?"), 200)
        reason = short(error if isinstance(error, DecodeError) else f"{type(error).__name__}: {error}")
        self.last_bad = f"{source}: {reason}"
        size = len(message.data) if isinstance(message.data, (bytes, bytearray)) else 0
        self._dead_letters.append(DeadLetter(time.time(), source, reason, size))
        if self._bad_log.ready():
            more = self._bad_log.take_suppressed()
            logger.warning("skipped a bad message from %s: %s%s", source, reason,
                           f" (and {more} more since the last line)" if more else "")

    # ------------------------------------------------------------ board thread
    def server_now(self) -> float:
        """Redis's clock, extrapolated from the last heartbeat."""
        server, mono = self._server_time
        return server + (time.monotonic() - mono)

    def _board_loop(self) -> None:
        opts = self.options
        last_train, last_recv, last_time = self.trainer.train_count, 0, time.monotonic()
        next_beat = 0.0
        while not self.stop.is_set():
            try:
                self._flush_publish()
                now = time.monotonic()
                if now >= next_beat:
                    dt = max(now - last_time, 1e-9)
                    train_count = self.trainer.train_count
                    stats = self._stats((train_count - last_train) / dt, (self.received_transitions - last_recv) / dt)
                    last_train, last_recv, last_time = train_count, self.received_transitions, now
                    self._heartbeat(stats)
                    next_beat = time.monotonic() + opts.heartbeat_interval
            except _BOARD_AWAY as e:
                if self._lease_lost_at is None:
                    self._lease_lost_at = time.monotonic()
                if self._board_log.ready():
                    logger.warning("board unreachable or unreadable for %.0fs (%s); training goes on, retrying",
                                   time.monotonic() - self._lease_lost_at, short(e))
                next_beat = time.monotonic() + min(opts.heartbeat_interval, 1.0)
            except Exception as e:
                logger.exception("trainer board thread crashed")
                self.fatal = f"board thread crashed: {type(e).__name__}: {short(e)}"
                self.stop.set(self.fatal)
                break
            self._wake.wait(max(0.0, min(next_beat - time.monotonic(), opts.heartbeat_interval)))
            self._wake.clear()

    def _stats(self, train_per_s: float, received_per_s: float) -> dict[str, Any]:
        return {
            "uid": self.options.uid,
            "epoch": self.epoch,
            "train_count": self.trainer.train_count,
            "train_per_s": round(train_per_s, 1),
            "received_per_s": round(received_per_s, 1),
            "memory": len(self.memory),
            "received_batches": self.received_batches,
            "bad_messages": self.bad_messages,
            "duplicates": self.duplicates,
            "params_version": self.version,
            "loss": "" if self.loss is None else round(self.loss, 6),
            "device": str(self.device),
        }

    def _heartbeat(self, stats: dict[str, Any]) -> None:
        opts = self.options
        board = self.board
        if self.bad_messages > self._bad_reported:  # one event per heartbeat, not one per message
            board.log_event(f"{self.bad_messages - self._bad_reported} bad message(s) skipped; last from "
                            f"{self.last_bad}", level="WARNING", source=opts.uid)
            self._bad_reported = self.bad_messages
        letters = [self._dead_letters.popleft() for _ in range(len(self._dead_letters))]
        if letters:
            try:
                board.add_dead_letters(letters)
            except BaseException:
                self._dead_letters.extendleft(reversed(letters))
                raise
        with self.counters.taken() as deltas:
            hb = board.heartbeat("trainer", opts.uid, int(opts.lease_ttl * 1000), "trainer", stats, deltas)
        self._server_time = (hb.server_time, time.monotonic())
        if hb.task_status is None:
            self.stop.set("the task vanished from the board")
            return
        if not hb.lease_held and not self._take_lease_back():
            return
        self._lease_lost_at = None
        if hb.task_status != "ACTIVE":
            status = board.get_status()
            reason = status.end_reason if status is not None else ""
            self.stop.set(f"task {hb.task_status.value}: {reason or 'no reason given'}")
            return
        self.env_steps_total = int(board.get_counters().get("env_steps", 0))

    def _take_lease_back(self) -> bool:
        """The lease lapsed: take it back if no other trainer took over (else stop, fenced)."""
        opts = self.options
        if self.board.reclaim_trainer(opts.uid, self.epoch, int(opts.lease_ttl * 1000)):
            away = 0.0 if self._lease_lost_at is None else time.monotonic() - self._lease_lost_at
            text = (f"trainer {opts.uid} took its lapsed lease back (epoch {self.epoch}, {away:.0f}s without the "
                    f"board); memory ({len(self.memory)} rows) and train_count {self.trainer.train_count} kept")
            logger.warning("%s", text)
            self.board.log_event(text, level="WARNING", source=opts.uid)
            return True
        status = self.board.get_status()
        newer = "another trainer" if status is None else f"trainer {status.trainer_uid} (epoch {status.trainer_epoch})"
        self.stop.set(f"fenced off: {newer} took the trainer lease over from epoch {self.epoch}")
        self.board.log_event(f"trainer {opts.uid} (epoch {self.epoch}) fenced off by {newer}", level="WARNING",
                             source=opts.uid)
        return False

    # ------------------------------------------------------------ publishing
    def request_publish(self) -> int:
        """Hand the current weights to the board thread as a new version; that version."""
        self.version += 1
        self.parameter.version = self.version
        blob = self.codec.encode_params(
            self.parameter.to_arrays(),
            {"epoch": self.epoch, "version": self.version, "train_count": self.trainer.train_count,
             "algorithm": self.task.rl_config.algorithm},
        )
        with self._publish_lock:
            self._pending = (self.version, self.trainer.train_count, blob)
        self._wake.set()
        return self.version

    def _flush_publish(self) -> None:
        with self._publish_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        version, train_count, blob = pending
        try:
            ok = self.board.publish_params(self.options.uid, self.epoch, version, blob, train_count)
            if not ok and self._take_lease_back():
                ok = self.board.publish_params(self.options.uid, self.epoch, version, blob, train_count)
        except BaseException:
            with self._publish_lock:
                if self._pending is None:  # keep it for the next try, unless a newer one came
                    self._pending = pending
            raise
        if ok:
            self._published_version = version

    def publish_and_wait(self) -> bool:
        """Publish the current weights and wait until they are on the board (False if stopped first)."""
        version = self.request_publish()
        while self._published_version < version:
            if self.stop.is_set():
                return False
            time.sleep(0.01)
        return True

    def _limit_reached(self) -> str | None:
        task = self.task
        if task.max_train_count is not None and self.trainer.train_count >= task.max_train_count:
            return f"max_train_count {task.max_train_count} reached"
        if task.max_steps is not None and self.env_steps_total >= task.max_steps:
            return f"max_steps {task.max_steps} reached"
        if task.timeout is not None and self.task_started_at is not None:
            if self.server_now() - self.task_started_at >= task.timeout:
                return f"timeout {task.timeout:g}s reached"
        return None

    # ------------------------------------------------------------ the loop
    def run(self) -> str:
        opts = self.options
        status = with_retry(self.board.get_status, "reading the task")
        self.task_started_at = status.started_at if status is not None else None
        self._server_time = (with_retry(self.board.server_time, "reading the server clock"), time.monotonic())
        self.restore()
        ingest = threading.Thread(target=self._ingest_loop, name="srl-trainer-ingest", daemon=True)
        board_thread = threading.Thread(target=self._board_loop, name="srl-trainer-board", daemon=True)
        ingest.start()
        board_thread.start()
        logger.info("trainer %s holds the lease at epoch %d on %s; train_count %d", opts.uid, self.epoch,
                    self.device, self.trainer.train_count)
        self.request_publish()  # actors act with this trainer's weights from the start
        next_publish = time.monotonic() + opts.publish_interval
        end_reason: str | None = None
        try:
            while not self.stop.is_set():
                end_reason = self._limit_reached()
                if end_reason:
                    break
                stats = self.trainer.train()
                if stats is None:
                    self.data_arrived.wait(0.05)
                    self.data_arrived.clear()
                else:
                    self.loss = stats.loss
                if time.monotonic() >= next_publish:
                    next_publish = time.monotonic() + opts.publish_interval
                    self.request_publish()
            # final params first, then END: a client that sees END finds them
            if end_reason and not self.stop.is_set() and self.publish_and_wait():
                with_retry(lambda: self.board.end_task("END", end_reason or ""), "ending the task")
                self.stop.set(f"task END: {end_reason}")
        finally:
            self.stop.set(self.stop.reason or "trainer stopping")
            self._wake.set()
            board_thread.join(timeout=opts.heartbeat_interval + 5)
            ingest.join(timeout=10)
            try:
                with self.counters.taken() as deltas:
                    self.board.incr_counters("trainer", **deltas)
                self.board.release_lease("trainer", opts.uid)
            except Exception as e:
                logger.warning("could not report the end of trainer %s: %s", opts.uid, short(e))
        if self.fatal:
            raise RuntimeError(self.fatal)
        return self.stop.reason

    def summary(self) -> str:
        return (f"epoch {self.epoch}, train_count {self.trainer.train_count}, received {self.received_batches} "
                f"batches, {self.bad_messages} bad, {self.duplicates} duplicates")


def _close_quietly(queue: Any) -> None:
    try:
        queue.close()
    except Exception as e:
        logger.debug("closing the queue: %s", e)


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
    opts.run_once = opts.run_once or run_once
    opts.set_default_uid("trainer")
    require_remote(redis_params, "trainer_run_forever")
    board = Board(redis_params.connect(), redis_params.task_name)
    where = f"{redis_params.describe()} task {redis_params.task_name!r}"
    logger.info("trainer %s ready (cuda available: %s); waiting for a task on %s", opts.uid,
                torch.cuda.is_available(), where)
    ttl_ms = int(opts.lease_ttl * 1000)

    def standby(task: TaskSpec) -> str:
        holder = with_retry(lambda: board.lease_holder("trainer"), "reading the trainer lease")[0]
        return f"trainer lease held by {holder}; standing by to take over"

    try:
        serve(
            "trainer", board, where, opts, queue_params,
            claim=lambda task: board.claim_trainer(opts.uid, ttl_ms),
            lease_name=lambda epoch: "trainer",
            standby_note=standby,
            build_run=lambda task, epoch: TrainerRun(board, redis_params, queue_params, task, epoch, opts),
        )
    except KeyboardInterrupt:
        logger.info("trainer %s interrupted; exiting (its lease, if any, is released)", opts.uid)
