"""The Redis blackboard of one task: :class:`Board`, the one object a role or a client holds for it.

Owns: binding the board's parts to one task — its name, and the ``task_id`` a node serves (:meth:`Board.bound`)
— the list of every key of the task (:meth:`Board.task_keys`) and their removal (:meth:`Board.delete_task`).
Each part owns its keys and the methods that read and write them, in a module of its own: ``tasks`` (the task
record, config, status, resume), ``leases`` (``lease:*``, the epoch, the inference address, the heartbeat),
``params`` (params, their feed, the checkpoint), ``accounts`` (counters, ledgers, stats, roles) and
``journal`` (events, dead letters, history, refusals); ``view`` owns no key: it reads those of every part in
one round trip (:meth:`Board.view`, what a progress line shows); ``keys`` names every key, ``scripts`` holds
the Lua, ``records`` the errors and what is read back. ``Board`` inherits the parts (one level, nothing deeper):
a part is read and changed beside its keys, while callers keep one object and its method names. What
was importable from this module still is (``__all__``).

Must never: be bypassed (no other module writes board keys; a queue backend
that stores its data in this Redis puts it under :meth:`Board.queue_key` so it
is deleted with the task), do get-then-set on anything shared (leases are one
``SET NX PX``, renewals and parameter writes are compare-and-set scripts),
block (every call is a bounded number of round trips), or trust what it reads:
whoever can write to this Redis may have written anything. Every value read is
parsed with bounds by the one bounded reader (``board_values``); a malformed
field raises :class:`BoardDataError` (a :class:`BoardError`), never a stray
``ValueError`` or ``OverflowError``, and a malformed entry of a list or hash
(counters, stats, events, history, refusals, dead letters) is skipped.

Times that decide something (a task's start for its timeout, a heartbeat's
"now") are the Redis server's ``TIME``, so nodes with skewed clocks agree.

Cost (the system-wide budget is about 0.05 Redis commands per transition):
an actor's heartbeat — lease renewal, stats, counters and the read of task
status and params head it needs — is ONE ``EVALSHA``; what a progress line
reads of the board is ONE pipeline (:meth:`Board.view`), however many actors.

A task is its name and the ``task_id`` its client's ``create_task`` drew. A
node's board is bound to the id of the task it serves (:meth:`Board.bound`):
its writes (heartbeat, counters, stats, events, claims, params) first check
that the task of that name is still that one, and are dropped otherwise, so a
deleted task never grows keys back, and a task replaced by another of the
same name (``overwrite=True``) is never written to by the old task's nodes.

Works with Redis 6.2 (the embedded server) and 7.x. The client must return
bytes (``decode_responses=False``): params blobs are binary.
"""

from __future__ import annotations

import copy

import redis

from srl.runner.distribution.board.accounts import (
    DEFAULT_STATS_TTL_MS,
    LEDGER_BYTES,
    MAX_STATS_BYTES,
    BoardAccounts,
    count_token,
)
from srl.runner.distribution.board.journal import (
    DEADLETTER_CAP,
    EVENT_LOG_CAP,
    EVENT_TEXT_LIMIT,
    HISTORY_CAP,
    HISTORY_ROW_BYTES,
    REFUSALS_CAP,
    BoardJournal,
)
from srl.runner.distribution.board.keys import (
    _ROLE_ID,
    _SCAN_COUNT,
    BOARD_FORMAT_VERSION,
    MAX_ACTORS,
    MAX_INFERENCE_SERVERS,
    actor_slot,
    inference_lease,
    inference_server,
    list_tasks,
    task_key_prefix,
)
from srl.runner.distribution.board.leases import SMALL_TASK_SLOTS, BoardLeases
from srl.runner.distribution.board.params import BoardParams
from srl.runner.distribution.board.records import (
    BOARD_AWAY,
    BoardDataError,
    BoardError,
    BoardFormatError,
    DeadLetter,
    Event,
    Heartbeat,
    InferenceAddress,
    ParamsRecord,
    Refusal,
    TaskExistsError,
    TaskNotFoundError,
    TaskRecord,
    TaskState,
    TaskStatus,
    _int,
    _str,
)
from srl.runner.distribution.board.scripts import _DELETE_ORPHANS_LUA
from srl.runner.distribution.board.tasks import MAX_CONFIG_BYTES, BoardTasks
from srl.runner.distribution.board.view import BoardViews, TaskView

__all__ = [
    "BOARD_AWAY",
    "BOARD_FORMAT_VERSION",
    "DEADLETTER_CAP",
    "DEFAULT_STATS_TTL_MS",
    "EVENT_LOG_CAP",
    "EVENT_TEXT_LIMIT",
    "HISTORY_CAP",
    "HISTORY_ROW_BYTES",
    "LEDGER_BYTES",
    "MAX_ACTORS",
    "MAX_CONFIG_BYTES",
    "MAX_INFERENCE_SERVERS",
    "MAX_STATS_BYTES",
    "REFUSALS_CAP",
    "SMALL_TASK_SLOTS",
    "Board",
    "BoardDataError",
    "BoardError",
    "BoardFormatError",
    "DeadLetter",
    "Event",
    "Heartbeat",
    "InferenceAddress",
    "ParamsRecord",
    "Refusal",
    "TaskExistsError",
    "TaskNotFoundError",
    "TaskRecord",
    "TaskState",
    "TaskStatus",
    "TaskView",
    "actor_slot",
    "count_token",
    "inference_lease",
    "inference_server",
    "list_tasks",
    "task_key_prefix",
]


