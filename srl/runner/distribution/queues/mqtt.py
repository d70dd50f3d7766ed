"""MQTT experience queue (MQTT 5 through paho-mqtt 2.x, QoS 1).

Features:
    * QoS 1 both ways; a producer's ``put``/``put_many`` return once every
      message got its PUBACK (up to ``inflight`` in flight, never more than
      the broker's Receive Maximum);
    * the consumer holds a persistent session (fixed client id derived from
      the namespace, clean start off, ``session_expiry_s``): batches published
      while it is away or reconnecting wait for it on the broker;
    * manual ack: paho runs with ``manual_ack=True`` and the PUBACK for a
      delivered message is sent only when the caller acks it, so a consumer
      that dies or disconnects gets the unacked messages again (the broker
      resends them when the session resumes);
    * a producer whose PUBACK says "no matching subscribers" (the consumer's
      session does not exist yet, e.g. the trainer never came) creates the
      session itself and sends those messages again: nothing is dropped for
      want of a subscriber;
    * paho's network thread reconnects with backoff; ``put``/``get`` raise
      only after ``reconnect_timeout_s`` without a connection;
    * ``depth()`` is None (MQTT cannot tell): the actor uses the board's counters.

One consumer per namespace: a second one with the same client id takes the
session over from the first.

Broker settings that matter (Mosquitto): ``max_queued_messages`` (default
1000) is how many QoS 1 messages a session may queue beyond those in flight,
and Mosquitto drops the rest *silently* (with a successful PUBACK): keep the
actor's queue capacity well below it, or set ``max_queued_messages 0``
(scripts/services.sh does). Without ``persistence true`` a broker restart
loses sessions and queued messages. ``max_inflight_messages`` (20 by default)
is the Receive Maximum it announces, which caps ``inflight``.

Connection string:
    ``mqtt://[user:password@]host[:port][/topic]``, ``mqtts://`` (TLS),
    query ``?client_id=NAME`` for the consumer's session.

Options (fields of ``MQTTParameters``): topic_name, client_id, keepalive_s,
prefetch, read_linger_s, inflight, session_expiry_s, confirm_timeout_s, reconnect_timeout_s,
max_message_bytes, tls_ca_certs.

TLS (``mqtts://`` or ``tls=True``): the broker's certificate is verified
against ``tls_ca_certs`` (else the system CAs) and must name the host
connected to; a failed check raises ``BrokerUnavailableError`` saying so.
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from srl.runner.distribution.queues.base import (
    BrokerUnavailableError,
    ExperienceQueue,
    Message,
    QueueError,
    QueueFullError,
    QueueMessage,
    Role,
    as_queue_messages,
    read_refusal,
    safe_name,
)
from srl.runner.distribution.settings.credentials import authentication_failed, permission_denied
from srl.runner.distribution.settings.queue_parameters import MQTTParameters

logger = logging.getLogger("srl.queues.mqtt")

_QOS = 1
_NO_MATCHING_SUBSCRIBERS = 0x10
_QUOTA_EXCEEDED = 0x97
_CONNECT_TIMEOUT_S = 10.0
_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux only


def topic_for(namespace: str) -> str:
    return f"srl/{safe_name(namespace)}/exp"


def session_client_id_for(namespace: str) -> str:
    return f"srl-{safe_name(namespace)}-trainer"


_BAD_LOGIN = 134
"""CONNACK reason code: bad user name or password"""
_NOT_AUTHORIZED = 135
"""CONNACK / SUBACK reason code: not authorized"""


class _Connection:
    """One paho client with its network thread, and what its callbacks saw."""

    def __init__(
        self,
        params: MQTTParameters,
        client_id: str,
        *,
        persistent: bool,
        inflight: int,
        receive_maximum: int | None,
        max_packet_bytes: int | None = None,
        on_message: Any = None,
        on_connected: Any = None,
    ) -> None:
        self.params = params
        self.client_id = client_id
        self.persistent = persistent
        self.cond = threading.Condition()
        self.connected = False
        self.generation = 0
        self.disconnected_since: float | None = time.monotonic()
        self.refused: str | None = None
        self.refused_code = 0
        """the CONNACK reason code of a refused connection (134 bad user name or password, 135 not authorized)"""
        self.stopping = False
        self.server_receive_maximum = 65535
        self.published: dict[int, int] = {}  # mid -> PUBACK reason code value
        self.subscribed: set[int] = set()
        self._on_message_cb = on_message
        self._on_connected_cb = on_connected
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv5,
            manual_ack=True,
        )
        self.client.max_inflight_messages_set(max(1, inflight))
        self.client.max_queued_messages_set(0)
        self.client.reconnect_delay_set(1, 2)
        if params.username is not None:
            self.client.username_pw_set(params.username, params.password)
        if params.tls:
            try:
                self.client.tls_set(ca_certs=params.tls_ca_certs, cert_reqs=ssl.CERT_REQUIRED)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"cannot load the CA bundle tls_ca_certs={params.tls_ca_certs!r} for the MQTT "
                                 f"broker at {params.describe()}: {e}; expected a PEM file of CA certificates") from e
            self.client.tls_insecure_set(False)  # the broker's host name is checked against its certificate
        self.client.on_socket_open = self._on_socket_open
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.connect_properties = Properties(PacketTypes.CONNECT)
        if persistent:
            self.connect_properties.SessionExpiryInterval = params.session_expiry_s
        if receive_maximum is not None:
            self.connect_properties.ReceiveMaximum = max(1, min(receive_maximum, 65535))
        if max_packet_bytes is not None:
            # the broker must not send larger packets to us (MQTT 5): it drops them instead
            self.connect_properties.MaximumPacketSize = max(1024, min(max_packet_bytes, 268_435_455))

    # paho's network thread runs these
    def _on_socket_open(self, _c: mqtt.Client, _u: Any, sock: Any) -> None:
        # PUBACKs and the tails of PUBLISHes are small writes: without TCP_NODELAY, Nagle holds
        # each one until the peer's delayed ACK (40 ms) releases it
        if isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _ack_now(self) -> None:
        """ACK what was just read at once: a broker without TCP_NODELAY (Mosquitto's default) holds
        its next small packets (PUBACKs) until it sees our ACK, which Linux would delay 40 ms."""
        sock = self.client.socket()
        if _TCP_QUICKACK is not None and isinstance(sock, socket.socket):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)
            except OSError:
                pass

    def _on_connect(self, client: mqtt.Client, _u: Any, flags: Any, reason: ReasonCode, properties: Any) -> None:
        with self.cond:
            if reason.is_failure:
                self.refused = str(reason)
                self.refused_code = int(reason.value)
                self.cond.notify_all()
                return
            self.connected = True
            self.disconnected_since = None
            self.generation += 1
            receive_maximum = getattr(properties, "ReceiveMaximum", None)
            if receive_maximum:
                self.server_receive_maximum = int(receive_maximum)
            self.cond.notify_all()
        if self._on_connected_cb is not None:
            self._on_connected_cb(bool(flags.session_present))

    def _on_disconnect(self, _c: mqtt.Client, _u: Any, _flags: Any, reason: ReasonCode, _p: Any) -> None:
        with self.cond:
            if self.connected and not self.stopping:
                logger.warning("MQTT client %s: disconnected from %s (%s); reconnecting",
                               self.client_id, self.params.describe(), reason)
            self.connected = False
            if self.disconnected_since is None:
                self.disconnected_since = time.monotonic()
            self.cond.notify_all()

    def _on_publish(self, _c: mqtt.Client, _u: Any, mid: int, reason: ReasonCode, _p: Any) -> None:
        self._ack_now()
        with self.cond:
            self.published[mid] = int(reason.value)
            self.cond.notify_all()

    def _on_subscribe(self, _c: mqtt.Client, _u: Any, mid: int, reasons: Any, _p: Any) -> None:
        with self.cond:
            failed = [r for r in reasons if r.is_failure]
            if failed:
                self.refused = f"subscription refused: {failed[0]}"
            self.subscribed.add(mid)
            self.cond.notify_all()

    def _on_message(self, _c: mqtt.Client, _u: Any, message: mqtt.MQTTMessage) -> None:
        self._ack_now()
        if self._on_message_cb is not None:
            self._on_message_cb(self.generation, message)

    # the caller's thread runs these
    def start(self, clean_start: bool) -> None:
        p = self.params
        try:
            self.client.connect(p.host, p.port, keepalive=p.keepalive_s, clean_start=clean_start,
                                properties=self.connect_properties)
        except ssl.SSLCertVerificationError as e:
            raise BrokerUnavailableError(
                f"TLS certificate verification failed for the MQTT broker at {p.describe()} ({e}); set "
                "tls_ca_certs (MQTTParameters.tls_ca_certs, or ?tls_ca_certs=PATH in the mqtts:// URL) to the CA "
                "that signed the broker's certificate, and connect by a host name that certificate names"
            ) from e
        except (OSError, ValueError) as e:
            raise BrokerUnavailableError(
                f"cannot reach the MQTT broker at {p.describe()} for the experience queue ({e}); is it running "
                "there (mosquitto, scripts/services.sh start)? or fix host/port/url"
            ) from e
        self.client.loop_start()
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        with self.cond:
            while not self.connected and self.refused is None and time.monotonic() < deadline:
                self.cond.wait(0.1)
        if self.refused is not None or not self.connected:
            self.stop()
            where = f"the MQTT broker at {p.describe()}"
            if self.refused_code in (_BAD_LOGIN, _NOT_AUTHORIZED):
                raise authentication_failed(where, self.refused or "", "the user and password of the queue URL or "
                                            "MQTTParameters (and the broker's password file / ACL)")
            why = self.refused or f"no CONNACK within {_CONNECT_TIMEOUT_S:.0f}s"
            raise BrokerUnavailableError(
                f"the MQTT broker at {p.describe()} did not accept the connection ({why}); check "
                "username/password, TLS settings and that it speaks MQTT 5"
            )

    def stop(self) -> None:
        self.stopping = True
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()

    def subscribe(self, topic: str, timeout: float = _CONNECT_TIMEOUT_S) -> None:
        _, mid = self.client.subscribe(topic, qos=_QOS)
        deadline = time.monotonic() + timeout
        with self.cond:
            while mid not in self.subscribed and self.refused is None:
                if time.monotonic() > deadline:
                    # a broker too busy to answer is away for now, not wrong: callers retry as for a lost link
                    raise BrokerUnavailableError(
                        f"no SUBACK for {topic} from {self.params.describe()} within {timeout:.0f}s")
                self.cond.wait(0.1)
            self.subscribed.discard(mid)
            if self.refused is not None:
                if "Not authorized" in self.refused:
                    raise permission_denied(f"the MQTT broker at {self.params.describe()}", self.refused,
                                            f"allow this user to read {topic} (the broker's ACL)")
                raise QueueError(f"the MQTT broker at {self.params.describe()} refused {topic}: {self.refused}")

    def away_for(self) -> float:
        since = self.disconnected_since
        return 0.0 if since is None else time.monotonic() - since


class MQTTQueue(ExperienceQueue):
    """Experience queue on an MQTT topic; see the module docstring."""

    # what an earlier task left waits in the trainer's persistent session: ending it as its consumer drops it
    _leftovers_role: Role = "consumer"

    def __init__(
        self,
        params: MQTTParameters,
        *,
        namespace: str,
        role: Role,
        consumer_name: str | None = None,
        max_read_bytes: int | None = None,
    ) -> None:
        self.params = params
        self.role = role
        self.max_read_bytes = max_read_bytes
        self.topic = params.topic_name or topic_for(namespace)
        self.session_client_id = params.client_id or session_client_id_for(namespace)
        self.max_message_bytes = params.max_message_bytes
        self.source_name = f"mqtt topic {self.topic} on {params.describe()}"
        self._inbox: queue.Queue[QueueMessage] = queue.Queue()
        self._closed = False
        if role == "consumer":
            self._conn = _Connection(
                params, self.session_client_id, persistent=True, inflight=params.inflight,
                receive_maximum=params.prefetch, on_message=self._on_message, on_connected=self._on_connected,
                max_packet_bytes=None if max_read_bytes is None else max_read_bytes + 64 * 1024,
            )
            self._conn.start(clean_start=False)
            try:
                self._conn.subscribe(self.topic)
            except BaseException:
                self._conn.stop()
                raise
        else:
            producer_id = f"srl-{safe_name(namespace)}-{safe_name(consumer_name or 'actor')}-{uuid.uuid4().hex[:8]}"
            self._conn = self._start_producer(producer_id, params.inflight)
            if self._conn.server_receive_maximum < params.inflight:
                # paho cannot lower its in-flight window once connected: start again within the broker's limit
                logger.debug("%s: broker's Receive Maximum is %d; in flight lowered from %d",
                             self.source_name, self._conn.server_receive_maximum, params.inflight)
                limit = self._conn.server_receive_maximum
                self._conn.stop()
                self._conn = self._start_producer(producer_id, limit)

    def _start_producer(self, client_id: str, inflight: int) -> _Connection:
        conn = _Connection(self.params, client_id, persistent=False, inflight=inflight, receive_maximum=None)
        conn.start(clean_start=True)
        return conn

    # ------------------------------------------------------------ producer
    def put(self, data: bytes) -> None:
        self.put_many([data])

    def put_many(self, items: Sequence[bytes]) -> None:
        pending = self._payloads(items)
        if self._closed:
            raise QueueError(f"{self.source_name}: the queue is closed")
        for _ in range(3):
            unrouted = self._publish_and_wait(pending)
            if not unrouted:
                return
            logger.info("%s: nobody subscribed yet (%d message(s)); creating the trainer's session %s and "
                        "sending them again", self.source_name, len(unrouted), self.session_client_id)
            self._create_consumer_session()
            pending = unrouted
        raise QueueError(
            f"{self.source_name}: the broker still reports no subscriber for {len(pending)} message(s) after "
            f"creating the consumer session {self.session_client_id!r}; does the broker keep sessions?"
        )

    def _publish_and_wait(self, items: list[bytes]) -> list[bytes]:
        """Publish all, wait for every PUBACK; returns those no subscriber took."""
        conn = self._conn
        with conn.cond:
            conn.published.clear()  # PUBACKs of an earlier call that gave up; their mids may come again
        mids: list[int] = []
        for data in items:
            info = conn.client.publish(self.topic, data, qos=_QOS)
            if info.rc == mqtt.MQTT_ERR_QUEUE_SIZE:
                raise QueueError(f"{self.source_name}: paho's outgoing queue is full")
            mids.append(info.mid)  # also when not connected: paho sends it once it reconnects
        deadline = time.monotonic() + self.params.confirm_timeout_s
        with conn.cond:
            while True:
                missing = [m for m in mids if m not in conn.published]
                if not missing:
                    break
                away = conn.away_for()
                if away > self.params.reconnect_timeout_s:
                    raise BrokerUnavailableError(
                        f"the MQTT broker at {self.params.describe()} has been unreachable for {away:.0f}s with "
                        f"{len(missing)} message(s) unconfirmed; check that it runs (scripts/services.sh status)"
                    )
                if conn.connected and time.monotonic() > deadline:
                    raise QueueError(
                        f"{self.source_name}: no PUBACK for {len(missing)} message(s) within "
                        f"{self.params.confirm_timeout_s:.0f}s although connected; is the broker overloaded?"
                    )
                if not conn.connected:
                    deadline = time.monotonic() + self.params.confirm_timeout_s
                conn.cond.wait(0.5)
            codes = [conn.published.pop(m) for m in mids]
        unrouted = [items[i] for i, c in enumerate(codes) if c == _NO_MATCHING_SUBSCRIBERS]
        refused = [(items[i], c) for i, c in enumerate(codes) if c >= 0x80]
        if refused:
            quota = [d for d, c in refused if c == _QUOTA_EXCEEDED]
            if len(quota) == len(refused):
                raise QueueFullError(
                    f"{self.source_name}: the broker refused {len(quota)} message(s) (quota exceeded); back off "
                    "and put them again", quota)
            raise QueueError(f"{self.source_name}: the broker refused {len(refused)} message(s) "
                             f"(PUBACK reason {ReasonCode(PacketTypes.PUBACK, identifier=refused[0][1])})")
        return unrouted

    def _create_consumer_session(self) -> None:
        """Create the trainer's persistent session, subscribed, so the broker keeps batches for it."""
        session = _Connection(self.params, self.session_client_id, persistent=True, inflight=1,
                              receive_maximum=self.params.prefetch)
        session.start(clean_start=False)
        try:
            session.subscribe(self.topic)
        finally:
            session.stop()

    # ------------------------------------------------------------ consumer
    def _on_connected(self, session_present: bool) -> None:
        # paho's network thread, before any message of this connection
        if session_present:
            # the broker resends every unacked message of the session: the copies here are stale
            stale = 0
            while True:
                try:
                    self._inbox.get_nowait()
                    stale += 1
                except queue.Empty:
                    break
            if stale:
                logger.info("%s: session resumed; %d buffered message(s) will come again", self.source_name, stale)
        elif self._conn_generation() > 1:
            logger.warning("%s: the broker had lost the session %s (restarted without persistence?); "
                           "batches queued there are gone", self.source_name, self.session_client_id)
            # a fresh session has no subscription
            self._conn.client.subscribe(self.topic, qos=_QOS)

    def _conn_generation(self) -> int:
        conn = getattr(self, "_conn", None)
        return 0 if conn is None else conn.generation

    def _on_message(self, generation: int, message: mqtt.MQTTMessage) -> None:
        note = " (redelivered)" if message.dup else ""
        refused = read_refusal(len(message.payload), self.max_read_bytes)
        self._inbox.put(QueueMessage(
            data=b"" if refused else bytes(message.payload),
            refused=refused,
            source=f"mqtt topic {message.topic} mid {message.mid}{note}",
            receipt=message.mid,
            generation=generation,
            _ack_many=self.ack_many,
        ))

    def get_many(self, max_messages: int, timeout: float) -> list[Message]:
        self._require_consumer()
        deadline = time.monotonic() + max(0.0, timeout)
        first: QueueMessage | None = None
        while first is None:
            remaining = deadline - time.monotonic()
            try:
                first = self._inbox.get(timeout=min(max(remaining, 0.0), 0.5)) if remaining > 0 \
                    else self._inbox.get_nowait()
            except queue.Empty:
                away = self._conn.away_for()
                if away > self.params.reconnect_timeout_s:
                    raise BrokerUnavailableError(
                        f"the MQTT broker at {self.params.describe()} has been unreachable for {away:.0f}s; "
                        "check that it runs (scripts/services.sh status)"
                    ) from None
                if remaining <= 0:
                    return []
        out: list[Message] = [first]
        linger_end = time.monotonic() + self.params.read_linger_s
        wanted = min(max_messages, self.params.prefetch)  # the broker pushes no more than that unacked
        while len(out) < wanted:
            try:  # what is there now, or what comes before the linger ends (a timeout of 0 only looks)
                out.append(self._inbox.get(timeout=max(0.0, linger_end - time.monotonic())))
            except queue.Empty:
                break
        return out

    def ack_many(self, messages: Sequence[Message]) -> None:
        todo = as_queue_messages(messages, self.source_name)
        generation = self._conn.generation
        stale = 0
        for m in todo:
            m.acked = True
            if m.generation == generation and self._conn.connected:
                self._conn.client.ack(m.receipt, _QOS)
            else:
                stale += 1  # the broker resends it on the resumed session; its packet id is void here
                m.returned = True
        if stale:
            logger.info("%s: %d message(s) came over a connection that was lost; the broker redelivers them",
                        self.source_name, stale)

    # ------------------------------------------------------------ both
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._conn.stop()

    def destroy(self) -> None:
        """End the consumer's session (and the batches it holds) on the broker (end of task)."""
        self.close()
        ender = _Connection(self.params, self.session_client_id, persistent=False, inflight=1, receive_maximum=None)
        ender.start(clean_start=True)  # clean start with session expiry 0 discards the session
        ender.stop()
