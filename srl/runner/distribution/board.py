"""The Redis blackboard of one task: status, config, leases, fencing, params, counters, stats, events.

Owns: every Redis key of a task. They all live under ``srl:{<task_name>}:`` —
the braces are literal: a Redis Cluster hash tag, so a task's keys share one
slot and the multi-key scripts below also run on a cluster — and
:meth:`Board.task_keys` lists them all; :meth:`Board.delete_task` removes them.
Must never: be bypassed (no other module writes board keys; a queue backend
that stores its data in this Redis puts it under :meth:`Board.queue_key` so it
is deleted with the task), do get-then-set on anything shared (leases are one
``SET NX PX``, renewals and parameter writes are compare-and-set scripts), or
block: every call is a bounded number of round trips.

Keys (``P`` = ``srl:{<task_name>}:``)::

    P task            hash   status, times, limits, config JSON, params head (epoch, version, train_count)
    P epoch           string trainer epoch, INCR'd by the script that grants the trainer lease
    P params          hash   epoch, version, train_count, blob, published_at
    P lease:trainer   string owner uid, PX ttl
    P lease:actor:<i> string owner uid, PX ttl
    P counters        hash   role_id -> JSON of running totals
    P roles           set    role ids that ever wrote stats
    P stats:<role_id> string JSON of the latest stats, PX ttl
    P events          list   JSON events, newest first, capped
    P queue:<name>    (any)  owned by a queue backend, deleted with the task

Cost (the system-wide budget is about 0.05 Redis commands per transition):
an actor's heartbeat — lease renewal, stats, counters and the read of task
status and params version it needs — is ONE ``EVALSHA`` (Redis counts seven
commands for it in all, whatever the number of counters).

Writes that a role may still make after :meth:`Board.delete_task` (heartbeat,
counters, stats, events, claims) first check that the task exists and are
dropped otherwise, so a deleted task never grows keys back.

Works with Redis 6.2 (the embedded server) and 7.x. The client must return
bytes (``decode_responses=False``): params blobs are binary.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import redis

BOARD_FORMAT_VERSION = 1
"""version of the key layout and field encoding above; bumped on any incompatible change"""
EVENT_LOG_CAP = 1000
"""events kept per task (older ones are trimmed)"""
DEFAULT_STATS_TTL_MS = 60_000
"""how long a role's stats outlive its last write"""

_TASK_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_ROLE_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_LEASE_NAME = re.compile(r"trainer|actor:(0|[1-9][0-9]{0,5})")
_COUNTER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_SCAN_COUNT = 500


def _srl_version() -> str:
    return str(getattr(sys.modules.get("srl"), "__version__", "unknown"))


def task_key_prefix(task_name: str) -> str:
    """The prefix of every key of ``task_name`` (validated)."""
    if not _TASK_NAME.fullmatch(task_name):
        raise ValueError(
            f"task name {task_name!r} is not allowed: use 1-128 characters among letters, digits, '_', '.', '-'"
        )
    return f"srl:{{{task_name}}}:"


class BoardError(RuntimeError):
    """The board is not in the state the caller expected."""


class TaskExistsError(BoardError):
    """A task of that name is still INIT or ACTIVE."""


class TaskNotFoundError(BoardError):
    """No task of that name on this Redis."""


class BoardFormatError(BoardError):
    """The task was written by an srl with another board format."""


class TaskState(str, Enum):
    INIT = "INIT"
    """created by a client, waiting for its trainer"""
    ACTIVE = "ACTIVE"
    """the trainer has started it"""
    END = "END"
    """finished by its end rule (max_train_count, max_steps, timeout) or stopped by a user"""
    FAILED = "FAILED"
    """stopped by an error; ``end_reason`` says which"""

    @property
    def finished(self) -> bool:
        return self in (TaskState.END, TaskState.FAILED)


