"""A trainer's reads of the experience queue counted on the board, then acked: at least once, counted once.

Owns: :class:`ReadCounter` — the count of each read written in a thread of its own while the ingest reads the
next one, with the ledger of the last reads (the ``(actor, seq)`` of their batches) beside it, and the read acked
once its count is on the board; the batches the trainers before this run counted (their ledgers), whose
redeliveries are taken without being counted again. Must never: ack a read before its count is on the board,
or wait on a count once the lease lapsed (the reads go back to the queue, unacked, for the lease's holder).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from srl.runner.distribution.board.board import Board, BoardError, count_token
from srl.runner.distribution.node.retry import BoardUnreachableError, with_retry
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.queues import ExperienceQueue, Message
from srl.runner.distribution.wire.codec import short

logger = logging.getLogger("srl.trainer")

LEDGER_READS = 3
"""reads whose batches a trainer names in its ledger: the one it counts, and the two before, whose acks
may still be on their way to the broker (Redis sends an ack with the next read; AMQP does not wait)"""
Key = tuple[str, int]
"""a batch's name: its sender and seq"""


class StoppedWhileWaiting(Exception):
    """The run stopped while a read's rows waited for room in the buffer: the read is not acked."""


class LeaseLapsed(Exception):
    """The trainer's lease lapsed while its reads waited to be counted: they go back to the queue unacked."""


class ReadCounter:
    """One trainer run's counts on the board and the acks that wait for them: the ingest thread's helper, which
    counts on the board the ingest names in each call."""

    def __init__(self, uid: str, stop: StopFlag, lease_lapsed: Callable[[], bool]) -> None:
        self.uid = uid
        self.stop = stop
        self.lease_lapsed = lease_lapsed
        # the (actor, seq) of the batches of the last reads, counted on the board before their acks: a
        # trainer that takes over after this one dies takes their redeliveries without counting them again
        self._ledger: deque[list[Key]] = deque(maxlen=LEDGER_READS)
        self.counted_before: set[Key] = set()
        """batches the trainers before this run counted and may not have acked (their ledgers): one that comes
        again is taken (counted as redelivered), once (the ingest discards it from here then)"""
        # a read's count is written in this thread while the ingest reads the next one; acked once written
        self._counter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="srl-trainer-count")
        self._counting: deque[tuple[Future[None], list[Message], ExperienceQueue, list[Key]]] = deque()
        self._given_back: list[tuple[Future[None], list[Key]]] = []
        """reads given back to the queue unacked whose counts were still on their way (``forget``)"""
        self._returned: list[Key] = []
        """batches of counted reads whose ack could not be made (their connection was lost): delivered again"""

    def recall(self, board: Board) -> None:
        """Batches that trainers before this one counted, and may not have acked before they died, come
        again: their rows are taken (they went with the dead trainer's buffer), but they are counted as
        redelivered, not as received twice."""
        try:
            ledgers = with_retry(board.get_ledgers, "reading the trainers' ledgers")
        except BoardError as e:
            logger.warning("the trainers' ledgers cannot be read (%s): batches a dead trainer counted may be "
                           "counted again", short(e))
            return
        for taken in ledgers.values():  # this process's own earlier run too: this run starts a new SeenBatches
            self.counted_before.update(taken)
        if self.counted_before:
            logger.info("%d batch(es) an earlier trainer counted are taken without being counted again if they "
                        "come again", len(self.counted_before))

    @property
    def in_flight(self) -> bool:
        """Whether a read waits for its count or its ack."""
        return bool(self._counting)

    def submit(self, count: Callable[[], None], messages: list[Message], queue: ExperienceQueue,
               taken: list[Key]) -> None:
        """Run ``count`` (which counts the read of ``messages``, ``taken`` its batches received, on the board) in
        the count thread; the read is acked once it returns (``settle``)."""
        self._counting.append((self._counter.submit(count), messages, queue, taken))

    def settle(self, keep: int = 0) -> None:
        """Wait for the counts of the reads in flight (all but the newest ``keep``) to be on the board, and
        ack each read once its count is (after every message is in the buffer, or refused, and counted).
        Raises StoppedWhileWaiting, and acks nothing more, when the run stopped before a count was
        written: that read is delivered again; LeaseLapsed when the lease lapsed while a count waited."""
        while len(self._counting) > keep:
            future, messages, queue, _ = self._counting[0]
            while True:
                try:
                    future.result(timeout=0.25)
                    break
                except TimeoutError:
                    if self.lease_lapsed():
                        raise LeaseLapsed(f"the lease lapsed with {len(self._counting)} read(s) not yet "
                                          "counted") from None
            _, _, _, taken = self._counting.popleft()
            queue.ack_many(messages)
            if any(m.returned for m in messages):  # counted, and the broker delivers them again
                self._returned.extend(taken)

    def forget(self, wait: bool = False) -> None:
        """Let the reads in flight go unacked (their queue was closed: their messages come again). ``wait``:
        once their counts are done, written or not; else those go on alone (they land only if the lease is
        still this trainer's). Those whose counts land are given back counted (``given_back``)."""
        if wait:
            for future, _, _, _ in self._counting:
                with contextlib.suppress(Exception):
                    future.result()
        self._given_back.extend((future, taken) for future, _, _, taken in self._counting)
        self._counting.clear()

    @property
    def returned(self) -> bool:
        """Whether a counted read's ack came back undone since the last ``given_back``."""
        return bool(self._returned)

    def given_back(self) -> list[Key]:
        """The batches of reads given back to the queue whose counts landed, and of counted reads whose acks came
        back undone (the queue reconnected under them): they count as received and are queued again, where the
        trainer that reads them takes them as duplicates (its own) or as redelivered (its ledger's). Waits for
        the counts still on their way, which land now that the lease is this trainer's again, or end with the
        run."""
        landed, self._returned = self._returned, []
        for future, taken in self._given_back:
            with contextlib.suppress(Exception):  # stopped first: not counted, delivered again
                future.result()
                landed.extend(taken)
        self._given_back.clear()
        return landed

    def close(self) -> None:
        """Forget the reads in flight and wait for the count thread's last write."""
        self._counting.clear()
        self._counter.shutdown(wait=True)

    def count(self, board: Board, counts: dict[str, float], taken: list[Key] | None) -> None:
        """Count a read on ``board`` before it is acked (one round trip), with the ledger of the last reads.
        Killed between the two, this trainer leaves the read counted and named: the next trainer takes its
        redelivery without counting it again. Counted after the ack, a killed trainer would lose the read from the
        counts, which then would not add up. Actors on a queue without a depth (MQTT, Pub/Sub) read it
        from these counts, so they see room as soon as it is made."""
        if taken is not None:  # None: a count that is not a read's (the ledger keeps the last reads)
            self._ledger.append(taken)
        ledger = [key for read in self._ledger for key in read]
        uid = self.uid
        token = count_token()  # the same on every try: a try whose reply was lost counted the read already
        while True:
            try:
                answer = with_retry(lambda: board.count_received(uid, counts, ledger, token),
                                    "counting received batches", should_stop=self.stop.is_set)
            except BoardUnreachableError:  # stopping while the board is away
                answer = "not held"
            if answer == "noted":
                return
            if self.stop.is_set():  # the read stays unacked: delivered again, to whoever holds the lease
                raise StoppedWhileWaiting(f"the run stopped before its read of {len(taken or ())} batches was "
                                          "counted")
            # the lease lapsed (an outage) or the task is another one: the board thread takes the lease back
            # or stops the run
            self.stop.wait(0.05)
