"""What happened to the task, kept capped: its event log, notes of refused messages (dead letters), history
rows for curves, and the nodes that refuse the task.

Owns the keys ``events``, ``deadletters``, ``history`` and ``refusals``. Must never: grow without a cap
(entries are capped in count and their text in length), write for a task that is gone, or fail a read on a
malformed entry (it is skipped).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

from srl.runner.distribution.board.keys import _check_role
from srl.runner.distribution.board.records import DeadLetter, Event, Refusal, _json_object, _str, _text
from srl.runner.distribution.board.scripts import _NOTE_REFUSAL_LUA, _PUSH_CAPPED_LUA
from srl.runner.distribution.board.values import finite

EVENT_LOG_CAP = 1000
"""events kept per task (older ones are trimmed)"""
EVENT_TEXT_LIMIT = 500
"""characters of an event's text kept (the rest is cut): the log is capped by size too"""
DEADLETTER_CAP = 100
"""notes of refused messages kept per task"""
REFUSALS_CAP = 1000
"""nodes whose refusal of a task is kept (one entry per node: its latest reason)"""
HISTORY_CAP = 5000
"""history rows (one per progress interval: scalars for curves) kept per task"""
HISTORY_ROW_BYTES = 16 * 1024
"""larger history rows are refused when written and skipped when read"""