@dataclass(frozen=True)
class TaskStatus:
    """What the board says about a task (everything but its config)."""

    task_name: str
    status: TaskState
    end_reason: str
    created_at: float
    started_at: float | None
    ended_at: float | None
    actor_num: int
    max_train_count: int | None
    max_steps: int | None
    timeout: float | None
    params_epoch: int
    """epoch of the latest published params (0: none yet)"""
    params_version: int
    """version of the latest published params (0: none yet)"""
    train_count: int
    """trainer's train count at the latest publish"""
    board_format: int
    srl_version: str
    """srl version of the client that created the task"""


@dataclass(frozen=True)
class Heartbeat:
    """The answer to one heartbeat: is the lease still ours, and what should the role know.

    ``bool(heartbeat)`` is ``lease_held``.
    """

    lease_held: bool
    task_status: TaskState | None
    """None: the task is gone (deleted or overwritten)"""
    params_epoch: int
    params_version: int

    def __bool__(self) -> bool:
        return self.lease_held


@dataclass(frozen=True)
class Event:
    """One line of the task's event log."""

    ts: float
    level: str
    text: str
    source: str


# ---------------------------------------------------------------- Lua scripts
# Every script names all the keys it touches in KEYS (cluster-safe) and takes
# times from the caller (deterministic, so script replication is safe on 6.2).

_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# Writes that could run after delete_task (a role still finishing) check that the task
# exists first, so a deleted task never grows keys back.

# KEYS: trainer lease, epoch, task. ARGV: uid, ttl_ms. The epoch is consumed only by the winner.
_CLAIM_TRAINER_LUA = """
if redis.call('EXISTS', KEYS[3]) == 0 then return false end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return false
"""

# KEYS: task, then the actor slot leases in order. ARGV: uid, ttl_ms. A slot this uid already holds is kept.
_CLAIM_SLOT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
for i = 2, #KEYS do
  local key = KEYS[i]
  if redis.call('GET', key) == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
    return i - 2
  end
end
for i = 2, #KEYS do
  if redis.call('SET', KEYS[i], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return i - 2
  end
end
return -1
"""

# KEYS: trainer lease, epoch, params, task. ARGV: uid, epoch, version, train_count, blob, now.
_PUBLISH_PARAMS_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local epoch = tonumber(ARGV[2])
if epoch ~= tonumber(redis.call('GET', KEYS[2]) or '0') then return 0 end
local stored = redis.call('HGET', KEYS[4], 'params_epoch')
if not stored or epoch < tonumber(stored) then return 0 end
redis.call('HSET', KEYS[3], 'epoch', ARGV[2], 'version', ARGV[3], 'train_count', ARGV[4],
           'blob', ARGV[5], 'published_at', ARGV[6])
redis.call('HSET', KEYS[4], 'params_epoch', ARGV[2], 'params_version', ARGV[3], 'train_count', ARGV[4])
return 1
"""

# Adds the JSON object of deltas ARGV[d] to the JSON totals of role ARGV[r] in hash KEYS[k].
_ADD_COUNTERS_LUA = """
local function add_counters(key, role, deltas_json)
  local current = redis.call('HGET', key, role)
  local totals = {}
  if current then totals = cjson.decode(current) end
  for name, delta in pairs(cjson.decode(deltas_json)) do
    totals[name] = (totals[name] or 0) + delta
  end
  redis.call('HSET', key, role, cjson.encode(totals))
end
"""

# KEYS: counters, task. ARGV: role_id, deltas_json.
_INCR_COUNTERS_LUA = _ADD_COUNTERS_LUA + """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
add_counters(KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# KEYS: stats:<role>, roles, task. ARGV: role_id, stats_json, stats_ttl_ms.
_PUT_STATS_LUA = """
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
if not redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3], 'GET') then
  redis.call('SADD', KEYS[2], ARGV[1])
end
return 1
"""

# KEYS: events, task. ARGV: event_json, cap.
_LOG_EVENT_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
return 1
"""

