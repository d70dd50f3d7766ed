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

import contextlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from srl.base.checkpoint import build_checkpoint, checkpoint_memory, split_checkpoint, task_config
from srl.base.env import allowed_env_modules, env_spec
from srl.base.rl import Buffer, Columns, DataPath, seed_everything
from srl.base.schema import Schema
from srl.runner.distribution.board import Board, BoardError, DeadLetter
from srl.runner.distribution.codec import (
    MAX_CHECKPOINT_MEMORY_BYTES,
    BatchFrame,
    DecodeError,
    batch_message_bytes,
    checkpoint_message_bytes,
    join_frames,
    params_message_bytes,
    short,
    task_tag,
)
from srl.runner.distribution.credentials import CredentialsError
from srl.runner.distribution.node import (
    CounterDeltas,
    apply_overrides,
    lease_kept,
    remove_orphans,
    require_remote,
    serve,
)
from srl.runner.distribution.options import TrainerOptions
from srl.runner.distribution.queues import ExperienceQueue, Message, QueueError, check_queue, open_queue
from srl.runner.distribution.redis_parameters import RedisParameters
from srl.runner.distribution.retry import TRANSIENT_ERRORS, BoardUnreachableError, Throttle, with_retry
from srl.runner.distribution.stats import TrainerStats
from srl.runner.distribution.task import (
    TASK_GONE,
    TASK_REPLACED,
    StopFlag,
    TaskConfigError,
    TaskSpec,
    max_message_rows,
)
from srl.runner.progress import ensure_logging
from srl.runner.run_log import write_checkpoint

Opened = tuple[Message, BatchFrame]
"""a batch message taken from the queue, and its checked frame (arrays not made yet)"""
Block = tuple[list[Opened], Columns, "np.ndarray | None"]
"""valid batches and their rows as one block (columns, priorities)"""

logger = logging.getLogger("srl.trainer")

_BOARD_AWAY: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, BoardError)
_BOARD_AWAY_OR_TOO_BIG: tuple[type[BaseException], ...] = (*_BOARD_AWAY, ValueError)  # ValueError: over a bound
_WAIT_OUT: tuple[type[BaseException], ...] = (*_BOARD_AWAY, QueueError)

