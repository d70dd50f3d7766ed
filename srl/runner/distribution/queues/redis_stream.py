"""Redis Streams experience queue: one stream per task, one consumer group.

Features:
    * at-least-once: XADD; XREADGROUP (consumer group ``trainer``); the caller's
      ack is XACK + XDEL, so XLEN is exactly the messages not yet acked and
      ``depth()`` is one cheap command; ``backlog()`` (what actors' backpressure
      counts) is XLEN less the group's pending entries, in one script, and
      ``put_many_then_backlog`` learns it in the puts' round trip. An ack is held back and sent in the same
      round trip as the consumer's next command (a read, ``depth()``, ``close()``,
      or ``send_acks()``): a read and its ack cost one round trip, not two. Until
      then another client sees those entries as pending; should the consumer die
      meanwhile, they are redelivered (at least once);
    * takeover: on start and every ``claim_interval_s`` a consumer XAUTOCLAIMs
      entries another consumer has held for longer than ``claim_min_idle_s``
      (a dead trainer's batches go to the next one); ``close()`` marks its own
      unacked entries as long idle so the next consumer takes them at once;
    * batching: ``put_many`` is one pipeline of XADDs, ``get_many`` one
      XREADGROUP COUNT (after the held-back XACK + XDEL, in one pipeline);
    * bounded reads: a consumer's connection parses replies with ``BoundedReplyParser``, which
      keeps an entry's payload only when it is at most ``max_read_bytes`` and drops, as it reads
      them off the socket, larger payloads, extra fields and over-long arrays; such an entry is
      handed out ``refused`` (its id and why) to be acked away. So one read holds at most
      ``count * max_read_bytes`` (plus ids), whatever another writer put in the stream;
    * waiting: a read with a timeout is one XREADGROUP BLOCK (split at the next takeover look and
      at half the connection's ``socket_timeout``): an idle consumer sends about one command per
      wait, and an entry put meanwhile comes back at once (a sync learner waiting for its actors'
      segments);
    * never trimmed: XADD has no MAXLEN, as a trimmed entry would be experience lost and counted
      nowhere; an acked entry is deleted at once (XDEL), so the stream holds only entries not yet
      read or not yet acked, as many as the actors' backpressure lets them put (``queue_capacity``
      plus what each actor has in transit), however large that is;
    * reconnect: a dropped connection (Redis restarted) is retried with backoff
      for ``reconnect_timeout_s``; a stream or group that vanished with it is
      created again; a read whose reply the connection took with it (the entries are this consumer's
      pending ones, delivered to no one) is followed by a read of those entries (``XREADGROUP ... 0``),
      so they come at once, not ``claim_min_idle_s`` later by takeover;
    * works with Redis >= 6.2 (XAUTOCLAIM's 6.2 two-element reply and 7.x
      three-element reply both handled).

Connection string:
    ``redis://[user:password@]host[:port][/db]``, ``rediss://`` (TLS),
    ``unix:///path/redis.sock``, or ``params=None`` for the board's Redis;
    the client comes from ``RedisParameters.connect()``.

Options (``open_queue(..., options={...})``):
    stream_key           stream name (default ``srl:{<namespace>}:queue:exp``, under the board's prefix)
    group_name           consumer group (default ``trainer``)
    claim_min_idle_s     idle time after which another consumer's entry is taken over (30)
    claim_interval_s     how often a consumer looks for such entries (min(10, claim_min_idle_s / 2))
    reconnect_timeout_s  how long to keep reconnecting before raising (60)
    max_message_bytes    largest payload put (256 MiB; Redis's proto-max-bulk-len is 512 MB)
"""

from __future__ import annotations

import io
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis
from redis._parsers.resp2 import _RESP2Parser
from redis._parsers.socket import SENTINEL, SERVER_CLOSED_CONNECTION_ERROR
from redis.backoff import NoBackoff
from redis.retry import Retry

from srl.runner.distribution.board.board import task_key_prefix
from srl.runner.distribution.node.retry import TRANSIENT_ERRORS, hint_for
from srl.runner.distribution.queues.base import (
    BrokerUnavailableError,
    ExperienceQueue,
    Message,
    MiB,
    QueueMessage,
    Reconnector,
    Role,
    as_queue_messages,
)
from srl.runner.distribution.settings.credentials import CredentialsError, permission_denied
from srl.runner.distribution.settings.redis_parameters import RedisParameters

