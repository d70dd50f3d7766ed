"""What each role counts and reports: running counters (a retried count adds once), the trainer's ledger of
the batches it counted and may not have acked, and each role's latest stats.

Owns the keys ``counters``, ``counted``, ``ledger``, ``roles`` and ``stats:<role_id>``. Must never: add a
retried count twice, let a number that is not finite into the totals, or fail a read on a malformed entry
(it is skipped).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal

import redis

from srl.runner.distribution.board import values as board_values
from srl.runner.distribution.board.keys import _ROLE_ID, _check_role
from srl.runner.distribution.board.records import _json_object, _str
from srl.runner.distribution.board.scripts import _COUNT_RECEIVED_LUA, _INCR_COUNTERS_LUA, _PUT_STATS_LUA
from srl.runner.distribution.board.values import BoardValueError, finite

LEDGER_BYTES = 64 * 1024
"""largest ledger entry of a trainer read from the board"""
DEFAULT_STATS_TTL_MS = 60_000
"""how long a role's stats outlive its last write"""
MAX_STATS_BYTES = 64 * 1024
"""larger stats records are ignored when read"""

_COUNTER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class BoardAccounts:
    """The accounts' part of :class:`Board`: counters, ledgers and stats, per role."""

    # what Board.__init__ and the other parts give this one
    client: redis.Redis
    prefix: str
    task_id: str
    stats_ttl_ms: int
    _task_key: str
    lease_key: Callable[[str], str]

    def _init_accounts(self) -> None:
        """Name this part's keys and register its scripts (from ``Board.__init__``)."""
        self._counters_key = self.prefix + "counters"
        self._counted_key = self.prefix + "counted"
        self._roles_key = self.prefix + "roles"
        self._ledger_key = self.prefix + "ledger"
        self._incr = self.client.register_script(_INCR_COUNTERS_LUA)
        self._count_received = self.client.register_script(_COUNT_RECEIVED_LUA)
        self._put_stats = self.client.register_script(_PUT_STATS_LUA)

    def stats_key(self, role_id: str) -> str:
        return self.prefix + "stats:" + _check_role(role_id)

    # -------------------------------------------------------------- counters

    def incr_counters(self, role_id: str, *, token: str = "", **deltas: int | float) -> None:
        """Add ``deltas`` (sent_batches=1, backpressure_wait_s=0.3, ...) to ``role_id``'s totals.

        ``token`` (a fresh :func:`count_token` per count, the same on each retry of it): a call whose reply
        was lost and is sent again adds nothing the second time (the last count ``role_id`` added carried
        it); '' adds every time."""
        deltas_json = _deltas_json(deltas)
        if deltas_json:
            self._incr(keys=[self._counters_key, self._task_key, self._counted_key],
                       args=[_check_role(role_id), deltas_json, self.task_id, _check_token(token)])

    def get_role_counters(self) -> dict[str, dict[str, float]]:
        """Running totals per role id (records that are not JSON objects of numbers are skipped)."""
        return _role_counters(self.client.hgetall(self._counters_key))

    def get_counters(self) -> dict[str, float]:
        """Running totals summed over every role."""
        return _counter_totals(self.get_role_counters())

    def count_received(self, owner_uid: str, deltas: Mapping[str, int | float],
                      ledger: list[tuple[str, int]], token: str = "") -> Literal["noted", "not held", "not ours"]:
        """The trainer's count of one read, before it acks the read, and its ledger: the ``(actor, seq)`` of
        the batches of its last reads whose acks may not have reached the broker yet. "not held": this
        trainer does not hold the lease (do not ack); "not ours": the task is gone or was replaced.
        ``token``: as :meth:`incr_counters`'s (a retry of a count that was added is "noted", adding nothing)."""
        ledger_json = json.dumps(ledger, separators=(",", ":"))
        keys = [self.lease_key("trainer"), self._counters_key, self._task_key, self._ledger_key, self._counted_key]
        answer = int(self._count_received(keys=keys, args=[owner_uid, _deltas_json(deltas), ledger_json,
                                                          self.task_id, _check_token(token)]))
        return {1: "noted", 0: "not held"}.get(answer, "not ours")  # type: ignore[return-value]

    def get_ledgers(self) -> dict[str, list[tuple[str, int]]]:
        """Each trainer's ledger (see :meth:`count_received`); malformed entries are skipped."""
        out: dict[str, list[tuple[str, int]]] = {}
        for uid, raw in self.client.hgetall(self._ledger_key).items():
            if raw is None:
                continue
            try:
                entries = board_values.json_record(raw, "a ledger", LEDGER_BYTES)
            except BoardValueError:
                continue
            if isinstance(entries, list):
                out[_str(uid)[:128]] = [
                    (e[0][:128], e[1]) for e in entries
                    if isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int)
                    and not isinstance(e[1], bool) and 0 <= e[1] < 2**63
                ]
        return out

    # ----------------------------------------------------------------- stats

    def put_stats(self, role_id: str, stats: Mapping[str, Any]) -> None:
        """Replace ``role_id``'s stats (flat JSON-able values; ``updated_at`` is added).

        They expire ``stats_ttl_ms`` after this write.
        """
        keys = [self.stats_key(role_id), self._roles_key, self._task_key]
        self._put_stats(keys=keys, args=[role_id, _stats_json(stats), self.stats_ttl_ms, self.task_id])

    def get_all_stats(self, max_age_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Latest stats per live role id (expired ones are absent; older than ``max_age_s`` too;
        malformed or oversized records are skipped)."""
        roles = _stats_roles(self.client.smembers(self._roles_key))
        if not roles:
            return {}
        return _live_stats(roles, self.client.mget([self.prefix + "stats:" + r for r in roles]), max_age_s)


def _role_counters(raw: Mapping[Any, Any]) -> dict[str, dict[str, float]]:
    """The ``counters`` hash as read (HGETALL) as totals per role id; a malformed record is skipped."""
    out: dict[str, dict[str, float]] = {}
    for role, value in raw.items():
        counters = _json_object(value, MAX_STATS_BYTES)
        if counters is None:
            continue
        totals = {str(k)[:64]: v for k, raw_value in counters.items() if (v := finite(raw_value)) is not None}
        name = _str(role)[:128]
        if name == "trainer" and "refused_batches" not in totals and totals.get("bad_messages"):
            # written by a trainer that counted the batches it refused only as bad messages (nothing else
            # it counts is a bad message): they are its refused batches
            totals["refused_batches"] = totals["bad_messages"]
        out[name] = totals
    return out


def _counter_totals(role_counters: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Totals per role summed over every role."""
    totals: dict[str, float] = {}
    for counters in role_counters.values():
        for name, value in counters.items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _stats_roles(members: Any) -> list[str]:
    """The ``roles`` set as read (SMEMBERS): the well-formed role ids, sorted (the order their stats are read in)."""
    return sorted(r for r in (_str(x) for x in members) if _ROLE_ID.fullmatch(r))


def _live_stats(roles: list[str], raws: list[Any], max_age_s: float | None) -> dict[str, dict[str, Any]]:
    """Each role's stats as read (``raws[i]``: the value of ``stats:<roles[i]>``), those alive and younger than
    ``max_age_s``; a malformed or oversized record is skipped."""
    now = time.time()
    found: dict[str, dict[str, Any]] = {}
    for role, raw in zip(roles, raws, strict=True):
        stats = _json_object(raw, MAX_STATS_BYTES)
        if stats is None:
            continue
        updated = finite(stats.get("updated_at", 0.0))
        if updated is None:
            continue
        if max_age_s is None or now - updated <= max_age_s:
            found[role] = stats
    return found


def _stats_json(stats: Mapping[str, Any]) -> str:
    return json.dumps({**stats, "updated_at": time.time()}, separators=(",", ":"), default=str)


def count_token() -> str:
    """A fresh token for one count (:meth:`Board.incr_counters`, :meth:`Board.count_received`): made once per
    count, outside the retry loop, so that each retry of the count carries it."""
    return uuid.uuid4().hex


def _check_token(token: str) -> str:
    if not isinstance(token, str) or len(token) > 64:
        raise ValueError(f"count token {token!r}: expected a str of at most 64 characters (count_token())")
    return token


def _deltas_json(deltas: Mapping[str, int | float] | None) -> str:
    """JSON of the non-zero deltas, or '' when there are none."""
    if not deltas:
        return ""
    clean: dict[str, int | float] = {}
    for name, delta in deltas.items():
        if not _COUNTER_NAME.fullmatch(name):
            raise ValueError(f"counter name {name!r}: use a Python identifier of at most 64 characters")
        if isinstance(delta, bool) or not isinstance(delta, (int, float)):
            raise TypeError(f"counter {name!r} delta must be a number, found {delta!r}")
        if finite(delta) is None:  # Redis could not add it, nor write the totals again
            raise ValueError(f"counter {name!r} delta must be a finite number, found {delta!r}")
        if delta:
            clean[name] = delta
    return json.dumps(clean, separators=(",", ":")) if clean else ""
