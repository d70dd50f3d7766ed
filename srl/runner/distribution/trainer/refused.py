"""The messages a trainer's ingest refuses: how many, the last one, and their notes on the board.

Owns: :class:`RefusedMessages` — the count of refused messages (``bad_messages``), the last one's source and
reason, a note per message (a :class:`~srl.runner.distribution.board.board.DeadLetter`, the last 100 kept until
the board takes them), a throttled log line, and the heartbeat's one event line for the ones refused since the
last (one event per heartbeat, not one per message). Must never: raise for a message, or drop notes the board
did not take (they wait for the next flush).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from srl.runner.distribution.board.board import Board, DeadLetter
from srl.runner.distribution.node.retry import Throttle
from srl.runner.distribution.queues import Message
from srl.runner.distribution.wire.codec import DecodeError, short

logger = logging.getLogger("srl.trainer")


class RefusedMessages:
    """One trainer run's refused messages; the ingest thread notes them, the count and board threads put them on
    the board they name."""

    def __init__(self, log_every: float) -> None:
        self.count = 0
        """messages refused (the ingest adds a read's once the read is ingested)"""
        self.last = ""
        """the last refused message's source and reason"""
        self._reported = 0
        self._dead_letters: deque[DeadLetter] = deque(maxlen=100)
        self._letters_lock = threading.Lock()
        self._log = Throttle(log_every)

    def note(self, message: Message, error: BaseException) -> None:
        """A note of ``message``, refused for ``error``, for the board (and the log, throttled)."""
        source = short(getattr(message, "source", "?"), 200)
        reason = short(error if isinstance(error, DecodeError) else f"{type(error).__name__}: {error}")
        self.last = f"{source}: {reason}"
        size = len(message.data) if isinstance(message.data, (bytes, bytearray)) else 0
        self._dead_letters.append(DeadLetter(time.time(), source, reason, size))
        if self._log.ready():
            more = self._log.take_suppressed()
            logger.warning("skipped a bad message from %s: %s%s", source, reason,
                           f" (and {more} more since the last line)" if more else "")

    def report(self, board: Board, source: str) -> None:
        """The heartbeat's part: a line in the board's event log on the messages refused since the last report
        (reported once on the board: a board that is away gets it at the next heartbeat), then their notes."""
        count = self.count
        if count > self._reported:
            text = f"{count - self._reported} bad message(s) skipped; last from {self.last}"
            board.log_event(text, level="WARNING", source=source)
            self._reported = max(self._reported, count)
        self.flush(board)

    def flush(self, board: Board) -> None:
        """Put the notes of refused messages taken since the last flush on ``board`` (kept on failure); the
        count thread and the board thread both do, one at a time."""
        with self._letters_lock:
            letters = [self._dead_letters.popleft() for _ in range(len(self._dead_letters))]
            if letters:
                try:
                    board.add_dead_letters(letters)
                except BaseException:
                    self._dead_letters.extendleft(reversed(letters))
                    raise