# KEYS: lease, stats:<role>, roles, counters, task.
# ARGV: uid, ttl_ms, role_id, stats_json ('' = none), stats_ttl_ms, deltas_json ('' = none).
_HEARTBEAT_LUA = _ADD_COUNTERS_LUA + """
local head = redis.call('HMGET', KEYS[5], 'status', 'params_epoch', 'params_version')
if not head[1] then return {0, false, false, false} end
local held = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  held = 1
end
if ARGV[4] ~= '' then
  if not redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5], 'GET') then
    redis.call('SADD', KEYS[3], ARGV[3])
  end
end
if ARGV[6] ~= '' then add_counters(KEYS[4], ARGV[3], ARGV[6]) end
return {held, head[1], head[2], head[3]}
"""

# KEYS: task. ARGV: overwrite ('1'/'0'), then field, value, ...
_CREATE_TASK_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status and ARGV[1] ~= '1' and (status == 'INIT' or status == 'ACTIVE') then return status end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 'OK'
"""

# KEYS: task. ARGV: now.
_SET_ACTIVE_LUA = """
if redis.call('HGET', KEYS[1], 'status') == 'INIT' then
  redis.call('HSET', KEYS[1], 'status', 'ACTIVE', 'started_at', ARGV[1])
  return 1
end
return 0
"""

# KEYS: task. ARGV: status, reason, now.
_END_TASK_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'INIT' or status == 'ACTIVE' then
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'end_reason', ARGV[2], 'ended_at', ARGV[3])
  return 1
end
return 0
"""


def _text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _optional_float(value: bytes | str | None) -> float | None:
    return None if value is None or value in (b"", "") else float(value)


def _optional_int(value: bytes | str | None) -> int | None:
    return None if value is None or value in (b"", "") else int(value)


def _field(value: int | float | None) -> str:
    return "" if value is None else repr(int(value) if isinstance(value, bool) else value)


_STATUS_FIELDS = (
    "status", "end_reason", "created_at", "started_at", "ended_at", "actor_num", "max_train_count",
    "max_steps", "timeout", "params_epoch", "params_version", "train_count", "format", "srl_version",
)


