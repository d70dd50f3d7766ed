"""Redis Streams experience queue: one stream per task, one consumer group.

This module owns what is put, read, handed out, acked and taken over; the connection (reconnecting,
creating the stream and group again, the acks held back for the next command) is
``redis_stream_connection``'s, and the bounded reading of replies ``redis_reply``'s. It never trims
the stream, and never acks for the caller.

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
      unacked entries as long idle so the next consumer takes them at once; a consumer told it is the
      only rightful reader (``take_over()``: the trainer holding the lease) takes the others' entries
      on its next read, however briefly idle (a SIGKILLed trainer's reads come at once);
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

import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from srl.runner.distribution.board.board import task_key_prefix
from srl.runner.distribution.queues.base import (
    ExperienceQueue,
    Message,
    MiB,
    QueueMessage,
    Role,
    as_queue_messages,
)
from srl.runner.distribution.queues.redis_reply import FIELD, MAX_ARRAY, entry_payload
from srl.runner.distribution.queues.redis_stream_connection import TRANSIENT, StreamConnection
from srl.runner.distribution.settings.redis_parameters import RedisParameters

logger = logging.getLogger("srl.queues.redis")
T = TypeVar("T")

_ANY_REDIS_ERROR: tuple[type[BaseException], ...] = (redis.RedisError, *TRANSIENT)
# XCLAIM ... IDLE sets an entry's idle time: this makes it claimable by anyone at once
_RELEASED_IDLE_MS = 10**10
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
        self._read_unanswered = False  # a read was sent and its reply never came (a lost connection)
        self._claim_cursor = b"0-0"
        self._next_claim = 0.0
        self._claim_idle_ms = self.claim_min_idle_ms  # 0 for one look through: take_over()
        self._closed = False
        self._backlog_by_script = True  # False once the Redis user was refused EVAL or XPENDING
        self._link = StreamConnection(
            params, key=self.key, group=self.group, consumer=self.consumer, role=role, source_name=self.source_name,
            read_limit=self._read_limit(), claim_min_idle_ms=self.claim_min_idle_ms,
            reconnect_timeout_s=reconnect_timeout_s,
        )
        self._client = self._link.client
        self._republished = 0

    # ------------------------------------------------------------ producer
    @property
    def republished(self) -> int:
        return self._republished

    def _retried(self, op: Callable[[], T], count: int) -> Callable[[], T]:
        """``op`` (a put of ``count`` entries), counting each try after the first as ``count`` republished: it
        follows a failure (a lost connection, an error reply to one entry of a pipeline), and Redis may hold the
        entries an earlier try sent (their replies lost with it)."""
        tries = 0

        def run() -> T:
            nonlocal tries
            if tries:
                self._republished += count
            tries += 1
            return op()

        return run

    def put(self, data: bytes) -> None:
        [payload] = self._payloads([data])
        self._link.call("put", self._retried(lambda: self._client.xadd(self.key, {FIELD: payload}), 1))

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
                pipe.xadd(self.key, {FIELD: data})
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

        result: int | None = self._link.call("put_many", self._retried(send, len(items)))
        return result

    # ------------------------------------------------------------ consumer
    def get_many(self, max_messages: int, timeout: float) -> list[Message]:
        return self.get_expecting(max_messages, timeout, 1)

    def get_expecting(self, max_messages: int, timeout: float, expect: int) -> list[Message]:
        """``get_many``; with ``expect`` > 1 the read is followed, in the same round trip, by ``expect`` - 1
        reads of one entry that each wait up to ``_GATHER_S`` in Redis: messages put a moment after the first
        (each actor's segments of one sync version) come back with it, not a round trip later."""
        self._require_consumer()
        max_messages = min(max(1, int(max_messages)), MAX_ARRAY)
        expect = min(max(1, int(expect)), max_messages)
        deadline = time.monotonic() + max(0.0, timeout)
        paging = False  # a takeover look that has more pages to go: one page per call
        while True:
            if not paging and time.monotonic() >= self._next_claim:
                claimed = self._link.call("claim", lambda: self._claim(max_messages))
                if claimed:
                    return claimed
                paging = not self._claim_scan_done
            fresh = self._link.call("get", lambda: self._read_new(max_messages, self._block_ms(deadline), expect))
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
        replies = self._link.pipelined(read(count - (expect - 1), block), *[read(1, follow)] * (expect - 1))
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
        known = set(self._held) | set(self._link.acks)
        reply = self._link.with_acks("XREADGROUP", "GROUP", self.group, self.consumer,
                                "COUNT", min(count + len(known), MAX_ARRAY), "STREAMS", self.key, "0")
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
        idle_ms = self._claim_idle_ms
        reply = self._link.with_acks(
            "XAUTOCLAIM", self.key, self.group, self.consumer, idle_ms, self._claim_cursor, "COUNT", count)
        self._read_unanswered = unanswered
        cursor = reply[0] if isinstance(reply, list) and reply else b"0-0"
        self._claim_cursor = cursor if isinstance(cursor, bytes) else b"0-0"
        if self._claim_scan_done:
            self._next_claim = time.monotonic() + self.claim_interval_s
            self._claim_idle_ms = self.claim_min_idle_ms
        # else: more pages are waiting; claim again on the next call
        messages = self._messages(reply[1] if isinstance(reply, list) and len(reply) > 1 else [],
                                  redelivered=True)
        if messages and idle_ms < self.claim_min_idle_ms:
            logger.warning("%s: took over %d entries other consumers read and never acked (this consumer is the "
                           "only rightful reader now)", self.source_name, len(messages))
        elif messages:
            logger.warning("%s: took over %d unacked entries idle for over %.1fs (a consumer died?)",
                           self.source_name, len(messages), self.claim_min_idle_ms / 1000)
        return messages

    def take_over(self) -> None:
        """The next read first takes every entry other consumers of the group read and never acked, however
        briefly idle (one look through the pending entries, a page a call); later looks wait for
        ``claim_min_idle_s`` again."""
        self._require_consumer()
        self._claim_cursor = b"0-0"  # from the start: a look under way has passed entries by as too fresh
        self._claim_idle_ms = 0
        self._next_claim = 0.0

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
            data, refused = entry_payload(fields, self._read_limit())
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
            self._link.acks.append(m.receipt)
        if len(self._link.acks) >= MAX_ARRAY:  # a caller that acks without reading again
            self.send_acks()

    def send_acks(self) -> None:
        """Send the acks held back now (one round trip), not with the next command."""
        if self._link.acks:
            self._link.call("ack", lambda: self._link.with_acks("PING"))


    # ------------------------------------------------------------ both
    def depth(self) -> int | None:
        length: int = self._link.call("depth", lambda: self._link.with_acks("XLEN", self.key))
        return int(length)

    def backlog(self) -> int | None:
        """XLEN less the group's pending entries (read, not yet acked), in one script; a Redis user that may
        not run scripts gets ``depth()`` (XLEN: the read entries count too, so actors wait a little more)."""
        def count() -> int:
            if self._backlog_by_script:
                try:
                    return int(self._link.with_acks("EVAL", _BACKLOG_LUA, 1, self.key, self.group))
                except redis.exceptions.NoPermissionError as e:
                    self._no_scripts(e)
            return int(self._link.with_acks("XLEN", self.key))

        backlog: int = self._link.call("backlog", count)
        return backlog

    def _no_scripts(self, error: BaseException) -> None:
        self._backlog_by_script = False
        logger.info("%s: the Redis user may not run EVAL or XPENDING (%s): backpressure counts the entries the "
                    "trainer read and has not acked yet as waiting too", self.source_name, error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        left = "Redis is away" if self._link.away else ""  # why acks or unacked entries stay behind
        try:
            if not self._link.away:
                # once, without redis-py's retries either: closing does not wait for a Redis that went away
                self._client.set_retry(Retry(NoBackoff(), 0))
                if self._link.acks:
                    self._link.with_acks("PING")
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
        if left and (self._link.acks or self._held):
            logger.info("%s: %d acks not sent and %d unacked entries not released on close (%s); they are "
                        "delivered again after %.0fs idle", self.source_name, len(self._link.acks), len(self._held),
                        left, self.claim_min_idle_ms / 1000)

    def destroy(self) -> None:
        """Delete the stream and its consumer group (end of task)."""
        self._closed = True
        try:
            self._link.call("destroy", lambda: self._client.delete(self.key))
        finally:
            self._client.close()
