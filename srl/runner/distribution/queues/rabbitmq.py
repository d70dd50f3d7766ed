"""RabbitMQ experience queue (AMQP 0-9-1 through pika's BlockingConnection).

Features:
    * durable queue, persistent messages (delivery mode 2), publisher
      confirms: ``put``/``put_many`` return once the broker confirmed every
      message, waiting once per call (not once per message);
    * ``x-max-length`` (``capacity``) with ``x-overflow: reject-publish`` as a
      backstop: beyond it the broker nacks and ``put_many`` raises
      ``QueueFullError`` carrying the refused payloads (back off, send them again);
    * manual ack, ``basic_qos`` prefetch; unacked messages go back to the queue
      when the consumer's connection closes or dies;
    * ``depth()``: passive ``queue_declare`` message count plus what this
      consumer holds unacked (exact with one consumer);
    * reconnect with backoff for ``reconnect_timeout_s`` when the broker goes
      away; a put in flight resends what was not confirmed (at-least-once).

A queue object belongs to one thread: pika's BlockingConnection is not
thread-safe, and each queue object has its own connection.

Connection string:
    ``amqp://[user:password@]host[:port][/vhost]``, ``amqps://`` (TLS); the
    query string goes to pika (``?heartbeat=30&connection_attempts=3``).

Options (fields of ``RabbitMQParameters``): queue_name, prefetch, capacity,
queue_arguments, heartbeat_s, confirm_timeout_s, reconnect_timeout_s,
max_message_bytes.

Redeclaring an existing queue with other arguments (another ``capacity``) is
an error in RabbitMQ (PRECONDITION_FAILED); this backend then logs how to
change it and uses the queue as it is.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

from srl.runner.distribution.queue_parameters import RabbitMQParameters
from srl.runner.distribution.queues.base import (
    BrokerUnavailableError,
    ExperienceQueue,
    Message,
    QueueError,
    QueueFullError,
    QueueMessage,
    Reconnector,
    Role,
    as_queue_messages,
    safe_name,
)

logger = logging.getLogger("srl.queues.rabbitmq")

_TRANSIENT: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.ChannelWrongStateError,
    ConnectionError,
    OSError,
)
_ANY_AMQP_ERROR: tuple[type[BaseException], ...] = (pika.exceptions.AMQPError, *_TRANSIENT)
_PERSISTENT = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent,
                                   content_type="application/octet-stream")
_warned_arguments: set[str] = set()


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
    ) -> None:
        self.params = params
        self.role = role
        self.queue_name = params.queue_name or queue_name_for(namespace)
        self.connection_name = f"srl {role} {consumer_name or ''} {namespace}".replace("  ", " ")
        self.max_message_bytes = params.max_message_bytes
        self.source_name = f"amqp queue {self.queue_name} on {params.describe()}"
        self._conn: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._generation = 0
        self._buffer: deque[QueueMessage] = deque()
        self._held: dict[int, QueueMessage] = {}  # delivery tag -> handed out, not acked (this connection)
        self._next_tag = 0
        self._outstanding: dict[int, int] = {}  # delivery tag -> index in the batch being confirmed
        self._nacked: list[int] = []
        self._returned = 0
        self._closed = False
        self._reconnector = Reconnector(
            broker=f"RabbitMQ at {params.describe()}",
            transient=_TRANSIENT,
            reconnect=self._connect,
            timeout_s=params.reconnect_timeout_s,
            hint="check that rabbitmq-server is running there (scripts/services.sh status), reachable, "
            "and not blocking publishers (rabbitmqctl status: alarms)",
        )
        try:
            self._connect()
        except pika.exceptions.ProbableAuthenticationError as e:
            raise BrokerUnavailableError(
                f"RabbitMQ at {params.describe()} refused the login ({e}); check username/password "
                "(the guest user can only log in from localhost)"
            ) from e
        except pika.exceptions.ConnectionClosedByBroker as e:
            raise BrokerUnavailableError(
                f"RabbitMQ at {params.describe()} closed the connection ({e.reply_code} {e.reply_text}); "
                f"check the user's permissions on vhost {params.virtual_host!r}"
            ) from e
        except _TRANSIENT as e:
            raise BrokerUnavailableError(
                f"cannot reach RabbitMQ at {params.describe()} for the experience queue "
                f"({type(e).__name__}: {e}); is rabbitmq-server running there? start it "
                "(scripts/services.sh start) or fix host/port/url"
            ) from e

    # ------------------------------------------------------------ connection
    def _connection_parameters(self) -> pika.ConnectionParameters | pika.URLParameters:
        p = self.params
        client_properties = {"connection_name": self.connection_name}
        if p.url is not None:
            url_params = pika.URLParameters(p.url)
            if "heartbeat" not in p.url:
                url_params.heartbeat = p.heartbeat_s
            url_params.client_properties = client_properties
            return url_params
        ssl_options = None
        if p.ssl:
            ssl_options = pika.SSLOptions(ssl.create_default_context(), p.host)
        return pika.ConnectionParameters(
            host=p.host,
            port=p.port,
            virtual_host=p.virtual_host,
            credentials=pika.PlainCredentials(p.username, p.password),
            heartbeat=p.heartbeat_s,
            ssl_options=ssl_options,
            connection_attempts=1,
            socket_timeout=10,
            client_properties=client_properties,
        )

    def _connect(self) -> None:
        self._drop_connection()
        conn = pika.BlockingConnection(self._connection_parameters())
        try:
            channel = self._declare(conn)
            if self.role == "producer":
                self._enable_confirms(conn, channel)
                channel.add_on_return_callback(self._on_return)
            else:
                channel.basic_qos(prefetch_count=self.params.prefetch)
                channel.basic_consume(self.queue_name, self._on_delivery, auto_ack=False)
        except BaseException:
            _close_quietly(conn)
            raise
        self._conn, self._channel = conn, channel
        self._generation += 1

    def _declare(self, conn: pika.BlockingConnection) -> BlockingChannel:
        arguments: dict[str, Any] = {"x-max-length": self.params.capacity, "x-overflow": "reject-publish"}
        arguments.update(self.params.queue_arguments)
        channel = conn.channel()
        try:
            channel.queue_declare(self.queue_name, durable=True, arguments=arguments)
            return channel
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code != 406:  # PRECONDITION_FAILED: it exists with other arguments
                raise QueueError(f"{self.source_name}: cannot declare the queue ({e.reply_code} {e.reply_text})") from e
            if self.queue_name not in _warned_arguments:
                _warned_arguments.add(self.queue_name)
                logger.warning(
                    "%s: the queue already exists with other arguments than %s (%s); using it as it is. "
                    "To apply these, delete it first (rabbitmqctl delete_queue %s, which drops its messages) "
                    "or choose another queue_name.",
                    self.source_name, arguments, e.reply_text, self.queue_name,
                )
        channel = conn.channel()
        channel.queue_declare(self.queue_name, passive=True)
        return channel

    def _enable_confirms(self, conn: pika.BlockingConnection, channel: BlockingChannel) -> None:
        # BlockingChannel.confirm_delivery() makes every basic_publish wait for its own
        # confirm (one round trip per message). Enabling confirm mode on the underlying
        # channel instead lets put_many publish a whole batch and wait once.
        selected: list[bool] = []

        def on_select_ok(_frame: Any) -> None:
            selected.append(True)
            conn.add_callback_threadsafe(_wake)

        channel._impl.confirm_delivery(ack_nack_callback=self._on_confirm, callback=on_select_ok)
        deadline = time.monotonic() + 10.0
        while not selected:
            if time.monotonic() > deadline:
                raise pika.exceptions.AMQPConnectionError("no Confirm.SelectOk from the broker within 10s")
            conn.process_data_events(time_limit=0.5)
        self._next_tag = 0

    def _drop_connection(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        # what was fetched over the old connection goes back to the queue with it
        self._buffer.clear()
        self._held.clear()
        self._outstanding.clear()
        if conn is not None:
            _close_quietly(conn)

    def _open_channel(self) -> tuple[pika.BlockingConnection, BlockingChannel]:
        if self._closed:
            raise QueueError(f"{self.source_name}: the queue is closed")
        if self._conn is None or self._channel is None or not self._conn.is_open or not self._channel.is_open:
            raise pika.exceptions.ConnectionWrongStateError("connection lost")
        return self._conn, self._channel

    # ------------------------------------------------------------ producer
    def put(self, data: bytes) -> None:
        self.put_many([data])

    def put_many(self, items: Sequence[bytes]) -> None:
        pending = self._payloads(items)

        def attempt() -> None:
            nonlocal pending
            conn, channel = self._open_channel()
            self._outstanding.clear()
            self._nacked.clear()
            self._returned = 0
            published = 0
            try:
                for index, data in enumerate(pending):
                    # registered before publishing: its confirm may be read while basic_publish flushes
                    self._next_tag += 1
                    self._outstanding[self._next_tag] = index
                    channel.basic_publish("", self.queue_name, data, _PERSISTENT, mandatory=True)
                    published += 1
                self._wait_for_confirms(conn)
            except _TRANSIENT:
                # resend what the broker did not confirm (it may hold some of it: at-least-once)
                again = set(self._outstanding.values()) | set(self._nacked) | set(range(published, len(pending)))
                pending = [pending[i] for i in sorted(again)]
                self._drop_connection()
                raise
            except pika.exceptions.ChannelClosedByBroker as e:
                self._drop_connection()
                if e.reply_code == 406 and "size" in e.reply_text:
                    raise ValueError(
                        f"{self.source_name}: the broker refused a message as too large ({e.reply_text}); "
                        "lower max_message_bytes to the broker's max_message_size and split batches"
                    ) from e
                if e.reply_code == 404:
                    raise QueueError(f"{self.source_name}: the queue does not exist any more ({e.reply_text}); "
                                     "was the task's queue deleted?") from e
                raise QueueError(f"{self.source_name}: the broker closed the channel ({e.reply_code} "
                                 f"{e.reply_text})") from e

        if pending:
            self._reconnector.call(attempt, "put")
        if self._returned:
            raise QueueError(
                f"{self.source_name}: {self._returned} message(s) could not be routed: the queue does not "
                "exist any more (was the task's queue deleted?)"
            )
        if self._nacked:
            rejected = [pending[i] for i in sorted(self._nacked)]
            self._nacked.clear()
            raise QueueFullError(
                f"{self.source_name}: the broker refused {len(rejected)} of {len(pending)} message(s): the "
                f"queue is at its capacity (x-max-length={self.params.capacity}) or the broker had an internal "
                "error; back off and put them again",
                rejected,
            )

    def _wait_for_confirms(self, conn: pika.BlockingConnection) -> None:
        deadline = time.monotonic() + self.params.confirm_timeout_s
        while self._outstanding:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise QueueError(
                    f"{self.source_name}: the broker confirmed none of the last {len(self._outstanding)} "
                    f"message(s) within {self.params.confirm_timeout_s:.0f}s; RabbitMQ blocks publishers "
                    "when memory or disk runs low: check `rabbitmqctl status` (alarms) and free disk space"
                )
            conn.process_data_events(time_limit=min(remaining, 1.0))

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag, multiple = method.delivery_tag, method.multiple
        tags = [t for t in self._outstanding if t <= tag] if multiple else [tag]
        nack = isinstance(method, pika.spec.Basic.Nack)
        for t in tags:
            index = self._outstanding.pop(t, None)
            if nack and index is not None:
                self._nacked.append(index)
        if self._conn is not None and not self._outstanding:
            self._conn.add_callback_threadsafe(_wake)  # makes process_data_events return now

    def _on_return(self, _channel: Any, _method: Any, _properties: Any, _body: bytes) -> None:
        self._returned += 1

    # ------------------------------------------------------------ consumer
    def _on_delivery(
        self, _channel: Any, method: pika.spec.Basic.Deliver, _properties: Any, body: bytes
    ) -> None:
        tag = method.delivery_tag
        note = " (redelivered)" if method.redelivered else ""
        self._buffer.append(QueueMessage(
            data=body,
            source=f"amqp queue {self.queue_name} tag {tag}{note}",
            receipt=tag,
            generation=self._generation,
            _ack_many=self.ack_many,
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
        except _TRANSIENT as e:
            logger.info("%s: connection lost while acking (%s); the broker redelivers those messages",
                        self.source_name, e)
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
            return ready + len(self._buffer) + len(self._held)

        try:
            return self._reconnector.call(count, "depth")
        except pika.exceptions.ChannelClosedByBroker as e:
            self._drop_connection()
            raise QueueError(f"{self.source_name}: cannot read the queue's depth ({e.reply_code} "
                             f"{e.reply_text}); was the task's queue deleted?") from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_connection()

    def destroy(self) -> None:
        """Delete the queue (end of task); its messages are gone."""
        try:
            _, channel = self._open_channel()
            channel.queue_delete(self.queue_name)
        except _ANY_AMQP_ERROR:
            conn = pika.BlockingConnection(self._connection_parameters())
            try:
                conn.channel().queue_delete(self.queue_name)
            finally:
                _close_quietly(conn)
        finally:
            self.close()


def _wake() -> None:
    """A no-op callback: scheduling it makes BlockingConnection.process_data_events return."""


def _close_quietly(conn: pika.BlockingConnection) -> None:
    try:
        if conn.is_open:
            conn.close()
    except Exception as e:  # closing a dead connection: nothing left to do
        logger.debug("closing the RabbitMQ connection: %s", e)
