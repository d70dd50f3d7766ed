"""How many batches an actor's experience queue holds, and where an actor counts what it sent.

Owns: :class:`InFlight`, the one place that knows some queues cannot tell their depth. A queue that can
(Redis Streams: its entries not yet read; RabbitMQ: the queue's ready messages) is asked, and the sends
are counted with the actor's heartbeat. One that cannot (MQTT, Pub/Sub) is measured on the board: batches sent minus
the batches the trainer took off the queue (received, or refused: a refused batch is never received, and
left in, each would hold a place for ever), so each actor counts its sends there at once, and the trainer
counts each read before it acks it. Each count carries a token, so a count sent again after its reply was
lost adds nothing. Must never: be below the queue's real depth (actors would overfill it), stay above it
(actors would wait for ever), or see a batch's bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from srl.runner.distribution.board.board import Board, count_token
from srl.runner.distribution.node.retry import with_retry
from srl.runner.distribution.node.serve import CounterDeltas
from srl.runner.distribution.queues import ExperienceQueue


def batches_refused(counters: Mapping[str, float]) -> float:
    """Batches the trainer took off the queue and refused, of the board's summed ``counters``. Not
    ``bad_messages``: that also counts the params and inference requests other nodes refuse, never sent as
    batches."""
    return counters.get("refused_batches", 0)


def batches_in_flight(counters: Mapping[str, float]) -> float:
    """Batches sent and not yet taken off the queue (received or refused), by the board's summed
    ``counters``: the one rule for the depth of a queue that cannot tell it, the progress line's "in flight"
    and the history's ``queue_in_flight``. Below 0 while the actors have not reported their last sends
    (they count them with their heartbeats where the queue tells its depth)."""
    taken = counters.get("received_batches", 0) + batches_refused(counters) - batches_given_back(counters)
    return counters.get("sent_batches", 0) - taken


def batches_given_back(counters: Mapping[str, float]) -> float:
    """Batches counted as received whose reads went back to the queue (a trainer's lease lapsed, or its queue
    went away, while their counts were on their way), not read again yet: received and still queued too."""
    return max(0.0, counters.get("given_back_batches", 0))


class InFlight:
    """The depth of ``queue`` as an actor reads it for backpressure, and the counting of its sends.

    The loop that uses it::

        while queue_in_flight.depth() >= capacity:   # backpressure: wait
            wait()
        queue.put_many([blob])
        queue_in_flight.sent(batches=1, rows=count)
    """

    def __init__(self, queue: ExperienceQueue, board: Board, role_id: str, counters: CounterDeltas) -> None:
        self.queue = queue
        self.board = board
        self.role_id = role_id
        self.counters = counters
        self.on_board = not queue.reports_depth
        """the depth is read from the board's counts (MQTT, Pub/Sub)"""

    def depth(self) -> int:
        """Batches waiting for the trainer: put and not yet read where the queue tells (a read batch waits in
        the trainer's buffer, which has room for it), else put and not yet counted received or refused;
        never below the real number (callers retry a board that is away)."""
        depth = None if self.on_board else self.queue.backlog()
        if depth is not None:
            return depth
        return int(batches_in_flight(self.board.get_counters()))

    def sent(self, batches: int, rows: int, *, should_stop: Callable[[], bool] | None = None) -> None:
        """Count ``batches`` of ``rows`` just put: at once on the board where they are the queue's depth for
        every actor, else with the next heartbeat."""
        if not self.on_board:
            self.counters.add(sent_batches=batches, sent_transitions=rows)
            return
        # one token for every try: a try whose reply was lost counted the batches already
        with_retry(functools.partial(self.board.incr_counters, self.role_id, token=count_token(), sent_batches=batches,
                                     sent_transitions=rows), "counting a sent batch", should_stop=should_stop)