logger = logging.getLogger("srl.queues.redis")

_FIELD = b"d"
_TRANSIENT = TRANSIENT_ERRORS  # an outage, or a Redis refusing for a while (OOM, READONLY, BUSY): both waited out
_ANY_REDIS_ERROR: tuple[type[BaseException], ...] = (redis.RedisError, *_TRANSIENT)
# XCLAIM ... IDLE sets an entry's idle time: this makes it claimable by anyone at once
_RELEASED_IDLE_MS = 10**10
# A read keeps an entry's id and field name beside its payload: the bytes allowed past the read limit
_ENTRY_SLACK = 4096
# Longest array a consumer's reply keeps: entries of one read (get_many reads at most this many),
# an entry's fields (srl writes one), group members
_MAX_ARRAY = 4096

_COMPACT_AT = 1 << 20
_RECREATE_TRIES = 5
_GATHER_S = 0.05  # how long each follow-up read of ``get_expecting`` waits in Redis for one more entry
# the entries not yet delivered to the group: every entry (acked ones are deleted) less the pending ones; one
# script, so a read or an ack between the two counts cannot make it too small
_BACKLOG_LUA = """
local length = redis.call('XLEN', KEYS[1])
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1])
if ok and type(pending) == 'table' and tonumber(pending[1]) then
  return length - tonumber(pending[1])
end
return length
"""


class Unread:
    """What a bounded reply holds in place of a bulk string or array it did not keep: its size
    (bytes of a string, elements of an array), the bytes read off the socket and dropped."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __repr__(self) -> str:
        return f"Unread({self.size})"


class BoundedReplyParser(_RESP2Parser):
    """redis-py's RESP2 parser that keeps a reply's size bounded whatever the server holds.

    Within one array, bulk strings are kept while their bytes total at most ``max_kept``; a string
    that would go over it, and an array of more than ``max_array`` elements, are read off the
    socket a chunk at a time, dropped, and replaced by ``Unread(size)``. A stream entry is
    ``[id, [field, value, ...]]``, so a read of ``count`` entries keeps at most ``count *
    max_kept`` bytes of payload, however large or many-fielded an entry another writer put: the
    bound the consumer needs without a script, which copies every payload into Lua and back (307
    µs of Redis time a read of 16 entries of 15.5 KB, against 15.5 µs for the plain XREADGROUP).
    Subclassed per queue with its limits (``bounded_parser``).
    """

    max_kept: int = 2**62
    max_array: int = 2**62

    def _read_response(self, disable_decoding: bool = False, timeout: Any = SENTINEL,
                       budget: list[int] | None = None) -> Any:
        buffer = self._buffer
        assert buffer is not None
        kind, rest = self._header(timeout)
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            budget = budget if budget is not None else [self.max_kept]
            if length > budget[0]:
                self._drop(length + 2, timeout)
                return Unread(length)
            budget[0] -= length
            data = buffer.read(length, timeout=timeout)
            return self._decoded(data, disable_decoding)
        if kind == b"*":
            n = int(rest)
            if n < 0:
                return None
            if n > self.max_array:
                for _ in range(n):
                    self._skip(timeout)
                return Unread(n)
            inner = [self.max_kept]
            return [self._read_response(disable_decoding, timeout, inner) for _ in range(n)]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return self._decoded(rest, disable_decoding)
        if kind == b"-":
            error = self.parse_error(rest.decode("utf-8", errors="replace"))
            if isinstance(error, redis.ConnectionError):
                raise error
            return error
        raise redis.exceptions.InvalidResponse(f"Protocol Error: {kind + rest!r}")

    def _decoded(self, data: bytes, disable_decoding: bool) -> Any:
        return data if disable_decoding or self.encoder is None else self.encoder.decode(data)

    def _header(self, timeout: Any) -> tuple[bytes, bytes]:
        """The next reply element's type byte and the rest of its first line."""
        assert self._buffer is not None
        raw = self._buffer.readline(timeout=timeout)
        if not raw:
            raise redis.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
        return raw[:1], raw[1:]

    def _skip(self, timeout: Any) -> None:
        """Read one reply element off the socket and keep none of it."""
        self._compact()
        kind, rest = self._header(timeout)
        if kind == b"$" and int(rest) >= 0:
            self._drop(int(rest) + 2, timeout)
        elif kind == b"*":
            for _ in range(max(0, int(rest))):
                self._skip(timeout)

    def _drop(self, nbytes: int, timeout: Any) -> None:
        """Consume ``nbytes`` of the reply, first what is buffered, then the socket a chunk at a time."""
        buffer = self._buffer
        assert buffer is not None
        held = min(nbytes, buffer.unread_bytes())
        buffer._buffer.seek(held, io.SEEK_CUR)
        nbytes -= held
        sock = buffer._sock
        if nbytes and timeout is not SENTINEL:
            sock.settimeout(timeout)
        try:
            scratch = memoryview(bytearray(min(nbytes, 1 << 16))) if nbytes else memoryview(b"")
            while nbytes > 0:
                got = sock.recv_into(scratch, min(nbytes, len(scratch)))
                if not got:
                    raise redis.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                nbytes -= got
        except TimeoutError as e:  # socket.timeout
            raise redis.TimeoutError("Timeout reading from socket") from e
        finally:
            if timeout is not SENTINEL:
                sock.settimeout(buffer.socket_timeout)
        self._compact()

    def _compact(self) -> None:
        """Let go of the reply's bytes already parsed once they pass 1 MiB: redis-py keeps a whole
        reply in its buffer until the reply ends, and each socket read brings up to 64 KB, so the
        parts dropped would otherwise pile up there (an entry of thousands of 60 KB fields). What
        was kept is copied out already; a read that fails midway disconnects, so nothing rewinds."""
        buffer = self._buffer
        assert buffer is not None
        if buffer.get_pos() < _COMPACT_AT:
            return
        held = buffer._buffer
        rest = held.read()
        held.seek(0)
        held.truncate(0)
        held.write(rest)
        held.seek(0)


