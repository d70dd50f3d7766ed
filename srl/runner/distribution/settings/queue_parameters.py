"""Where the experience queue lives when it is not the board's Redis.

Owns: ``RabbitMQParameters``, ``MQTTParameters`` and ``GCPParameters``, each
built from its URL (``from_url``); ``srl.runner.distribution.queues`` picks the
class by the URL's scheme. Must never: import pika, paho or google-cloud
(the backend modules in ``srl.runner.distribution.queues`` do that) or hold a
connection. ``describe()`` never shows a password.

A URL in the ``url`` field fills the other fields it names; the fields it does
not name keep their values. Names (queue, topic, subscription, client id) left
as None are derived from the task namespace, so two tasks never share a queue.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from srl.base.config import Settings

MiB = 1024 * 1024



def _split(url: str, schemes: tuple[str, ...], form: str) -> Any:
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a non-numeric port
    except ValueError as e:
        raise ValueError(f"malformed queue URL {_hide_password(url)!r}: {e}; expected {form}") from None
    if parts.scheme not in schemes:
        raise ValueError(
            f"a {'/'.join(s + '://' for s in schemes)} URL was expected, like {form}; "
            f"got {_hide_password(url)!r}"
        )
    return parts


def _hide_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    return f"{scheme}://{netloc}{slash}{path}"


def _query_one(query: dict[str, list[str]], key: str) -> str | None:
    values = query.get(key)
    return values[-1] if values else None


def _replace(obj: Any, changes: dict[str, Any]) -> Any:
    return dataclasses.replace(obj, **changes)


# ---------------------------------------------------------------- RabbitMQ
@dataclass
class RabbitMQParameters(Settings):
    """A RabbitMQ (AMQP 0-9-1) broker holding the experience queue.

    Needs ``pip install "srl[rabbitmq]"`` (pika).
    """

    url: str | None = None
    """amqp://user:password@host:port/vhost or amqps:// (TLS); fills host, port, credentials, vhost, ssl.
    Query: ssl_ca_certs=PATH (amqps); the rest goes to pika as is (heartbeat=30, connection_attempts=3, ...)"""
    host: str = "localhost"
    """host name of the broker"""
    port: int = 5672
    """AMQP port (5671 is the usual TLS port)"""
    username: str = "guest"
    """user name (RabbitMQ's guest user can only log in from localhost)"""
    password: str = dataclasses.field(default="guest", repr=False)
    """password"""
    virtual_host: str = "/"
    """virtual host"""
    ssl: bool = False
    """connect with TLS (certificate and host name checked against ssl_ca_certs, else the system CAs)"""
    ssl_ca_certs: str | None = None
    """CA bundle (PEM file) that signed the broker's TLS certificate; None: the system CAs"""
    queue_name: str | None = None
    """durable queue name; None: derived from the task namespace (srl.<namespace>.exp)"""
    prefetch: int = 128
    """unacked messages the broker pushes ahead to the consumer (basic_qos prefetch_count)"""
    read_linger_s: float = 0.002
    """once a read has its first message, how long it waits for more (up to the count asked): after an
    ack the broker pushes the next messages at once, and a read that takes only those already in the
    socket pays the trainer's per-read costs for a few"""
    capacity: int = 100_000
    """x-max-length of the queue, a backstop: beyond it the broker refuses publishes
    (x-overflow reject-publish) and put raises QueueFullError; actors normally wait far earlier"""
    queue_arguments: dict[str, Any] = dataclasses.field(default_factory=dict)
    """extra x-arguments for queue_declare, e.g. {"x-queue-type": "quorum"}"""
    heartbeat_s: int = 60
    """AMQP heartbeat; a connection silent for about twice this is dropped (and reconnected)"""
    confirm_timeout_s: float = 60.0
    """how long put waits for the broker's publisher confirms before raising"""
    reconnect_timeout_s: float = 60.0
    """how long put/get keep reconnecting to a broker that went away before raising"""
    max_message_bytes: int = 128 * MiB
    """largest payload sent; RabbitMQ 3.x refuses bodies over max_message_size (128 MiB by default,
    16 MiB by default in RabbitMQ 4): keep this at or under your broker's setting"""

    def __post_init__(self) -> None:
        if self.url is None:
            if self.ssl_ca_certs is not None and not self.ssl:
                raise ValueError("ssl_ca_certs is set but ssl is False; set ssl=True (TLS), or drop ssl_ca_certs")
            return
        form = "amqp://[user:password@]host[:port][/vhost] or amqps://..."
        parts = _split(self.url, ("amqp", "amqps"), form)
        if not parts.hostname:
            raise ValueError(f"an AMQP URL needs a host, like {form}; got {_hide_password(self.url)!r}")
        self.ssl = parts.scheme == "amqps"
        self.host = parts.hostname
        self.port = parts.port or (5671 if self.ssl else 5672)
        if parts.username is not None:
            self.username = unquote(parts.username)
        if parts.password is not None:
            self.password = unquote(parts.password)
        if parts.path not in ("", "/"):
            self.virtual_host = unquote(parts.path[1:])
        ca_certs = _query_one(parse_qs(parts.query), "ssl_ca_certs")
        if ca_certs:
            self.ssl_ca_certs = ca_certs
        if self.ssl_ca_certs is not None and not self.ssl:
            raise ValueError(
                f"ssl_ca_certs is set but {_hide_password(self.url)!r} is not a TLS URL; use amqps://... "
                "(TLS), or drop ssl_ca_certs"
            )

    def __repr__(self) -> str:
        return f"RabbitMQParameters({self.describe()!r})"

    @classmethod
    def from_url(cls, url: str) -> RabbitMQParameters:
        return cls(url=url)

    def describe(self) -> str:
        """Where this points, without secrets, for log lines and errors."""
        scheme = "amqps" if self.ssl else "amqp"
        vhost = "" if self.virtual_host == "/" else "/" + self.virtual_host
        return f"{scheme}://{self.username}@{self.host}:{self.port}{vhost}"

    def replace(self, **changes: Any) -> RabbitMQParameters:
        result: RabbitMQParameters = _replace(self, changes)
        return result


# ---------------------------------------------------------------- MQTT
@dataclass
class MQTTParameters(Settings):
    """An MQTT broker (e.g. Mosquitto) carrying the experience queue over QoS 1.

    Needs ``pip install "srl[mqtt]"`` (paho-mqtt 2.x). One consumer per
    namespace: its persistent session (fixed client id) is what keeps batches
    for it while it reconnects. The broker must not drop queued messages:
    Mosquitto keeps only 1000 per session unless ``max_queued_messages 0``.
    """

    url: str | None = None
    """mqtt://user:password@host:port[/topic] or mqtts:// (TLS); fills host, port, credentials, tls, topic.
    Query: client_id=NAME, tls_ca_certs=PATH (mqtts)"""
    host: str = "localhost"
    """host name of the broker"""
    port: int = 1883
    """MQTT port (8883 is the usual TLS port)"""
    topic_name: str | None = None
    """topic the batches travel on; None: derived from the task namespace (srl/<namespace>/exp)"""
    username: str | None = None
    """user name, if the broker wants one"""
    password: str | None = dataclasses.field(default=None, repr=False)
    """password"""
    tls: bool = False
    """connect with TLS (certificate and host name checked against tls_ca_certs, else the system CAs)"""
    tls_ca_certs: str | None = None
    """CA bundle (PEM file) that signed the broker's TLS certificate; None: the system CAs"""
    client_id: str | None = None
    """client id of the consumer's persistent session; None: derived from the namespace"""
    keepalive_s: int = 30
    """MQTT keepalive; a dead connection is noticed after about 1.5 times this"""
    prefetch: int = 256
    """unacked messages the broker may push to the consumer (MQTT 5 Receive Maximum)"""
    read_linger_s: float = 0.002
    """once a read has its first message, how long it waits for more (up to the count asked): the broker
    pushes messages one by one, and a read of one pays the trainer's per-read costs for one"""
    inflight: int = 128
    """QoS 1 publishes a producer keeps in flight before waiting for PUBACKs"""
    session_expiry_s: int = 7 * 24 * 3600
    """how long the broker keeps the consumer's session (and its queued batches) while it is away"""
    confirm_timeout_s: float = 60.0
    """how long put waits for PUBACKs while connected before raising"""
    reconnect_timeout_s: float = 60.0
    """how long put/get keep reconnecting to a broker that went away before raising"""
    max_message_bytes: int = 64 * MiB
    """largest payload sent (MQTT allows 256 MiB; Mosquitto's message_size_limit may be lower)"""

    def __post_init__(self) -> None:
        if self.url is None:
            if self.tls_ca_certs is not None and not self.tls:
                raise ValueError("tls_ca_certs is set but tls is False; set tls=True (TLS), or drop tls_ca_certs")
            return
        form = "mqtt://[user:password@]host[:port][/topic] or mqtts://..."
        parts = _split(self.url, ("mqtt", "mqtts"), form)
        if not parts.hostname:
            raise ValueError(f"an MQTT URL needs a host, like {form}; got {_hide_password(self.url)!r}")
        self.tls = parts.scheme == "mqtts"
        self.host = parts.hostname
        self.port = parts.port or (8883 if self.tls else 1883)
        if parts.username is not None:
            self.username = unquote(parts.username)
        if parts.password is not None:
            self.password = unquote(parts.password)
        if parts.path not in ("", "/"):
            self.topic_name = unquote(parts.path[1:])
        query = parse_qs(parts.query)
        client_id = _query_one(query, "client_id")
        if client_id:
            self.client_id = client_id
        ca_certs = _query_one(query, "tls_ca_certs")
        if ca_certs:
            self.tls_ca_certs = ca_certs
        if self.tls_ca_certs is not None and not self.tls:
            raise ValueError(
                f"tls_ca_certs is set but {_hide_password(self.url)!r} is not a TLS URL; use mqtts://... "
                "(TLS), or drop tls_ca_certs"
            )

    def __repr__(self) -> str:
        return f"MQTTParameters({self.describe()!r})"

    @classmethod
    def from_url(cls, url: str) -> MQTTParameters:
        return cls(url=url)

    def describe(self) -> str:
        """Where this points, without secrets, for log lines and errors."""
        scheme = "mqtts" if self.tls else "mqtt"
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}{self.host}:{self.port}"

    def replace(self, **changes: Any) -> MQTTParameters:
        result: MQTTParameters = _replace(self, changes)
        return result