class Board(BoardTasks, BoardLeases, BoardParams, BoardAccounts, BoardJournal, BoardViews):
    """The blackboard of task ``task_name`` on ``client`` (a redis-py client with bytes responses).

    One instance per process and task; it is as thread-safe as the client. ``task_id`` binds it to
    one task of that name (see :meth:`bound`); '' (unbound) reads and writes whichever task has it.
    """

    def __init__(
        self,
        client: redis.Redis,
        task_name: str,
        *,
        event_cap: int = EVENT_LOG_CAP,
        stats_ttl_ms: int = DEFAULT_STATS_TTL_MS,
        task_id: str = "",
    ) -> None:
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError(
                "Board needs a redis client with decode_responses=False (params are binary); "
                "use RedisParameters.connect() or drop decode_responses=True"
            )
        self.client = client
        self.task_name = task_name
        self.prefix = task_key_prefix(task_name)
        self.event_cap = event_cap
        self.stats_ttl_ms = stats_ttl_ms
        self.task_id = task_id
        # each part names its keys and registers its scripts (register_script: EVALSHA, and SCRIPT LOAD + retry
        # on NOSCRIPT: a restarted or flushed Redis)
        self._init_tasks()
        self._init_leases()
        self._init_params()
        self._init_accounts()
        self._init_journal()
        self._delete_orphans = client.register_script(_DELETE_ORPHANS_LUA)

    def __repr__(self) -> str:
        return f"Board(task_name={self.task_name!r}" + (f", task_id={self.task_id!r})" if self.task_id else ")")

    def bound(self, task_id: str) -> Board:
        """This board bound to the task ``task_id`` (same client): its writes land only while the task of
        this name is that one, and its heartbeats say when it is not (``Heartbeat.replaced``)."""
        board = copy.copy(self)
        board.task_id = task_id
        return board

    # ------------------------------------------------------------------ keys

    def queue_key(self, name: str) -> str:
        """Where a queue backend that lives in this Redis keeps ``name`` (deleted with the task)."""
        if not _ROLE_ID.fullmatch(name):
            raise ValueError(f"queue key name {name!r}: use letters, digits, '_', '.', ':', '-'")
        return self.prefix + "queue:" + name

    def task_keys(self) -> list[str]:
        """Every key of this task that exists now (the named ones, plus a SCAN of the prefix)."""
        keys = {self._task_key, self._epoch_key, self._params_key, self._feed_key, self._counters_key, self._roles_key,
                self._events_key, self._deadletters_key, self._history_key, self._resume_key, self._counted_key,
                self._refusals_key, self._ledger_key, self._checkpoint_key, self.inference_key(0),
                self.lease_key("trainer"), self.lease_key("inference")}
        try:
            actor_num = _int(self.client.hget(self._task_key, "actor_num") or 0, "actor_num", 0, MAX_ACTORS)
        except BoardDataError:
            actor_num = 0  # the SCAN below still finds every lease
        keys.update(self.lease_key(f"actor:{i}") for i in range(actor_num))
        for role in self.client.smembers(self._roles_key):
            if _ROLE_ID.fullmatch(_str(role)):
                keys.add(self.prefix + "stats:" + _str(role))
        keys.update(_str(k) for k in self.client.scan_iter(match=self.prefix + "*", count=_SCAN_COUNT))
        existing: list[str] = []
        ordered = sorted(keys)
        pipe = self.client.pipeline(transaction=False)
        for key in ordered:
            pipe.exists(key)
        for key, found in zip(ordered, pipe.execute(), strict=True):
            if found:
                existing.append(key)
        return existing

    def delete_task(self) -> int:
        """Remove every key of this task; the number removed. Leases vanish too: their holders stop."""
        removed = 0
        for _ in range(3):  # a queue backend still writing may recreate its key between SCAN and UNLINK
            # the task key goes first: once it is gone, board writes of late roles are dropped
            keys = sorted(self.task_keys(), key=lambda k: k != self._task_key)
            if not keys:
                break
            removed += self._delete_keys(keys)
        return removed

    def _delete_keys(self, keys: list[str]) -> int:
        removed = 0
        for start in range(0, len(keys), _SCAN_COUNT):
            removed += int(self.client.unlink(*keys[start : start + _SCAN_COUNT]))
        return removed

    def delete_orphans(self) -> int:
        """Remove what is left under this task's prefix while no task of this name exists (keys a node
        wrote back as it stopped, after the task vanished); the number removed. Atomic against a client
        creating a task of this name meanwhile: then nothing is removed."""
        if self.client.exists(self._task_key):
            return 0
        keys = [_str(k) for k in self.client.scan_iter(match=self.prefix + "*", count=_SCAN_COUNT)]
        removed = 0
        for start in range(0, len(keys), _SCAN_COUNT):
            removed += int(self._delete_orphans(keys=[self._task_key, *keys[start:start + _SCAN_COUNT]]))
        return removed
