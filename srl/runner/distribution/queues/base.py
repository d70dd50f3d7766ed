"""The experience-queue protocol every backend implements, and what they share.

Owns: ``Message``, ``ExperienceQueue``, the queue errors and the reconnect loop. A backend raises
:class:`CredentialsError` (not a queue error: waiting will not cure it) when its broker refuses the
login or a permission.
Must never: import a broker's client library (each backend module imports its
own) or see numpy/torch: a queue moves ``bytes``.
"""

from __future__ import annotations

import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from srl.runner.distribution.settings.credentials import CredentialsError

logger = logging.getLogger("srl.queues")

Role = Literal["producer", "consumer"]
T = TypeVar("T")

KiB = 1024
MiB = 1024 * KiB


# ---------------------------------------------------------------- errors
class QueueError(Exception):
    """Something the experience queue cannot do; the message says what to do about it."""


class BrokerUnavailableError(QueueError, ConnectionError):
    """The broker cannot be reached (at open time), or stayed away longer than ``reconnect_timeout_s``."""


class QueueFullError(QueueError):
    """The broker refused messages because the queue is at its capacity.

    ``rejected`` holds the payloads that were not accepted (in order): back off,
    keep the heartbeat going, and ``put_many`` them again.
    """

    def __init__(self, message: str, rejected: Sequence[bytes]) -> None:
        super().__init__(message)
        self.rejected: list[bytes] = list(rejected)


class MissingBackendLibraryError(QueueError, ImportError):
    """The client library of a backend is not installed (it comes with an extra of srl)."""


# ---------------------------------------------------------------- protocol
class QueueParameters(Protocol):
    """What a backend's parameters dataclass offers (``RedisParameters``, ``RabbitMQParameters``, ...): it is
    built from its URL and says where it points without secrets. It imports no client library."""

    def describe(self) -> str:
        """Where this points, without a password, for log lines, errors and the task record."""
        ...


@runtime_checkable
class Message(Protocol):
    """One payload taken from the queue; it stays the caller's until ``ack``.

    An unacked message is delivered again (to this or the next consumer) when
    the consumer closes, dies or loses its connection: at-least-once.
    """

    data: bytes
    """the payload, byte for byte what the producer put (empty when ``refused``)"""
    source: str
    """human-readable origin for log lines, e.g. ``redis stream srl:{ns}:queue:exp id 1700-0``"""
    refused: str
    """why the backend did not read the payload (e.g. over ``max_read_bytes``), or '': ack it away"""
    returned: bool
    """set by an ack that could not be made: the connection it came over was lost, and the broker delivers
    it again (to whoever consumes next)"""

    def ack(self) -> None:
        """Tell the broker this message is handled; it will not be delivered again."""
        ...