# ---------------------------------------------------------------- Google Cloud Pub/Sub
@dataclass
class GCPParameters(Settings):
    """A Google Cloud Pub/Sub topic and subscription carrying the experience queue.

    Needs ``pip install "srl[gcp]"`` (google-cloud-pubsub). Credentials come
    from the environment (GOOGLE_APPLICATION_CREDENTIALS or gcloud's
    application-default login); none are needed with the emulator.
    """

    project_id: str = ""
    """Google Cloud project id (any id with the emulator)"""
    topic_name: str | None = None
    """topic id; None: derived from the task namespace (srl-<namespace>-exp)"""
    subscription_name: str | None = None
    """subscription id the trainer pulls from; None: <topic>-trainer"""
    emulator_host: str | None = None
    """HOST:PORT of a Pub/Sub emulator; None: $PUBSUB_EMULATOR_HOST if set, else the real service"""
    url: str | None = None
    """pubsub://PROJECT[/TOPIC][?subscription=NAME&emulator_host=HOST:PORT]; fills the fields it names"""
    ack_deadline_s: int = 60
    """seconds a pulled, unacked message stays the trainer's before Pub/Sub redelivers it (10..600);
    applied when the subscription is created (by the first producer or consumer)"""
    batch_max_messages: int = 100
    """publisher batching: messages per publish request"""
    batch_max_bytes: int = 9 * MiB
    """publisher batching: bytes per publish request (Pub/Sub allows 10 MB)"""
    batch_max_latency_s: float = 0.005
    """publisher batching: how long a message waits for others to join its request"""
    confirm_timeout_s: float = 60.0
    """how long put waits for Pub/Sub to accept the messages before raising"""
    reconnect_timeout_s: float = 60.0
    """how long put/get keep retrying a service that went away before raising"""
    max_message_bytes: int = 10_000_000 - 64 * 1024
    """largest payload sent: Pub/Sub's limit is 10 MB per message and per request, less a margin"""

    def __post_init__(self) -> None:
        if self.url is None:
            return
        form = "pubsub://PROJECT[/TOPIC][?subscription=NAME&emulator_host=HOST:PORT]"
        parts = _split(self.url, ("pubsub",), form)
        if not parts.netloc or "@" in parts.netloc or ":" in parts.netloc:
            raise ValueError(f"a Pub/Sub URL names the project first, like {form}; got {self.url!r}")
        path = parts.path.strip("/")
        if "/" in path:
            raise ValueError(f"a Pub/Sub URL has at most one path segment (the topic), like {form}; "
                             f"got {self.url!r}")
        self.project_id = parts.netloc
        if path:
            self.topic_name = unquote(path)
        query = parse_qs(parts.query)
        unknown = sorted(set(query) - {"subscription", "emulator_host"})
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} in {self.url!r}; expected {form}")
        self.subscription_name = _query_one(query, "subscription") or self.subscription_name
        self.emulator_host = _query_one(query, "emulator_host") or self.emulator_host

    def __repr__(self) -> str:
        return f"GCPParameters({self.describe()!r})"

    @classmethod
    def from_url(cls, url: str) -> GCPParameters:
        return cls(url=url)

    @property
    def effective_emulator_host(self) -> str | None:
        """The emulator this talks to, if any (the field, else $PUBSUB_EMULATOR_HOST)."""
        return self.emulator_host or os.environ.get("PUBSUB_EMULATOR_HOST") or None

    def describe(self) -> str:
        """Where this points, without secrets, for log lines and errors."""
        topic = f"/{self.topic_name}" if self.topic_name else ""
        emulator = self.effective_emulator_host
        return f"pubsub://{self.project_id}{topic}" + (f" (emulator {emulator})" if emulator else "")

    def replace(self, **changes: Any) -> GCPParameters:
        result: GCPParameters = _replace(self, changes)
        return result
