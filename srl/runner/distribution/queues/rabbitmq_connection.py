"""RabbitMQ's connection for the experience queue: pika's parameters, the queue's declaration, and why
a connection was refused.

Owns: turning ``RabbitMQParameters`` into pika's connection parameters (TLS verified against
``ssl_ca_certs`` or the system CAs, our ``ssl_ca_certs`` query option kept from pika), declaring the
durable queue (and living with one declared with other arguments), switching a channel to confirm
mode without making each publish wait, and telling a refused login or permission, a broker out of
reach, and why the broker closed a channel, from other errors. Must never: publish, consume or keep
state of its own (``rabbitmq`` does); pika is imported here and in ``rabbitmq`` only.
"""

from __future__ import annotations

import logging
import re
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from srl.runner.distribution.queues.base import BrokerUnavailableError, QueueError
from srl.runner.distribution.settings.credentials import CredentialsError, authentication_failed, permission_denied
from srl.runner.distribution.settings.queue_parameters import RabbitMQParameters

logger = logging.getLogger("srl.queues.rabbitmq")

TRANSIENT: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.ChannelWrongStateError,
    ConnectionError,
    OSError,
)
ANY_AMQP_ERROR: tuple[type[BaseException], ...] = (pika.exceptions.AMQPError, *TRANSIENT)
_MAX_SIZE_TEXT = re.compile(r"larger than configured max size (\d+)")
_warned_arguments: set[str] = set()


def _tls_context(params: RabbitMQParameters) -> ssl.SSLContext:
    """Verifies the broker's certificate (against ``ssl_ca_certs``, else the system CAs) and host name."""
    try:
        context = ssl.create_default_context(cafile=params.ssl_ca_certs)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load the CA bundle ssl_ca_certs={params.ssl_ca_certs!r} for RabbitMQ at "
                         f"{params.describe()}: {e}; expected a PEM file of CA certificates") from e
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _without_query_option(url: str, name: str) -> tuple[str, str]:
    """``url`` without the query option ``name``, and the query that is left."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if all(k != name for k, _ in pairs):
        return url, parts.query
    query = urlencode([(k, v) for k, v in pairs if k != name])
    return urlunsplit(parts._replace(query=query)), query


def connection_parameters(params: RabbitMQParameters,
                          connection_name: str) -> pika.ConnectionParameters | pika.URLParameters:
    """pika's parameters for a connection to ``params`` that the broker lists as ``connection_name``."""
    p = params
    client_properties = {"connection_name": connection_name}
    if p.url is not None:
        url, query = _without_query_option(p.url, "ssl_ca_certs")  # ours (in p.ssl_ca_certs), not pika's
        url_params = pika.URLParameters(url)
        if "heartbeat" not in query:
            url_params.heartbeat = p.heartbeat_s
        if p.ssl and "ssl_options" not in query:
            url_params.ssl_options = pika.SSLOptions(_tls_context(p), p.host)
        url_params.client_properties = client_properties
        return url_params
    ssl_options = None
    if p.ssl:
        ssl_options = pika.SSLOptions(_tls_context(p), p.host)
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


def refusal(params: RabbitMQParameters, error: BaseException) -> CredentialsError | None:
    """A refused login (ACCESS_REFUSED), vhost or resource permission, as a refusal."""
    where = f"RabbitMQ at {params.describe()}"
    if isinstance(error, (pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError)):
        return authentication_failed(where, error, "the user and password of the queue URL or RabbitMQParameters "
                                     "(RabbitMQ's guest user can log in only from localhost)")
    if isinstance(error, pika.exceptions.ProbableAccessDeniedError):
        return permission_denied(where, error, f"give the user access to vhost {params.virtual_host!r} "
                                 "(rabbitmqctl set_permissions)")
    closed = error if isinstance(error, (pika.exceptions.ConnectionClosedByBroker,
                                         pika.exceptions.ChannelClosedByBroker)) else None
    if closed is not None and closed.reply_code == 403:  # ACCESS_REFUSED on a queue or an exchange
        return permission_denied(where, error, "give the user configure, write and read permissions on "
                                 "the task's queue (rabbitmqctl set_permissions)")
    return None