MAX_INITIAL_PRIORITY = 1e6
"""initial priorities from actors are clipped here (one huge value would starve every other row)"""
LEDGER_READS = 3
"""reads whose batches a trainer names in its ledger: the one it counts, and the two before, whose acks
may still be on their way to the broker (Redis sends an ack with the next read; AMQP does not wait)"""


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
        self.learner = config.make_learner(self.spec, self.parameter, self.buffer, task.actor_num)
        self.queue_params = queue_params
        self.redis_params = redis_params
        self.data_arrived = threading.Event()
        self.seen = SeenBatches()
        self.lag = PolicyLag()
        self.counters = CounterDeltas()
        # the (actor, seq) of the batches of the last reads, counted on the board before their acks: a
        # trainer that takes over after this one dies counts their redeliveries as duplicates
        self._ledger: deque[list[tuple[str, int]]] = deque(maxlen=LEDGER_READS)
        # a read's count is written in this thread while the ingest reads the next one; acked once written
        self._counter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="srl-trainer-count")
        self._counting: deque[tuple[Future[None], list[Message], ExperienceQueue]] = deque()
        self._rows_base = 0  # rows this run started with in its buffer (a checkpoint's memory)
        self._memory_log = Throttle(3600.0)
        self._train_base = 0  # train_count when this run began
        self.received_batches = 0
        self.received_transitions = 0
        self.bad_messages = 0
        self.duplicates = 0
        self.other_task_batches = 0
        self.stale_rows = 0
        self.task_tag = task_tag(board.task_id)
        self.last_bad = ""
        self._bad_reported = 0
        self._dead_letters: deque[DeadLetter] = deque(maxlen=100)
        self._letters_lock = threading.Lock()
        self._bad_log = Throttle(options.heartbeat_interval)
        self._queue_log = Throttle()
        self._board_log = Throttle()
        self.env_steps_total = 0
        self.last_stats: dict[str, float] = {}
        self._last_rates = (0.0, 0.0)  # train steps/s, rows received/s at the last heartbeat
        self.task_started_at: float | None = None
        self.fatal: str | None = None
        self.refused_by: CredentialsError | None = None  # the queue refused this trainer's login
        self.task_gone = False  # the task vanished from the board (what this run wrote back is removed)
        self.task_replaced = False  # another task of this name replaced it
        self.fenced = False  # another trainer took the lease over
        self.task_ended = False  # the task ended on the board (the client's cancel, a limit): final params go
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
        self._requested = (0, -1)  # (version, train_count) last handed to the board thread
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
            # fresh weights, a version of their own: the numbering goes on (actors only ever move forward)
            self._published_version = record.version
            self.version = self.parameter.version = record.version + 1
            return
        self.version = record.version
        self._published_version = record.version
        self.parameter.version = record.version
        self.learner.train_count = record.train_count
        self.lag.published(record.version, record.train_count)
        self.learner.on_parameters_loaded()
        logger.info("trainer at epoch %d restored the params of epoch %d version %d: train_count continues from %d",
                    self.epoch, record.epoch, record.version, record.train_count)

    def _skip_counted_redeliveries(self) -> None:
        """Batches that trainers before this one counted, and may not have acked before they died, come
        again: mark them seen, so they count as duplicates here, not as received twice."""
        try:
            ledgers = with_retry(self.board.get_ledgers, "reading the trainers' ledgers")
        except BoardError as e:
            logger.warning("the trainers' ledgers cannot be read (%s): batches a dead trainer counted may be "
                           "counted again", short(e))
            return
        marked = 0
        for taken in ledgers.values():  # this process's own earlier run too: this run starts a new SeenBatches
            for actor_id, seq in taken:
                self.seen.mark(actor_id, seq)
                marked += 1
        if marked:
            logger.info("%d batch(es) an earlier trainer counted are taken as duplicates if they come again",
                        marked)

    def _resume(self) -> bool:
        """A new task (no params yet): start from the checkpoint the client put on the board, if any.
        Treated as hostile: bounded, signed when a secret is set, every array checked against this
        network and optimizer; one that does not fit is a TaskConfigError (the task ends FAILED)."""
        if with_retry(self.board.get_params_version, "reading the params version") is not None:
            return False  # a takeover: restore() continues from the board's params
        bound = checkpoint_message_bytes(self.parameter.to_arrays(), with_memory=True)
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
            self.learner.on_parameters_loaded()
            if state is not None:
                self.learner.load_state_arrays(*state)
        except (DecodeError, ValueError, KeyError, TypeError) as e:
            raise TaskConfigError(f"the checkpoint to resume from does not fit this task: {short(e)}") from None
        memory = checkpoint_memory(checkpoint, arrays)
        if memory is not None:
            try:
                self.buffer.load_state_arrays(*memory)
                self._rows_base = len(self.buffer)
                logger.info("the checkpoint's replay memory is back: %d rows", len(self.buffer))
            except (ValueError, TypeError) as e:  # another capacity or columns: the run refills it
                logger.warning("the checkpoint's replay memory does not fit this task (%s); starting with an "
                               "empty one", short(e))
        self.learner.train_count = int(checkpoint["train_count"])
        self.version = self._published_version = self.parameter.version = int(checkpoint["version"])
        self.lag.published(self.version, self.learner.train_count)
        logger.info("resumed from a checkpoint: version %d, train_count %d, env steps %d%s", self.version,
                    self.learner.train_count, checkpoint["env_steps"],
                    "" if state is not None else " (weights only: the optimizer starts fresh)")
        return True

    # ------------------------------------------------------------ checkpoints
    def checkpoint(self, *, local: bool = True, on_board: bool = True) -> Path | None:
        """Keep a checkpoint: under ``checkpoint_dir/<task>/`` when a directory is set (``local``), and on the
        board when the task asks for one (``on_board``: a client with a log_dir keeps it there, wherever this
        trainer runs). The local file's path, or None. Neither a full disk nor a board that is away stops
        training."""
        opts, task = self.options, self.task
        to_dir = local and bool(opts.checkpoint_dir)
        to_board = on_board and task.checkpoint_interval is not None
        if not (to_dir or to_board):
            return None
        memory = self._memory_state() if to_board and task.checkpoint_memory else None
        arrays, meta = build_checkpoint(self.parameter, self.learner, task_config(task.rl_config, task.env_config),
                                        self.learner.train_count, self.env_steps_total, 0, memory=memory)
        path = None
        if to_dir:
            directory = Path(opts.checkpoint_dir) / self.board.task_name
            try:
                path = write_checkpoint(directory, self.learner.train_count, arrays, meta, opts.keep_checkpoints)
                logger.info("checkpoint %s (train_count %d)", path, self.learner.train_count)
            except OSError as e:  # a full disk must not stop training
                logger.error("could not write a checkpoint in %s: %s", directory, e)
        if to_board:
            self._checkpoint_on_board(arrays, meta, memory is not None)
        return path

    def _memory_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """The replay memory for a checkpoint on the board, when it keeps one and it fits the board's bound
        (told before anything is copied)."""
        size = self.buffer.state_nbytes()
        if size is None:
            return None
        if size > MAX_CHECKPOINT_MEMORY_BYTES:
            if self._memory_log.ready():
                logger.warning("the replay memory (%.0f MiB) is over the %d MiB a checkpoint on the board carries: "
                               "checkpoints go without it", size / 2**20, MAX_CHECKPOINT_MEMORY_BYTES >> 20)
            return None
        return self.buffer.state_arrays()

    def _checkpoint_on_board(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], with_memory: bool) -> None:
        codec = self.codec.with_max_bytes(checkpoint_message_bytes(self.parameter.to_arrays(), with_memory))
        try:
            blob = codec.encode_params(arrays, {"epoch": self.epoch, "version": self.version,
                                                "train_count": self.learner.train_count, "checkpoint": meta})
            if self.board.put_checkpoint(self.options.uid, self.epoch, self.learner.train_count, blob):
                logger.info("checkpoint on the board (train_count %d, %.1f MiB)", self.learner.train_count,
                            len(blob) / 2**20)
        except _BOARD_AWAY_OR_TOO_BIG as e:
            logger.error("could not put a checkpoint on the board: %s", short(e))

    # ------------------------------------------------------------ ingest thread
    def open_consumer(self) -> ExperienceQueue:
        """The task's experience queue, opened as this trainer's consumer."""
        return open_queue(self.queue_params, namespace=self.redis_params.task_name, role="consumer",
                          redis_params=self.redis_params, consumer_name=self.options.uid,
                          max_read_bytes=self.codec.max_bytes, prefetch=self.options.prefetch)

    def ingest_once(self, queue: ExperienceQueue) -> int:
        """One step of the ingest path: read what the buffer has room for, decode, validate and insert; the
        read is then counted on the board and acked once counted. The count's round trip overlaps the next
        read: a read is acked when the one after it is in the buffer, or when the queue runs dry. The
        number of messages read (0 when none came within the read timeout or there is no room)."""
        room = self.buffer.room()
        count = self.options.ingest_max_messages
        if room is not None:  # a full buffer is not read into: the queue fills, actors wait
            count = min(count, room // self.max_message_rows)
            if count < 1:
                self.settle_count()
                queue.send_acks()  # the next read may be a while: actors see the room they made
                self.stop.wait(0.005)
                return 0
        # with a read still to ack, only look: a dry queue gets it acked before the long wait
        messages = queue.get_many(count, timeout=0.0 if self._counting else 0.2)
        if not messages:
            self.settle_count()
            return 0
        counts, taken = self._ingest(messages)
        self._counting.append((self._counter.submit(self._count, counts, taken), messages, queue))
        self.data_arrived.set()
        self.settle_count(keep=1)  # the read before: counted while this one was read, acked now
        return len(messages)

    def settle_count(self, keep: int = 0) -> None:
        """Wait for the counts of the reads in flight (all but the newest ``keep``) to be on the board, and
        ack each read once its count is (after every message is in the buffer, or refused, and counted).
        Raises StoppedWhileWaiting, and acks nothing more, when the run stopped before a count was
        written: that read is delivered again."""
        while len(self._counting) > keep:
            future, messages, queue = self._counting[0]
            future.result()
            self._counting.popleft()
            queue.ack_many(messages)

    def _count(self, counts: dict[str, float], taken: list[tuple[str, int]]) -> None:
        """Count a read on the board before it is acked (one round trip), with the ledger of the last reads.
        Killed between the two, this trainer leaves the read counted and named: the next trainer counts its
        redelivery as duplicates. Counted after the ack, a killed trainer would lose the read from the
        counts, which then would not add up. Actors on a queue without a depth (MQTT, Pub/Sub) read it
        from these counts, so they see room as soon as it is made."""
        if counts.get("bad_messages"):  # their notes are on the board by the time the count says they came
            with contextlib.suppress(*_BOARD_AWAY):  # else the next heartbeat writes them
                self._flush_dead_letters()
        self._ledger.append(taken)
        ledger = [key for read in self._ledger for key in read]
        uid = self.options.uid
        while True:
            try:
                answer = with_retry(lambda: self.board.note_received(uid, counts, ledger),
                                    "counting received batches", should_stop=self.stop.is_set)
            except BoardUnreachableError:  # stopping while the board is away
                answer = "not held"
            if answer == "noted":
                return
            if self.stop.is_set():  # the read stays unacked: delivered again, to whoever holds the lease
                raise StoppedWhileWaiting(f"the run stopped before its read of {len(taken)} batches was counted")
            # the lease lapsed (an outage) or the task is another one: the board thread takes the lease back
            # or stops the run
            self.stop.wait(0.05)

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
                except CredentialsError as e:  # the queue (or the board) refused it: this node stops, the task stays
                    logger.error("%s", e)
                    self.refused_by = e
                    self.stop.set(f"refused: {e}")
                    break
                except _WAIT_OUT as e:
                    if self._queue_log.ready():
                        logger.warning("experience queue unavailable (%s); retrying", short(e))
                    if queue is not None:
                        _close_quietly(queue)  # unacked messages come again (counted: as this run's duplicates)
                        queue = None
                    for future, _, _ in self._counting:  # counted or not, their messages come again
                        with contextlib.suppress(Exception):
                            future.result()
                    self._counting.clear()
                    self.stop.wait(delay)
                    delay = min(delay * 2, 2.0)
        except Exception as e:  # a bug, not a message: stop the trainer instead of training on nothing
            logger.exception("ingest thread crashed")
            self.fatal = f"ingest thread crashed: {type(e).__name__}: {short(e)}"
            self.stop.set(self.fatal)
        finally:
            if queue is not None:
                with contextlib.suppress(Exception):  # what was counted is acked; else it comes again
                    self.settle_count()
                _close_quietly(queue)
            self._counting.clear()
            self._counter.shutdown(wait=True)

    def _ingest(self, messages: list[Message]) -> tuple[dict[str, float], list[tuple[str, int]]]:
        """Decode, dedupe, validate, apply the version policy and add to the buffer; the counts for the
        board and the ``(actor, seq)`` of the batches received. Never raises for a message.

        Each message is opened (frame, signature, head, sizes) and deduplicated alone; the good ones'
        rows are then made as one block per layout, checked against the schema, filtered and added
        (one array per column, one validation and one buffer insert per read instead of per message:
        per-call costs dominate small batches). Should a block fail its check, each message is
        checked alone, so only the bad one is refused.
        """
        bad = dups = other_task = 0
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
                if header.task and header.task != self.task_tag:  # the task this one replaced: its actors stop soon
                    other_task += 1
                    continue
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
        taken: list[tuple[str, int]] = []
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
                taken.append((frame.header.actor_id, frame.header.seq))
            received += len(block)
            rows += kept
            stale += refused
        self.received_batches += received
        self.received_transitions += rows
        self.bad_messages += bad
        self.duplicates += dups
        self.stale_rows += stale
        self.other_task_batches += other_task
        return {"received_batches": received, "received_transitions": rows, "bad_messages": bad,
                "duplicates": dups, "stale_rows": stale, "other_task_batches": other_task}, taken

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

    def _flush_dead_letters(self) -> None:
        """Put the notes of refused messages taken since the last flush on the board (kept on failure); the
        count thread and the board thread both do, one at a time."""
        with self._letters_lock:
            letters = [self._dead_letters.popleft() for _ in range(len(self._dead_letters))]
            if letters:
                try:
                    self.board.add_dead_letters(letters)
                except BaseException:
                    self._dead_letters.extendleft(reversed(letters))
                    raise

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
        last_train, last_recv, last_time = self.learner.train_count, 0, time.monotonic()
        next_beat = 0.0
        while not self.stop.is_set():
            try:
                self._flush_publish()
                now = time.monotonic()
                if now >= next_beat:
                    dt = max(now - last_time, 1e-9)
                    train_count = self.learner.train_count
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
            except CredentialsError as e:  # a password rotated, a permission revoked: this node stops, not the task
                logger.error("%s", e)
                self.refused_by = e
                self.stop.set(f"refused: {e}")
                break
            except Exception as e:
                logger.exception("trainer board thread crashed")
                self.fatal = f"board thread crashed: {type(e).__name__}: {short(e)}"
                self.stop.set(self.fatal)
                break
            self._wake.wait(max(0.0, min(next_beat - time.monotonic(), opts.heartbeat_interval)))
            self._wake.clear()

    def _stats(self, train_per_s: float, received_per_s: float) -> dict[str, Any]:
        learner = {k: round(v, 6) for k, v in self.last_stats.items()}
        lag = {k: round(v, 2) for k, v in self.lag.summary().items()}
        return TrainerStats(
            uid=self.options.uid,
            epoch=self.epoch,
            train_count=self.learner.train_count,
            train_per_s=round(train_per_s, 1),
            received_per_s=round(received_per_s, 1),
            memory=len(self.buffer),
            received_batches=self.received_batches,
            bad_messages=self.bad_messages,
            duplicates=self.duplicates,
            stale_rows=self.stale_rows,
            params_version=self.version,
            waiting_for=",".join(str(i) for i in self.waiting_for),
            device=str(self.device),
            loss=learner.pop("loss", None),
            lag_p50=lag.get("lag_p50"), lag_p95=lag.get("lag_p95"), lag_max=lag.get("lag_max"),
            lag_steps_p50=lag.get("lag_steps_p50"), lag_steps_p95=lag.get("lag_steps_p95"),
            lag_steps_max=lag.get("lag_steps_max"),
            extra=learner,
        ).to_record()

    def _heartbeat(self, stats: dict[str, Any]) -> None:
        opts = self.options
        board = self.board
        if self.bad_messages > self._bad_reported:  # one event per heartbeat, not one per message
            board.log_event(f"{self.bad_messages - self._bad_reported} bad message(s) skipped; last from "
                            f"{self.last_bad}", level="WARNING", source=opts.uid)
            self._bad_reported = self.bad_messages
        self._flush_dead_letters()
        with self.counters.taken() as deltas:
            hb = board.heartbeat("trainer", opts.uid, int(opts.lease_ttl * 1000), "trainer", stats, deltas)
        self._server_time = (hb.server_time, time.monotonic())
        if hb.task_status is None:
            self._task_lost(TASK_GONE, gone=True)
            return
        if hb.replaced:
            self._task_lost(TASK_REPLACED)
            return
        if not hb.lease_held and not self._take_lease_back():
            return
        self._lease_lost_at = None
        if hb.task_status != "ACTIVE":
            self.task_ended = True
            status = board.get_status()
            reason = status.end_reason if status is not None else ""
            self.stop.set(f"task {hb.task_status.value}: {reason or 'no reason given'}")
            return
        self.env_steps_total = int(board.get_counters().get("env_steps", 0))

    def _task_lost(self, reason: str, *, gone: bool = False) -> None:
        """The task this run serves is no longer on the board: stop (a vanished task's final checkpoint is
        still written; a replaced one's is not, for the new task of that name keeps its own there)."""
        self.task_gone = self.task_gone or gone
        self.task_replaced = self.task_replaced or not gone
        if not self.stop.is_set():
            logger.error("%s", reason)
        self.stop.set(reason)

    def _take_lease_back(self) -> bool:
        """The lease lapsed: take it back if no other trainer took over (else stop, fenced)."""
        opts = self.options
        answer = self.board.reclaim_trainer(opts.uid, self.epoch, int(opts.lease_ttl * 1000))
        if answer == "gone":
            self._task_lost(TASK_GONE, gone=True)
            return False
        if answer == "replaced":
            self._task_lost(TASK_REPLACED)
            return False
        if answer == "taken":
            away = 0.0 if self._lease_lost_at is None else time.monotonic() - self._lease_lost_at
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

    # ------------------------------------------------------------ publishing
    def request_publish(self) -> int:
        """Hand the learner's weights, as params version ``self.version``, to the board thread."""
        self.parameter.version = self.version
        self._requested = (self.version, self.learner.train_count)
        self._last_publish = time.monotonic()
        self.lag.published(self.version, self.learner.train_count)
        self._arrivals = {}
        blob = self.codec.encode_params(
            self.parameter.to_arrays(),
            {"epoch": self.epoch, "version": self.version, "train_count": self.learner.train_count,
             "algorithm": self.task.rl_config.algorithm},
        )
        with self._publish_lock:
            self._pending = (self.version, self.learner.train_count, blob)
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
        """Publish the final weights and wait until they are on the board (False if stopped first). Weights
        trained past the last publication get a version of their own, one past it, whatever the data path's
        rule would count: a version names one set of weights."""
        self._request_final()
        version = self.version
        while self._published_version < version:
            if self.stop.is_set():
                return False
            time.sleep(0.01)
        return True

    def _request_final(self) -> bool:
        """Hand the weights over as the run's last params: those trained past the last publication get a
        version of their own, one past it, whatever the data path's rule would count (a version names one
        set of weights). False when the board has them already."""
        if self.learner.train_count > self._requested[1]:
            self.version = max(self.version, self._requested[0] + 1)
        if (self.version, self.learner.train_count) == self._requested:
            return False
        self.request_publish()
        return True

    def _flush_final(self) -> None:
        """Write what is still pending once the board thread stopped (the weights of a task ended on the
        board: a cancelling client waits for this trainer to let go, then loads them)."""
        if self._pending is None or self.fenced or self.task_replaced or self.task_gone:
            return
        try:
            self._flush_publish()
            logger.info("final params published: version %d, train_count %d", self._published_version,
                        self.learner.train_count)
        except Exception as e:
            logger.warning("could not publish the final params: %s", short(e))

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
    def _sync_ready(self) -> bool:
        """Sync: every actor's segments of this version are in, or ``sync_wait_s`` passed with at least
        ``min_segments`` (then the log says which actors it goes on without)."""
        path = self.data_path
        needed = path.update_segments(self.task.actor_num, self.task.rl_config.envs_per_actor)
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
                stats = self.learner.train()
                if stats is not None:
                    self.version = path.next_version(self.version, self.learner.train_count)
                    self.request_publish()
                    self._waiting_since = None
        else:
            stats = None if self._ahead_of_data() else self.learner.train()
            if stats is not None:
                with self._version_lock:
                    self.version = path.next_version(self.version, self.learner.train_count)
            if self._publish_due():  # waiting for rows too: actors pace themselves by the published train_count
                self.request_publish()
        if stats is None:
            return False
        self.last_stats = {k: v for k, v in stats.scalars().items() if k != "gradient_steps"}
        return True

    def _ahead_of_data(self) -> bool:
        """Off-policy: this run made ``train_ahead`` times the train steps the replay ratio gives the rows it
        received (after the warmup's), and one publication interval more: it waits for new rows instead of
        replaying the same memory without end (a queue or board that stopped delivering, actors gone).
        Actors keep to the ratio itself, so a trainer they keep up with never waits here."""
        path = self.data_path
        if path.sync or path.env_steps_per_train is None:
            return False
        rows = self._rows_base + self.received_transitions
        allowed = path.train_steps_allowed(rows, self.options.train_ahead) + max(1, path.publish_every)
        return self.learner.train_count - self._train_base >= allowed

    def _publish_due(self) -> bool:
        """A version the board does not have yet, and ``min_publish_interval`` since the last publication
        (versions that come faster are merged: the next publication skips to the newest)."""
        if self.version <= self._requested[0]:
            return False
        return time.monotonic() - self._last_publish >= self.options.min_publish_interval

    def run(self) -> str:
        opts = self.options
        # params of hundreds of MB over a slow link can outlast the TTL: the lease is kept until heartbeats start
        with lease_kept(self.board, "trainer", opts.uid, opts.lease_ttl, opts.heartbeat_interval, opts.max_start_s):
            status = with_retry(self.board.get_status, "reading the task")
            self.task_started_at = status.started_at if status is not None else None
            self._server_time = (with_retry(self.board.server_time, "reading the server clock"), time.monotonic())
            self.restore()
            self._skip_counted_redeliveries()
        self._train_base = self.learner.train_count
        ingest = threading.Thread(target=self._ingest_loop, name="srl-trainer-ingest", daemon=True)
        board_thread = threading.Thread(target=self._board_loop, name="srl-trainer-board", daemon=True)
        ingest.start()
        board_thread.start()
        logger.info("trainer %s holds the lease at epoch %d on %s; train_count %d", opts.uid, self.epoch,
                    self.device, self.learner.train_count)
        self.learner.plan(self.task.max_steps, self.task.max_train_count)
        self.version = max(self.version, DataPath.FIRST_VERSION)
        self.request_publish()  # actors act with this trainer's weights from the start
        end_reason: str | None = None
        next_local = time.monotonic() + opts.checkpoint_interval if opts.checkpoint_dir else math.inf
        board_every = None if self.task.checkpoint_interval is None else max(1.0, self.task.checkpoint_interval)
        next_on_board = math.inf if board_every is None else time.monotonic() + board_every
        try:
            while not self.stop.is_set():
                end_reason = self._limit_reached()
                if end_reason:
                    break
                if not self._update():
                    self.data_arrived.wait(0.05)
                    self.data_arrived.clear()
                now = time.monotonic()
                if now >= next_local or now >= next_on_board:
                    self.checkpoint(local=now >= next_local, on_board=now >= next_on_board)
                    if now >= next_local:
                        next_local = time.monotonic() + opts.checkpoint_interval
                    if board_every is not None and now >= next_on_board:
                        next_on_board = time.monotonic() + board_every
            if self.task_ended and not (self.fenced or self.task_gone or self.task_replaced):
                self._request_final()  # ended on the board (a client's cancel): its last weights, flushed below
            if not self.task_replaced:  # whatever ended the task, keep where it got to (not into the new one's)
                self.checkpoint()
            # final params first, then END: a client that sees END finds them
            if end_reason and not self.stop.is_set() and self.publish_and_wait():
                with_retry(lambda: self.board.end_task("END", end_reason or ""), "ending the task")
                self.stop.set(f"task END: {end_reason}")
        finally:
            self.stop.set(self.stop.reason or "trainer stopping")
            self._wake.set()
            board_thread.join(timeout=opts.heartbeat_interval + 5)
            ingest.join(timeout=10)
            self._flush_final()
            try:
                # a fenced trainer's stats would overwrite its successor's: only its counts still go
                stats = None if self.fenced else self._stats(*self._last_rates)
                with self.counters.taken() as deltas:  # a last heartbeat: counters and stats in one round trip
                    self.board.heartbeat("trainer", opts.uid, int(opts.lease_ttl * 1000), "trainer", stats, deltas)
                self.board.release_lease("trainer", opts.uid)
            except Exception as e:
                logger.warning("could not report the end of trainer %s: %s", opts.uid, short(e))
            if self.task_gone:
                remove_orphans(self.board)
        if self.refused_by is not None:
            raise self.refused_by
        if self.fatal:
            raise RuntimeError(self.fatal)
        return self.stop.reason

    def summary(self) -> str:
        return (f"epoch {self.epoch}, train_count {self.learner.train_count}, received {self.received_batches} "
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
    check_queue(queue_params)  # an unknown scheme, a malformed URL, a missing library: now, not when a task comes
    opts.validate()
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
