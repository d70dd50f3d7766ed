"""RabbitMQ experience queue (AMQP 0-9-1 through pika's BlockingConnection).

This module owns the queue object: its connection's life, publishing and reading the confirms,
consuming, acking, depth. pika's parameters, declaring the queue and telling a refusal from an
outage are ``rabbitmq_connection``'s; the bookkeeping of what waits for a confirm is
``rabbitmq_confirms``'s. It never drops a payload put before the broker confirmed or refused it,
unless the queue is deleted or closed.

Features:
    * durable queue, persistent messages (delivery mode 2), asynchronous
      publisher confirms over a window: ``put``/``put_many`` return once the
      messages are published on the channel, as long as fewer than
      ``confirm_window`` messages (and ``confirm_window_bytes`` bytes) wait for
      the broker's confirm; with the window full, ``put`` blocks, reading
      confirms, until there is room. Every unconfirmed payload is kept until
      its confirm arrives;
    * ``flush()`` waits until the broker confirmed (or refused) everything put
      so far; ``close()`` flushes first, so nothing put is left unconfirmed
      silently. Waiting gives up after ``confirm_timeout_s`` without a single
      confirm, with an error saying how many messages were not confirmed;
    * ``x-max-length`` (``capacity``) with ``x-overflow: reject-publish`` as a
      backstop: beyond it the broker nacks. A refused payload is neither
      dropped silently nor resent by the queue: the next ``put``/``put_many``/
      ``flush`` raises ``QueueFullError`` whose ``rejected`` holds exactly the
      payloads refused since the last such error, in the order they were put.
      That call published its own payloads before raising (they are in
      ``rejected`` only if the broker refused them as well). Back off, then
      put ``rejected`` again. ``close()`` logs what was refused since and
      does not raise for it (flush first to get those payloads). A message
      returned as unroutable (the queue was deleted) raises ``QueueError``
      the same way: resending cannot help;
    * manual ack, ``basic_qos`` prefetch; unacked messages go back to the queue
      when the consumer's connection closes or dies;
    * ``depth()``: passive ``queue_declare`` message count plus what this
      consumer holds unacked (exact with one consumer) plus what this producer
      put and the broker has not confirmed yet (an upper bound, by at most the
      window: the broker counts some of those already; exact after ``flush``);
    * reconnect with backoff for ``reconnect_timeout_s`` when the broker goes
      away; every message unconfirmed when the connection went is published
      again on the new one, before anything newer (at-least-once: the broker
      may then hold it twice; batches carry ``(actor, seq)`` for that). What a
      failed ``put`` could not publish is kept for the next ``put``/``flush``.

A queue object belongs to one thread: pika's BlockingConnection is not
thread-safe, and each queue object has its own connection.

Connection string:
    ``amqp://[user:password@]host[:port][/vhost]``, ``amqps://`` (TLS); the
    query string goes to pika (``?heartbeat=30&connection_attempts=3``), but
    for ``ssl_ca_certs=PATH``, the CA bundle that signed the broker's
    certificate. Over TLS the certificate is verified (against
    ``ssl_ca_certs``, else the system CAs) and must name the host connected
    to; a failed check raises ``BrokerUnavailableError`` saying so.

Options (fields of ``RabbitMQParameters``, also through
``open_queue(options=...)``): ssl_ca_certs, queue_name, prefetch, read_linger_s, capacity,
queue_arguments, heartbeat_s, confirm_timeout_s, reconnect_timeout_s,
max_message_bytes. Keywords of the ``RabbitMQQueue`` constructor only
(``open_queue`` gives this backend the parameters' fields alone):
``confirm_window`` (default ``CONFIRM_WINDOW``; 1 = one message in flight:
each put waits for the previous message's confirm) and
``confirm_window_bytes`` (default ``CONFIRM_WINDOW_BYTES``: bounds the memory
unconfirmed payloads hold; a single larger message still goes).

Redeclaring an existing queue with other arguments (another ``capacity``) is
an error in RabbitMQ (PRECONDITION_FAILED); this backend then logs how to
change it and uses the queue as it is.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

from srl.runner.distribution.queues.base import (
    ExperienceQueue,
    Message,
    MiB,
    QueueError,
    QueueFullError,
    QueueMessage,
    Reconnector,
    Role,
    as_queue_messages,
    read_refusal,
    safe_name,
)
from srl.runner.distribution.queues.rabbitmq_confirms import ConfirmWindow
from srl.runner.distribution.queues.rabbitmq_connection import (
    ANY_AMQP_ERROR,
    TRANSIENT,
    close_quietly,
    closed_channel_error,
    connection_parameters,
    declare_queue,
    enable_confirms,
    open_failure,
    refusal,
    size_limit,
    wake,
)
from srl.runner.distribution.settings.queue_parameters import RabbitMQParameters

logger = logging.getLogger("srl.queues.rabbitmq")

CONFIRM_WINDOW = 256
"""messages a producer may have published and not yet confirmed by the broker before put blocks;
an actor's message is one batch, so this is far more than one fsync of the broker needs"""
CONFIRM_WINDOW_BYTES = 64 * MiB
"""payload bytes a producer may hold unconfirmed before put blocks (large batches: memory bound)"""

