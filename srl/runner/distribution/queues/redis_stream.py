"""Redis Streams experience queue: one stream per task, one consumer group.

Features:
    * at-least-once: XADD; XREADGROUP (consumer group ``trainer``); the caller's
      ack is XACK + XDEL in one pipeline, so XLEN is exactly the messages not
      yet acked and ``depth()`` is one cheap command;
    * takeover: on start and every ``claim_interval_s`` a consumer XAUTOCLAIMs
      entries another consumer has held for longer than ``claim_min_idle_s``
      (a dead trainer's batches go to the next one); ``close()`` marks its own
      unacked entries as long idle so the next consumer takes them at once;
    * batching: ``put_many`` is one pipeline of XADDs, ``get_many`` one
      XREADGROUP COUNT, ``ack_many`` one XACK + XDEL;
    * bounded reads: a consumer reads (and takes over) entries only through a
      script that returns a payload when it is at most ``max_read_bytes``; a
      larger one is handed out ``refused`` (its id and size, not its bytes) to
      be acked away. So one read brings at most ``count * max_read_bytes``.
      Every blocking read of Redis would return whatever an entry holds, so
      an idle consumer polls instead, backing off to ``poll_max_s`` (about
      fifty commands a second while idle, none extra while batches flow: a
      sync learner that waits for its actors' segments sees them within 20 ms);
    * capped: XADD trims the stream to about ``max_len`` entries (MAXLEN ~), a
      safety stop far above any queue capacity actors keep to (they wait at
      ``capacity`` batches): only a flood that ignores backpressure is trimmed;
    * reconnect: a dropped connection (Redis restarted) is retried with backoff
      for ``reconnect_timeout_s``; a stream or group that vanished with it is
      created again;
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
    max_len              entries kept at most (MAXLEN ~; default 10,000)
    poll_max_s           longest pause between reads of an idle consumer (0.02)
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis

from srl.runner.distribution.board import task_key_prefix
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
from srl.runner.distribution.redis_parameters import RedisParameters

logger = logging.getLogger("srl.queues.redis")

_FIELD = b"d"
_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.BusyLoadingError,
    ConnectionError,
)
_ANY_REDIS_ERROR: tuple[type[BaseException], ...] = (redis.RedisError, *_TRANSIENT)
# XCLAIM ... IDLE sets an entry's idle time: this makes it claimable by anyone at once
_RELEASED_IDLE_MS = 10**10
DEFAULT_MAX_LEN = 10_000

# Reads entries for this consumer without sending a payload over max_read_bytes back:
# such an entry comes back as {id, false, size}. KEYS: stream. ARGV: group, consumer, count,
# limit, mode ('new': XREADGROUP >; 'claim': XAUTOCLAIM), min_idle_ms, start id.
_READ_LUA = """
local entries, cursor
if ARGV[5] == 'claim' then
  local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[6], ARGV[7], 'COUNT', ARGV[3])
  cursor, entries = reply[1], reply[2]
else
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
  cursor, entries = '', (reply and reply[1][2]) or {}
end
local limit = tonumber(ARGV[4])
local out = {cursor}
for _, entry in ipairs(entries) do
  if entry and entry[2] then
    local data, size = false, -1
    local fields = entry[2]
    for i = 1, #fields, 2 do
      if fields[i] == 'd' then size = string.len(fields[i + 1]); data = fields[i + 1] end
    end
    if size > limit then data = false end
    table.insert(out, {entry[1], data, size})
  end
