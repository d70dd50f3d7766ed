"""The trainer process's ingest thread: from the experience queue into the buffer, nothing lost.

Owns: :class:`Ingest`, the path every batch takes in a trainer: read what the buffer has room for,
open each message (frame, signature, size bounds, the task it belongs to), dedupe by ``(actor, seq)``
(:class:`SeenBatches`), make the rows of the good ones as one block per layout, check them against the
algorithm's schema, apply the version policy (:class:`~srl.runner.distribution.trainer.versions.VersionGate`),
insert them, count the read on the board with a ledger of the last reads, then ack it (its
:class:`~srl.runner.distribution.trainer.counter.ReadCounter`); a refused message is noted by its
:class:`~srl.runner.distribution.trainer.refused.RefusedMessages`. Must never: ack a read before its rows
are in the buffer and its count is on the board, let one message stop it (whatever a message does, it is
counted, noted with its source, acked and skipped), or count a batch twice.

At least once, counted once: a batch that a killed trainer counted but had not acked (its ledger on the
board names it) comes again to the trainer that takes over, which adds its rows (the killed one's buffer went
with it) and counts it as redelivered, not as received again. What the killed trainer had acked is gone
with its buffer.

A trainer cut from the board but not from the queue (a partition) cannot count its reads, so it holds them
unacked, where a broker keeps them for it, out of the queue's depth, while its connection lives. Once its lease
has lapsed by its own clock, a standby may hold the lease: the ingest closes its consumer, which gives those reads
back to the queue for the lease's holder, and reads nothing until the lease is this trainer's again. A count still
on its way lands if the trainer takes its lease back (the reads' copies are then duplicates) and never if it was
fenced off (the holder counts them).

The loop (the thread's ``run``)::

    queue = open_consumer()
    while not stopped:
        messages = queue.get_many(what the buffer has room for)
        counts, taken = ingest(messages)          # decode, dedupe, check, version policy, buffer.add
        count on the board (counts, ledger)       # in a helper thread, while the next read comes
        ack the read before this one              # once its count is on the board
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from srl.base.rl import Buffer, Columns
from srl.base.schema import Schema
from srl.runner.distribution.board.board import BOARD_AWAY, Board
from srl.runner.distribution.node.retry import Throttle
from srl.runner.distribution.node.serve import InTransit
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.queues import ExperienceQueue, Message, QueueError
from srl.runner.distribution.settings.credentials import CredentialsError
from srl.runner.distribution.settings.options import TrainerOptions
from srl.runner.distribution.trainer.counter import Key, LeaseLapsed, ReadCounter, StoppedWhileWaiting
from srl.runner.distribution.trainer.refused import RefusedMessages
from srl.runner.distribution.trainer.versions import VersionGate
from srl.runner.distribution.wire.codec import BatchFrame, Codec, DecodeError, join_frames, short

Opened = tuple[Message, BatchFrame]
"""a batch message taken from the queue, and its checked frame (arrays not made yet)"""
Block = tuple[list[Opened], Columns, "np.ndarray | None"]
"""valid batches and their rows as one block (columns, priorities)"""

logger = logging.getLogger("srl.trainer")

_WAIT_OUT: tuple[type[BaseException], ...] = (*BOARD_AWAY, QueueError)

READ_AGAIN_KEPT = 65536
"""the latest duplicates a trainer remembers (``GivenBack``): more than a queue's reads in flight"""
MAX_INITIAL_PRIORITY = 1e6
"""initial priorities from actors are clipped here (one huge value would starve every other row)"""


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


class ReadWindow:
    """How much the learner's FIFO must hold when its trainer reads the queue over a long round trip, and
    growing it to that.

    A read brings at most the room the buffer has, and the next read goes only when this one is in. So a
    learner starves unless the buffer holds what two reads' round trips carry at the rate rows come
    (:class:`InTransit`: the rows it trains on while a read is on its way, and the read being inserted)
    beyond the algorithm's own size. Once a second the buffer grows to that (by a quarter at least; never
    shrinks), up to ``limit`` rows. On loopback nothing grows: the algorithm's size (and with it its
    policy lag) is what a LAN run gets."""

    def __init__(self, buffer: Buffer, base: int, limit: int, step: int, link: InTransit | None = None) -> None:
        self.buffer = buffer
        self.base = base
        """the algorithm's size, in rows"""
        self.capacity = base
        self.limit = limit
        """rows it may grow to"""
        self.step = max(1, step)
        """sizes are whole messages of rows"""
        self.link = link or InTransit()
        """timed by the reads that brought messages, fed the rows added"""

    def added(self, rows: int) -> None:
        """``rows`` went into the buffer; once a second, the buffer grows where the round trip needs it."""
        carried = self.link.moved(rows)
        if carried is None or self.capacity >= self.limit:
            return
        want = self.base + math.ceil(carried)
        if want <= self.capacity * 1.25:
            return
        rows = min(self.limit, math.ceil(want / self.step) * self.step)
        if self.buffer.grow(rows):
            logger.info("the learner's buffer grows from %d to %d rows: reads of the queue take %.0f ms at %.0f "
                        "rows/s (it holds what two of them carry beyond the algorithm's %d)", self.capacity, rows,
                        (self.link.round_trip or 0.0) * 1000, self.link.rate, self.base)
            self.capacity = rows


