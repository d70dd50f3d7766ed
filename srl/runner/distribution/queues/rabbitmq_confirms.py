"""A RabbitMQ producer's window of publisher confirms: what it put and the broker has not confirmed yet.

Owns: the payloads waiting to be published and those published and not yet confirmed (in publish
order, by publish sequence number), their bytes, the room the window has left, and what the broker
refused or returned since the last error about it. Must never: talk to the broker or import pika
(``rabbitmq`` publishes and reads the confirms, and tells this what they say), or let go of a payload
before its confirm came, unless told the queue is being deleted.
"""

from __future__ import annotations

import itertools
from collections import deque

from srl.runner.distribution.queues.base import QueueError, QueueFullError


class ConfirmWindow:
    """At most ``messages`` messages (and ``nbytes`` bytes, but a single larger message still goes)
    published and not confirmed at once; every payload kept until its confirm, requeued first when
    a connection is lost with it unconfirmed."""

    def __init__(self, messages: int, nbytes: int) -> None:
        if messages < 1 or nbytes < 1:
            raise ValueError(f"confirm_window and confirm_window_bytes must be at least 1, got "
                             f"{messages} and {nbytes}")
        self.messages = messages
        self.nbytes = nbytes
        self.next_tag = 0  # the publish sequence number of the last message published on this channel
        self.unconfirmed: dict[int, bytes] = {}  # publish sequence number -> payload, oldest first
        self.unconfirmed_bytes = 0
        self.unsent: deque[bytes] = deque()  # to publish, in order (requeued unconfirmed ones first)
        self.refused: list[bytes] = []  # nacked since the last QueueFullError
        self.returned = 0  # unroutable since the last error about it
        self.confirmed = 0  # confirm frames' messages seen, to tell progress while waiting
        self.republished = 0  # published again after a connection was lost with them unconfirmed

    def __len__(self) -> int:
        """Messages put and not yet confirmed (published or waiting to be)."""
        return len(self.unconfirmed) + len(self.unsent)

    def has_room(self) -> bool:
        return len(self.unconfirmed) < self.messages and (
            not self.unconfirmed or self.unconfirmed_bytes < self.nbytes)

    def publishing(self) -> bytes:
        """The next payload to publish, registered as unconfirmed before it goes: its confirm may be read
        while it is being published."""
        data = self.unsent[0]
        self.next_tag += 1
        self.unconfirmed[self.next_tag] = data
        self.unconfirmed_bytes += len(data)
        self.unsent.popleft()
        return data

    def settle(self, tag: int, multiple: bool, nack: bool) -> None:
        """A confirm frame: the broker took (or, ``nack``, refused) message ``tag``, and with ``multiple``
        every one before it."""
        # the dict is in tag order: the tags up to `tag` are its first ones
        tags = list(itertools.takewhile(lambda t: t <= tag, self.unconfirmed)) if multiple else [tag]
        for t in tags:
            data = self.unconfirmed.pop(t, None)
            if data is None:
                continue
            self.unconfirmed_bytes -= len(data)
            self.confirmed += 1
            if nack:
                self.refused.append(data)

    def requeue(self) -> None:
        """The connection went: what was published over it and not confirmed is published again on the
        next one, first. The broker may have taken some before the connection went (their confirms lost
        with it): those it will hold twice, counted in ``republished``."""
        self.republished += len(self.unconfirmed)
        self.unsent.extendleft(reversed(self.unconfirmed.values()))
        self.unconfirmed.clear()
        self.unconfirmed_bytes = 0

    def drop_larger_than(self, limit: int) -> int:
        """Forget the payloads over ``limit`` bytes (the broker's size: sending them again cannot work);
        how many there were."""
        before = len(self)
        self.unconfirmed = {tag: data for tag, data in self.unconfirmed.items() if len(data) <= limit}
        self.unsent = deque(data for data in self.unsent if len(data) <= limit)
        return before - len(self)

    def forget(self) -> None:
        """Drop everything still to publish or to see confirmed (the queue is being deleted)."""
        self.unsent.clear()
        self.unconfirmed.clear()
        self.unconfirmed_bytes = 0
        self.refused.clear()
        self.returned = 0

    def take_refusal(self, source_name: str, capacity: int) -> QueueError | None:
        """The error for what the broker returned or refused since the last one (and those forgotten), or
        None: ``QueueError`` for unroutable messages, ``QueueFullError`` with the refused payloads."""
        if self.returned:
            returned, self.returned = self.returned, 0
            return QueueError(
                f"{source_name}: {returned} message(s) could not be routed: the queue does not "
                "exist any more (was the task's queue deleted?)"
            )
        if self.refused:
            rejected, self.refused = self.refused, []
            return QueueFullError(
                f"{source_name}: the broker refused {len(rejected)} message(s): the queue is at its "
                f"capacity (x-max-length={capacity}) or the broker had an internal error; "
                "back off and put them again (QueueFullError.rejected)",
                rejected,
            )
        return None
