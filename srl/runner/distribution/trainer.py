"""``trainer_run_forever``: hold the trainer lease, ingest experience, learn, publish params.

Owns: the trainer process — taking the lease (which increments the epoch that
fences every params write), restoring from the params on the board so
``train_count`` continues after a takeover, ingesting in a background thread
(decode → dedupe → memory → ack: never ack before the batch is in replay),
training on the main thread, publishing params every interval, and ending the
task at its limits with the final params written first. Must never: ack a
batch before it is in memory, or let a bad message stop it.

The loop::

    epoch = claim_trainer()                      # SET NX PX + INCR, atomically
    restore params (epoch, version) from board   # train_count goes on
    start ingest thread: get_many → decode → memory.add → ack_many
    while not done: trainer.train(); every interval: publish_params(epoch, ...)
    publish final params; end_task(END, reason)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from srl.base.env import EnvAdapter
from srl.rl.memories import Memory
from srl.runner.distribution.board import Board
from srl.runner.distribution.codec import Codec, DecodeError
from srl.runner.distribution.node import CounterDeltas, NodeOptions, apply_overrides, require_remote, serve
from srl.runner.distribution.queues import Message, open_queue
from srl.runner.distribution.redis_parameters import RedisParameters
from srl.runner.distribution.retry import TRANSIENT_ERRORS, with_retry
from srl.runner.distribution.task import StopFlag, TaskSpec
from srl.runner.progress import ensure_logging
from srl.runner.runner import seed_everything

logger = logging.getLogger("srl.trainer")


@dataclass
class TrainerOptions(NodeOptions):
    """How a trainer process behaves (the task itself comes from the board)."""

    publish_interval: float = 1.0
    """seconds between params publications to the board"""
    ingest_max_messages: int = 16
    """batches fetched from the queue per round trip"""
    max_message_bytes: int = 256 * 2**20
    """larger messages are refused as oversized"""


class _SeenBatches:
    """Recently ingested (actor, seq) ids, so a redelivered batch is recognised and skipped."""

    def __init__(self, per_actor: int = 4096) -> None:
        self.per_actor = per_actor
        self._seen: dict[str, OrderedDict[int, None]] = {}

    def first_time(self, actor_id: str, seq: int) -> bool:
        seen = self._seen.setdefault(actor_id, OrderedDict())
        if seq in seen:
            return False
        seen[seq] = None
        if len(seen) > self.per_actor:
            seen.popitem(last=False)
        return True


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
        self.codec = Codec(secret=options.secret, max_bytes=options.max_message_bytes)
        config = task.rl_config
        torch.set_num_threads(max(1, config.torch_threads))
        seed_everything(config.seed)
        env = EnvAdapter(task.env_config, config.algorithm, config.action_bins)
        self.spec = env.spec
        env.close()
        self.device = config.resolve_device()
        self.parameter = config.make_parameter(self.spec, self.device)
        self.memory: Memory = config.make_memory()
        self.trainer = config.make_trainer(self.spec, self.parameter, self.memory)
        self.queue_params = queue_params
        self.redis_params = redis_params
        self.data_arrived = threading.Event()
        self.seen = _SeenBatches()
        self.counters = CounterDeltas()
        self.received_batches = 0
        self.received_transitions = 0
        self.bad_messages = 0
        self.duplicates = 0
        self.last_bad = ""
        self._bad_reported = 0
        self.queue_depth: int | None = None
        self.env_steps_total = 0
        self.loss: float | None = None
        self.task_started_at: float | None = None

    # ------------------------------------------------------------ restore
    def restore(self) -> None:
        """Continue from the params on the board (a takeover or a restart)."""
        got = self.board.get_params()
        if got is None:
            logger.info("no params on the board: starting from fresh weights")
            return
        epoch, version, train_count, blob = got
        try:
            _, arrays = self.codec.decode_params(blob)
            self.parameter.from_arrays(arrays)
        except (DecodeError, ValueError) as e:
            logger.error("params on the board (epoch %d, version %d) cannot be restored: %s; starting fresh",
                         epoch, version, e)
            return
        self.parameter.version = version
        self.trainer.train_count = train_count
        sync = getattr(self.trainer, "sync_target", None)
        if callable(sync):
            sync()
        logger.info("restored params epoch %d version %d: train_count continues from %d", epoch, version, train_count)

    # ------------------------------------------------------------ ingest thread
    def _ingest_loop(self) -> None:
        opts = self.options
        queue = None
        try:
            queue = open_queue(self.queue_params, namespace=self.redis_params.task_name, role="consumer",
                               redis_params=self.redis_params, consumer_name=opts.uid)
            while not self.stop.is_set():
                messages = queue.get_many(opts.ingest_max_messages, timeout=0.2)
                if not messages:
                    continue
                counts = self._ingest(messages)
                queue.ack_many(messages)
                self.data_arrived.set()
                if queue.reports_depth:
                    self.counters.add(**counts)
                else:  # actors read the queue depth from these counters: write them now
                    with_retry(functools.partial(self.board.incr_counters, "trainer", **counts),
                               "counting received batches")
        except Exception as e:
            logger.exception("ingest thread failed")
            self.stop.set(f"ingest failed: {e}")
        finally:
            if queue is not None:
                queue.close()

    def _ingest(self, messages: list[Message]) -> dict[str, float]:
        """Decode, dedupe and add to memory; the counts for the board."""
        received = transitions = bad = dups = 0
        for message in messages:
            try:
                header, columns, priorities = self.codec.decode_batch(message.data)
            except DecodeError as e:
                bad += 1
                logger.warning("skipped a bad message from %s: %s", message.source, e)
                self.last_bad = f"{message.source}: {e}"
                continue
            if not self.seen.first_time(header.actor_id, header.seq):
                dups += 1
                continue
            try:
                self.memory.add(columns, priorities)
            except ValueError as e:
                bad += 1
                logger.warning("skipped a batch from %s (actor %s seq %d) that does not fit the memory: %s",
                               message.source, header.actor_id, header.seq, e)
                continue
            received += 1
            transitions += header.count
        self.received_batches += received
        self.received_transitions += transitions
        self.bad_messages += bad
        self.duplicates += dups
        return {"received_batches": received, "received_transitions": transitions, "bad_messages": bad,
                "duplicates": dups}

    # ------------------------------------------------------------ board thread
    def _board_loop(self) -> None:
        opts = self.options
        last_train, last_recv, last_time = self.trainer.train_count, 0, time.monotonic()
        while not self.stop.is_set():
            try:
                now = time.monotonic()
                dt = max(now - last_time, 1e-9)
                train_count = self.trainer.train_count
                stats = {
                    "uid": opts.uid,
                    "epoch": self.epoch,
                    "train_count": train_count,
                    "train_per_s": round((train_count - last_train) / dt, 1),
                    "received_per_s": round((self.received_transitions - last_recv) / dt, 1),
                    "memory": len(self.memory),
                    "received_batches": self.received_batches,
                    "bad_messages": self.bad_messages,
                    "duplicates": self.duplicates,
                    "params_version": self.parameter.version,
                    "loss": "" if self.loss is None else round(self.loss, 6),
                    "device": str(self.device),
                }
                last_train, last_recv, last_time = train_count, self.received_transitions, now
                if self.bad_messages > self._bad_reported:  # one event per heartbeat, not one per message
                    self.board.log_event(f"{self.bad_messages - self._bad_reported} bad message(s) skipped; "
                                         f"last from {self.last_bad}", level="WARNING", source=opts.uid)
                    self._bad_reported = self.bad_messages
                with self.counters.taken() as deltas:
                    hb = self.board.heartbeat("trainer", opts.uid, int(opts.lease_ttl * 1000), "trainer", stats, deltas)
                if not hb.lease_held:
                    self.stop.set("lost the trainer lease (another trainer took over, or this one was paused)")
                    break
                if hb.task_status is None:
                    self.stop.set("the task vanished from the board")
                    break
                if hb.task_status != "ACTIVE":
                    status = self.board.get_status()
                    reason = status.end_reason if status is not None else ""
                    self.stop.set(f"task {hb.task_status.value}: {reason or 'no reason given'}")
                    break
                counters = self.board.get_counters()
                self.env_steps_total = int(counters.get("env_steps", 0))
            except Exception as e:
                if not isinstance(e, TRANSIENT_ERRORS):
                    logger.exception("trainer board thread failed")
                    self.stop.set(f"board thread failed: {e}")
                    break
                logger.warning("board unreachable (%s); retrying", e)
            self.stop.wait(opts.heartbeat_interval)

    # ------------------------------------------------------------ publishing
    def publish(self) -> bool:
        blob = self.codec.encode_params(
            self.parameter.to_arrays(),
            {"epoch": self.epoch, "version": self.parameter.version, "train_count": self.trainer.train_count,
             "algorithm": self.task.rl_config.algorithm},
        )
        ok = with_retry(
            lambda: self.board.publish_params(self.options.uid, self.epoch, self.parameter.version, blob,
                                              self.trainer.train_count),
            "publishing params",
        )
        if not ok:
            self.stop.set(f"params write refused: epoch {self.epoch} is fenced off by a newer trainer")
            with contextlib.suppress(*TRANSIENT_ERRORS):
                self.board.log_event(f"params write of epoch {self.epoch} refused (fenced)", level="WARNING",
                                     source=self.options.uid)
        return ok

    def _limit_reached(self) -> str | None:
        task = self.task
        if task.max_train_count is not None and self.trainer.train_count >= task.max_train_count:
            return f"max_train_count {task.max_train_count} reached"
        if task.max_steps is not None and self.env_steps_total >= task.max_steps:
            return f"max_steps {task.max_steps} reached"
        if task.timeout is not None and self.task_started_at is not None:
            if time.time() - self.task_started_at >= task.timeout:
                return f"timeout {task.timeout:g}s reached"
        return None

    # ------------------------------------------------------------ the loop
    def run(self) -> str:
        opts = self.options
        status = self.board.get_status()
        self.task_started_at = status.started_at if status is not None else None
        self.restore()
        ingest = threading.Thread(target=self._ingest_loop, name="srl-trainer-ingest", daemon=True)
        board_thread = threading.Thread(target=self._board_loop, name="srl-trainer-board", daemon=True)
        ingest.start()
        board_thread.start()
        logger.info("trainer %s holds the lease at epoch %d on %s; train_count %d", opts.uid, self.epoch,
                    self.device, self.trainer.train_count)
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
                    self.publish()
            if end_reason and not self.stop.is_set():
                # final params first, then END: a client that sees END finds them
                if self.publish():
                    with_retry(lambda: self.board.end_task("END", end_reason or ""), "ending the task")
                    self.stop.set(f"task END: {end_reason}")
        finally:
            self.stop.set(self.stop.reason or "trainer stopping")
            board_thread.join(timeout=opts.heartbeat_interval + 5)
            ingest.join(timeout=10)
            try:
                with self.counters.taken() as deltas:
                    self.board.incr_counters("trainer", **deltas)
                self.board.release_lease("trainer", opts.uid)
            except Exception as e:
                logger.warning("could not report the end of trainer %s: %s", opts.uid, e)
        return self.stop.reason

    def summary(self) -> str:
        return (f"epoch {self.epoch}, train_count {self.trainer.train_count}, received {self.received_batches} "
                f"batches, {self.bad_messages} bad, {self.duplicates} duplicates")


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
    try:
        serve(
            "trainer", board, where, opts, queue_params,
            claim=lambda task: board.claim_trainer(opts.uid, ttl_ms),
            lease_name=lambda epoch: "trainer",
            standby_note=lambda task: f"trainer lease held by {board.lease_holder('trainer')[0]}; "
                                      "standing by to take over",
            build_run=lambda task, epoch: TrainerRun(board, redis_params, queue_params, task, epoch, opts),
        )
    except KeyboardInterrupt:
        logger.info("trainer %s interrupted; exiting (its lease, if any, is released)", opts.uid)
