"""The experience queue: actors put encoded batches, the trainer gets and acks them.

Owns: the ``ExperienceQueue`` protocol (see ``base``), the table of backends
(:data:`BACKENDS`: schemes, parameters class, module) that everything else
reads, and ``open_queue``. Must never: see numpy or torch (it moves bytes), or
import a broker's client library outside that broker's modules.

Backends (Kombu style: dotted paths, imported only when used)::

    redis:// rediss:// unix://   Redis Streams + consumer group   (core install)
    amqp:// amqps://             RabbitMQ, durable queue           pip install "srl[rabbitmq]"
    mqtt:// mqtts://             MQTT 5 QoS 1, persistent session  pip install "srl[mqtt]"
    pubsub://PROJECT/TOPIC       Google Cloud Pub/Sub              pip install "srl[gcp]"

All of them are at-least-once: a message is gone only once the caller acked
it; unacked ones come back to the next consumer. The batches carry
``(actor, epoch, seq)`` so the trainer recognises a duplicate.

A new backend is one module and one row: a module with its ``ExperienceQueue``
class (its client library imported there) and a parameters dataclass that
imports no client library (``from_url``, ``describe()``, ``replace()``), and a
:class:`Backend` in :data:`BACKENDS` (or :func:`register` for one outside srl).
URL parsing, ``describe_queue``, ``queue_scheme``, local processes and clearing
a task's leftovers all read the table.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from srl.runner.distribution.queues.base import (
    BrokerUnavailableError,
    ExperienceQueue,
    Message,
    MissingBackendLibraryError,
    QueueError,
    QueueFullError,
    QueueMessage,
    QueueParameters,
    Role,
)
from srl.runner.distribution.settings.redis_parameters import RedisParameters

__all__ = [
    "BACKENDS",
    "Backend",
    "BrokerUnavailableError",
    "ExperienceQueue",
    "Message",
    "MissingBackendLibraryError",
    "QueueError",
    "QueueFullError",
    "QueueMessage",
    "QueueParameters",
    "check_queue",
    "describe_queue",
    "discard_leftovers",
    "open_queue",
    "parameter_classes",
    "parse_queue_url",
    "queue_scheme",
    "register",
    "unknown_scheme_error",
]


@dataclass(frozen=True)
class Backend:
    """One experience-queue backend: its schemes, its parameters, its module, what it needs installed."""

    name: str
    """canonical scheme, the one ``queue_scheme`` reports"""
    schemes: tuple[str, ...]
    """URL schemes it takes"""
    parameters: str
    """module:Class of its parameters dataclass (imports no client library): ``from_url``, ``describe``"""
    queue: str
    """module:Class of its ExperienceQueue, imported on first use"""
    library: str | None = None
    """top-level module of its client library (None: a core dependency)"""
    extra: str | None = None
    """the srl extra that installs it"""


_PARAMS = "srl.runner.distribution.settings.queue_parameters"
_QUEUES = "srl.runner.distribution.queues"
BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("redis", ("redis", "rediss", "unix"), "srl.runner.distribution.settings.redis_parameters:RedisParameters",
            f"{_QUEUES}.redis_stream:RedisStreamQueue"),
    Backend("amqp", ("amqp", "amqps"), f"{_PARAMS}:RabbitMQParameters", f"{_QUEUES}.rabbitmq:RabbitMQQueue",
            "pika", "rabbitmq"),
    Backend("mqtt", ("mqtt", "mqtts"), f"{_PARAMS}:MQTTParameters", f"{_QUEUES}.mqtt:MQTTQueue", "paho", "mqtt"),
    Backend("pubsub", ("pubsub",), f"{_PARAMS}:GCPParameters", f"{_QUEUES}.pubsub:PubSubQueue", "google", "gcp"),
)}
"""Every backend by its canonical scheme: the one table URL parsing, open_queue and local nodes read."""


def register(backend: Backend) -> None:
    """Add a backend to the table (one outside srl); a scheme another backend takes is refused."""
    taken = {scheme: b.name for b in BACKENDS.values() for scheme in b.schemes if b.name != backend.name}
    clash = sorted(set(backend.schemes) & set(taken))
    if clash:
        raise ValueError(f"scheme(s) {clash} already belong to backend(s) {sorted({taken[c] for c in clash})}")
    BACKENDS[backend.name] = backend


def _by_scheme(scheme: str) -> Backend:
    for backend in BACKENDS.values():
        if scheme.lower() in backend.schemes:
            return backend
    raise unknown_scheme_error(scheme)


def _load(path: str) -> Any:
    module_name, _, name = path.partition(":")
    return getattr(importlib.import_module(module_name), name)


def parameter_classes() -> dict[str, type]:
    """The parameters dataclass of every backend, by class name (they import no client library)."""
    return {cls.__name__: cls for cls in (_load(b.parameters) for b in BACKENDS.values())}


def _by_params(params: Any) -> Backend:
    for backend in BACKENDS.values():
        if isinstance(params, _load(backend.parameters)):
            return backend
    raise TypeError(
        "queue parameters must be None (the board's Redis), a URL str, or the parameters of a backend ("
        f"{', '.join(sorted(parameter_classes()))}); got {type(params).__name__}"
    )


def unknown_scheme_error(scheme: str) -> ValueError:
    """ValueError for a URL scheme no backend handles, listing the known ones."""
    known = sorted(s for b in BACKENDS.values() for s in b.schemes)
    close = difflib.get_close_matches(scheme.lower(), known, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"No such queue backend: {scheme!r}. Known schemes: {', '.join(known)}.{hint}")


def parse_queue_url(url: str) -> QueueParameters:
    """The parameters a queue URL stands for (ValueError on a malformed URL or an unknown scheme)."""
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme:
        forms = ", ".join(f"{s}://..." for b in BACKENDS.values() for s in b.schemes)
        raise ValueError(f"a queue URL was expected ({forms}); got {url.partition('@')[2] or url!r}")
    params: QueueParameters = _load(_by_scheme(scheme).parameters).from_url(url)
    return params


def _as_parameters(params: Any, redis_params: RedisParameters | None) -> QueueParameters:
    if params is None:
        if redis_params is None:
            raise ValueError(
                "params=None means the queue lives in the board's Redis, but redis_params was not given; "
                "pass redis_params=RedisParameters(...) or a queue URL/parameters"
            )
        return redis_params
    if isinstance(params, str):
        return parse_queue_url(params)
    _by_params(params)
    return params


def queue_scheme(params: QueueParameters | str | None) -> str:
    """Canonical scheme of the queue ``params`` point at (redis, amqp, mqtt, pubsub, ...).

    None counts as redis (the board's Redis). Imports no client library.
    """
    if params is None:
        return "redis"
    if isinstance(params, str):
        return _by_scheme(params.partition("://")[0]).name
    return _by_params(params).name


def describe_queue(params: QueueParameters | str | None) -> str:
    """Where the queue lives, without secrets (for the task record and log lines)."""
    if params is None:
        return "the board's Redis"
    return _as_parameters(params, None).describe()


def check_queue(params: QueueParameters | str | None) -> str:
    """What a node checks when it starts, before any task comes: the queue's URL or parameters make sense
    (an unknown scheme, a malformed URL: ValueError) and its backend's client library is installed
    (MissingBackendLibraryError, naming the extra to install). Its description, as ``describe_queue``."""
    where = describe_queue(params)
    if params is not None:
        _queue_class(_by_params(_as_parameters(params, None)))
    return where


def _queue_class(backend: Backend) -> type[ExperienceQueue]:
    try:
        cls: type[ExperienceQueue] = _load(backend.queue)
    except ImportError as e:
        missing = (e.name or "").split(".")[0]
        if backend.library is not None and missing == backend.library:
            raise MissingBackendLibraryError(
                f"the {backend.name} queue needs the {backend.library!r} package, which is not installed "
                f"({e}); install it with: pip install \"srl[{backend.extra}]\""
            ) from e
        raise
    return cls


def discard_leftovers(params: QueueParameters | str | None, *, namespace: str,
                      redis_params: RedisParameters | None = None) -> int | None:
    """Delete what an earlier task named ``namespace`` left on the broker, before a new one starts; how
    many messages were there (None: the broker cannot tell). See ``ExperienceQueue.discard_leftovers``."""
    resolved = _as_parameters(params, redis_params)
    return _queue_class(_by_params(resolved)).discard_leftovers(resolved, namespace=namespace)


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
    resolved: Any = _as_parameters(params, redis_params)  # a backend's parameters dataclass
    backend = _by_params(resolved)
    if prefetch is not None and any(f.name == "prefetch" for f in dataclasses.fields(resolved)):
        resolved = dataclasses.replace(resolved, prefetch=max(1, int(prefetch)))
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
    cls = _queue_class(backend)
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