class Board:
    """The blackboard of task ``task_name`` on ``client`` (a redis-py client with bytes responses).

    One instance per process and task; it is as thread-safe as the client.
    """

    def __init__(
        self,
        client: redis.Redis,
        task_name: str,
        *,
        event_cap: int = EVENT_LOG_CAP,
        stats_ttl_ms: int = DEFAULT_STATS_TTL_MS,
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
        self._task_key = self.prefix + "task"
        self._epoch_key = self.prefix + "epoch"
        self._params_key = self.prefix + "params"
        self._counters_key = self.prefix + "counters"
        self._roles_key = self.prefix + "roles"
        self._events_key = self.prefix + "events"
        # register_script: EVALSHA, and SCRIPT LOAD + retry on NOSCRIPT (a restarted or flushed Redis).
        self._renew = client.register_script(_RENEW_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._claim_trainer = client.register_script(_CLAIM_TRAINER_LUA)
        self._claim_slot = client.register_script(_CLAIM_SLOT_LUA)
        self._publish = client.register_script(_PUBLISH_PARAMS_LUA)
        self._incr = client.register_script(_INCR_COUNTERS_LUA)
        self._put_stats = client.register_script(_PUT_STATS_LUA)
        self._log_event = client.register_script(_LOG_EVENT_LUA)
        self._heartbeat = client.register_script(_HEARTBEAT_LUA)
        self._create = client.register_script(_CREATE_TASK_LUA)
        self._set_active = client.register_script(_SET_ACTIVE_LUA)
        self._end = client.register_script(_END_TASK_LUA)

    def __repr__(self) -> str:
        return f"Board(task_name={self.task_name!r})"

    # ------------------------------------------------------------------ keys

    def lease_key(self, name: str) -> str:
        if not _LEASE_NAME.fullmatch(name):
            raise ValueError(f"lease name {name!r}: expected 'trainer' or 'actor:<index>'")
        return self.prefix + "lease:" + name

    def stats_key(self, role_id: str) -> str:
        return self.prefix + "stats:" + _check_role(role_id)

    def queue_key(self, name: str) -> str:
        """Where a queue backend that lives in this Redis keeps ``name`` (deleted with the task)."""
        if not _ROLE_ID.fullmatch(name):
            raise ValueError(f"queue key name {name!r}: use letters, digits, '_', '.', ':', '-'")
        return self.prefix + "queue:" + name

    def task_keys(self) -> list[str]:
        """Every key of this task that exists now (the named ones, plus a SCAN of the prefix)."""
        keys = {self._task_key, self._epoch_key, self._params_key, self._counters_key, self._roles_key,
                self._events_key, self.lease_key("trainer")}
        raw = self.client.hget(self._task_key, "actor_num")
        keys.update(self.lease_key(f"actor:{i}") for i in range(int(raw or 0)))
        keys.update(self.prefix + "stats:" + _str(role) for role in self.client.smembers(self._roles_key))
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
            for start in range(0, len(keys), _SCAN_COUNT):
                removed += int(self.client.unlink(*keys[start : start + _SCAN_COUNT]))
        return removed

    # ------------------------------------------------------------------ task

    def ping(self) -> bool:
        """True if the Redis answers (raises redis.ConnectionError otherwise)."""
        return bool(self.client.ping())

    def create_task(
        self,
        config: Mapping[str, Any] | str,
        *,
        actor_num: int | None = None,
        max_train_count: int | None = None,
        max_steps: int | None = None,
        timeout: float | None = None,
        overwrite: bool = False,
    ) -> TaskStatus:
        """Write a new task in state INIT with ``config`` (a JSON object, or its text: algorithm + fields).

        ``actor_num``, ``max_train_count``, ``max_steps`` and ``timeout`` default
        to the config's keys of those names (actor_num: 1). Refuses
        (TaskExistsError) while a task of that name is INIT or ACTIVE, unless
        ``overwrite``; an old task's keys are removed first.
        """
        if isinstance(config, str):
            try:
                parsed = json.loads(config)
            except ValueError as e:
                raise ValueError(f"task config must be a JSON object: {e}") from e
            config_json = config
        else:
            parsed = dict(config)
            config_json = json.dumps(parsed, separators=(",", ":"))
        if not isinstance(parsed, dict):
            raise ValueError(f"task config must be a JSON object, found {type(parsed).__name__}")
        actor_num = int(parsed.get("actor_num", 1)) if actor_num is None else int(actor_num)
        max_train_count = _limit(parsed, "max_train_count", max_train_count, int)
        max_steps = _limit(parsed, "max_steps", max_steps, int)
        timeout = _limit(parsed, "timeout", timeout, float)
        if actor_num < 1:
            raise ValueError(f"actor_num must be >= 1, found {actor_num}")
        state = _text(self.client.hget(self._task_key, "status"))
        if state in ("INIT", "ACTIVE") and not overwrite:
            raise self._exists_error(state)
        if state is not None:
            self.delete_task()
        fields: list[str] = [
            "status", TaskState.INIT.value, "end_reason", "", "created_at", repr(time.time()),
            "started_at", "", "ended_at", "", "actor_num", str(actor_num),
            "max_train_count", _field(max_train_count), "max_steps", _field(max_steps),
            "timeout", _field(timeout), "params_epoch", "0", "params_version", "0", "train_count", "0",
            "format", str(BOARD_FORMAT_VERSION), "srl_version", _srl_version(), "config", config_json,
        ]
        answer = _text(self._create(keys=[self._task_key], args=["1" if overwrite else "0", *fields]))
        if answer != "OK":  # another client created it between our check and our write
            raise self._exists_error(answer)
        status = self.get_status()
        assert status is not None
        return status

    def _exists_error(self, state: str | None) -> TaskExistsError:
        return TaskExistsError(
            f"task {self.task_name!r} already exists and is {state}; wait for it to end, pick another "
            "task_name, or pass overwrite=True to replace it (its actors and trainer lose their leases)"
        )

    def get_status(self) -> TaskStatus | None:
        """The task's status, or None if there is no such task."""
        raw = dict(zip(_STATUS_FIELDS, self.client.hmget(self._task_key, *_STATUS_FIELDS), strict=True))
        if raw["status"] is None:
            return None
        self._check_format(raw["format"])
        try:
            return TaskStatus(
                task_name=self.task_name,
                status=TaskState(_text(raw["status"])),
                end_reason=_text(raw["end_reason"]) or "",
                created_at=float(raw["created_at"] or 0.0),
                started_at=_optional_float(raw["started_at"]),
                ended_at=_optional_float(raw["ended_at"]),
                actor_num=int(raw["actor_num"] or 0),
                max_train_count=_optional_int(raw["max_train_count"]),
                max_steps=_optional_int(raw["max_steps"]),
                timeout=_optional_float(raw["timeout"]),
                params_epoch=int(raw["params_epoch"] or 0),
                params_version=int(raw["params_version"] or 0),
                train_count=int(raw["train_count"] or 0),
                board_format=int(raw["format"] or 0),
                srl_version=_text(raw["srl_version"]) or "",
            )
        except ValueError as e:
            raise BoardError(f"task {self.task_name!r} has a malformed status record: {e}") from e

    def _check_format(self, raw: bytes | str | None) -> None:
        found = _text(raw)
        if found != str(BOARD_FORMAT_VERSION):
            raise BoardFormatError(
                f"task {self.task_name!r} was written with board format {found}; this srl "
                f"({_srl_version()}) reads board format {BOARD_FORMAT_VERSION}; run the same srl version "
                "on every client, actor and trainer (or recreate the task with overwrite=True)"
            )

    def get_task_config(self) -> dict[str, Any]:
        """The task's config (JSON object); TaskNotFoundError / BoardFormatError with what to do."""
        raw_config, raw_format = self.client.hmget(self._task_key, "config", "format")
        if raw_config is None:
            raise TaskNotFoundError(
                f"no task {self.task_name!r} on this Redis; submit it first (Runner.train_distribution)"
            )
        self._check_format(raw_format)
        config = json.loads(raw_config)
        if not isinstance(config, dict):
            raise BoardError(f"task {self.task_name!r} config is not a JSON object")
        return config

    def set_active(self) -> bool:
        """INIT -> ACTIVE (the trainer started it); False if it was not INIT."""
        return bool(self._set_active(keys=[self._task_key], args=[repr(time.time())]))

    def end_task(self, status: TaskState | str, reason: str) -> bool:
        """Mark the task END or FAILED with ``reason``; False if it had already ended (first one wins)."""
        state = TaskState(status)
        if not state.finished:
            raise ValueError(f"end_task takes END or FAILED, found {state.value}")
        return bool(self._end(keys=[self._task_key], args=[state.value, reason, repr(time.time())]))

    # ---------------------------------------------------------------- leases

    def claim_lease(self, name: str, owner_uid: str, ttl_ms: int) -> bool:
        """Take lease ``name`` for ``ttl_ms`` if nobody holds it (one ``SET NX PX``)."""
        return bool(self.client.set(self.lease_key(name), owner_uid, nx=True, px=_ttl(ttl_ms)))

    def renew_lease(self, name: str, owner_uid: str, ttl_ms: int) -> bool:
        """Extend the lease if ``owner_uid`` still holds it; False means it is lost: stop working on it."""
        return bool(self._renew(keys=[self.lease_key(name)], args=[owner_uid, _ttl(ttl_ms)]))

    def release_lease(self, name: str, owner_uid: str) -> bool:
        """Give the lease up if ``owner_uid`` holds it."""
        return bool(self._release(keys=[self.lease_key(name)], args=[owner_uid]))

    def lease_holder(self, name: str) -> tuple[str | None, int]:
        """``(owner uid or None, remaining ttl in ms (<0 when free))`` in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        key = self.lease_key(name)
        pipe.get(key)
        pipe.pttl(key)
        holder, ttl = pipe.execute()
        return _text(holder), int(ttl)

    def claim_actor_slot(self, owner_uid: str, actor_num: int, ttl_ms: int) -> int | None:
        """The lowest free actor slot, now leased to ``owner_uid`` (or the one it already holds); None if full."""
        keys = [self._task_key, *(self.lease_key(f"actor:{i}") for i in range(actor_num))]
        slot = int(self._claim_slot(keys=keys, args=[owner_uid, _ttl(ttl_ms)]))
        return None if slot < 0 else slot

    def claim_trainer(self, owner_uid: str, ttl_ms: int) -> int | None:
        """Take the trainer lease; the new epoch (fencing token) if taken, None if someone holds it."""
        keys = [self.lease_key("trainer"), self._epoch_key, self._task_key]
        epoch = self._claim_trainer(keys=keys, args=[owner_uid, _ttl(ttl_ms)])
        return None if epoch is None else int(epoch)

    def heartbeat(
        self,
        lease_name: str,
        owner_uid: str,
        ttl_ms: int,
        role_id: str,
        stats: Mapping[str, Any] | None = None,
        counter_deltas: Mapping[str, int | float] | None = None,
    ) -> Heartbeat:
        """Renew the lease, write stats, add counters, read task status and params head: one round trip.

        A falsy answer (``lease_held`` False) means the lease is lost: stop working on it now.
        """
        stats_json = "" if stats is None else _stats_json(stats)
        deltas_json = _deltas_json(counter_deltas)
        keys = [self.lease_key(lease_name), self.stats_key(role_id), self._roles_key, self._counters_key,
                self._task_key]
        held, status, epoch, version = self._heartbeat(
            keys=keys, args=[owner_uid, _ttl(ttl_ms), role_id, stats_json, self.stats_ttl_ms, deltas_json]
        )
        state = _text(status)
        return Heartbeat(
            lease_held=bool(held),
            task_status=None if state is None else TaskState(state),
            params_epoch=int(epoch or 0),
            params_version=int(version or 0),
        )

    # ---------------------------------------------------------------- params

    def publish_params(self, owner_uid: str, epoch: int, version: int, blob: bytes, train_count: int) -> bool:
        """Store params atomically; False (nothing written) unless ``owner_uid`` holds the trainer
        lease and ``epoch`` is the current trainer epoch, not older than the stored params' epoch."""
        keys = [self.lease_key("trainer"), self._epoch_key, self._params_key, self._task_key]
        args: list[str | bytes] = [owner_uid, str(epoch), str(version), str(train_count), blob, repr(time.time())]
        return bool(self._publish(keys=keys, args=args))

    def get_params_version(self) -> tuple[int, int] | None:
        """``(epoch, version)`` of the latest params (one HMGET); None before the first publish."""
        epoch, version = self.client.hmget(self._task_key, "params_epoch", "params_version")
        if epoch is None or version is None or int(epoch) == 0:
            return None
        return int(epoch), int(version)

    def get_params(self) -> tuple[int, int, int, bytes] | None:
        """``(epoch, version, train_count, blob)`` of the latest params; None before the first publish."""
        epoch, version, train_count, blob = self.client.hmget(
            self._params_key, "epoch", "version", "train_count", "blob"
        )
        if epoch is None or version is None or train_count is None or not isinstance(blob, bytes):
            return None
        return int(epoch), int(version), int(train_count), blob

    # -------------------------------------------------------------- counters

    def incr_counters(self, role_id: str, **deltas: int | float) -> None:
        """Add ``deltas`` (sent_batches=1, backpressure_wait_s=0.3, ...) to ``role_id``'s totals."""
        deltas_json = _deltas_json(deltas)
        if deltas_json:
            self._incr(keys=[self._counters_key, self._task_key], args=[_check_role(role_id), deltas_json])

    def get_role_counters(self) -> dict[str, dict[str, float]]:
        """Running totals per role id."""
        raw = self.client.hgetall(self._counters_key)
        return {str(_text(role)): {str(k): float(v) for k, v in json.loads(value).items()}
                for role, value in raw.items()}

    def get_counters(self) -> dict[str, float]:
        """Running totals summed over every role."""
        totals: dict[str, float] = {}
        for counters in self.get_role_counters().values():
            for name, value in counters.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    # ----------------------------------------------------------------- stats

    def put_stats(self, role_id: str, stats: Mapping[str, Any]) -> None:
        """Replace ``role_id``'s stats (flat JSON-able values; ``updated_at`` is added).

        They expire ``stats_ttl_ms`` after this write.
        """
        keys = [self.stats_key(role_id), self._roles_key, self._task_key]
        self._put_stats(keys=keys, args=[role_id, _stats_json(stats), self.stats_ttl_ms])

    def get_all_stats(self, max_age_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Latest stats per live role id (expired ones are absent; older than ``max_age_s`` too)."""
        roles = sorted(str(_text(r)) for r in self.client.smembers(self._roles_key))
        if not roles:
            return {}
        now = time.time()
        found: dict[str, dict[str, Any]] = {}
        for role, raw in zip(roles, self.client.mget([self.prefix + "stats:" + r for r in roles]), strict=True):
            if raw is None:
                continue
            stats = json.loads(raw)
            if max_age_s is None or now - float(stats.get("updated_at", 0.0)) <= max_age_s:
                found[role] = stats
        return found

    # ---------------------------------------------------------------- events

    def log_event(self, text: str, level: str = "INFO", source: str = "") -> None:
        """Append to the capped event log (one round trip); dropped if the task does not exist."""
        event = json.dumps({"ts": time.time(), "level": level, "text": text, "source": source})
        self._log_event(keys=[self._events_key, self._task_key], args=[event, self.event_cap])

    def get_events(self, n: int = 100) -> list[Event]:
        """The latest ``n`` events, oldest first."""
        if n <= 0:
            return []
        events = []
        for raw in reversed(self.client.lrange(self._events_key, 0, n - 1)):
            item = json.loads(raw)
            events.append(Event(ts=float(item["ts"]), level=str(item["level"]), text=str(item["text"]),
                                source=str(item.get("source", ""))))
        return events


def _limit(config: Mapping[str, Any], name: str, value: Any, kind: type[int] | type[float]) -> Any:
    """``value``, else ``config[name]``, as ``kind`` (None: no limit)."""
    value = config.get(name) if value is None else value
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"task {name} must be a number or None, found {value!r}") from e


def _ttl(ttl_ms: int) -> int:
    if int(ttl_ms) < 1:
        raise ValueError(f"a lease ttl must be >= 1 ms, found {ttl_ms}")
    return int(ttl_ms)


def _check_role(role_id: str) -> str:
    if not _ROLE_ID.fullmatch(role_id):
        raise ValueError(f"role id {role_id!r}: use 1-128 letters, digits, '_', '.', ':', '-'")
    return role_id


def _stats_json(stats: Mapping[str, Any]) -> str:
    return json.dumps({**stats, "updated_at": time.time()}, separators=(",", ":"), default=str)


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
        if delta:
            clean[name] = delta
    return json.dumps(clean, separators=(",", ":")) if clean else ""