class BoardJournal:
    """The journal's part of :class:`Board`: events, dead letters, history and refusals."""

    # what Board.__init__ and the other parts give this one
    client: redis.Redis
    prefix: str
    task_id: str
    event_cap: int
    _task_key: str
    server_time: Callable[[], float]

    def _init_journal(self) -> None:
        """Name this part's keys and register its scripts (from ``Board.__init__``)."""
        self._events_key = self.prefix + "events"
        self._deadletters_key = self.prefix + "deadletters"
        self._history_key = self.prefix + "history"
        self._refusals_key = self.prefix + "refusals"
        self._push_capped = self.client.register_script(_PUSH_CAPPED_LUA)
        self._note_refusal = self.client.register_script(_NOTE_REFUSAL_LUA)

    # ---------------------------------------------------------------- events

    def log_event(self, text: str, level: str = "INFO", source: str = "") -> None:
        """Append to the capped event log (one round trip); dropped if the task does not exist.
        The text is cut to ``EVENT_TEXT_LIMIT`` characters."""
        event = json.dumps({"ts": time.time(), "level": level[:16], "text": _text(text, EVENT_TEXT_LIMIT),
                            "source": source[:128]})
        self._push_capped(keys=[self._events_key, self._task_key], args=[event, self.event_cap, self.task_id])

    def get_events(self, n: int = 100) -> list[Event]:
        """The latest ``n`` events, oldest first (malformed entries are skipped)."""
        if n <= 0:
            return []
        events = []
        for raw in reversed(self.client.lrange(self._events_key, 0, n - 1)):
            item = _json_object(raw, 4 * EVENT_TEXT_LIMIT)
            if item is None:
                continue
            events.append(Event(
                ts=finite(item.get("ts")) or 0.0,
                level=str(item.get("level", ""))[:16],
                text=str(item.get("text", ""))[:EVENT_TEXT_LIMIT],
                source=str(item.get("source", ""))[:128],
            ))
        return events

    # ---------------------------------------------------------------- dead letters

    def add_dead_letters(self, letters: list[DeadLetter]) -> None:
        """Note refused messages (not their bytes) in the capped dead-letter list."""
        pipe = self.client.pipeline(transaction=False)
        for letter in letters[-DEADLETTER_CAP:]:
            entry = json.dumps({"ts": letter.ts, "source": letter.source[:300], "reason": letter.reason[:300],
                                "size": letter.size})
            self._push_capped(keys=[self._deadletters_key, self._task_key], args=[entry, DEADLETTER_CAP, self.task_id],
                              client=pipe)
        pipe.execute()

    def get_dead_letters(self, n: int = DEADLETTER_CAP) -> list[DeadLetter]:
        """The latest ``n`` refused-message notes, oldest first."""
        letters = []
        for raw in reversed(self.client.lrange(self._deadletters_key, 0, max(0, n - 1))):
            item = _json_object(raw, 4096)
            if item is None:
                continue
            size = item.get("size")
            letters.append(DeadLetter(
                ts=finite(item.get("ts")) or 0.0,
                source=str(item.get("source", ""))[:300],
                reason=str(item.get("reason", ""))[:300],
                size=size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else 0,
            ))
        return letters

    # ---------------------------------------------------------------- history

    def push_history(self, row: Mapping[str, float | int | str | None]) -> None:
        """Append one row of scalars (a progress interval: counters, rates, rewards, losses) to the
        task's capped history; what dashboards draw curves from. Dropped if the task does not exist."""
        raw = json.dumps({str(k)[:128]: v for k, v in row.items()}, separators=(",", ":"), allow_nan=False,
                         default=str)
        if len(raw) > HISTORY_ROW_BYTES:
            raise ValueError(f"a history row is {len(raw)} bytes; at most {HISTORY_ROW_BYTES}")
        self._push_capped(keys=[self._history_key, self._task_key], args=[raw, HISTORY_CAP, self.task_id])

    def get_history(self, n: int = HISTORY_CAP) -> list[dict[str, float | int | str | None]]:
        """The latest ``n`` history rows, oldest first; only finite numbers, short strings and nulls are
        kept of each (anything else read from the board is dropped)."""
        rows = []
        for raw in reversed(self.client.lrange(self._history_key, 0, max(0, min(n, HISTORY_CAP) - 1))):
            item = _json_object(raw, HISTORY_ROW_BYTES)
            if item is None:
                continue
            row: dict[str, float | int | str | None] = {}
            for key, value in item.items():
                if value is None or (isinstance(value, str) and len(value) <= 200):
                    row[key] = value
                elif finite(value) is not None:
                    row[key] = value
            rows.append(row)
        return rows

    # -------------------------------------------------------------- refusals

    def note_refusal(self, uid: str, role: str, reason: str) -> None:
        """Note that node ``uid`` (a ``role``) refuses the task, and why: the client shows it where it would
        say the role is missing. One entry per node (its latest reason); dropped if the task is gone."""
        entry = json.dumps({"role": role[:16], "reason": _text(reason, EVENT_TEXT_LIMIT)})
        self._note_refusal(keys=[self._refusals_key, self._task_key],
                           args=[_check_role(uid), entry, REFUSALS_CAP, self.task_id])

    def clear_refusal(self, uid: str) -> None:
        """Node ``uid`` no longer refuses the task (it took a lease)."""
        self.client.hdel(self._refusals_key, uid)

    def get_refusals(self, max_age_s: float | None = None) -> list[Refusal]:
        """Nodes refusing the task (those noted within ``max_age_s`` of the server's clock), oldest first."""
        raw = self.client.hgetall(self._refusals_key)
        if not raw:
            return []
        return _refusals(raw, self.server_time(), max_age_s)


def _refusals(raw: Mapping[Any, Any], now: float, max_age_s: float | None) -> list[Refusal]:
    """The ``refusals`` hash as read (HGETALL): those noted within ``max_age_s`` of ``now`` (the server's clock),
    oldest first; a malformed entry is skipped."""
    found = []
    for uid, value in raw.items():
        item = _json_object(value, 4 * EVENT_TEXT_LIMIT)
        ts = finite(item.get("ts")) if item is not None else None
        if item is None or ts is None:
            continue
        if max_age_s is None or now - ts <= max_age_s:
            found.append(Refusal(_str(uid)[:128], str(item.get("role", ""))[:16],
                                 str(item.get("reason", ""))[:EVENT_TEXT_LIMIT], ts))
    return sorted(found, key=lambda r: r.ts)
