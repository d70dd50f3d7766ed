"""The experience queue: actors put encoded batches, the trainer gets and acks them.

Owns: the ``ExperienceQueue`` protocol (see ``base``), the registry of backends
by URL scheme and ``open_queue``. Must never: see numpy or torch (it moves
bytes), or import a broker's client library outside that broker's module.

Backends (Kombu style: dotted paths, imported only when used)::

    redis:// rediss:// unix://   Redis Streams + consumer group   (core install)
    amqp:// amqps://             RabbitMQ, durable queue           pip install "srl[rabbitmq]"
    mqtt:// mqtts://             MQTT 5 QoS 1, persistent session  pip install "srl[mqtt]"
    pubsub://PROJECT/TOPIC       Google Cloud Pub/Sub              pip install "srl[gcp]"

All of them are at-least-once: a message is gone only once the caller acked
it; unacked ones come back to the next consumer. The batches carry
``(actor, epoch, seq)`` so the trainer recognises a duplicate.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from srl.runner.distribution.queue_parameters import (
    GCPParameters,
    MQTTParameters,
    QueueParameters,
    RabbitMQParameters,
    parse_queue_url,
)
from srl.runner.distribution.queues.base import (
    BrokerUnavailableError,
    ExperienceQueue,
    Message,
    MissingBackendLibraryError,
    QueueError,
    QueueFullError,
    QueueMessage,
    Role,
)
from srl.runner.distribution.redis_parameters import RedisParameters

__all__ = [
    "BACKENDS",
    "BrokerUnavailableError",
    "ExperienceQueue",
    "GCPParameters",
    "MQTTParameters",
    "Message",
    "MissingBackendLibraryError",
    "QueueError",
    "QueueFullError",
    "QueueMessage",
    "RabbitMQParameters",
    "describe_queue",
    "open_queue",
    "queue_scheme",
    "unknown_scheme_error",
]


@dataclass(frozen=True)
class Backend:
    """Where a backend lives and what it needs installed."""

    name: str
    """canonical scheme, the one ``queue_scheme`` reports"""
    path: str
    """module:Class, imported on first use"""
    library: str | None
    """top-level module of its client library (None: a core dependency)"""
    extra: str | None
    """the srl extra that installs it"""


_REDIS = Backend("redis", "srl.runner.distribution.queues.redis_stream:RedisStreamQueue", None, None)
_AMQP = Backend("amqp", "srl.runner.distribution.queues.rabbitmq:RabbitMQQueue", "pika", "rabbitmq")
_MQTT = Backend("mqtt", "srl.runner.distribution.queues.mqtt:MQTTQueue", "paho", "mqtt")
_PUBSUB = Backend("pubsub", "srl.runner.distribution.queues.pubsub:PubSubQueue", "google", "gcp")

BACKENDS: dict[str, Backend] = {
    "redis": _REDIS,
    "rediss": _REDIS,
    "unix": _REDIS,
    "amqp": _AMQP,
    "amqps": _AMQP,
    "mqtt": _MQTT,
    "mqtts": _MQTT,
    "pubsub": _PUBSUB,
}
"""URL scheme -> backend. Add one here: a module with a class taking (params, namespace=, role=, ...)."""

_BY_PARAMS: dict[type, Backend] = {
    RedisParameters: _REDIS,
    RabbitMQParameters: _AMQP,
    MQTTParameters: _MQTT,
    GCPParameters: _PUBSUB,
}


def unknown_scheme_error(scheme: str) -> ValueError:
    """ValueError for a URL scheme no backend handles, listing the known ones."""
    known = sorted(BACKENDS)
    close = difflib.get_close_matches(scheme.lower(), known, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"No such queue backend: {scheme!r}. Known schemes: {', '.join(known)}.{hint}")


def _as_parameters(
    params: QueueParameters | str | None, redis_params: RedisParameters | None
) -> QueueParameters:
    if params is None:
        if redis_params is None:
            raise ValueError(
                "params=None means the queue lives in the board's Redis, but redis_params was not given; "
                "pass redis_params=RedisParameters(...) or a queue URL/parameters"
            )
        return redis_params
    if isinstance(params, str):
        return parse_queue_url(params)
    if isinstance(params, tuple(_BY_PARAMS)):
        return params
    raise TypeError(
        "queue parameters must be None (the board's Redis), a URL str, RedisParameters, "
        f"RabbitMQParameters, MQTTParameters or GCPParameters; got {type(params).__name__}"
    )


def _backend_for(params: QueueParameters) -> Backend:
    return _BY_PARAMS[type(params)]


def queue_scheme(params: QueueParameters | str | None) -> str:
    """Canonical scheme of the queue ``params`` point at: redis, amqp, mqtt or pubsub.

    None counts as redis (the board's Redis). Imports no client library.
    """
    if params is None:
        return _REDIS.name
    if isinstance(params, str):
        scheme = params.partition("://")[0].lower()
        if scheme not in BACKENDS:
            raise unknown_scheme_error(scheme)
        return BACKENDS[scheme].name
    return _backend_for(_as_parameters(params, None)).name


def describe_queue(params: QueueParameters | str | None) -> str:
    """Where the queue lives, without secrets (for the task record and log lines)."""
    if params is None:
        return "the board's Redis"
    return _as_parameters(params, None).describe()


def _load(backend: Backend) -> type[ExperienceQueue]:
    module_name, _, class_name = backend.path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = (e.name or "").split(".")[0]
        if backend.library is not None and missing == backend.library:
            raise MissingBackendLibraryError(
                f"the {backend.name} queue needs the {backend.library!r} package, which is not installed "
                f"({e}); install it with: pip install \"srl[{backend.extra}]\""
            ) from e
        raise
    cls: type[ExperienceQueue] = getattr(module, class_name)
    return cls


def open_queue(
    params: QueueParameters | str | None,
    *,
    namespace: str,
    role: Role,
    redis_params: RedisParameters | None = None,
    consumer_name: str | None = None,
    options: Mapping[str, Any] | None = None,
    max_read_bytes: int | None = None,
    prefetch: int | None = None,
) -> ExperienceQueue:
    """Connect to the experience queue of task ``namespace`` as a producer or the consumer.

    ``params`` None: the Redis queue on the board's Redis (``redis_params``).
    A str is a URL: redis://, rediss://, unix://, amqp://, amqps://, mqtt://,
    mqtts:// or pubsub://PROJECT/TOPIC. ``consumer_name`` names this consumer
    where the broker keeps one per consumer (Redis); ``options`` are backend
    options (Kombu's transport options): for Redis e.g.
    ``{"claim_min_idle_s": 30.0}``; for the other backends they override fields
    of the parameters dataclass. ``max_read_bytes`` (consumer): larger
    payloads are handed out ``refused`` instead of decoded, and not even read
    where the backend can tell first (Redis, MQTT). ``prefetch`` (consumer):
    how many messages a broker that pushes (RabbitMQ, MQTT) may hand this
    consumer ahead of its acks, overriding the parameters' ``prefetch``; what
    is pushed ahead no longer counts as queued on RabbitMQ, so a trainer keeps
    it to three reads (``TrainerOptions.prefetch``): actors may put that many
    past the queue's capacity. Raises
    ``BrokerUnavailableError`` (a ``ConnectionError``) when the broker does not answer.
    """
    if role not in ("producer", "consumer"):
        raise ValueError(f"role must be 'producer' or 'consumer', got {role!r}")
    if not namespace:
        raise ValueError("namespace must be a non-empty task namespace (it names the queue)")
    resolved = _as_parameters(params, redis_params)
    backend = _backend_for(resolved)
    if prefetch is not None and any(f.name == "prefetch" for f in dataclasses.fields(resolved)):
        resolved = dataclasses.replace(resolved, prefetch=max(1, int(prefetch)))  # type: ignore[arg-type]
    extra: dict[str, Any] = dict(options or {})
    if extra and not isinstance(resolved, RedisParameters):
        fields = {f.name for f in dataclasses.fields(resolved)}
        unknown = sorted(set(extra) - fields)
        if unknown:
            raise TypeError(
                f"unknown option(s) {unknown} for {type(resolved).__name__}; known: {', '.join(sorted(fields))}"
            )
        resolved = dataclasses.replace(resolved, **extra)
        extra = {}
    cls = _load(backend)
    if extra:
        accepted = [
            name for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
            and name not in ("namespace", "role", "consumer_name", "max_read_bytes")
        ]
        unknown = sorted(set(extra) - set(accepted))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown} for the {backend.name} queue; known: {', '.join(accepted)}")
    queue: ExperienceQueue = cls(  # type: ignore[call-arg]
        resolved, namespace=namespace, role=role, consumer_name=consumer_name, max_read_bytes=max_read_bytes,
        **extra,
    )
    return queue
