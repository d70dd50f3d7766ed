"""Google Cloud Pub/Sub experience queue (google-cloud-pubsub), also against the emulator.

Features:
    * one topic and one subscription per task, created when missing (by the
      producer too, so batches sent before the trainer first comes are kept),
      with ``ack_deadline_s``;
    * ``put_many`` hands every message to the batching publisher and waits for
      all publish futures together;
    * ``get_many`` is one unary (synchronous) pull of up to ``max_messages``;
      ``ack_many`` one acknowledge request (per 1000 ack ids);
    * at-least-once: a message not acked within ``ack_deadline_s`` is delivered
      again; ``close()`` hands the unacked ones back at once (ack deadline 0);
    * with an emulator (``emulator_host`` or ``$PUBSUB_EMULATOR_HOST``) the
      clients run on insecure gRPC channels without the 4 MB receive limit
      the library's own emulator channel has;
    * transient errors (service or emulator away) are retried with backoff for
      ``reconnect_timeout_s``; a topic or subscription that vanished (emulator
      restarted) is created again;
    * ``depth()`` is None (Pub/Sub's backlog metric is in Cloud Monitoring,
      not cheap): the actor uses the board's counters.

Connection string:
    ``pubsub://PROJECT[/TOPIC][?subscription=NAME&emulator_host=HOST:PORT]``.
    Credentials come from the environment (GOOGLE_APPLICATION_CREDENTIALS or
    ``gcloud auth application-default login``); none with the emulator.

Options (fields of ``GCPParameters``): topic_name, subscription_name,
emulator_host, ack_deadline_s, batch_max_messages, batch_max_bytes,
batch_max_latency_s, confirm_timeout_s, reconnect_timeout_s, max_message_bytes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exceptions
from google.cloud import pubsub_v1
from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport

from srl.runner.distribution.queues.base import (
    BrokerUnavailableError,
    ExperienceQueue,
    Message,
    QueueError,
    QueueMessage,
    Reconnector,
    Role,
    as_queue_messages,
    read_refusal,
    safe_name,
)
from srl.runner.distribution.settings.credentials import CredentialsError, authentication_failed, permission_denied
from srl.runner.distribution.settings.queue_parameters import GCPParameters

logger = logging.getLogger("srl.queues.pubsub")

T = TypeVar("T")
_TRANSIENT: tuple[type[BaseException], ...] = (
    gexc.ServiceUnavailable,
    gexc.InternalServerError,
    gexc.Aborted,
    gexc.Unknown,
    gexc.RetryError,
)
_TRANSIENT_OR_DEADLINE: tuple[type[BaseException], ...] = (*_TRANSIENT, gexc.DeadlineExceeded)
_UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_ACK_CHUNK = 1000
_OPEN_TIMEOUT_S = 10.0


def topic_for(namespace: str) -> str:
    return f"srl-{safe_name(namespace, r'A-Za-z0-9._~+-')}-exp"


class PubSubQueue(ExperienceQueue):
    """Experience queue on a Pub/Sub topic + subscription; see the module docstring."""

    def __init__(
        self,
        params: GCPParameters,
        *,
        namespace: str,
        role: Role,
        consumer_name: str | None = None,
        max_read_bytes: int | None = None,
    ) -> None:
        if not params.project_id:
            raise ValueError("GCPParameters.project_id is empty: name the Google Cloud project "
                             "(any id with the emulator), e.g. pubsub://my-project")
        self.params = params
        self.role = role
        self.max_read_bytes = max_read_bytes
        self.topic_id = params.topic_name or topic_for(namespace)
        self.subscription_id = params.subscription_name or f"{self.topic_id}-trainer"
        self.topic_path = f"projects/{params.project_id}/topics/{self.topic_id}"
        self.subscription_path = f"projects/{params.project_id}/subscriptions/{self.subscription_id}"
        self.max_message_bytes = params.max_message_bytes
        self.source_name = f"pubsub subscription {self.subscription_id} on {params.describe()}"
        self.emulator = params.effective_emulator_host
        self._channels: list[grpc.Channel] = []
        self._held: dict[str, QueueMessage] = {}  # ack id -> handed out, not acked
        self._closed = False
        self._reconnector = Reconnector(
            broker=f"Pub/Sub at {params.describe()}",
            transient=_TRANSIENT,
            reconnect=lambda: None,  # gRPC channels reconnect by themselves
            timeout_s=params.reconnect_timeout_s,
            hint="check that the emulator runs (scripts/services.sh status) or that the network and "
            "credentials for Google Cloud are fine",
            refused=self._refusal,
        )
        self.publisher: pubsub_v1.PublisherClient | None = None
        try:
            self.subscriber = pubsub_v1.SubscriberClient(**self._transport_kwargs(SubscriberGrpcTransport))
            if role == "producer":
                self.publisher = pubsub_v1.PublisherClient(
                    batch_settings=pubsub_v1.types.BatchSettings(
                        max_messages=params.batch_max_messages,
                        max_bytes=params.batch_max_bytes,
                        max_latency=params.batch_max_latency_s,
                    ),
                    **self._transport_kwargs(PublisherGrpcTransport),
                )
            self._ensure_topology(timeout=_OPEN_TIMEOUT_S)
        except (auth_exceptions.DefaultCredentialsError, gexc.PermissionDenied, gexc.Unauthenticated) as e:
            self._close_channels()
            refusal = self._refusal(e)
            assert refusal is not None  # each error caught here is one
            raise refusal from e
        except _TRANSIENT_OR_DEADLINE as e:
            self._close_channels()
            where = f"the Pub/Sub emulator at {self.emulator}" if self.emulator else "Google Cloud Pub/Sub"
            raise BrokerUnavailableError(
                f"cannot reach {where} for the experience queue {params.describe()} ({type(e).__name__}: "
                f"{_short(e)}); " + ("is it running? start it (scripts/services.sh start)" if self.emulator
                                     else "check the network, the project id and the credentials")
            ) from e
        if role == "producer":
            # the subscriber client was only needed to create the subscription
            self.subscriber.close()

    # ------------------------------------------------------------ connection
    def _refusal(self, error: BaseException) -> CredentialsError | None:
        """Missing or refused Google Cloud credentials, or a role without Pub/Sub rights, as a refusal."""
        where = f"Pub/Sub {self.params.describe()}"
        if isinstance(error, (auth_exceptions.DefaultCredentialsError, gexc.Unauthenticated)):
            return authentication_failed(where, _short(error), "the credentials: GOOGLE_APPLICATION_CREDENTIALS or "
                                         "`gcloud auth application-default login` (or emulator_host / "
                                         "PUBSUB_EMULATOR_HOST for a local emulator)")
        if isinstance(error, gexc.PermissionDenied):
            return permission_denied(where, _short(error), "the credentials need the Pub/Sub Editor role (topics "
                                     "and subscriptions are created when missing)")
        return None

    def _transport_kwargs(self, transport_cls: Any) -> dict[str, Any]:
        if not self.emulator:
            return {}
        channel = grpc.insecure_channel(self.emulator, options=_UNLIMITED)
        self._channels.append(channel)
        return {"transport": transport_cls(channel=channel)}

    def _ensure_topology(self, timeout: float | None = None) -> None:
        """Create the topic and the subscription if they are missing."""
        assert self.subscriber is not None
        kwargs: dict[str, Any] = {"timeout": timeout, "retry": None} if timeout is not None else {}
        publisher = self.publisher
        try:
            if publisher is not None:
                publisher.create_topic(name=self.topic_path, **kwargs)
            else:
                # a consumer has no publisher client: create the topic through a short-lived one
                with_publisher = pubsub_v1.PublisherClient(**self._transport_kwargs(PublisherGrpcTransport))
                try:
                    with_publisher.create_topic(name=self.topic_path, **kwargs)
                finally:
                    with_publisher.transport.close()
            logger.info("%s: created topic %s", self.source_name, self.topic_path)
        except gexc.AlreadyExists:
            pass
        try:
            self.subscriber.create_subscription(
                request={
                    "name": self.subscription_path,
                    "topic": self.topic_path,
                    "ack_deadline_seconds": self.params.ack_deadline_s,
                },
                **kwargs,
            )
            logger.info("%s: created subscription %s", self.source_name, self.subscription_path)
        except gexc.AlreadyExists:
            pass

    def _call(self, what: str, op: Callable[[], T]) -> T:
        def run() -> T:
            try:
                return op()
            except gexc.NotFound as e:
                logger.warning("%s: %s (emulator restarted?); creating topic and subscription again",
                               self.source_name, _short(e))
                self._ensure_topology()
                return op()

        return self._reconnector.call(run, what)

    def _close_channels(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()

    # ------------------------------------------------------------ producer
    def put(self, data: bytes) -> None:
        self.put_many([data])

    def put_many(self, items: Sequence[bytes]) -> None:
        pending = self._payloads(items)
        if self.publisher is None:
            raise RuntimeError(f"{self.source_name}: put on a queue opened as {self.role!r}")
        publisher = self.publisher

        def send() -> None:
            nonlocal pending
            futures = [publisher.publish(self.topic_path, data) for data in pending]
            failed: list[bytes] = []
            first_error: BaseException | None = None
            _, not_done = concurrent.futures.wait(futures, timeout=self.params.confirm_timeout_s)
            if not_done:
                raise QueueError(
                    f"{self.source_name}: Pub/Sub accepted none of {len(not_done)} message(s) within "
                    f"{self.params.confirm_timeout_s:.0f}s; check the service/emulator and the quota"
                )
            for data, future in zip(pending, futures, strict=True):
                error = future.exception()
                if error is not None:
                    failed.append(data)
                    first_error = first_error or error
            if first_error is not None:
                pending = failed  # a retry resends only what was not accepted
                raise first_error

        if pending:
            self._call("put", send)

    # ------------------------------------------------------------ consumer
    def get_many(self, max_messages: int, timeout: float) -> list[Message]:
        self._require_consumer()
        max_messages = max(1, int(max_messages))
        deadline = time.monotonic() + max(0.0, timeout)

        def pull() -> list[Message]:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    # a long poll bounded by the caller's timeout; if it expires just as the
                    # service hands out messages, those come again after ack_deadline_s
                    response = self.subscriber.pull(
                        request={"subscription": self.subscription_path, "max_messages": max_messages},
                        timeout=max(remaining, 0.1),
                        retry=None,
                    )
                except gexc.DeadlineExceeded:
                    response = None
                # the protobuf under the proto-plus wrapper: reading a message's fields through the
                # wrapper took 22 µs a message, directly 0.9
                received = type(response).pb(response).received_messages if response is not None else ()
                if received:
                    return self._messages(received)
                if deadline - time.monotonic() <= 0:
                    return []
                time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))

        return self._call("get", pull)

    def _messages(self, received: Any) -> list[Message]:
        out: list[Message] = []
        for r in received:
            note = f" (delivery {r.delivery_attempt})" if r.delivery_attempt > 1 else ""
            data = r.message.data
            refused = read_refusal(len(data), self.max_read_bytes)
            message = QueueMessage(
                data=b"" if refused else data,
                source=f"pubsub subscription {self.subscription_id} message {r.message.message_id}{note}",
                receipt=r.ack_id,
                generation=0,
                _ack_many=self.ack_many,
                refused=refused,
            )
            self._held[r.ack_id] = message
            out.append(message)
        return out

    def ack_many(self, messages: Sequence[Message]) -> None:
        todo = as_queue_messages(messages, self.source_name)
        if not todo:
            return
        ack_ids = [m.receipt for m in todo]
        for start in range(0, len(ack_ids), _ACK_CHUNK):
            chunk = ack_ids[start:start + _ACK_CHUNK]

            def acknowledge(chunk: list[str] = chunk) -> None:
                self.subscriber.acknowledge(request={"subscription": self.subscription_path, "ack_ids": chunk})

            try:
                self._call("ack", acknowledge)
            except gexc.InvalidArgument as e:
                logger.warning("%s: acking %d message(s) failed (%s); their ack deadline passed and Pub/Sub "
                               "delivers them again", self.source_name, len(chunk), _short(e))
        for m in todo:
            m.acked = True
            self._held.pop(m.receipt, None)

    # ------------------------------------------------------------ both
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.role == "consumer" and self._held:
                # hand unacked messages back now instead of after ack_deadline_s
                self.subscriber.modify_ack_deadline(
                    request={"subscription": self.subscription_path, "ack_ids": list(self._held),
                             "ack_deadline_seconds": 0},
                    timeout=5.0, retry=None,
                )
                self._held.clear()
        except gexc.GoogleAPIError as e:
            logger.info("%s: could not hand back unacked messages (%s); Pub/Sub redelivers them after %ds",
                        self.source_name, _short(e), self.params.ack_deadline_s)
        finally:
            if self.publisher is not None:
                self.publisher.stop()
                self.publisher.transport.close()
            if self.role == "consumer":
                self.subscriber.close()
            self._close_channels()

    def destroy(self) -> None:
        """Delete the subscription and the topic (end of task); their messages are gone."""
        self.close()
        subscriber = pubsub_v1.SubscriberClient(**self._transport_kwargs(SubscriberGrpcTransport))
        publisher = pubsub_v1.PublisherClient(**self._transport_kwargs(PublisherGrpcTransport))
        try:
            for delete, kwargs in (
                (subscriber.delete_subscription, {"subscription": self.subscription_path}),
                (publisher.delete_topic, {"topic": self.topic_path}),
            ):
                try:
                    delete(request=kwargs, timeout=10.0)
                except gexc.NotFound:
                    pass
        finally:
            subscriber.close()
            publisher.transport.close()
            self._close_channels()


def _short(error: BaseException) -> str:
    text = str(error)
    return text if len(text) < 300 else text[:300] + "…"