def open_failure(params: RabbitMQParameters, error: BaseException) -> Exception | None:
    """What the first connection's ``error`` is raised as: a refusal, or ``BrokerUnavailableError`` saying
    what to check; None for an error that is neither (it is raised as it is)."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return BrokerUnavailableError(
            f"TLS certificate verification failed for RabbitMQ at {params.describe()} ({error}); set "
            "ssl_ca_certs (RabbitMQParameters.ssl_ca_certs, or ?ssl_ca_certs=PATH in the amqps:// URL) to "
            "the CA that signed the broker's certificate, and connect by a host name that certificate names"
        )
    if not isinstance(error, ANY_AMQP_ERROR):
        return None
    refused = refusal(params, error)
    if refused is not None:
        return refused
    if isinstance(error, pika.exceptions.ConnectionClosedByBroker):
        return BrokerUnavailableError(
            f"RabbitMQ at {params.describe()} closed the connection ({error.reply_code} {error.reply_text}); "
            f"check the user's permissions on vhost {params.virtual_host!r}"
        )
    if not isinstance(error, TRANSIENT):
        return None
    return BrokerUnavailableError(
        f"cannot reach RabbitMQ at {params.describe()} for the experience queue "
        f"({type(error).__name__}: {error}); is rabbitmq-server running there? start it "
        "(scripts/services.sh start) or fix host/port/url"
    )


def size_limit(error: pika.exceptions.ChannelClosedByBroker) -> int | None:
    """The largest message the broker takes, where ``error`` (it closed the channel) names it."""
    match = _MAX_SIZE_TEXT.search(error.reply_text or "")
    return None if match is None else int(match.group(1))


def closed_channel_error(source_name: str, error: pika.exceptions.ChannelClosedByBroker, too_large: int,
                         unconfirmed: int) -> Exception:
    """What a put or flush raises when the broker closed the channel under it: ValueError for a message over
    its size (``too_large`` of them were dropped), ``QueueError`` for a queue that is gone or another reason
    (``unconfirmed`` messages go again with the next put or flush)."""
    if error.reply_code == 406 and "size" in error.reply_text:
        return ValueError(
            f"{source_name}: the broker refused a message as too large ({error.reply_text}); "
            f"{too_large} message(s) over its limit were not sent; lower max_message_bytes to "
            "the broker's max_message_size and split batches"
        )
    if error.reply_code == 404:
        return QueueError(f"{source_name}: the queue does not exist any more ({error.reply_text}); "
                          "was the task's queue deleted?")
    return QueueError(f"{source_name}: the broker closed the channel ({error.reply_code} "
                      f"{error.reply_text}); the {unconfirmed} unconfirmed message(s) are published "
                      "again by the next put or flush")


def declare_queue(conn: pika.BlockingConnection, queue_name: str, params: RabbitMQParameters,
                  source_name: str) -> BlockingChannel:
    """A channel on ``conn`` with the durable queue declared: with ``params``' capacity and arguments, or as
    it is when it exists with others (logged once per queue)."""
    arguments: dict[str, Any] = {"x-max-length": params.capacity, "x-overflow": "reject-publish"}
    arguments.update(params.queue_arguments)
    channel = conn.channel()
    try:
        channel.queue_declare(queue_name, durable=True, arguments=arguments)
        return channel
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code != 406:  # PRECONDITION_FAILED: it exists with other arguments
            raise QueueError(f"{source_name}: cannot declare the queue ({e.reply_code} {e.reply_text})") from e
        if queue_name not in _warned_arguments:
            _warned_arguments.add(queue_name)
            logger.warning(
                "%s: the queue already exists with other arguments than %s (%s); using it as it is. "
                "To apply these, delete it first (rabbitmqctl delete_queue %s, which drops its messages) "
                "or choose another queue_name.",
                source_name, arguments, e.reply_text, queue_name,
            )
    channel = conn.channel()
    channel.queue_declare(queue_name, passive=True)
    return channel


def enable_confirms(conn: pika.BlockingConnection, channel: BlockingChannel,
                    on_confirm: Callable[[Any], None]) -> None:
    """Put ``channel`` in confirm mode, ``on_confirm`` called with each Ack or Nack frame as it is read."""
    # BlockingChannel.confirm_delivery() makes every basic_publish wait for its own
    # confirm (one round trip per message). Enabling confirm mode on the underlying
    # channel instead lets put publish and go on, with the confirms read as they come.
    selected: list[bool] = []

    def on_select_ok(_frame: Any) -> None:
        selected.append(True)
        conn.add_callback_threadsafe(wake)

    channel._impl.confirm_delivery(ack_nack_callback=on_confirm, callback=on_select_ok)
    deadline = time.monotonic() + 10.0
    while not selected:
        if time.monotonic() > deadline:
            raise pika.exceptions.AMQPConnectionError("no Confirm.SelectOk from the broker within 10s")
        conn.process_data_events(time_limit=0.5)


def wake() -> None:
    """A no-op callback: scheduling it makes BlockingConnection.process_data_events return."""


def close_quietly(conn: pika.BlockingConnection) -> None:
    """Close ``conn`` if it is open; a failure to is logged at debug level, never raised."""
    try:
        if conn.is_open:
            conn.close()
    except Exception as e:  # closing a dead connection: nothing left to do
        logger.debug("closing the RabbitMQ connection: %s", e)