class ExperienceQueue(ABC):
    """A durable FIFO of byte payloads between actors (producers) and the trainer (consumer).

    The loops that call it::

        # actor
        with open_queue(params, namespace=ns, role="producer") as queue:
            while acting:
                blob = codec.encode_batch(...)            # <= queue.max_message_bytes
                queue.put(blob)                           # returns once the broker holds it

        # trainer
        with open_queue(params, namespace=ns, role="consumer") as queue:
            while training:
                messages = queue.get_many(64, timeout=0.2)   # [] when nothing came in time
                for m in messages:
                    memory.add(codec.decode_batch(m.data))   # log m.source if it is malformed
                queue.ack_many(messages)                     # only once they are in memory

    A queue object belongs to the thread that uses it (some client libraries,
    pika's ``BlockingConnection`` among them, are not thread-safe). Open one
    per thread. Payloads are ``bytes``; nothing else is accepted.
    """

    max_message_bytes: int
    """largest payload this backend accepts safely; ``put`` of more raises ValueError"""
    max_read_bytes: int | None = None
    """consumer: larger payloads are not read (handed out ``refused``, to be acked away) where the
    backend can tell before reading them (Redis: the reply parser drops them unread; MQTT: the broker drops
    packets over the Maximum Packet Size the consumer announces). None: no bound beyond the broker's"""
    source_name: str = "queue"
    """what this queue is, for log lines and errors (no secrets)"""
    role: Role
    """"producer" (actors) or "consumer" (the trainer)"""

    @property
    def republished(self) -> int:
        """Producer: payloads sent again because the broker had not confirmed them when a try failed (a lost
        connection, RabbitMQ's unconfirmed window; an error reply within a Redis pipeline). The broker may have
        taken one before, and then holds it twice (at-least-once: the trainer drops the copy it reads as a
        duplicate). 0 where a backend never sends a payload twice."""
        return 0

    @abstractmethod
    def put(self, data: bytes) -> None:
        """Send one payload; returns once the broker has accepted it (as durably as it can say)."""

    def put_many(self, items: Sequence[bytes]) -> None:
        """Send several payloads; backends batch the round trips (one confirm wait per call)."""
        for data in items:
            self.put(data)

    def flush(self) -> None:
        """Wait until the broker has taken or refused every payload put so far; raises ``QueueFullError``
        with what it refused. A backend whose puts return only once the broker answered (all but RabbitMQ,
        which confirms over a window) has nothing to wait for."""
        return None

    def put_many_then_backlog(self, items: Sequence[bytes]) -> int | None:
        """``put_many``, then the backlog those puts left, where the backend learns it in the same round trip
        (Redis: one pipeline); None where it does not (the caller asks ``backlog()`` when it needs it)."""
        self.put_many(items)
        return None

    def get(self, timeout: float) -> Message | None:
        """The next payload, waiting at most ``timeout`` seconds; None if nothing came."""
        messages = self.get_many(1, timeout)
        return messages[0] if messages else None

    @abstractmethod
    def get_many(self, max_messages: int, timeout: float) -> list[Message]:
        """Up to ``max_messages`` payloads, waiting at most ``timeout`` for the first one."""

    def get_expecting(self, max_messages: int, timeout: float, expect: int) -> list[Message]:
        """``get_many`` for a caller that expects ``expect`` messages to come about together (a sync
        version's segments, one from each actor): a backend whose read returns at the first (Redis) also
        waits a moment for the rest in the same round trip. Others read as ``get_many``."""
        return self.get_many(max_messages, timeout)

    def _require_consumer(self) -> None:
        if self.role != "consumer":
            raise RuntimeError(f"{self.source_name}: get on a queue opened as {self.role!r}")

    def ack_many(self, messages: Sequence[Message]) -> None:
        """Ack several messages; backends do it in one round trip. Redis holds the acks back and sends
        them with the consumer's next command (``send_acks`` sends them now); RabbitMQ sends them
        without waiting for an answer."""
        for message in messages:
            message.ack()

    def send_acks(self) -> None:
        """Send acks a backend holds back (Redis), for a consumer that will not read again soon."""
        return None  # the others send each ack when it is made

    def take_over(self) -> None:
        """This consumer is the queue's only rightful reader from now on (the trainer holding the lease: any
        other was fenced off): what other consumers read and never acked comes to it on its next read, where
        the broker keeps such reads for their consumer (Redis) instead of waiting for them to idle. The other
        backends give a consumer's unacked reads back themselves when its connection goes."""
        return None

    def depth(self) -> int | None:
        """Messages put but not yet acked, if the broker can tell cheaply; else None."""
        return None

    def backlog(self) -> int | None:
        """Messages put and not yet delivered to a consumer: what actors' backpressure counts (a batch the
        trainer has read sits in its buffer, bounded by the buffer's room, until it is acked). Where the
        broker cannot tell the delivered from the waiting, ``depth()`` (never less)."""
        return self.depth()

    @property
    def reports_depth(self) -> bool:
        """Whether this backend overrides ``depth()``; where not, callers count in flight on the board."""
        return type(self).depth is not ExperienceQueue.depth

    @abstractmethod
    def close(self) -> None:
        """Release the connection; unacked messages go back to the broker for redelivery."""

    def destroy(self) -> None:
        """Delete what this queue created on the broker (stream, queue, topic, session).

        For the end of a task only: messages still in the queue are lost.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot delete what it created on the broker")

    # the role that reaches what an earlier task of the name left: the producer's side by default
    _leftovers_role: Role = "producer"

    @classmethod
    def discard_leftovers(cls, params: Any, *, namespace: str) -> int | None:
        """Delete what an earlier task named ``namespace`` left on the broker (a queue, a topic, a session:
        they outlive their task) before a new task of that name starts, so its batches never reach the new
        trainer; how many messages were there (None: the broker cannot tell)."""
        queue = cls(params, namespace=namespace, role=cls._leftovers_role)  # type: ignore[call-arg]
        try:
            depth = queue.depth()
            queue.destroy()
        finally:
            queue.close()
        return depth

    def __enter__(self) -> ExperienceQueue:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.source_name}>"

    # ------------------------------------------------------------ helpers for backends
    def _payloads(self, items: Sequence[bytes]) -> list[bytes]:
        """``items`` checked (bytes-like, not empty, not too large) and as ``bytes``."""
        for data in items:
            self._check_payload(data)
        return [data if isinstance(data, bytes) else bytes(data) for data in items]

    def _check_payload(self, data: bytes) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(
                f"{self.source_name}: a queue moves bytes; got {type(data).__name__} "
                "(encode the batch with srl.runner.distribution.wire.codec first)"
            )
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
        if size == 0:
            raise ValueError(f"{self.source_name}: an empty message carries nothing (Pub/Sub even refuses it); "
                             "send a non-empty encoded batch")
        if size > self.max_message_bytes:
            raise ValueError(
                f"{self.source_name}: a message of {size} bytes is larger than the "
                f"{self.max_message_bytes} bytes this backend accepts (max_message_bytes); "
                "split the batch into smaller messages"
            )


@dataclass(eq=False)
class QueueMessage:
    """A ``Message`` as the backends hand it out.

    ``receipt`` is the backend's handle for acking (stream id, delivery tag,
    packet id, ack id); ``generation`` is the connection it came over: a
    receipt from a connection that has since been replaced is void, and the
    broker redelivers that message by itself.
    """

    data: bytes
    source: str
    receipt: Any
    generation: int
    _ack_many: Callable[[Sequence[QueueMessage]], None] = field(repr=False)
    acked: bool = False
    refused: str = ""
    returned: bool = False

    def ack(self) -> None:
        if not self.acked:
            self._ack_many([self])


def read_refusal(size: int, limit: int | None) -> str:
    """Why a payload of ``size`` bytes is refused under a read limit, or '' when it is fine."""
    if limit is not None and size > limit:
        return f"payload of {size} bytes is over the {limit}-byte read limit; not decoded"
    return ""


def as_queue_messages(messages: Sequence[Message], owner: str) -> list[QueueMessage]:
    """The messages to ack, checked to come from a backend (already-acked ones left out)."""
    out: list[QueueMessage] = []
    for m in messages:
        if not isinstance(m, QueueMessage):
            raise TypeError(f"{owner}: can only ack messages it handed out, got {type(m).__name__}")
        if not m.acked:
            out.append(m)
    return out


# ---------------------------------------------------------------- reconnecting
class Reconnector:
    """Retries an operation across a broker restart, with backoff, for a bounded time.

    ``transient`` are the exception types that mean "connection lost";
    ``reconnect`` rebuilds the connection (it may raise a transient error too).
    After ``timeout_s`` without success it raises ``BrokerUnavailableError``
    naming the broker and what to check. ``refused`` tells a refused login or
    permission among the errors (a :class:`CredentialsError` to raise at once,
    or None): some client libraries report those as lost connections.
    """

    def __init__(
        self,
        *,
        broker: str,
        transient: tuple[type[BaseException], ...],
        reconnect: Callable[[], None],
        timeout_s: float,
        hint: str,
        hint_for: Callable[[BaseException], str] = lambda error: "",
        refused: Callable[[BaseException], CredentialsError | None] = lambda error: None,
    ) -> None:
        self.broker = broker
        self.transient = transient
        self.reconnect = reconnect
        self.timeout_s = timeout_s
        self.hint = hint
        self.hint_for = hint_for
        """more advice for the last error, beyond ``hint``"""
        self.refused = refused

    def _transient(self, error: Exception) -> Exception:
        """``error`` when it means a lost connection; raises it (or the refusal it is) otherwise."""
        refusal = self.refused(error)
        if refusal is not None:
            raise refusal from error
        if not isinstance(error, self.transient):
            raise error
        return error

    def call(self, op: Callable[[], T], what: str) -> T:
        try:
            return op()
        except Exception as e:
            first_error: BaseException = self._transient(e)
        deadline = time.monotonic() + self.timeout_s
        logger.warning(
            "%s: connection lost during %s (%s); reconnecting for up to %.0fs",
            self.broker, what, first_error, self.timeout_s,
        )
        delay = 0.05
        last_error = first_error
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrokerUnavailableError(
                    f"{self.broker} did not come back within {self.timeout_s:.0f}s "
                    f"(last error during {what}: {last_error}); {self.hint}{self.hint_for(last_error)}"
                ) from last_error
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 2.0)
            try:
                self.reconnect()
                result = op()
            except Exception as e:
                last_error = self._transient(e)
                continue
            logger.warning("%s: reconnected; %s goes on", self.broker, what)
            return result


def safe_name(text: str, allowed: str = r"A-Za-z0-9._-", replacement: str = "-") -> str:
    """``text`` with every character a broker would refuse in a name replaced."""
    return re.sub(f"[^{allowed}]", replacement, text)