def bounded_parser(max_kept: int, max_array: int) -> type[BoundedReplyParser]:
    """A ``BoundedReplyParser`` with these limits, for one client's ``parser_class``."""
    return type("BoundedReplyParser", (BoundedReplyParser,), {"max_kept": max_kept, "max_array": max_array})


def stream_key_for(namespace: str) -> str:
    """The stream that holds task ``namespace``'s experience: under the board's key prefix, so
    ``Board.delete_task`` removes it with every other key of the task."""
    return task_key_prefix(namespace) + "queue:exp"


class RedisStreamQueue(ExperienceQueue):
    """Experience queue on a Redis stream; see the module docstring."""

    def __init__(
        self,
        params: RedisParameters,
        *,
        namespace: str,
        role: Role,
        consumer_name: str | None = None,
        stream_key: str | None = None,
        group_name: str = "trainer",
        claim_min_idle_s: float = 30.0,
        claim_interval_s: float | None = None,
        reconnect_timeout_s: float = 60.0,
        max_message_bytes: int = 256 * MiB,
        max_read_bytes: int | None = None,
    ) -> None:
        self.params = params
        self.role = role
        self.key = stream_key or stream_key_for(namespace)
        self.group = group_name
        self.consumer = consumer_name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.claim_min_idle_ms = max(1, int(claim_min_idle_s * 1000))
        self.claim_interval_s = (
            claim_interval_s if claim_interval_s is not None else min(10.0, claim_min_idle_s / 2)
        )
        self.max_message_bytes = max_message_bytes
        self.max_read_bytes = max_read_bytes
        self.source_name = f"redis stream {self.key} on {params.describe()}"
        self._held: dict[bytes, None] = {}  # ids handed out and not acked, in order
        self._acks: list[bytes] = []  # ids acked by the caller, sent with the next command
        self._away = False  # the last command gave up: Redis did not come back
        self._read_unanswered = False  # a read was sent and its reply never came (a lost connection)
        self._claim_cursor = b"0-0"
        self._next_claim = 0.0
        self._closed = False
        self._backlog_by_script = True  # False once the Redis user was refused EVAL or XPENDING
        self._client = self._connect()
        self._reconnector = Reconnector(
            broker=f"Redis at {params.describe()}",
            transient=_TRANSIENT,
            reconnect=self._reconnect,
            timeout_s=reconnect_timeout_s,
            hint="check that redis-server is running there (scripts/services.sh status) and reachable",
            hint_for=hint_for,
            refused=self._refusal,
        )
        try:
            self._client.ping()
            if role == "consumer":
                self._create_group()
                self._forget_idle_consumers()
        except redis.exceptions.NoPermissionError as e:
            self._client.close()
            refusal = self._refusal(e)
            assert refusal is not None  # each error caught here is one
            raise refusal from e
        except _TRANSIENT as e:
            self._client.close()
            if "TLS certificate verification failed" in str(e):  # the cause is known: say only that
                raise BrokerUnavailableError(f"Redis at {params.describe()} for the experience queue: {e}") from e
            raise BrokerUnavailableError(
                f"cannot reach Redis at {params.describe()} for the experience queue ({e}); "
                "is redis-server running there? start it (scripts/services.sh start) or fix host/port/url"
            ) from e

    # ------------------------------------------------------------ connection
    def _connect(self) -> redis.Redis:
        # RESP2 for the bounded parser (every Redis speaks it); it bounds what a read can bring
        client = self.params.connect(decode_responses=False, protocol=2)
        # set on the pool, over the URL's options: a ?protocol=3 there would swap the parser out (and
        # bring RESP3-only maintenance notifications with it)
        options = client.connection_pool.connection_kwargs
        if options.get("protocol") not in (None, 2, "2"):
            options.pop("maint_notifications_config", None)
            options.pop("maint_notifications_pool_handler", None)
        options.update(protocol=2, parser_class=bounded_parser(self._read_limit() + _ENTRY_SLACK, _MAX_ARRAY))
        # Raw replies, parsed below: XAUTOCLAIM differs between Redis 6.2 and 7.x, and an entry
        # may hold Unread parts.
        for command in ("XAUTOCLAIM", "XREADGROUP"):
            client.set_response_callback(command, lambda response, **options: response)
        return client

    def _refusal(self, error: BaseException) -> CredentialsError | None:
        """A command the Redis user may not run (an ACL without XADD, XACK, ...), as a refusal."""
        if isinstance(error, redis.exceptions.NoPermissionError):
            return permission_denied(f"Redis at {self.params.describe()}", error,
                                     "the Redis user of the experience queue needs the stream commands (XADD, "
                                     "XREADGROUP, XACK, XDEL, XAUTOCLAIM, XCLAIM, XGROUP, XINFO, XLEN, XPENDING, "
                                     "DEL; EVAL for the backlog)")
        return None

    def _reconnect(self) -> None:
        self._client.connection_pool.disconnect()
        self._client.ping()
        if self.role == "consumer":
            self._create_group()

    def _create_group(self) -> None:
        try:
            # id 0: entries put before the trainer first came are delivered too
            self._client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _forget_idle_consumers(self) -> None:
        """Drop group members that hold nothing and have been silent long (dead trainers)."""
        try:
            consumers = self._client.xinfo_consumers(self.key, self.group)
        except (redis.ResponseError, TypeError):  # TypeError: more members than a reply keeps (Unread)
            return
        for info in consumers:
            name = info.get("name")
            if not isinstance(name, bytes) or name == self.consumer.encode():
                continue  # not one to forget: this consumer, or a name longer than a reply keeps
            if int(info.get("pending", 0)) == 0 and int(info.get("idle", 0)) > max(self.claim_min_idle_ms, 600_000):
                self._client.xgroup_delconsumer(self.key, self.group, name)

    def _call(self, what: str, op: Any) -> Any:
        try:
            result = self._reconnector.call(self._recreating(op), what)
        except BrokerUnavailableError:
            self._away = True
            raise
        self._away = False
        return result

    def _recreating(self, op: Any) -> Any:
        """``op``, creating the stream and group again should they have vanished (NOGROUP; UNBLOCKED: the
        stream was deleted while a read waited on it, Redis 7): Redis restarted empty, or a client deleted or
        replaced the task. A client deletes a task's keys in several passes, so it may vanish again at
        once; after a few tries the caller hears of it as a broker that is away, never as a crash."""
        def run() -> Any:
            for attempt in range(_RECREATE_TRIES):
                try:
                    return op()
                except redis.ResponseError as e:
                    if not ("NOGROUP" in str(e) or "UNBLOCKED" in str(e)) or self.role != "consumer":
                        raise
                    if attempt == 0:
                        logger.warning("%s: stream or group vanished (Redis restarted? the task deleted or "
                                       "replaced?); creating it again", self.source_name)
                    error = e
                time.sleep(0.05 * attempt)
                self._create_group()
            raise BrokerUnavailableError(f"{self.source_name}: the stream vanished {_RECREATE_TRIES} times in a "
                                         f"row ({error}); is something deleting it?")

        return run

    # ------------------------------------------------------------ producer
    def put(self, data: bytes) -> None:
        [payload] = self._payloads([data])
        self._call("put", lambda: self._client.xadd(self.key, {_FIELD: payload}))

    def put_many(self, items: Sequence[bytes]) -> None:
        self._put_many(items, then_backlog=False)

    def put_many_then_backlog(self, items: Sequence[bytes]) -> int | None:
        return self._put_many(items, then_backlog=self._backlog_by_script)

    def _put_many(self, items: Sequence[bytes], then_backlog: bool) -> int | None:
        items = self._payloads(items)
        if not items:
            return None

        def send() -> int | None:
            pipe = self._client.pipeline(transaction=False)
            for data in items:
                pipe.xadd(self.key, {_FIELD: data})
            if then_backlog:
                pipe.execute_command("EVAL", _BACKLOG_LUA, 1, self.key, self.group)
            replies = pipe.execute(raise_on_error=False)
            for reply in replies[:len(items)]:
                if isinstance(reply, Exception):
                    raise reply
            if not then_backlog:
                return None
            backlog = replies[-1]
            if isinstance(backlog, redis.exceptions.NoPermissionError):  # the entries went: only the count did not
                self._no_scripts(backlog)
                return None
            if isinstance(backlog, Exception):
                raise backlog
            return int(backlog)

        result: int | None = self._call("put_many", send)
        return result

    # ------------------------------------------------------------ consumer
    def get_many(self, max_messages: int, timeout: float) -> list[Message]:
        return self.get_expecting(max_messages, timeout, 1)

    def get_expecting(self, max_messages: int, timeout: float, expect: int) -> list[Message]:
        """``get_many``; with ``expect`` > 1 the read is followed, in the same round trip, by ``expect`` - 1
        reads of one entry that each wait up to ``_GATHER_S`` in Redis: messages put a moment after the first
        (each actor's segments of one sync version) come back with it, not a round trip later."""
        self._require_consumer()
        max_messages = min(max(1, int(max_messages)), _MAX_ARRAY)
        expect = min(max(1, int(expect)), max_messages)
        deadline = time.monotonic() + max(0.0, timeout)
        paging = False  # a takeover look that has more pages to go: one page per call
        while True:
            if not paging and time.monotonic() >= self._next_claim:
                claimed = self._call("claim", lambda: self._claim(max_messages))
                if claimed:
                    return claimed
                paging = not self._claim_scan_done
            fresh = self._call("get", lambda: self._read_new(max_messages, self._block_ms(deadline), expect))
            if fresh or time.monotonic() >= deadline:
                return fresh

    def _block_ms(self, deadline: float) -> int | None:
        """How long the next read may wait in Redis, in whole milliseconds: to the deadline, no later
        than a takeover look that is due, and well inside the socket's timeout; None: do not wait."""
        now = time.monotonic()
        wait = deadline - now
        if self._next_claim > now:
            wait = min(wait, self._next_claim - now)
        socket_timeout = self._client.connection_pool.connection_kwargs.get("socket_timeout")
        if socket_timeout:
            wait = min(wait, socket_timeout / 2)
        return math.ceil(wait * 1000) if wait > 0 else None

    def _read_limit(self) -> int:
        return self.max_read_bytes if self.max_read_bytes is not None else 2**62

    def _read_new(self, count: int, block_ms: int | None, expect: int = 1) -> list[Message]:
        def read(n: int, block: tuple[Any, ...]) -> tuple[Any, ...]:
            return ("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", n, *block, "STREAMS", self.key, ">")

        if self._read_unanswered:
            lost = self._read_lost(count)
            if lost:
                return lost
        block = () if block_ms is None else ("BLOCK", block_ms)
        follow = () if block_ms is None else ("BLOCK", max(1, min(block_ms, math.ceil(_GATHER_S * 1000))))
        self._read_unanswered = True  # until its reply is in
        replies = self._pipelined(read(count - (expect - 1), block), *[read(1, follow)] * (expect - 1))
        self._read_unanswered = False
        out: list[Message] = []
        for reply in replies:
            if not isinstance(reply, list) or not reply:
                continue
            stream = reply[0]
            out += self._messages(stream[1] if isinstance(stream, list) and len(stream) == 2 else [],
                                  redelivered=False)
        return out

    def _read_lost(self, count: int) -> list[Message]:
        """The entries a read delivered to this consumer whose reply was lost with its connection: this
        consumer's pending entries not handed out (nor acked) already, read again by id (up to ``count``)."""
        known = set(self._held) | set(self._acks)
        reply = self._with_acks("XREADGROUP", "GROUP", self.group, self.consumer,
                                "COUNT", min(count + len(known), _MAX_ARRAY), "STREAMS", self.key, "0")
        self._read_unanswered = False
        stream = reply[0] if isinstance(reply, list) and reply else None
        entries = stream[1] if isinstance(stream, list) and len(stream) == 2 else []
        lost = [e for e in entries if isinstance(e, list) and e and e[0] not in known][:count]
        messages = self._messages(lost, redelivered=True)
        if messages:
            logger.warning("%s: %d entries read before a connection was lost are read again", self.source_name,
                           len(messages))
        return messages

    @property
    def _claim_scan_done(self) -> bool:
        """Whether the last takeover look went through every pending entry (else more pages wait)."""
        return self._claim_cursor in (b"0-0", b"0")

    def _claim(self, count: int) -> list[Message]:
        """Take over entries idle for longer than claim_min_idle_s (a dead consumer's), a page at a time."""
        unanswered, self._read_unanswered = self._read_unanswered, True  # its entries become ours: as a read's
        reply = self._with_acks(
            "XAUTOCLAIM", self.key, self.group, self.consumer, self.claim_min_idle_ms, self._claim_cursor,
            "COUNT", count)
        self._read_unanswered = unanswered
        cursor = reply[0] if isinstance(reply, list) and reply else b"0-0"
        self._claim_cursor = cursor if isinstance(cursor, bytes) else b"0-0"
        if self._claim_scan_done:
            self._next_claim = time.monotonic() + self.claim_interval_s
        # else: more pages are waiting; claim again on the next call
        messages = self._messages(reply[1] if isinstance(reply, list) and len(reply) > 1 else [],
                                  redelivered=True)
        if messages:
            logger.warning("%s: took over %d unacked entries idle for over %.1fs (a consumer died?)",
                           self.source_name, len(messages), self.claim_min_idle_ms / 1000)
        return messages

    def _payload(self, fields: Any) -> tuple[bytes, str]:
        """An entry's payload and '', or b'' and why it was not read."""
        if isinstance(fields, Unread):
            return b"", f"entry has {fields.size // 2} fields (srl writes one); not read"
        if not isinstance(fields, list):
            return b"", "entry has no fields (not written by srl)"
        for name, value in zip(fields[::2], fields[1::2], strict=False):
            if name != _FIELD:
                continue
            size = value.size if isinstance(value, Unread) else len(value) if isinstance(value, bytes) else 0
            if size > self._read_limit():
                return b"", f"payload of {size} bytes is over the {self._read_limit()}-byte read limit; not read"
            if isinstance(value, Unread):  # the entry's other fields took the read's room
                return b"", (f"entry of over {self._read_limit()} bytes (a {size}-byte payload and other "
                             "fields) is over the read limit; not read")
            return value, ""
        return b"", f"entry has no {_FIELD!r} field (not written by srl)"

    def _messages(self, entries: Any, *, redelivered: bool) -> list[Message]:
        """Messages from a reply's ``[[id, [field, value, ...]], ...]``; unread ones are handed out refused.

        An entry deleted while pending (``[id, nil]``, or nil) is skipped, as Redis 7 drops it itself."""
        out: list[Message] = []
        note = " (redelivered)" if redelivered else ""
        for entry in entries if isinstance(entries, list) else []:
            if not isinstance(entry, list) or len(entry) != 2 or entry[1] is None:
                continue
            entry_id, fields = entry
            if not isinstance(entry_id, bytes):
                continue  # not a stream's reply
            data, refused = self._payload(fields)
            self._held[entry_id] = None
            out.append(QueueMessage(
                data=data,
                source=f"redis stream {self.key} id {entry_id.decode(errors='replace')}{note}",
                receipt=entry_id,
                generation=0,
                _ack_many=self.ack_many,
                refused=refused,
            ))
        return out

    def ack_many(self, messages: Sequence[Message]) -> None:
        """Ack ``messages``: held back and sent with this consumer's next command (see the module's
        docstring), at once when many are held."""
        todo = as_queue_messages(messages, self.source_name)
        for m in todo:
            m.acked = True
            self._held.pop(m.receipt, None)
            self._acks.append(m.receipt)
        if len(self._acks) >= _MAX_ARRAY:  # a caller that acks without reading again
            self.send_acks()

    def send_acks(self) -> None:
        """Send the acks held back now (one round trip), not with the next command."""
        if self._acks:
            self._call("ack", lambda: self._with_acks("PING"))

    def _with_acks(self, *command: Any) -> Any:
        """``command``'s reply, the acks held back sent before it in the same round trip. Should the
        connection fail, they stay held, and go again with the retry (acking twice is harmless)."""
        return self._pipelined(command)[0]

    def _pipelined(self, *commands: tuple[Any, ...]) -> list[Any]:
        """The replies of ``commands``, sent in one round trip after the acks held back (see ``_with_acks``)."""
        if not self._acks and len(commands) == 1:
            return [self._client.execute_command(*commands[0])]
        ids = self._acks
        pipe = self._client.pipeline(transaction=False)
        if ids:
            pipe.execute_command("XACK", self.key, self.group, *ids)
            pipe.execute_command("XDEL", self.key, *ids)
        for command in commands:
            pipe.execute_command(*command)
        replies = pipe.execute(raise_on_error=False)
        ack_replies, replies = replies[:2 if ids else 0], replies[2 if ids else 0:]
        self._acks = []  # sent
        for error in ack_replies:
            # NOGROUP (the stream and group were deleted, or Redis restarted empty): nothing is left to
            # ack, and the command's own NOGROUP creates the group again (see _recreating). Anything else
            # (NOPERM: a user without XACK or XDEL) is raised: entries never acked would fill the queue.
            if isinstance(error, Exception) and "NOGROUP" not in str(error):
                raise error
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    # ------------------------------------------------------------ both
    def depth(self) -> int | None:
        length: int = self._call("depth", lambda: self._with_acks("XLEN", self.key))
        return int(length)

    def backlog(self) -> int | None:
        """XLEN less the group's pending entries (read, not yet acked), in one script; a Redis user that may
        not run scripts gets ``depth()`` (XLEN: the read entries count too, so actors wait a little more)."""
        def count() -> int:
            if self._backlog_by_script:
                try:
                    return int(self._with_acks("EVAL", _BACKLOG_LUA, 1, self.key, self.group))
                except redis.exceptions.NoPermissionError as e:
                    self._no_scripts(e)
            return int(self._with_acks("XLEN", self.key))

        backlog: int = self._call("backlog", count)
        return backlog

    def _no_scripts(self, error: BaseException) -> None:
        self._backlog_by_script = False
        logger.info("%s: the Redis user may not run EVAL or XPENDING (%s): backpressure counts the entries the "
                    "trainer read and has not acked yet as waiting too", self.source_name, error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        left = "Redis is away" if self._away else ""  # why acks or unacked entries stay behind
        try:
            if not self._away:
                # once, without redis-py's retries either: closing does not wait for a Redis that went away
                self._client.set_retry(Retry(NoBackoff(), 0))
                if self._acks:
                    self._with_acks("PING")
                if self.role == "consumer" and self._held:
                    # give the unacked entries back: the next consumer claims them at once
                    self._client.xclaim(
                        self.key, self.group, self.consumer, 0, list(self._held),
                        idle=_RELEASED_IDLE_MS, justid=True,
                    )
                    self._held.clear()
        except _ANY_REDIS_ERROR as e:
            left = str(e)
        finally:
            self._client.close()
        if left and (self._acks or self._held):
            logger.info("%s: %d acks not sent and %d unacked entries not released on close (%s); they are "
                        "delivered again after %.0fs idle", self.source_name, len(self._acks), len(self._held),
                        left, self.claim_min_idle_ms / 1000)

    def destroy(self) -> None:
        """Delete the stream and its consumer group (end of task)."""
        self._closed = True
        try:
            self._call("destroy", lambda: self._client.delete(self.key))
        finally:
            self._client.close()
