"""Rows to the experience queue: what an actor, and an inference server acting for actors, both do.

Owns: :class:`RowSender` — cutting rows into messages the queue and the codec take, naming each batch
(sender, seq) for the trainer's dedupe, backpressure (wait while the queue holds ``capacity`` batches),
resending what a broker refused or could not take, and counting what went. Must never: drop rows while
the run goes on; ack or read anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from srl.base.rl import Columns
from srl.base.schema import Schema
from srl.runner.distribution.board import Board
from srl.runner.distribution.codec import BatchHeader, Codec, short, split_columns
from srl.runner.distribution.in_flight import InFlight
from srl.runner.distribution.node import CounterDeltas
from srl.runner.distribution.queues import ExperienceQueue, QueueError, QueueFullError
from srl.runner.distribution.retry import TRANSIENT_ERRORS, BoardUnreachableError, Throttle, with_retry
from srl.runner.distribution.task import StopFlag

logger = logging.getLogger("srl.sender")

_QUEUE_AWAY: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, QueueError)


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
            self.wait_for_room()
            if self.stop.is_set():
                logger.info("not sending %d rows: %s", count, self.stop.reason)
                return
            self.seq += 1
            self.sent_batches += 1
            self.put([blob])
            self.in_flight.sent(1, self.schema.counted(chunk_cols))

    def wait_for_room(self) -> None:
        """Backpressure: block (with backoff) while the queue holds ``capacity`` batches or more."""
        delay = 0.005
        waited_from: float | None = None
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
            if depth < self.capacity:
                break
            if waited_from is None:
                self._begin_wait()
                waited_from = self.stalled_since = time.monotonic()
            self.stop.wait(delay)
            delay = min(delay * 2, 0.25)
        self.stalled_since = None
        if waited_from is not None:
            waited = self._end_wait() or time.monotonic() - waited_from
            self.backpressure_wait_s += waited
            self.counters.add(backpressure_wait_s=waited)

    def put(self, payloads: list[bytes]) -> None:
        """Hand payloads to the queue; what the broker refuses (its own capacity backstop) is
        sent again after a wait, and a broker that is away is waited for: never dropped while the
        task runs (a resend after a failure may deliver a batch twice: the trainer recognises it)."""
        delay = 0.05
        away_since: float | None = None
        while payloads:
            try:
                self.queue.put_many(payloads)
                if away_since is not None:
                    logger.warning("experience queue reachable again after %.0fs", time.monotonic() - away_since)
                return
            except QueueFullError as e:
                payloads = list(e.rejected)
                logger.warning("the broker refused %d message(s) (queue at its capacity): waiting to resend; "
                               "lower queue_capacity below the broker's limit", len(payloads))
                self.counters.add(refused_messages=len(payloads))
            except _QUEUE_AWAY as e:  # BrokerUnavailableError is a ConnectionError; QueueError: a queue lost
                away_since = away_since or time.monotonic()
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
                return

    def close(self) -> None:
        self.queue.close()