class GivenBack:
    """Batches counted as received whose reads went back to the queue unacked: ``batches`` of them are queued
    again until this trainer reads them again (as duplicates). A read whose ack came back undone only after the
    broker delivered its batches again, and this trainer read those (the latest ``READ_AGAIN_KEPT`` duplicates
    are remembered), gives back none of them: they are no longer queued."""

    def __init__(self) -> None:
        self.batches = 0
        self._keys: set[Key] = set()
        self._read_again: dict[Key, None] = {}  # oldest first

    def add(self, landed: list[Key]) -> list[Key]:
        """Give back ``landed``, less those read again already; those given back."""
        given = [key for key in landed if key not in self._read_again]
        for key in landed:
            self._read_again.pop(key, None)
        self._keys.update(given)
        self.batches += len(given)
        return given

    def read_again(self, key: Key) -> int:
        """A duplicate of ``key`` was read: 1 when it was given back (it is no longer queued), else 0."""
        if key in self._keys:
            self._keys.discard(key)
            return 1
        self._read_again[key] = None  # maybe the copy of a read whose ack is yet to come back undone
        if len(self._read_again) > READ_AGAIN_KEPT:
            del self._read_again[next(iter(self._read_again))]
        return 0


class Ingest:
    """One trainer run's ingest: its own thread (``start``), its counters; its reads' counts and acks are
    ``counter``'s (:class:`~srl.runner.distribution.trainer.counter.ReadCounter`), the messages it refuses
    ``refused``'s (:class:`~srl.runner.distribution.trainer.refused.RefusedMessages`)."""

    def __init__(
        self,
        board: Board,
        codec: Codec,
        schema: Schema,
        buffer: Buffer,
        gate: VersionGate,
        stop: StopFlag,
        options: TrainerOptions,
        max_message_rows: int,
        task_tag: int,
        open_consumer: Callable[[], ExperienceQueue],
        expected: Callable[[], int] = lambda: 1,
        window: ReadWindow | None = None,
        lease_lapsed: Callable[[], bool] = lambda: False,
    ) -> None:
        self.board = board
        self.codec = codec
        self.schema = schema
        self.buffer = buffer
        self.gate = gate
        self.stop = stop
        self.options = options
        self.max_message_rows = max_message_rows
        self.task_tag = task_tag
        self.open_consumer = open_consumer
        self.expected = expected
        """messages the next update waits for (sync: one from each actor still to send): a read waits a moment
        for them together (``ExperienceQueue.get_expecting``)"""
        self.window = window
        """grows the buffer to what the read round trip needs (None: its size is fixed)"""
        self.lease_lapsed = lease_lapsed
        """True while this trainer's lease may be another's (not renewed within its TTL): nothing is read, and
        reads not yet counted go back to the queue"""
        self.seen = SeenBatches()
        self.data_arrived = threading.Event()
        """set after each read: the main thread, waiting for rows to train on, looks again"""
        self.counter = ReadCounter(options.uid, stop, lease_lapsed)
        self.refused = RefusedMessages(options.heartbeat_interval)
        self.received_batches = 0
        self.received_transitions = 0
        self.duplicates = 0
        self.redelivered_batches = 0
        self.given_back = GivenBack()
        """batches counted as received whose reads went back to the queue (``_count_given_back``)"""
        self.other_task_batches = 0
        self.stale_rows = 0
        self._queue_log = Throttle()
        self.fatal: str | None = None
        self.refused_by: CredentialsError | None = None  # the queue refused this trainer's login
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="srl-trainer-ingest", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def bad_messages(self) -> int:
        """messages refused (``refused.count``)"""
        return self.refused.count

    @property
    def last_bad(self) -> str:
        """the last refused message's source and reason"""
        return self.refused.last

    def recall_counted_batches(self) -> None:
        """Batches the trainers before this one counted come again without being counted again
        (:meth:`ReadCounter.recall <srl.runner.distribution.trainer.counter.ReadCounter.recall>`)."""
        self.counter.recall(self.board)

    def ingest_once(self, queue: ExperienceQueue) -> int:
        """One step of the ingest path: read what the buffer has room for, decode, validate and insert; the
        read is then counted on the board and acked once counted. The count's round trip overlaps the next
        read: a read is acked when the one after it is in the buffer, or when the queue runs dry. The
        number of messages read (0 when none came within the read timeout or there is no room). Raises
        LeaseLapsed, reading nothing, while the lease may be another trainer's."""
        if self.lease_lapsed():
            raise LeaseLapsed("the lease lapsed")
        room = self.buffer.room()
        count = self.options.ingest_max_messages
        if self.window is not None:  # a grown buffer is read into as far as it has room (its size bounds the read)
            count = max(count, self.window.capacity // self.max_message_rows)
        if room is not None:  # a full buffer is not read into: the queue fills, actors wait
            count = min(count, room // self.max_message_rows)
            if count < 1:
                # the acks wait for the next read: actors' backpressure counts what was not read yet, so
                # sending them now would only cost a round trip in which no read could go
                self.ack_counted()
                self.stop.wait(0.005)
                return 0
        # with a read still to ack, only look: a dry queue gets it acked before the long wait
        started = time.monotonic()
        messages = queue.get_expecting(count, 0.0 if self.counter.in_flight else 0.2, self.expected())
        if messages and self.window is not None:
            self.window.link.timed(time.monotonic() - started)
        if not messages:
            self.ack_counted()
            return 0
        counts, taken = self._ingest(messages)
        self.counter.submit(lambda: self._count(counts, taken), messages, queue, taken)
        self.data_arrived.set()
        self.ack_counted(keep=1)  # the read before: counted while this one was read, acked now
        return len(messages)

    def ack_counted(self, keep: int = 0) -> None:
        """Ack the reads in flight (all but the newest ``keep``) once their counts are on the board
        (:meth:`ReadCounter.settle <srl.runner.distribution.trainer.counter.ReadCounter.settle>`); a counted read
        whose ack came back undone (its connection was lost under it) is given back (``_count_given_back``)."""
        self.counter.settle(keep)
        if self.counter.returned:
            self._count_given_back()

    def _count(self, counts: dict[str, float], taken: list[Key]) -> None:
        """Count a read on the board (in the count thread), the notes of the messages it refused first."""
        if counts.get("bad_messages"):  # their notes are on the board by the time the count says they came
            with contextlib.suppress(*BOARD_AWAY):  # else the next heartbeat writes them
                self.refused.flush(self.board)
        self.counter.count(self.board, counts, taken)

    def run(self) -> None:
        """The thread: read, ingest, count, ack until the run stops; a queue away is waited out."""
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
                except LeaseLapsed as e:
                    if queue is not None:
                        logger.warning("%s: this trainer gives its unacked reads back to the queue, for whoever "
                                       "holds the lease, and reads again once it holds the lease", e)
                        _close_quietly(queue)
                        queue = None
                    self.counter.forget()  # their counts still go on: they land only if the lease is still ours
                    while self.lease_lapsed() and not self.stop.is_set():
                        self.stop.wait(0.1)
                    self._count_given_back()
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
                    self.counter.forget(wait=True)  # counted or not, their messages come again
                    self._count_given_back()
                    self.stop.wait(delay)
                    delay = min(delay * 2, 2.0)
        except Exception as e:  # a bug, not a message: stop the trainer instead of training on nothing
            logger.exception("ingest thread crashed")
            self.fatal = f"ingest thread crashed: {type(e).__name__}: {short(e)}"
            self.stop.set(self.fatal)
        finally:
            if queue is not None:
                with contextlib.suppress(Exception):  # what was counted is acked; else it comes again
                    self.ack_counted()
                _close_quietly(queue)
            self.counter.close()

    def _count_given_back(self) -> None:
        """Batches counted as received whose reads went back to the queue unacked (the lease lapsed, or the queue
        went away, while their counts were on their way; or their ack found the connection they came over gone)
        are also queued: counted on the board as
        ``given_back_batches`` until this trainer reads them again (as duplicates), so the accounts balance
        (``sent = received + refused + still queued - given back``)."""
        landed = self.given_back.add(self.counter.given_back())
        if not landed:
            return
        logger.warning("%d batch(es) counted as received went back to the queue with their reads: they count as "
                       "given back until they are read again (as duplicates)", len(landed))
        with contextlib.suppress(StoppedWhileWaiting):  # stopping: the summary then names them as a surplus
            self.counter.count(self.board, {"given_back_batches": len(landed)}, None)

    def _ingest(self, messages: list[Message]) -> tuple[dict[str, float], list[Key]]:
        """Decode, dedupe, validate, apply the version policy and add to the buffer; the counts for the
        board and the ``(actor, seq)`` of the batches received. Never raises for a message.

        Each message is opened (frame, signature, head, sizes) and deduplicated alone; the good ones'
        rows are then made as one block per layout, checked against the schema, filtered and added
        (one array per column, one validation and one buffer insert per read instead of per message:
        per-call costs dominate small batches). Should a block fail its check, each message is
        checked alone, so only the bad one is refused.
        """
        bad = dups = other_task = back = 0
        opened: list[Opened] = []
        taking: set[Key] = set()  # (sender, seq) in this read: a copy of one is a duplicate
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
                    back += self.given_back.read_again(key)  # a read given back after its count: no longer queued
                    continue
                taking.add(key)
                opened.append((message, frame))
            except Exception as e:  # whatever one message causes stays that message's problem
                bad += 1
                self.refused.note(message, e)
        blocks, unfit = self._valid_blocks(opened)
        bad += unfit
        received = rows = stale = redelivered = 0
        taken: list[Key] = []
        for block, columns, priorities in blocks:
            try:
                kept, refused = self._accept_and_add(block, columns, priorities)
            except StoppedWhileWaiting:
                raise
            except Exception as e:  # not a message's fault (they passed every check): count them all bad
                bad += len(block)
                for message, _ in block:
                    self.refused.note(message, e)
                continue
            again = self._counted_again(block[0][1])  # a block is all of one kind (_valid_blocks)
            for _, frame in block:
                key = (frame.header.actor_id, frame.header.seq)
                self.seen.mark(*key)
                if again:  # the trainer that counted it has it in its ledger, not in a buffer
                    self.counter.counted_before.discard(key)
                else:
                    taken.append(key)
            if again:
                redelivered += len(block)
                continue
            received += len(block)
            rows += kept
            stale += refused
        self.received_batches += received
        self.received_transitions += rows
        self.refused.count += bad
        self.duplicates += dups
        self.stale_rows += stale
        self.redelivered_batches += redelivered
        self.other_task_batches += other_task
        # refused_batches: taken off the queue as received_batches are (actors on MQTT and Pub/Sub count both
        # out of its depth); bad_messages also counts what other nodes refuse (params, inference requests)
        return {"received_batches": received, "received_transitions": rows, "bad_messages": bad,
                "refused_batches": bad, "duplicates": dups, "stale_rows": stale, "redelivered_batches": redelivered,
                "other_task_batches": other_task, "given_back_batches": -back}, taken

    def _counted_again(self, frame: BatchFrame) -> bool:
        """Whether a trainer before this run counted this batch (its redelivery is not counted again)."""
        before = self.counter.counted_before
        return bool(before) and (frame.header.actor_id, frame.header.seq) in before

    def _valid_blocks(self, opened: list[Opened]) -> tuple[list[Block], int]:
        """The opened batches that fit the algorithm's schema as blocks of rows (one per layout: the
        columns and whether priorities come), each made in one copy per column; and how many did not
        fit (noted as bad)."""
        groups: dict[tuple[bytes, bool], list[Opened]] = {}
        for item in opened:  # a batch counted before is counted apart: never in a block with new ones
            groups.setdefault((item[1].layout, self._counted_again(item[1])), []).append(item)
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
                        self.refused.note(message, e)
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
        gate = self.gate
        with gate.lock:  # the version cannot move between the check and the add
            keep = gate.keep(columns["version"])
            if keep is not None:
                columns = {name: column[keep] for name, column in columns.items()}
                priorities = None if priorities is None else priorities[keep]
            counted_by = self.schema.counted_by  # frame rows: only transition rows carry a version
            gate.lag.note(columns["version"] if counted_by is None else columns["version"][columns[counted_by]],
                          gate.version)
            kept = self.schema.counted(columns)  # frame rows: the transitions among them
            if len(columns["version"]):
                self._add_when_room(columns, priorities)
                senders = []  # who delivered rows of this version (the sync wait)
                start = 0
                for _, frame in block:
                    header = frame.header
                    senders.append((header.actor_index, header.count if keep is None
                                    else int(keep[start:start + header.count].sum())))
                    start += header.count
                gate.arrived(senders)
        return kept, 0 if keep is None else len(keep) - kept

    def _add_when_room(self, columns: Columns, priorities: np.ndarray | None) -> None:
        n = len(columns["version"])
        while (room := self.buffer.room()) is not None and room < n:
            if self.stop.is_set():  # the read's messages stay unacked: delivered again, not lost
                raise StoppedWhileWaiting(f"the run stopped with {n} rows waiting for room in the buffer")
            self.stop.wait(0.005)  # the trainer is taking rows out; we hold the message meanwhile
        self.buffer.add(columns, priorities)
        if self.window is not None:
            self.window.added(n)


def _close_quietly(queue: ExperienceQueue) -> None:
    try:
        queue.close()
    except Exception as e:
        logger.debug("closing the queue: %s", e)
