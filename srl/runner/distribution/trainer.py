"""``trainer_run_forever``: hold the trainer lease, ingest experience, learn, publish params.

Owns: the trainer process — taking the lease (which increments the epoch that
fences every params write), restoring from the params on the board so
``train_count`` continues after a takeover, ingesting in a background thread
(decode against the algorithm's schema → dedupe → the data path's version
policy → buffer → ack: never ack before the rows are in the buffer), training
on the main thread, publishing params from the board thread, and ending the
task at its limits with the final params written first. It follows the
algorithm's ``DataPath`` and never branches on the algorithm. Must never: ack
a batch before it is in the buffer, let one message stop it (whatever a
message does, it is counted, noted with its source, acked and skipped), or
give up on a board that is away for a while.

The loop::

    epoch = claim_trainer()                      # SET NX PX + INCR, atomically
    restore params (epoch, version) from board   # train_count goes on
    ingest thread: get_many → decode(schema) → dedupe → version policy → buffer.add → ack_many
                   (a full buffer is not read into: the queue fills and actors wait)
    board thread:  heartbeat (renew lease, stats) · publish the latest params blob
    main thread:   while not done:
                       sync: once every actor's segments of this version are in → train → publish
                       else: train; publish every ``publish_every`` train steps
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
import math
import os
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from srl.base.env import allowed_env_modules, env_spec
from srl.base.rl import Buffer, Columns
from srl.base.schema import Schema
from srl.runner.distribution.board import Board, BoardError, DeadLetter
from srl.runner.distribution.codec import (
    BatchFrame,
    DecodeError,
    batch_message_bytes,
    join_frames,
    params_message_bytes,
    short,
)
from srl.runner.distribution.node import (
    CounterDeltas,
    apply_overrides,
    lease_kept,
    require_remote,
    serve,
)
from srl.runner.distribution.options import TrainerOptions
from srl.runner.distribution.queues import ExperienceQueue, Message, QueueError, open_queue
from srl.runner.distribution.redis_parameters import RedisParameters
from srl.runner.distribution.retry import TRANSIENT_ERRORS, Throttle, with_retry
from srl.runner.distribution.task import StopFlag, TaskConfigError, TaskSpec, max_message_rows
from srl.runner.progress import ensure_logging
from srl.runner.run_log import write_checkpoint
from srl.runner.runner import build_checkpoint, seed_everything, split_checkpoint, task_config

Opened = tuple[Message, BatchFrame]
"""a batch message taken from the queue, and its checked frame (arrays not made yet)"""
Block = tuple[list[Opened], Columns, "np.ndarray | None"]
"""valid batches and their rows as one block (columns, priorities)"""

logger = logging.getLogger("srl.trainer")

_BOARD_AWAY: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, BoardError)
_WAIT_OUT: tuple[type[BaseException], ...] = (*_BOARD_AWAY, QueueError)

MAX_INITIAL_PRIORITY = 1e6
"""initial priorities from actors are clipped here (one huge value would starve every other row)"""


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


class PolicyLag:
    """How old the params were that accepted rows were acted with, in versions and in train steps.

    The trainer notes the train count of each version it publishes; a row of version v that
    arrives when the latest version is V is ``V - v`` versions and ``train_count(V) -
    train_count(v)`` train steps behind. Kept for the last ``window`` rows (Sample Factory's
    ``version_diff``).
    """

    def __init__(self, window: int = 4096, versions_kept: int = 100_000) -> None:
        self.window = window
        self._runs: deque[tuple[int, int, int]] = deque()  # (versions behind, steps behind or -1, rows)
        self._rows = 0  # rows in _runs: under window + the oldest run's rows
        self._train_at: OrderedDict[int, int] = OrderedDict()
        self._kept = versions_kept

    def published(self, version: int, train_count: int) -> None:
        self._train_at[version] = train_count
        while len(self._train_at) > self._kept:
            self._train_at.popitem(last=False)

    def note(self, versions: np.ndarray, current: int) -> None:
        """Note rows acted with ``versions`` arriving when the latest version is ``current`` (one run
        per version, not one entry per row: a read brings thousands of rows of a few versions)."""
        if versions.size == 0:
            return
        first = int(versions[0])
        if (versions == first).all():  # the common case: one version in a read
            runs: Any = ((first, versions.size),)
        else:
            runs = zip(*np.unique(versions, return_counts=True), strict=True)
        now = self._train_at.get(current)
        for version, count in runs:
            behind = max(0, current - int(version))
            then = self._train_at.get(int(version))
            steps = -1 if now is None or then is None else max(0, now - then)
            self._runs.append((behind, steps, int(count)))
            self._rows += int(count)
        while self._runs and self._rows - self._runs[0][2] >= self.window:  # runs wholly out of the window
            self._rows -= self._runs.popleft()[2]

    def summary(self) -> dict[str, float]:
        """p50/p95/max of the lag of the last ``window`` rows, in versions (``lag_*``) and train steps
        (``lag_steps_*``)."""
        out: dict[str, float] = {}
        if not self._runs:
            return out
        behind, steps, counts = (np.array(column, dtype=np.int64) for column in zip(*self._runs, strict=True))
        for name, values in (("lag", behind), ("lag_steps", steps)):
            rows = np.repeat(values, counts)[-self.window:]
            known = rows[rows >= 0]
            if known.size:
                out[f"{name}_p50"] = float(np.percentile(known, 50))
                out[f"{name}_p95"] = float(np.percentile(known, 95))
                out[f"{name}_max"] = float(known.max())
        return out


class StoppedWhileWaiting(Exception):
    """The run stopped while a read's rows waited for room in the buffer: the read is not acked."""


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
        self.data_path = config.data_path()
        torch.set_num_threads(max(1, config.torch_threads))
        seed_everything(config.seed)
        self.spec = env_spec(task.env_config, allowed_env_modules(options.allow_env_modules))
        config.check_spec(self.spec)
        self.schema: Schema = config.schema(self.spec)
        self.max_message_rows = max_message_rows(task)
        self.device = config.resolve_device()
        self.parameter = config.make_parameter(self.spec, self.device)
        params_bytes = params_message_bytes(self.parameter.to_arrays())
        self.codec = options.codec(
            board.task_name, max_bytes=max(batch_message_bytes(self.schema, self.max_message_rows), params_bytes)
        )
        self.max_params_bytes = params_bytes
        self.buffer: Buffer = config.make_buffer(self.spec, task.actor_num)
        self._check_memory_fits(self.buffer.nbytes)  # the arrays are reserved, not yet touched
        self.trainer = config.make_trainer(self.spec, self.parameter, self.buffer, task.actor_num)
        self.queue_params = queue_params
        self.redis_params = redis_params
        self.data_arrived = threading.Event()
        self.seen = SeenBatches()
        self.lag = PolicyLag()
        self.counters = CounterDeltas()
        self._uncounted = 0  # batches received over a queue without depth, not yet counted on the board
        self._counted_at = -math.inf
        # actors stop at queue_capacity batches in flight: counting every half of it keeps them going
        self._count_every = max(1, task.queue_capacity // 2)
        self.received_batches = 0
        self.received_transitions = 0
        self.bad_messages = 0
        self.duplicates = 0
        self.stale_rows = 0
        self.last_bad = ""
        self._bad_reported = 0
        self._dead_letters: deque[DeadLetter] = deque(maxlen=100)
        self._bad_log = Throttle(options.heartbeat_interval)
        self._queue_log = Throttle()
        self._board_log = Throttle()
        self.env_steps_total = 0
        self.last_stats: dict[str, float] = {}
        self._last_rates = (0.0, 0.0)  # train steps/s, rows received/s at the last heartbeat
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
        # sync: which actor slots delivered segments of the current version, and since when we wait
        self._version_lock = threading.Lock()
        self._arrivals: dict[int, int] = {}
        self._waiting_since: float | None = None
        self.waiting_for: list[int] = []
        self._last_publish = 0.0
        self._next_publish = 0
        self.resumed = self._resume()

    def _check_memory_fits(self, needed: int) -> None:
        limit = self.options.max_buffer_bytes or int(0.75 * machine_memory_bytes())
        if limit and needed > limit:
            raise MemoryError(
                f"the task's buffer needs {needed / 2**30:.2f} GiB ({self.schema.row_nbytes} bytes per row); this "
                f"trainer allows {limit / 2**30:.2f} GiB (--max-buffer-bytes); make the buffer smaller "
                "(e.g. memory.capacity)"
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
            if not self.resumed:
                logger.info("no params on the board: starting from fresh weights")
            return
        try:
            _, arrays = self.codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
            self.parameter.from_arrays(arrays)
        except (DecodeError, ValueError) as e:
            logger.error("params on the board (epoch %d, version %d) cannot be restored: %s; starting fresh",
                         record.epoch, record.version, short(e))
            # fresh weights, but the version numbering goes on: actors only ever move forward
            self.version = self._published_version = self.parameter.version = record.version
            return
        self.version = record.version
        self._published_version = record.version
        self.parameter.version = record.version
        self.trainer.train_count = record.train_count
        self.lag.published(record.version, record.train_count)
        self.trainer.on_parameters_loaded()
        logger.info("trainer at epoch %d restored the params of epoch %d version %d: train_count continues from %d",
                    self.epoch, record.epoch, record.version, record.train_count)

    def _resume(self) -> bool:
        """A new task (no params yet): start from the checkpoint the client put on the board, if any.
        Treated as hostile: bounded, signed when a secret is set, every array checked against this
        network and optimizer; one that does not fit is a TaskConfigError (the task ends FAILED)."""
        if with_retry(self.board.get_params_version, "reading the params version") is not None:
            return False  # a takeover: restore() continues from the board's params
        bound = 8 * self.max_params_bytes + (1 << 20)  # weights, a target net, two optimizer moments, meta
        try:
            blob = with_retry(lambda: self.board.get_resume(bound), "reading the checkpoint to resume from")
        except BoardError as e:
            raise TaskConfigError(f"the checkpoint to resume from cannot be used: {short(e)}") from None
        if blob is None:
            return False
        try:
            meta, arrays = self.codec.with_max_bytes(bound).decode_params(blob)
            checkpoint = meta.get("checkpoint")
            if not isinstance(checkpoint, dict):
                raise DecodeError("the resume message carries no checkpoint meta")
            weights, state = split_checkpoint(checkpoint, arrays, self.task.rl_config, "the resume blob")
            self.parameter.from_arrays(weights)
            self.trainer.on_parameters_loaded()
            if state is not None:
                self.trainer.load_state_arrays(*state)
        except (DecodeError, ValueError, KeyError, TypeError) as e:
            raise TaskConfigError(f"the checkpoint to resume from does not fit this task: {short(e)}") from None
        self.trainer.train_count = int(checkpoint["train_count"])
        self.version = self._published_version = self.parameter.version = int(checkpoint["version"])
        self.lag.published(self.version, self.trainer.train_count)
        logger.info("resumed from a checkpoint: version %d, train_count %d, env steps %d%s", self.version,
                    self.trainer.train_count, checkpoint["env_steps"],
                    "" if state is not None else " (weights only: the optimizer starts fresh)")
        return True

    # ------------------------------------------------------------ checkpoints
    def checkpoint(self) -> Path | None:
        """Write a checkpoint under ``checkpoint_dir/<task>/`` (None when no directory is set)."""
        opts = self.options
        if not opts.checkpoint_dir:
            return None
        task = self.task
        arrays, meta = build_checkpoint(self.parameter, self.trainer, task_config(task.rl_config, task.env_config),
                                        self.trainer.train_count, self.env_steps_total, 0)
        directory = Path(opts.checkpoint_dir) / self.board.task_name
        try:
            path = write_checkpoint(directory, self.trainer.train_count, arrays, meta, opts.keep_checkpoints)
        except OSError as e:  # a full disk must not stop training
            logger.error("could not write a checkpoint in %s: %s", directory, e)
            return None
        logger.info("checkpoint %s (train_count %d)", path, self.trainer.train_count)
        return path

    # ------------------------------------------------------------ ingest thread
    def open_consumer(self) -> ExperienceQueue:
        """The task's experience queue, opened as this trainer's consumer."""
        return open_queue(self.queue_params, namespace=self.redis_params.task_name, role="consumer",
                          redis_params=self.redis_params, consumer_name=self.options.uid,
                          max_read_bytes=self.codec.max_bytes, prefetch=self.options.prefetch)

    def ingest_once(self, queue: ExperienceQueue) -> int:
        """One step of the ingest path: read what the buffer has room for, decode, validate, insert, then
        ack; the number of messages read (0 when none came within the read timeout or there is no room)."""
        room = self.buffer.room()
        count = self.options.ingest_max_messages
        if room is not None:  # a full buffer is not read into: the queue fills, actors wait
            count = min(count, room // self.max_message_rows)
            if count < 1:
                queue.send_acks()  # the next read may be a while: actors see the room they made
                self._count_on_board(now=True)
                self.stop.wait(0.005)
                return 0
        # with counts not yet on the board, wait as little as the backend can (MQTT only looks; a Pub/Sub
        # pull waits 0.1 s at least): a dry queue gets them written before the long wait
        messages = queue.get_many(count, timeout=0.0 if self._uncounted else 0.2)
        if not messages:
            self._count_on_board(now=True)
            return 0
        counts = self._ingest(messages)
        queue.ack_many(messages)  # after every message is in the buffer (or refused)
        self.data_arrived.set()
        self.counters.add(**counts)
        if not queue.reports_depth:  # actors read the queue's depth from these counts
            self._uncounted += len(messages)
            self._count_on_board(now=self._uncounted >= self._count_every)
        return len(messages)

    def _count_on_board(self, *, now: bool) -> None:
        """Write what was received to the board, if the queue's depth is read from it: ``now`` (the
        queue is dry, the buffer is full, or half the queue's capacity was taken since the last write,
        so actors held back by it see room), or once ``count_interval`` has passed since the last write
        (the heartbeat writes them too). A write per read costs a board round trip per message where
        messages come one at a time and the queue never runs dry."""
        if not self._uncounted:
            return
        if not now and time.monotonic() - self._counted_at < self.options.count_interval:
            return
        with self.counters.taken() as deltas:
            with_retry(lambda: self.board.incr_counters("trainer", **deltas),
                       "counting received batches", should_stop=self.stop.is_set)
        self._uncounted = 0
        self._counted_at = time.monotonic()

    def _ingest_loop(self) -> None:
        queue = None
        delay = 0.1
        try:
            while not self.stop.is_set():
                try:
                    if queue is None:
                        queue = self.open_consumer()
                    self.ingest_once(queue)
                    delay = 0.1
                except StoppedWhileWaiting:
                    break
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
        """Decode, dedupe, validate, apply the version policy and add to the buffer; the counts for the
        board. Never raises for a message.

        Each message is opened (frame, signature, head, sizes) and deduplicated alone; the good ones'
        rows are then made as one block per layout, checked against the schema, filtered and added
        (one array per column, one validation and one buffer insert per read instead of per message:
        per-call costs dominate small batches). Should a block fail its check, each message is
        checked alone, so only the bad one is refused.
        """
        bad = dups = 0
        opened: list[Opened] = []
        taking: set[tuple[str, int]] = set()  # (sender, seq) in this read: a copy of one is a duplicate
        for message in messages:
            try:
                if message.refused:
                    raise DecodeError(message.refused)
                frame = self.codec.open_batch(message.data)
                header = frame.header
                if header.count > self.max_message_rows:
                    raise DecodeError(f"batch of {header.count} rows; a message of this task carries at most "
                                      f"{self.max_message_rows}")
                key = (header.actor_id, header.seq)
                if key in taking or not self.seen.is_new(*key):
                    dups += 1
                    continue
                taking.add(key)
                opened.append((message, frame))
            except Exception as e:  # whatever one message causes stays that message's problem
                bad += 1
                self._note_bad(message, e)
        blocks, unfit = self._valid_blocks(opened)
        bad += unfit
        received = rows = stale = 0
        for block, columns, priorities in blocks:
            try:
                kept, refused = self._accept_and_add(block, columns, priorities)
            except StoppedWhileWaiting:
                raise
            except Exception as e:  # not a message's fault (they passed every check): count them all bad
                bad += len(block)
                for message, _ in block:
                    self._note_bad(message, e)
                continue
            for _, frame in block:
                self.seen.mark(frame.header.actor_id, frame.header.seq)
            received += len(block)
            rows += kept
            stale += refused
        self.received_batches += received
        self.received_transitions += rows
        self.bad_messages += bad
        self.duplicates += dups
        self.stale_rows += stale
        return {"received_batches": received, "received_transitions": rows, "bad_messages": bad,
                "duplicates": dups, "stale_rows": stale}

    def _valid_blocks(self, opened: list[Opened]) -> tuple[list[Block], int]:
        """The opened batches that fit the algorithm's schema as blocks of rows (one per layout: the
        columns and whether priorities come), each made in one copy per column; and how many did not
        fit (noted as bad)."""
        groups: dict[bytes, list[Opened]] = {}
        for item in opened:
            groups.setdefault(item[1].layout, []).append(item)
        blocks: list[Block] = []
        unfit = 0
        for group in groups.values():
            try:
                columns, priorities = join_frames([frame for _, frame in group])
                fits = self.schema.problem(columns, priorities) is None
            except ValueError:  # DecodeError: shapes numpy cannot make
                fits = False
            if not fits:  # each alone: refuse only the ones that do not fit
                fitting = []
                for message, frame in group:
                    try:
                        frame.arrays(self.schema)
                    except DecodeError as e:
                        unfit += 1
                        self._note_bad(message, e)
                        continue
                    fitting.append((message, frame))
                if not fitting:
                    continue
                group = fitting
                columns, priorities = join_frames([frame for _, frame in group])
            blocks.append((group, columns, priorities))
        return blocks, unfit

    def _accept_and_add(self, block: list[Opened], columns: Columns, priorities: np.ndarray | None) -> tuple[int, int]:
        """Apply the version policy to a block of valid batches and add what it keeps; (rows kept, rows
        refused)."""
        if priorities is not None:
            priorities = np.minimum(priorities, MAX_INITIAL_PRIORITY)
        with self._version_lock:  # the version cannot move between the check and the add
            keep = self._keep(columns["version"])
            if keep is not None:
                columns = {name: column[keep] for name, column in columns.items()}
                priorities = None if priorities is None else priorities[keep]
            self.lag.note(columns["version"], self.version)
            kept = len(columns["version"])
            if kept:
                self._add_when_room(columns, priorities)
                start = 0
                for _, frame in block:  # who delivered rows of this version (the sync wait)
                    header = frame.header
                    n = header.count if keep is None else int(keep[start:start + header.count].sum())
                    start += header.count
                    if n:
                        self._arrivals[header.actor_index] = self._arrivals.get(header.actor_index, 0) + n
        return kept, 0 if keep is None else len(keep) - kept

    def _keep(self, versions: np.ndarray) -> np.ndarray | None:
        """Which rows the data path accepts at the current version (None: all of them)."""
        path = self.data_path
        if path.sync:
            keep = versions == self.version
        elif path.max_policy_lag is not None:
            keep = (versions <= self.version) & (self.version - versions <= path.max_policy_lag)
        else:  # any age, but never a version not yet published (a forged or confused sender)
            keep = versions <= self.version
        return None if keep.all() else keep

    def _add_when_room(self, columns: Columns, priorities: np.ndarray | None) -> None:
        n = len(columns["version"])
        while (room := self.buffer.room()) is not None and room < n:
            if self.stop.is_set():  # the read's messages stay unacked: delivered again, not lost
                raise StoppedWhileWaiting(f"the run stopped with {n} rows waiting for room in the buffer")
            self.stop.wait(0.005)  # the trainer is taking rows out; we hold the message meanwhile
        self.buffer.add(columns, priorities)

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
                    self._last_rates = ((train_count - last_train) / dt, (self.received_transitions - last_recv) / dt)
                    stats = self._stats(*self._last_rates)
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
            "memory": len(self.buffer),
            "received_batches": self.received_batches,
            "bad_messages": self.bad_messages,
            "duplicates": self.duplicates,
            "stale_rows": self.stale_rows,
            "params_version": self.version,
            "waiting_for": ",".join(str(i) for i in self.waiting_for),
            "device": str(self.device),
            **{k: round(v, 6) for k, v in self.last_stats.items()},
            **{k: round(v, 2) for k, v in self.lag.summary().items()},
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
                    f"board); buffer ({len(self.buffer)} rows) and train_count {self.trainer.train_count} kept")
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
        """Make the current weights the next params version and hand them to the board thread."""
        self.version += 1
        self.parameter.version = self.version
        self.lag.published(self.version, self.trainer.train_count)
        self._arrivals = {}
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
    def _sync_ready(self) -> bool:
        """Sync: every actor's segments of this version are in, or ``sync_wait_s`` passed with at least
        ``min_segments`` (then the log says which actors it goes on without)."""
        path = self.data_path
        needed = self.task.actor_num * self.task.rl_config.envs_per_actor
        have = len(self.buffer)
        if have >= needed:
            self.waiting_for = []
            return True
        if have == 0:
            self._waiting_since = None
            return False
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        self.waiting_for = [i for i in range(self.task.actor_num) if i not in self._arrivals]
        if have >= path.min_segments and now - self._waiting_since >= path.sync_wait_s:
            logger.warning("version %d: going on with %d of %d segments after %.0fs; no segments from actor slot(s) "
                           "%s", self.version, have, needed, now - self._waiting_since, self.waiting_for)
            return True
        return False

    def _update(self) -> bool:
        """One update on the main thread (False: not enough data yet); publishes as the data path says."""
        path = self.data_path
        if path.sync:
            if not self._sync_ready():
                return False
            with self._version_lock:  # no row of the old version slips in between training and publishing
                stats = self.trainer.train()
                if stats is not None:
                    self.request_publish()
                    self._waiting_since = None
        else:
            stats = self.trainer.train()
            if stats is not None and self._publish_due():
                self.request_publish()
        if stats is None:
            return False
        self.last_stats = {k: v for k, v in stats.scalars().items() if k != "gradient_steps"}
        return True

    def _publish_due(self) -> bool:
        every = self.data_path.publish_every
        now = time.monotonic()
        if now - self._last_publish < self.options.min_publish_interval:
            return False
        if every == 0 or self.trainer.train_count >= self._next_publish:
            self._next_publish = (self.trainer.train_count // max(1, every) + 1) * max(1, every)
            self._last_publish = now
            return True
        return False

    def run(self) -> str:
        opts = self.options
        # params of hundreds of MB over a slow link can outlast the TTL: the lease is kept until heartbeats start
        with lease_kept(self.board, "trainer", opts.uid, opts.lease_ttl, opts.heartbeat_interval, opts.max_start_s):
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
        self.trainer.plan(self.task.max_steps, self.task.max_train_count)
        self.request_publish()  # actors act with this trainer's weights from the start
        self._last_publish = time.monotonic()
        every = max(1, self.data_path.publish_every)
        self._next_publish = (self.trainer.train_count // every + 1) * every
        end_reason: str | None = None
        next_checkpoint = time.monotonic() + opts.checkpoint_interval
        try:
            while not self.stop.is_set():
                end_reason = self._limit_reached()
                if end_reason:
                    break
                if not self._update():
                    self.data_arrived.wait(0.05)
                    self.data_arrived.clear()
                if opts.checkpoint_dir and time.monotonic() >= next_checkpoint:
                    self.checkpoint()
                    next_checkpoint = time.monotonic() + opts.checkpoint_interval
            self.checkpoint()  # whatever ended the task, keep where it got to
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
                with self.counters.taken() as deltas:  # a last heartbeat: counters and stats in one round trip
                    self.board.heartbeat("trainer", opts.uid, int(opts.lease_ttl * 1000), "trainer",
                                         self._stats(*self._last_rates), deltas)
                self.board.release_lease("trainer", opts.uid)
            except Exception as e:
                logger.warning("could not report the end of trainer %s: %s", opts.uid, short(e))
        if self.fatal:
            raise RuntimeError(self.fatal)
        return self.stop.reason

    def summary(self) -> str:
        return (f"epoch {self.epoch}, train_count {self.trainer.train_count}, received {self.received_batches} "
                f"batches, {self.bad_messages} bad, {self.duplicates} duplicates, {self.stale_rows} stale rows")


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