_PERSISTENT = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent,
                                   content_type="application/octet-stream")


def queue_name_for(namespace: str) -> str:
    return f"srl.{safe_name(namespace, r'A-Za-z0-9._:-')}.exp"


class RabbitMQQueue(ExperienceQueue):
    """Experience queue on a durable RabbitMQ queue; see the module docstring."""

    def __init__(
        self,
        params: RabbitMQParameters,
        *,
        namespace: str,
        role: Role,
        consumer_name: str | None = None,
        confirm_window: int = CONFIRM_WINDOW,
        confirm_window_bytes: int = CONFIRM_WINDOW_BYTES,
        max_read_bytes: int | None = None,
    ) -> None:
        self._window = ConfirmWindow(confirm_window, confirm_window_bytes)  # the producer's
        self.params = params
        self.role = role
        self.max_read_bytes = max_read_bytes
        self.queue_name = params.queue_name or queue_name_for(namespace)
        self.connection_name = f"srl {role} {consumer_name or ''} {namespace}".replace("  ", " ")
        self.max_message_bytes = params.max_message_bytes
        self.source_name = f"amqp queue {self.queue_name} on {params.describe()}"
        self.confirm_window = confirm_window
        self.confirm_window_bytes = confirm_window_bytes
        self._conn: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._channel_closed: pika.exceptions.ChannelClosedByBroker | None = None
        self._generation = 0
        # consumer
        self._buffer: deque[QueueMessage] = deque()
        self._held: dict[int, QueueMessage] = {}  # delivery tag -> handed out, not acked (this connection)
        # producer (and self._window)
        self._wake_when: Callable[[], bool] | None = None
        self._closed = False
        self._reconnector = Reconnector(
            broker=f"RabbitMQ at {params.describe()}",
            transient=TRANSIENT,
            reconnect=self._connect,
            timeout_s=params.reconnect_timeout_s,
            hint="check that rabbitmq-server is running there (scripts/services.sh status), reachable, "
            "and not blocking publishers (rabbitmqctl status: alarms)",
            refused=lambda error: refusal(params, error),
        )
        try:
            self._connect()
        except ANY_AMQP_ERROR as e:  # an OSError, a failed TLS check among them, or pika's
            failure = open_failure(params, e)
            if failure is None:
                raise
            raise failure from e

    @property
    def unconfirmed(self) -> int:
        """Messages put and not yet confirmed by the broker (published or waiting to be)."""
        return len(self._window)

    @property
    def republished(self) -> int:
        return self._window.republished

    # ------------------------------------------------------------ connection
    def _connect(self) -> None:
        self._drop_connection()
        conn = pika.BlockingConnection(connection_parameters(self.params, self.connection_name))
        try:
            channel = declare_queue(conn, self.queue_name, self.params, self.source_name)
            if self.role == "producer":
                enable_confirms(conn, channel, self._on_confirm)
                self._window.next_tag = 0  # a new channel numbers its publishes from 1
                # on the underlying channel, so that they run as the frames are read (as the confirms do)
                channel._impl.add_on_return_callback(self._on_return)
                channel._impl.add_on_close_callback(self._on_channel_close)
            else:
                channel.basic_qos(prefetch_count=self.params.prefetch)
                channel.basic_consume(self.queue_name, self._on_delivery, auto_ack=False)
        except BaseException:
            close_quietly(conn)
            raise
        self._conn, self._channel = conn, channel
        self._channel_closed = None
        self._generation += 1

    def _drop_connection(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        # what was fetched over the old connection goes back to the queue with it
        self._buffer.clear()
        self._held.clear()
        # what was published over it and not confirmed is published again on the next one, first
        self._window.requeue()
        if conn is not None:
            close_quietly(conn)  # confirms it still reads find self._conn None: ignored

    def _open_channel(self) -> tuple[pika.BlockingConnection, BlockingChannel]:
        if self._closed:
            raise QueueError(f"{self.source_name}: the queue is closed")
        if self._conn is None or self._channel is None or not self._conn.is_open:
            raise pika.exceptions.ConnectionWrongStateError("connection lost")
        if self._channel_closed is not None:
            raise self._channel_closed
        if not self._channel.is_open:
            raise pika.exceptions.ConnectionWrongStateError("channel lost")
        return self._conn, self._channel

    # ------------------------------------------------------------ producer
    def put(self, data: bytes) -> None:
        self.put_many([data])

    def put_many(self, items: Sequence[bytes]) -> None:
        """Publish ``items``; returns once they are on the channel and the confirm window has room.

        Raises ``QueueFullError`` for what the broker refused since the last
        such error (this call's payloads are published all the same).
        """
        payloads = self._payloads(items)
        if self.role != "producer":  # its channel is not in confirm mode: nothing would ever be confirmed
            raise RuntimeError(f"{self.source_name}: put on a queue opened as {self.role!r}; open a producer")
        if self._closed:
            raise QueueError(f"{self.source_name}: the queue is closed")
        self._window.unsent.extend(payloads)
        if self._window.unsent:
            self._producer_call(lambda: self._publish("put", drain=False), "put")
        self._raise_refused()

    def flush(self) -> None:
        """Wait until the broker confirmed (or refused) every message put so far.

        Reconnects and publishes again what a lost connection left
        unconfirmed. Raises ``QueueFullError`` for what the broker refused,
        ``QueueError`` when ``confirm_timeout_s`` passes without any confirm.
        """
        if self.role == "producer" and not self._closed and len(self._window):
            self._producer_call(lambda: self._publish("flush", drain=True), "flush")
        self._raise_refused()

    def _producer_call(self, op: Callable[[], None], what: str) -> None:
        try:
            self._reconnector.call(op, what)
        except pika.exceptions.ChannelClosedByBroker as e:
            # its unconfirmed messages go to the next connection (the one the broker choked on aside)
            limit = size_limit(e)
            too_large = 0 if limit is None else self._window.drop_larger_than(limit)
            self._drop_connection()
            raise closed_channel_error(self.source_name, e, too_large, self.unconfirmed) from e

    def _publish(self, what: str, *, drain: bool) -> None:
        """Publish what is unsent, within the window; with ``drain``, then wait for every confirm."""
        conn, channel = self._open_channel()
        window = self._window
        while window.unsent:
            if not window.has_room():
                self._wait(conn, window.has_room, what)
            data = window.publishing()  # registered first: its confirm may be read while basic_publish flushes
            channel.basic_publish("", self.queue_name, data, _PERSISTENT, mandatory=True)
        if drain:
            self._wait(conn, lambda: not window.unconfirmed, what)

    def _wait(self, conn: pika.BlockingConnection, done: Callable[[], bool], what: str) -> None:
        """Read confirms until ``done()``; raise when ``confirm_timeout_s`` passes without one."""
        timeout = self.params.confirm_timeout_s
        progress = self._window.confirmed
        deadline = time.monotonic() + timeout
        self._wake_when = done
        try:
            while not done():
                if self._window.confirmed != progress:
                    progress = self._window.confirmed
                    deadline = time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    unsent = self._window.unsent
                    waiting = f" ({len(unsent)} more wait to be published)" if unsent else ""
                    raise QueueError(
                        f"{self.source_name}: {what}: the broker confirmed none of the "
                        f"{len(self._window.unconfirmed)} "
                        f"message(s) in flight{waiting} within {timeout:g}s (confirm_timeout_s); RabbitMQ "
                        "blocks publishers when memory or disk runs low: check `rabbitmqctl status` (alarms) "
                        "and free disk space. They are kept: put or flush waits again, close gives them up"
                    )
                conn.process_data_events(time_limit=min(remaining, 1.0))
                if self._channel_closed is not None:
                    raise self._channel_closed
        finally:
            self._wake_when = None

    def _on_confirm(self, frame: Any) -> None:
        if self._conn is None:
            return  # a confirm read while the old connection closes: its messages were requeued already
        method = frame.method
        self._window.settle(method.delivery_tag, method.multiple, isinstance(method, pika.spec.Basic.Nack))
        if self._wake_when is not None and self._wake_when():
            self._conn.add_callback_threadsafe(wake)  # makes process_data_events return now

    def _on_return(self, _channel: Any, _method: Any, _properties: Any, _body: bytes) -> None:
        # the broker acks a returned message after returning it: count it here, not as refused
        if self._conn is not None:
            self._window.returned += 1

    def _on_channel_close(self, _channel: Any, reason: Exception) -> None:
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker) and self._conn is not None:
            self._channel_closed = reason
            self._conn.add_callback_threadsafe(wake)

    def _raise_refused(self) -> None:
        error = self._window.take_refusal(self.source_name, self.params.capacity)
        if error is not None:
            raise error

    # ------------------------------------------------------------ consumer
    def _on_delivery(
        self, _channel: Any, method: pika.spec.Basic.Deliver, _properties: Any, body: bytes
    ) -> None:
        tag = method.delivery_tag
        note = " (redelivered)" if method.redelivered else ""
        refused = read_refusal(len(body), self.max_read_bytes)  # pika read it already; not decoded, at least
        self._buffer.append(QueueMessage(
            data=b"" if refused else body,
            source=f"amqp queue {self.queue_name} tag {tag}{note}",
            receipt=tag,
            generation=self._generation,
            _ack_many=self.ack_many,
            refused=refused,
        ))

    def get_many(self, max_messages: int, timeout: float) -> list[Message]:
        self._require_consumer()
        max_messages = max(1, int(max_messages))
        deadline = time.monotonic() + max(0.0, timeout)

        def fetch() -> list[Message]:
            conn, _ = self._open_channel()
            if len(self._buffer) < max_messages:
                conn.process_data_events(time_limit=0)
            while not self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                conn.process_data_events(time_limit=remaining)
            # no more than the broker may push ahead of the acks (prefetch) can come while lingering
            wanted = min(max_messages, self.params.prefetch - len(self._held))
            linger_end = time.monotonic() + self.params.read_linger_s
            while len(self._buffer) < wanted and (left := linger_end - time.monotonic()) > 0:
                conn.process_data_events(time_limit=left)  # returns once a delivery came, or at the end
            out: list[Message] = []
            while self._buffer and len(out) < max_messages:
                message = self._buffer.popleft()
                self._held[message.receipt] = message
                out.append(message)
            return out

        return self._reconnector.call(fetch, "get")

    def ack_many(self, messages: Sequence[Message]) -> None:
        todo = as_queue_messages(messages, self.source_name)
        current = [m for m in todo if m.generation == self._generation and m.receipt in self._held]
        for m in todo:
            m.acked = True  # a stale one is back in the queue already: nothing to ack
            m.returned = m not in current
        if len(current) < len(todo):
            logger.info("%s: %d message(s) came over a connection that was lost; the broker redelivers them",
                        self.source_name, len(todo) - len(current))
        if not current or self._channel is None:
            return
        tags = sorted(m.receipt for m in current)
        try:
            if set(tags) == {t for t in self._held if t <= tags[-1]}:
                self._channel.basic_ack(tags[-1], multiple=True)
            else:
                for tag in tags:
                    self._channel.basic_ack(tag)
        except TRANSIENT as e:
            logger.info("%s: connection lost while acking (%s); the broker redelivers those messages",
                        self.source_name, e)
            for m in current:
                m.returned = True
            self._drop_connection()
            return
        for tag in tags:
            self._held.pop(tag, None)

    # ------------------------------------------------------------ both
    def depth(self) -> int | None:
        def count() -> int:
            _, channel = self._open_channel()
            ok = channel.queue_declare(self.queue_name, passive=True)
            ready = int(ok.method.message_count)
            # read after the round trip, which read the confirms that came before its answer
            return ready + len(self._buffer) + len(self._held) + self.unconfirmed

        try:
            return self._reconnector.call(count, "depth")
        except pika.exceptions.ChannelClosedByBroker as e:
            self._drop_connection()
            if e.reply_code != 404:
                raise QueueError(f"{self.source_name}: cannot read the queue's depth ({e.reply_code} "
                                 f"{e.reply_text})") from e
        # NOT_FOUND: the queue was deleted (a task replaced or removed): declared again as the connection is
        logger.warning("%s: the queue vanished (the task deleted or replaced?); declaring it again", self.source_name)
        return self._reconnector.call(count, "depth")

    def close(self) -> None:
        """Flush (a producer), then release the connection.

        Raises ``QueueError`` when the broker confirms nothing for
        ``confirm_timeout_s`` and ``BrokerUnavailableError`` when it stays
        away, saying how many messages were left unconfirmed; the connection
        is released all the same. Payloads the broker refused are logged,
        not raised (a closing producer would not resend them): call
        ``flush()`` first to get them as ``QueueFullError.rejected``.
        """
        if self._closed:
            return
        try:
            self.flush()
        except QueueFullError as e:
            logger.warning("%s: closing: %s. They were not put again (flush() before close() hands them back)",
                           self.source_name, e)
        finally:
            self._closed = True
            self._drop_connection()
            if self._window.unsent:
                logger.error("%s: closed with %d message(s) the broker never confirmed: they may or may not "
                             "be in the queue", self.source_name, len(self._window.unsent))
                self._window.unsent.clear()

    def destroy(self) -> None:
        """Delete the queue (end of task); its messages are gone, and so are unconfirmed ones."""
        self._window.forget()  # what this producer still had to publish or see confirmed
        try:
            _, channel = self._open_channel()
            channel.queue_delete(self.queue_name)
        except ANY_AMQP_ERROR:
            conn = pika.BlockingConnection(connection_parameters(self.params, self.connection_name))
            try:
                conn.channel().queue_delete(self.queue_name)
            finally:
                close_quietly(conn)
        finally:
            self.close()
