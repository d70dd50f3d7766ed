"""Why a node stops: :class:`StopFlag`, set once by whichever part of a run finds a reason first.

Owns the one stop signal every thread of a node waits on; must never lose the first reason to a later one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class StopFlag:
    """Why a node should stop working on its task; the first reason wins. Hooks run once when it is set
    (a call blocked on a socket is cancelled by one, so it returns at once)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self.reason = ""

    def set(self, reason: str) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._event.set()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def add_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the flag is set (now, if it is)."""
        with self._lock:
            if not self._event.is_set():
                self._hooks.append(hook)
                return
        hook()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)
