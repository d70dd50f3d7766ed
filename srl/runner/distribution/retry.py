"""Riding out a broker or Redis that is briefly away (restart, failover, network blip).

Owns: the one retry loop every node uses around board calls. Must never: retry
forever silently — it logs what it waits for and gives up after ``max_wait``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

T = TypeVar("T")

logger = logging.getLogger("srl.retry")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.BusyLoadingError,
    ConnectionError,
    TimeoutError,
)


class BoardUnreachableError(ConnectionError):
    """Redis did not answer for longer than the node is willing to wait."""


def with_retry(
    fn: Callable[[], T],
    what: str,
    *,
    max_wait: float = 60.0,
    should_stop: Callable[[], bool] | None = None,
) -> T:
    """Call ``fn``; on a transient connection error retry with backoff for up to ``max_wait`` s."""
    deadline = time.monotonic() + max_wait
    delay = 0.05
    warned = False
    while True:
        try:
            result = fn()
            if warned:
                logger.warning("%s: reachable again", what)
            return result
        except TRANSIENT_ERRORS as e:
            if time.monotonic() >= deadline or (should_stop is not None and should_stop()):
                raise BoardUnreachableError(
                    f"{what}: no answer for {max_wait:.0f}s ({e}); check that Redis is running and reachable"
                ) from e
            if not warned:
                logger.warning("%s: connection problem (%s); retrying for up to %.0fs", what, e, max_wait)
                warned = True
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
