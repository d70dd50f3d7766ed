"""Rows to the experience queue: what an actor, and an inference server acting for actors, both do.

Owns: :class:`RowSender` — cutting rows into messages the queue and the codec take, naming each batch
(sender, seq) for the trainer's dedupe (:func:`sender_name`: a name no earlier run or process had),
backpressure (wait while the queue holds ``capacity`` batches), resending what a broker refused or
could not take, and counting what went. With ``ahead`` > 0 a
sending thread does the broker's part (the depth read, the put): the caller hands it encoded batches and
waits only when ``ahead`` of them are still unsent, and the thread puts every batch waiting, as far as
the queue has room, in one call, so a long round trip to the broker costs a pipeline, not two round
trips per batch in the acting loop; where the broker tells the backlog in the puts' reply (Redis), the
next put goes without a read while that reply left room. Must never: drop rows while the run goes on;
ack or read anything.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

import numpy as np

from srl.base.rl import Columns
from srl.base.schema import Schema
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.node.retry import TRANSIENT_ERRORS, BoardUnreachableError, Throttle, with_retry
from srl.runner.distribution.node.serve import CounterDeltas, InTransit
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.queues import ExperienceQueue, QueueError, QueueFullError
from srl.runner.distribution.sending.in_flight import InFlight
from srl.runner.distribution.wire.codec import BatchHeader, Codec, short, split_columns

logger = logging.getLogger("srl.sender")

_QUEUE_AWAY: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, QueueError)


_RUNS = itertools.count()
"""runs of senders in this process"""
_incarnation: tuple[int, str] = (os.getpid(), uuid.uuid4().hex[:12])
"""this process (its pid, a fork's new one) and a random name for it"""


def sender_name(uid: str) -> str:
    """A name to send batches under, none other had: ``<uid>.<incarnation>-<run>``.

    The trainer dedupes by ``(sender, seq)``, and a :class:`RowSender` numbers its batches from seq 0,
    so a run of this process (a slot taken back, the next task) needs a name of its own, and so does this
    process among those that ran under the same ``uid`` before it: a node restarted with a fixed ``--uid``
    (a pod's name, a unit file's) would else have its first batches taken for its predecessor's and
    dropped as duplicates. The uid is what precedes the last dot (central inference reads it so)."""
    global _incarnation
    if _incarnation[0] != os.getpid():  # a forked child is another process: another name
        _incarnation = (os.getpid(), uuid.uuid4().hex[:12])
    return f"{uid}.{_incarnation[1]}-{next(_RUNS)}"


def _no_wait() -> None:
    return None


def _no_wait_end() -> float:
    return 0.0


class RowSender:
    """Sends rows to ``queue`` as batches named ``sender`` (seq 0, 1, ...); counts them under ``role_id``.

    The loop that uses it::

        columns = worker.take()
        sender.send(columns, worker.initial_priorities(columns), slot, epoch, params_version)
            # waits while the queue is full (backpressure), resends what the broker refused

    ``begin_wait`` / ``end_wait``: the owner's clock of idle time (the backpressure waits are idle).
    ``ahead``: batches handed to a sending thread before ``send`` waits (0: ``send`` puts them itself);
    ``finish`` (and ``close``) sends what it holds unless the run stopped.
    """

    def __init__(
        self,
        queue: ExperienceQueue,
        board: Board,
        role_id: str,
        codec: Codec,
        schema: Schema,
        max_rows: int,
        capacity: int,
        sender: str,
        task_tag: int,
        stop: StopFlag,
        counters: CounterDeltas,
        begin_wait: Callable[[], None] = _no_wait,
        end_wait: Callable[[], float] = _no_wait_end,
        ahead: int = 0,
    ) -> None:
        self.queue = queue
        self.in_flight = InFlight(queue, board, role_id, counters)
        self.codec = codec
        self.schema = schema
        self.max_rows = max_rows
        self.capacity = capacity
        self.sender = sender
        self.task_tag = task_tag
        self.stop = stop
        self.counters = counters
        self._begin_wait = begin_wait
        self._end_wait = end_wait
        self._log = Throttle()
        self.seq = 0
        self.sent_batches = 0
        self.backpressure_wait_s = 0.0
        self.stalled_since: float | None = None
        self.ahead = ahead
        self.in_transit = 0
        """batches two of a put's round trips carry at this sender's rate (:class:`InTransit`, measured by the
        sending thread, up to 8 times the capacity): the queue and the outbox may hold that many more than
        ``capacity`` and ``ahead``, so a long link to the broker does not throttle the actor (0 on a LAN)"""
        self.link = InTransit()
        """timed by the puts, fed the batches they carry"""
        self._outbox: deque[tuple[bytes, int]] = deque()
        """encoded batches and the rows each counts, not yet put (``ahead`` mode)"""
        self._changed = threading.Condition()
        self._closing = False
        self._settled = False
        self._broker_away = False  # the last put found the broker away (a flush would only wait for it again)
        self._error: BaseException | None = None
        self._republished = 0  # the queue's republished count already counted
        self._thread: threading.Thread | None = None
        if ahead > 0:
            self._thread = threading.Thread(target=self._send_loop, name="srl-sender", daemon=True)
            self._thread.start()

    def send(self, columns: Columns, priorities: np.ndarray | None, slot: int, epoch: int,
             params_version: int) -> None:
        """Send ``columns`` (with their initial priorities) in as many messages as their size needs."""
        fit = self.codec.max_rows(columns, priorities, self.queue.max_message_bytes)
        max_rows = min(self.max_rows, max(1, fit))
        cut_before = None if self.schema.split_at is None else columns[self.schema.split_at]
        for chunk_cols, chunk_pr in split_columns(columns, priorities, max_rows, cut_before):
            count = len(next(iter(chunk_cols.values())))
            header = BatchHeader(
                actor_id=self.sender, actor_index=slot, epoch=max(epoch, 0), seq=self.seq,
                params_version=max(params_version, 0), count=count, created_at=time.time(), task=self.task_tag,
            )
            blob = self.codec.encode_batch(header, chunk_cols, chunk_pr)
            if self._thread is not None:
                if not self._hand_over(blob, self.schema.counted(chunk_cols)):
                    logger.info("not sending %d rows: %s", count, self.stop.reason)
                    return
                self.seq += 1
                continue
            self.wait_for_room()
            if self.stop.is_set():
                logger.info("not sending %d rows: %s", count, self.stop.reason)
                return
            self.seq += 1
            _, unsent = self.put([blob])
            self._count_sent(1, self.schema.counted(chunk_cols), unsent, give_up_at_stop=False)

    def wait_for_room(self, clock: bool = True) -> int:
        """Backpressure: block (with backoff) while the queue holds ``capacity`` batches or more; the room
        left (0: the run is stopping). ``clock``: the wait is the owner's idle time and its stall (not when
        a sending thread waits while the owner acts on)."""
        delay = 0.005
        waited_from: float | None = None
        room = 0
        while not self.stop.is_set():
            try:
                depth = with_retry(self.in_flight.depth, "queue depth", should_stop=self.stop.is_set)
            except BoardUnreachableError:  # only raised once the run is stopping
                break
            except QueueError as e:  # a broker that lost the queue (a task replaced): the run stops soon, or not
                if self._log.ready():
                    logger.warning("cannot read the experience queue's depth (%s); retrying", short(e))
                self.stop.wait(delay)
                delay = min(delay * 2, 0.25)
                continue
            if depth < self.capacity + self.in_transit:
                room = self.capacity + self.in_transit - depth
                break
            if waited_from is None:
                waited_from = time.monotonic()
                if clock:
                    self._stall_began(waited_from)
            self.stop.wait(delay)
            delay = min(delay * 2, 0.25)
        if clock and waited_from is not None:
            self._stall_ended(waited_from)
        return room

    def _stall_began(self, since: float) -> None:
        self._begin_wait()
        self.stalled_since = since

    def _stall_ended(self, since: float) -> None:
        """The owner waited since ``since``: its backpressure."""
        self.stalled_since = None
        waited = self._end_wait() or time.monotonic() - since
        self.backpressure_wait_s += waited
        self.counters.add(backpressure_wait_s=waited)

    # ------------------------------------------------------------ ahead: the sending thread
    def _hand_over(self, blob: bytes, rows: int) -> bool:
        """Queue ``blob`` for the sending thread, first waiting while ``ahead`` batches are unsent (that wait
        is the caller's backpressure). False: the run stopped first."""
        with self._changed:
            self._raise_thread_error()
            if len(self._outbox) >= self.ahead + self.in_transit:
                waited_from = time.monotonic()
                self._stall_began(waited_from)
                while (len(self._outbox) >= self.ahead + self.in_transit and not self.stop.is_set()
                       and self._error is None):
                    self._changed.wait(0.05)
                self._stall_ended(waited_from)
                self._raise_thread_error()
            if self.stop.is_set():
                return False
            self._outbox.append((blob, rows))
            self._changed.notify_all()
        return True

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the sending thread failed: {type(self._error).__name__}: "
                               f"{short(self._error)}") from self._error

    def _send_loop(self) -> None:
        """Put what waits in the outbox, as much at a time as the queue has room for, until closed or stopped."""
        known_room = 0
        try:
            while True:
                with self._changed:
                    while not self._outbox and not self._closing and not self.stop.is_set():
                        self._changed.wait(0.1)
                    if self.stop.is_set() or not self._outbox:
                        break
                # the room the last put's reply told, else a read of the backlog (waiting while there is none)
                room = known_room if known_room > 0 else self.wait_for_room(clock=False)
                known_room = 0
                if room <= 0:  # stopping
                    break
                with self._changed:
                    taken = [self._outbox.popleft() for _ in range(min(room, len(self._outbox)))]
                    self._changed.notify_all()
                started = time.monotonic()
                backlog, unsent = self.put([blob for blob, _ in taken], then_backlog=True)
                self._note_put(time.monotonic() - started, len(taken))
                if backlog is not None:
                    known_room = self.capacity + self.in_transit - backlog
                self._count_sent(len(taken), sum(rows for _, rows in taken), unsent)
        except BaseException as e:  # the caller raises it at its next send, or at close
            logger.exception("the sending thread failed")
            with self._changed:
                self._error = e
                self._changed.notify_all()
        finally:
            with self._changed:
                left = sum(rows for _, rows in self._outbox)
                self._outbox.clear()
                self._changed.notify_all()
            if left:
                logger.info("not sending %d rows: %s", left, self.stop.reason or "the sender closed")

    def _note_put(self, seconds: float, batches: int) -> None:
        """A put of ``batches`` took ``seconds``; once a second, ``in_transit`` follows the link."""
        self.link.timed(seconds)
        if (carried := self.link.moved(batches)) is not None:
            self.in_transit = min(8 * self.capacity, math.floor(carried))  # an outbox's memory stays bounded

    def put(self, payloads: list[bytes], then_backlog: bool = False) -> tuple[int | None, list[bytes]]:
        """Hand payloads to the queue; what the broker refuses (its own capacity backstop) is
        sent again after a wait, and a broker that is away is waited for: never dropped while the
        task runs (a resend after a failure may deliver a batch twice: the trainer recognises it).
        Returns the queue's backlog after the puts where ``then_backlog`` and the broker tells it in their
        round trip (else None), and the payloads not sent because the run stopped first: of ``payloads``, or
        put by an earlier call and refused since (RabbitMQ refuses over its confirm window). The caller takes
        them off the sent counts (:meth:`_count_sent`), so the run's accounts balance."""
        delay = 0.05
        away_since: float | None = None
        while payloads:
            try:
                put = self.queue.put_many_then_backlog if then_backlog else self.queue.put_many
                backlog = put(payloads)
                self._broker_away = False
                if away_since is not None:
                    logger.warning("experience queue reachable again after %.0fs", time.monotonic() - away_since)
                return backlog, []
            except QueueFullError as e:
                payloads = list(e.rejected)
                logger.warning("the broker refused %d message(s) (queue at its capacity): waiting to resend; "
                               "lower queue_capacity below the broker's limit", len(payloads))
                self.counters.add(refused_messages=len(payloads))
            except _QUEUE_AWAY as e:  # BrokerUnavailableError is a ConnectionError; QueueError: a queue lost
                away_since = away_since or time.monotonic()
                self._broker_away = True
                if self._log.ready():
                    logger.warning("experience queue unreachable for %.0fs (%s); holding %d batch(es) until it "
                                   "is back", time.monotonic() - away_since, short(e), len(payloads))
            started = time.monotonic()
            self.stop.wait(delay)
            delay = min(delay * 2, 1.0)
            waited = time.monotonic() - started
            self.backpressure_wait_s += waited
            self.counters.add(backpressure_wait_s=waited)
            if self.stop.is_set():
                logger.warning("%d message(s) not sent: %s", len(payloads), self.stop.reason)
                return None, payloads
        return None, []

    def finish(self) -> None:
        """Send what the thread still holds (unless the run stopped) and wait for it, then for the broker's
        word on every put: when this returns the counts are final (a node's final report must come after it,
        or the run's sums miss a batch or count one the broker refused)."""
        if self._thread is not None:
            with self._changed:
                self._closing = True
                self._changed.notify_all()
            self._thread.join(timeout=30.0)
            if self._thread.is_alive():
                logger.warning("the sending thread did not finish within 30 s")
                return
        self._settle()
        self._count_republished()

    def _settle(self) -> None:
        """Wait (once) until the broker took or refused every batch put (RabbitMQ confirms over a window, so a
        refusal can come after the put that was counted as sent): a refused batch is put again while the run
        goes on; once it stopped, it is taken off the sent counts (it was never delivered and never will
        be). Not where the last put found the broker away: closing the queue waits for it once, and says
        what stayed unconfirmed."""
        if self._settled or self._broker_away:
            return
        self._settled = True
        while True:
            try:
                self.queue.flush()
                return
            except QueueFullError as e:
                refused = list(e.rejected)
                self.counters.add(refused_messages=len(refused))
            except Exception as e:  # away, a message too large, refused credentials: closing says it again
                logger.warning("could not wait for the broker to confirm the last batches: %s: %s",
                               type(e).__name__, short(e))
                return
            if not self.stop.is_set():
                logger.warning("the broker refused %d message(s) at the end of this sender's run: resending",
                               len(refused))
                _, refused = self.put(refused)
            if refused:
                logger.warning("%d message(s) the broker refused at the end were not sent again: %s", len(refused),
                               self.stop.reason or "the sender closed")
                self._count_sent(0, 0, refused)
                return

    def _count_sent(self, batches: int, rows: int, unsent: list[bytes], give_up_at_stop: bool = True) -> None:
        """Count ``batches`` of ``rows`` just put, less ``unsent``: what ``put`` hands back as not sent because the
        run stopped first (of these, or batches an earlier put counted that the broker refused since).
        ``give_up_at_stop``: a board that is away is not waited for once the run stops (else: as long as it
        takes, as the caller's own loop would)."""
        if unsent:
            batches -= len(unsent)
            rows -= sum(self.schema.counted(self.codec.open_batch(blob).arrays()[0]) for blob in unsent)
        if batches or rows:
            self.sent_batches += batches
            self.in_flight.sent(batches, rows, should_stop=self.stop.is_set if give_up_at_stop else None)
        self._count_republished()

    def _count_republished(self) -> None:
        """Count the batches the queue published again after a lost connection since the last count: the
        broker may hold them twice, and the run's accounts say so (``republished_batches``)."""
        republished = self.queue.republished
        if republished > self._republished:
            self.counters.add(republished_batches=republished - self._republished)
            self._republished = republished

    def close(self) -> None:
        """:meth:`finish`, then close the queue."""
        self.finish()
        self.queue.close()
