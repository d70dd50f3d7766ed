"""The Redis Streams queue's connection: one client's commands to a task's stream and its group.

Owns: the client (RESP2, with the bounded reply parser), reconnecting with backoff for
``reconnect_timeout_s``, creating the stream and group again when they vanish, forgetting dead
members of the group, and the acks held back to go in the round trip of the next command. Must
never: decide what is read, handed out or acked (``redis_stream`` does), or wait on a Redis that
is away past ``reconnect_timeout_s`` without saying so (``BrokerUnavailableError``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from srl.runner.distribution.node.retry import TRANSIENT_ERRORS, hint_for
from srl.runner.distribution.queues.base import BrokerUnavailableError, Reconnector, Role
from srl.runner.distribution.queues.redis_reply import ENTRY_SLACK, MAX_ARRAY, bounded_parser
from srl.runner.distribution.settings.credentials import CredentialsError, permission_denied
from srl.runner.distribution.settings.redis_parameters import RedisParameters

logger = logging.getLogger("srl.queues.redis")

TRANSIENT = TRANSIENT_ERRORS  # an outage, or a Redis refusing for a while (OOM, READONLY, BUSY): both waited out
_RECREATE_TRIES = 5


class StreamConnection:
    """The commands of one queue object to its stream: each goes through :meth:`call` (reconnecting, and
    creating the stream and group again), after the acks held back (:meth:`with_acks`, :meth:`pipelined`).
    Opening it pings Redis and, for a consumer, creates the group; ``BrokerUnavailableError`` or a
    refusal when that fails."""

    def __init__(
        self,
        params: RedisParameters,
        *,
        key: str,
        group: str,
        consumer: str,
        role: Role,
        source_name: str,
        read_limit: int,
        claim_min_idle_ms: int,
        reconnect_timeout_s: float,
    ) -> None:
        self.params = params
        self.key = key
        self.group = group
        self.consumer = consumer
        self.role = role
        self.source_name = source_name
        self.claim_min_idle_ms = claim_min_idle_ms
        self.acks: list[bytes] = []  # ids acked by the caller, sent with the next command
        self.away = False  # the last command gave up: Redis did not come back
        self.client = self._connect(read_limit)
        self._reconnector = Reconnector(
            broker=f"Redis at {params.describe()}",
            transient=TRANSIENT,
            reconnect=self._reconnect,
            timeout_s=reconnect_timeout_s,
            hint="check that redis-server is running there (scripts/services.sh status) and reachable",
            hint_for=hint_for,
            refused=self.refusal,
        )
        try:
            self.client.ping()
            if role == "consumer":
                self.create_group()
                self._forget_idle_consumers()
        except redis.exceptions.NoPermissionError as e:
            self.client.close()
            refusal = self.refusal(e)
            assert refusal is not None  # each error caught here is one
            raise refusal from e
        except TRANSIENT as e:
            self.client.close()
            if "TLS certificate verification failed" in str(e):  # the cause is known: say only that
                raise BrokerUnavailableError(f"Redis at {params.describe()} for the experience queue: {e}") from e
            raise BrokerUnavailableError(
                f"cannot reach Redis at {params.describe()} for the experience queue ({e}); "
                "is redis-server running there? start it (scripts/services.sh start) or fix host/port/url"
            ) from e

    def _connect(self, read_limit: int) -> redis.Redis:
        # RESP2 for the bounded parser (every Redis speaks it); it bounds what a read can bring
        client = self.params.connect(decode_responses=False, protocol=2)
        # set on the pool, over the URL's options: a ?protocol=3 there would swap the parser out (and
        # bring RESP3-only maintenance notifications with it)
        options = client.connection_pool.connection_kwargs
        if options.get("protocol") not in (None, 2, "2"):
            options.pop("maint_notifications_config", None)
            options.pop("maint_notifications_pool_handler", None)
        options.update(protocol=2, parser_class=bounded_parser(read_limit + ENTRY_SLACK, MAX_ARRAY))
        # Raw replies, parsed below: XAUTOCLAIM differs between Redis 6.2 and 7.x, and an entry
        # may hold Unread parts.
        for command in ("XAUTOCLAIM", "XREADGROUP"):
            client.set_response_callback(command, lambda response, **options: response)
        return client

    def refusal(self, error: BaseException) -> CredentialsError | None:
        """A command the Redis user may not run (an ACL without XADD, XACK, ...), as a refusal."""
        if isinstance(error, redis.exceptions.NoPermissionError):
            return permission_denied(f"Redis at {self.params.describe()}", error,
                                     "the Redis user of the experience queue needs the stream commands (XADD, "
                                     "XREADGROUP, XACK, XDEL, XAUTOCLAIM, XCLAIM, XGROUP, XINFO, XLEN, XPENDING, "
                                     "DEL; EVAL for the backlog)")
        return None

    def _reconnect(self) -> None:
        self.client.connection_pool.disconnect()
        self.client.ping()
        if self.role == "consumer":
            self.create_group()

    def create_group(self) -> None:
        try:
            # id 0: entries put before the trainer first came are delivered too
            self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _forget_idle_consumers(self) -> None:
        """Drop group members that hold nothing and have been silent long (dead trainers)."""
        try:
            consumers = self.client.xinfo_consumers(self.key, self.group)
        except (redis.ResponseError, TypeError):  # TypeError: more members than a reply keeps (Unread)
            return
        for info in consumers:
            name = info.get("name")
            if not isinstance(name, bytes) or name == self.consumer.encode():
                continue  # not one to forget: this consumer, or a name longer than a reply keeps
            if int(info.get("pending", 0)) == 0 and int(info.get("idle", 0)) > max(self.claim_min_idle_ms, 600_000):
                self.client.xgroup_delconsumer(self.key, self.group, name)

    def call(self, what: str, op: Any) -> Any:
        """``op()``, retried across a lost connection and a vanished stream; ``away`` says whether it gave up."""
        try:
            result = self._reconnector.call(self._recreating(op), what)
        except BrokerUnavailableError:
            self.away = True
            raise
        self.away = False
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
                self.create_group()
            raise BrokerUnavailableError(f"{self.source_name}: the stream vanished {_RECREATE_TRIES} times in a "
                                         f"row ({error}); is something deleting it?")

        return run

    def with_acks(self, *command: Any) -> Any:
        """``command``'s reply, the acks held back sent before it in the same round trip. Should the
        connection fail, they stay held, and go again with the retry (acking twice is harmless)."""
        return self.pipelined(command)[0]

    def pipelined(self, *commands: tuple[Any, ...]) -> list[Any]:
        """The replies of ``commands``, sent in one round trip after the acks held back (see ``with_acks``)."""
        if not self.acks and len(commands) == 1:
            return [self.client.execute_command(*commands[0])]
        ids = self.acks
        pipe = self.client.pipeline(transaction=False)
        if ids:
            pipe.execute_command("XACK", self.key, self.group, *ids)
            pipe.execute_command("XDEL", self.key, *ids)
        for command in commands:
            pipe.execute_command(*command)
        replies = pipe.execute(raise_on_error=False)
        ack_replies, replies = replies[:2 if ids else 0], replies[2 if ids else 0:]
        self.acks = []  # sent
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