end
return out
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
        max_len: int = DEFAULT_MAX_LEN,
        max_read_bytes: int | None = None,
        poll_max_s: float = 0.02,
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
        self.max_len = max(1, int(max_len))
        self.max_read_bytes = max_read_bytes
        self.poll_max_s = max(0.001, poll_max_s)
        self._poll_s = 0.001
        self.source_name = f"redis stream {self.key} on {params.describe()}"
        self._held: dict[bytes, None] = {}  # ids handed out and not acked, in order
        self._claim_cursor = b"0-0"
        self._next_claim = 0.0
        self._closed = False
        self._client = self._connect()
        self._read_script = self._client.register_script(_READ_LUA)
        self._reconnector = Reconnector(
            broker=f"Redis at {params.describe()}",
            transient=_TRANSIENT,
            reconnect=self._reconnect,
            timeout_s=reconnect_timeout_s,
            hint="check that redis-server is running there (scripts/services.sh status) and reachable",
        )
        try:
            self._client.ping()
            if role == "consumer":
                self._create_group()
                self._forget_idle_consumers()
        except redis.AuthenticationError as e:
            self._client.close()
            raise BrokerUnavailableError(
                f"Redis at {params.describe()} refused the login for the experience queue ({e}); "
                "check username/password in RedisParameters or the URL"
            ) from e
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
        client = self.params.connect(decode_responses=False)
        # Raw replies: XAUTOCLAIM differs between Redis 6.2 and 7.x, parsed below.
        client.set_response_callback("XAUTOCLAIM", lambda response, **options: response)
        return client

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
        except redis.ResponseError:
            return
        for info in consumers:
            name = info.get("name")
            if name is None or name in (self.consumer, self.consumer.encode()):
                continue
            if int(info.get("pending", 0)) == 0 and int(info.get("idle", 0)) > max(self.claim_min_idle_ms, 600_000):
                self._client.xgroup_delconsumer(self.key, self.group, name)

    def _call(self, what: str, op: Any) -> Any:
        def run() -> Any:
            try:
                return op()
            except redis.ResponseError as e:
                if "NOGROUP" in str(e) and self.role == "consumer":
                    logger.warning("%s: stream or group vanished (Redis restarted?); creating it again",
                                   self.source_name)
                    self._create_group()
                    return op()
                raise

        return self._reconnector.call(run, what)

    # ------------------------------------------------------------ producer
    def put(self, data: bytes) -> None:
        [payload] = self._payloads([data])
        self._call("put", lambda: self._client.xadd(self.key, {_FIELD: payload}, maxlen=self.max_len,
                                                    approximate=True))

    def put_many(self, items: Sequence[bytes]) -> None:
        items = self._payloads(items)
        if not items:
            return

        def send() -> None:
            pipe = self._client.pipeline(transaction=False)
            for data in items:
                pipe.xadd(self.key, {_FIELD: data}, maxlen=self.max_len, approximate=True)
            pipe.execute()

        self._call("put_many", send)

    # ------------------------------------------------------------ consumer
    def get_many(self, max_messages: int, timeout: float) -> list[Message]:
        self._require_consumer()
        max_messages = max(1, int(max_messages))
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if time.monotonic() >= self._next_claim:
                claimed = self._call("claim", lambda: self._claim(max_messages))
                if claimed:
                    return claimed
            # bounded, non-blocking: what is there now, payloads over the limit left unread
            fresh = self._call("get", lambda: self._scripted_read("new", max_messages))
            if fresh:
                self._poll_s = 0.001
                return fresh
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            time.sleep(min(remaining, self._poll_s))
            self._poll_s = min(self._poll_s * 2, self.poll_max_s)

    def _read_limit(self) -> int:
        return self.max_read_bytes if self.max_read_bytes is not None else 2**62

    def _scripted_read(self, mode: str, count: int) -> list[Message]:
        reply = self._read_script(
            keys=[self.key],
            args=[self.group, self.consumer, count, self._read_limit(), mode, self.claim_min_idle_ms,
                  self._claim_cursor],
        )
        cursor, entries = reply[0], reply[1:]
        if mode == "claim":
            self._claim_cursor = cursor if isinstance(cursor, bytes) else str(cursor).encode()
            if self._claim_cursor in (b"0-0", b"0"):
                self._next_claim = time.monotonic() + self.claim_interval_s
            # else: more pages are waiting; claim again on the next call
        return self._messages([(e[0], e[1], int(e[2])) for e in entries], redelivered=mode == "claim")

    def _claim(self, count: int) -> list[Message]:
        """Take over entries idle for longer than claim_min_idle_s (a dead consumer's), a page at a time."""
        messages = self._scripted_read("claim", count)
        if messages:
            logger.warning("%s: took over %d unacked entries idle for over %.1fs (a consumer died?)",
                           self.source_name, len(messages), self.claim_min_idle_ms / 1000)
        return messages

    def _messages(self, entries: list[tuple[Any, bytes | None, int]], *, redelivered: bool) -> list[Message]:
        """Messages from ``(id, payload or None, payload size or -1)``; unread ones are handed out refused."""
        out: list[Message] = []
        note = " (redelivered)" if redelivered else ""
        for entry_id, data, size in entries:
            entry_id = entry_id if isinstance(entry_id, bytes) else str(entry_id).encode()
            refused = ""
            if size < 0:
                refused = f"entry has no {_FIELD!r} field (not written by srl)"
            elif data is None:
                refused = f"payload of {size} bytes is over the {self._read_limit()}-byte read limit; not read"
            self._held[entry_id] = None
            out.append(QueueMessage(
                data=data if data is not None else b"",
                source=f"redis stream {self.key} id {entry_id.decode(errors='replace')}{note}",
                receipt=entry_id,
                generation=0,
                _ack_many=self.ack_many,
                refused=refused,
            ))
        return out

    def ack_many(self, messages: Sequence[Message]) -> None:
        todo = as_queue_messages(messages, self.source_name)
        if not todo:
            return
        ids = [m.receipt for m in todo]

        def ack() -> None:
            pipe = self._client.pipeline(transaction=False)
            pipe.xack(self.key, self.group, *ids)
            pipe.xdel(self.key, *ids)
            pipe.execute()

        self._call("ack", ack)
        for m in todo:
            m.acked = True
            self._held.pop(m.receipt, None)

    # ------------------------------------------------------------ both
    def depth(self) -> int | None:
        length: int = self._call("depth", lambda: self._client.xlen(self.key))
        return int(length)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.role == "consumer" and self._held:
                # give the unacked entries back: the next consumer claims them at once
                self._client.xclaim(
                    self.key, self.group, self.consumer, 0, list(self._held),
                    idle=_RELEASED_IDLE_MS, justid=True,
                )
                self._held.clear()
        except _ANY_REDIS_ERROR as e:
            logger.info("%s: could not release unacked entries on close (%s); they are claimed after "
                        "%.0fs idle", self.source_name, e, self.claim_min_idle_ms / 1000)
        finally:
            self._client.close()

    def destroy(self) -> None:
        """Delete the stream and its consumer group (end of task)."""
        self._closed = True
        try:
            self._call("destroy", lambda: self._client.delete(self.key))
        finally:
            self._client.close()
