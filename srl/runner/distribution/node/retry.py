"""Riding out a broker or Redis that is away (restart, failover, network cut, a paused server) or refuses
for a while (full, a replica after a failover, stuck in a slow script).

Owns: ``TRANSIENT_ERRORS``, what every caller waits out, the one retry loop every node uses around board
calls, and ``Throttle``, which keeps a repeated complaint to one log line every few
seconds. Must never: retry silently — while it waits it says what for, once
every ``log_every`` seconds, naming a refusal (OOM, READONLY, BUSY) and what it means. Nodes wait as long as
it takes (``max_wait=None``): a transient outage must never end an actor or a trainer, and a client keeps
telling its user what it waits for (Ctrl-C ends it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from srl.runner.distribution.settings.credentials import permission_denied
from srl.runner.distribution.settings.redis_parameters import DEFAULT_SOCKET_TIMEOUT_S, RedisRefusedError, refusal_code

T = TypeVar("T")

logger = logging.getLogger("srl.retry")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.BusyLoadingError,
    # Redis answers, but refuses for a while: srl's clients name every such reply (RedisParameters.connect);
    # redis-py's own classes for some of them, for a client srl did not make
    RedisRefusedError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    ConnectionError,
    TimeoutError,
)
"""errors that waiting cures: a Redis or broker that is away, or refuses for a while"""

LOG_EVERY_S = 5.0
"""how often a wait in progress is reported"""


def describe_wait(error: BaseException) -> str:
    """What a caller waits for after ``error``, for its log line."""
    code = refusal_code(error)
    if code is not None:
        return f"Redis refuses with {code} for now ({str(error)[:300]}); waiting for it to answer again"
    return f"waiting for the connection to come back ({str(error)[:200]})"


def hint_for(error: BaseException) -> str:
    """What to do about an error that waiting alone will not cure."""
    if "Timeout writing" in str(error):
        return ("; a write that outlasts the socket timeout (a large message or params over a slow link) "
                f"fails every time: raise RedisParameters(redis_options={{'socket_timeout': seconds}}), "
                f"{DEFAULT_SOCKET_TIMEOUT_S:.0f} s by default")
    return ""


class BoardUnreachableError(ConnectionError):
    """Redis did not answer for longer than the caller is willing to wait."""


class Throttle:
    """Lets a message through at most once every ``interval`` seconds; counts what it held back."""

    def __init__(self, interval: float = LOG_EVERY_S) -> None:
        self.interval = interval
        self._next = 0.0
        self.suppressed = 0

    def ready(self) -> bool:
        """True (and resets the count) when a line may be written now."""
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval
            return True
        self.suppressed += 1
        return False

    def take_suppressed(self) -> int:
        count, self.suppressed = self.suppressed, 0
        return count


def with_retry(
    fn: Callable[[], T],
    what: str,
    *,
    max_wait: float | None = None,
    should_stop: Callable[[], bool] | None = None,
    log_every: float = LOG_EVERY_S,
) -> T:
    """Call ``fn``; on a transient error (:data:`TRANSIENT_ERRORS`) retry with backoff (up to 2 s between tries).

    ``max_wait`` None: as long as it takes (nodes); else raise
    :class:`BoardUnreachableError` after that many seconds (clients).
    ``should_stop``: give up early (raises the same error) when it returns True.
    """
    started = time.monotonic()
    delay = 0.05
    next_log = started
    waited = False
    while True:
        try:
            result = fn()
            if waited:
                logger.warning("%s: answered again after %.0fs", what, time.monotonic() - started)
            return result
        except redis.exceptions.NoPermissionError as e:  # an ACL that lacks a command srl needs
            raise permission_denied("Redis", e, "the Redis user srl logs in as needs the commands of srl's board and "
                                    "queue (give it +@all on its task keys, or see the docs' Security section)") from e
        except TRANSIENT_ERRORS as e:
            now = time.monotonic()
            if (max_wait is not None and now - started >= max_wait) or (should_stop is not None and should_stop()):
                answer = "no answer" if refusal_code(e) is None else "refused"
                raise BoardUnreachableError(
                    f"{what}: {answer} for {now - started:.0f}s ({e}); check that Redis is running, reachable and "
                    "accepts writes"
                ) from e
            if now >= next_log:
                logger.warning("%s: %s, %.0fs so far%s", what, describe_wait(e), now - started, hint_for(e))
                next_log = now + log_every
            waited = True
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
