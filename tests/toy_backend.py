"""A toy experience-queue backend, in this process's memory: what a new backend is (one module, and one
row of ``srl.runner.distribution.queues.BACKENDS``, see tests/test_house.py)."""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from srl.runner.distribution.queues.base import ExperienceQueue, Message, QueueMessage, Role, as_queue_messages

_QUEUES: dict[str, deque[bytes]] = {}
_LOCK = threading.Condition()


@dataclass
class ToyParameters:
    """toy://NAME: a queue in this process's memory."""

    name: str = "toy"

    @classmethod
    def from_url(cls, url: str) -> ToyParameters:
        return cls(name=url.partition("://")[2] or "toy")

    def describe(self) -> str:
        return f"toy://{self.name}"

    def replace(self, **changes: Any) -> ToyParameters:
        return dataclasses.replace(self, **changes)


class ToyQueue(ExperienceQueue):
    max_message_bytes = 1 << 20

    def __init__(self, params: ToyParameters, *, namespace: str, role: Role, consumer_name: str | None = None,
                 max_read_bytes: int | None = None) -> None:
        self.role = role
        self.key = f"{params.name}/{namespace}"
        self.source_name = f"toy queue {self.key}"
        with _LOCK:
            self._queue = _QUEUES.setdefault(self.key, deque())
        self._held: list[bytes] = []

    def put(self, data: bytes) -> None:
        with _LOCK:
            self._queue.append(bytes(data))
            _LOCK.notify_all()

    def get_many(self, max_messages: int, timeout: float) -> list[Message]:
        with _LOCK:
            _LOCK.wait_for(lambda: bool(self._queue), timeout)
            taken = [self._queue.popleft() for _ in range(min(max_messages, len(self._queue)))]
        self._held += taken
        return [QueueMessage(data, f"{self.source_name} #{i}", data, 0, self.ack_many) for i, data in enumerate(taken)]

    def ack_many(self, messages: Sequence[Message]) -> None:
        for m in as_queue_messages(messages, self.source_name):
            m.acked = True
            self._held.remove(m.receipt)

    def depth(self) -> int:
        with _LOCK:
            return len(self._queue) + len(self._held)

    def close(self) -> None:
        with _LOCK:
            self._queue.extendleft(reversed(self._held))  # unacked: delivered again
            self._held = []

    def destroy(self) -> None:
        with _LOCK:
            _QUEUES.pop(self.key, None)
