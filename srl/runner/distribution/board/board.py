"""The Redis blackboard of one task: status, config, leases, fencing, params, counters, stats, events.

Owns: every Redis key of a task. They all live under ``srl:{<task_name>}:`` —
the braces are literal: a Redis Cluster hash tag, so a task's keys share one
slot and the multi-key scripts below also run on a cluster — and
:meth:`Board.task_keys` lists them all; :meth:`Board.delete_task` removes them.
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

Keys (``P`` = ``srl:{<task_name>}:``)::

    P task            hash   task_id (the client's, one per submission), status, times, limits,
                             config JSON + signature, params head (epoch, version, train_count),
                             the trainer's uid and epoch
    P epoch           string trainer epoch, INCR'd by the script that grants the trainer lease
    P params          hash   epoch, version, train_count, blob, published_at; master: the same version's
                             float32 weights when blob's are float16 (a trainer taking over restores them)
    P lease:trainer   string owner uid, PX ttl
    P lease:actor:<i> string owner uid, PX ttl
    P counters        hash   role_id -> JSON of running totals
    P counted         hash   role_id -> the token of the last count it added with one (a retried count
                             whose reply was lost carries it again and adds nothing); '<role_id> heartbeat'
                             -> the same for the counts its heartbeats bring
    P roles           set    role ids that ever wrote stats
    P stats:<role_id> string JSON of the latest stats, PX ttl
    P events          list   JSON events, newest first, capped by count; each text capped
    P deadletters     list   JSON notes of refused messages (source, reason, size), capped
    P refusals        hash   node uid -> JSON {role, reason, ts}: nodes that refuse the task, and why
    P ledger          hash   trainer uid -> JSON [[actor, seq], ...]: batches it counted and may not
                             have acked yet (a trainer that takes over takes their redeliveries, uncounted)
    P history         list   JSON rows of scalars, one per progress interval, capped
    P resume          string the checkpoint a new task starts from (a signed PARAMS message)
    P checkpoint      hash   train_count, blob: the trainer's latest checkpoint (a signed PARAMS message)
    P queue:<name>    (any)  owned by a queue backend, deleted with the task

Times that decide something (a task's start for its timeout, a heartbeat's
"now") are the Redis server's ``TIME``, so nodes with skewed clocks agree.

Cost (the system-wide budget is about 0.05 Redis commands per transition):
an actor's heartbeat — lease renewal, stats, counters and the read of task
status and params head it needs — is ONE ``EVALSHA``.

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
import json
import logging
import random
import re
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import redis

from srl.runner.distribution.board import values as board_values
from srl.runner.distribution.board.values import BoardValueError, finite
from srl.runner.distribution.node.retry import TRANSIENT_ERRORS

logger = logging.getLogger("srl.board")

BOARD_FORMAT_VERSION = 3
"""version of the key layout and field encoding above; bumped on any incompatible change (3: task ids)"""
EVENT_LOG_CAP = 1000
"""events kept per task (older ones are trimmed)"""
EVENT_TEXT_LIMIT = 500
"""characters of an event's text kept (the rest is cut): the log is capped by size too"""
DEADLETTER_CAP = 100
"""notes of refused messages kept per task"""
REFUSALS_CAP = 1000
"""nodes whose refusal of a task is kept (one entry per node: its latest reason)"""
LEDGER_BYTES = 64 * 1024
"""largest ledger entry of a trainer read from the board"""
HISTORY_CAP = 5000
"""history rows (one per progress interval: scalars for curves) kept per task"""
HISTORY_ROW_BYTES = 16 * 1024
"""larger history rows are refused when written and skipped when read"""
DEFAULT_STATS_TTL_MS = 60_000
"""how long a role's stats outlive its last write"""
MAX_ACTORS = 100_000
"""most actor slots a task may have"""
SMALL_TASK_SLOTS = 64
"""up to this many slots an actor takes the lowest free one; beyond, the first free one from a random start"""
MAX_CONFIG_BYTES = 1 << 20
"""largest task config JSON read from the board"""
MAX_STATS_BYTES = 64 * 1024
"""larger stats records are ignored when read"""

_TASK_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_ROLE_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_LEASE_NAME = re.compile(r"trainer|inference|actor:(0|[1-9][0-9]{0,5})")
_ADDRESS = re.compile(r"[A-Za-z0-9._\-]{1,253}:[0-9]{1,5}|\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")
_COUNTER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_SCAN_COUNT = 500
_MAX_INT = board_values.MAX_INT


def _srl_version() -> str:
    return str(getattr(sys.modules.get("srl"), "__version__", "unknown"))


def task_key_prefix(task_name: str) -> str:
    """The prefix of every key of ``task_name`` (validated)."""
    if not isinstance(task_name, str) or not _TASK_NAME.fullmatch(task_name):
        raise ValueError(
            f"task name {task_name!r} is not allowed: use 1-128 characters among letters, digits, '_', '.', '-'"
        )
    return f"srl:{{{task_name}}}:"


def actor_slot(lease_name: str) -> int | None:
    """The slot index of an actor's lease name (``"actor:3"`` -> 3); None for anything else."""
    match = _LEASE_NAME.fullmatch(lease_name)
    return int(match[1]) if match and match[1] is not None else None


def list_tasks(client: redis.Redis, limit: int = 1000) -> list[str]:
    """Names of the tasks on this Redis (at most ``limit``, sorted), found by their task records."""
    names: set[str] = set()
    for key in client.scan_iter(match="srl:{*}:task", count=_SCAN_COUNT):
        text = _str(key)
        name = text[len("srl:{"):-len("}:task")]
        if _TASK_NAME.fullmatch(name):
            names.add(name)
        if len(names) >= limit:
            break
    return sorted(names)


class BoardError(RuntimeError):
    """The board is not in the state the caller expected."""


BOARD_AWAY: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, BoardError)
"""what a node waits out, retrying: the board unreachable, or a record on it it cannot read"""


class TaskExistsError(BoardError):
    """A task of that name is still INIT or ACTIVE."""


class TaskNotFoundError(BoardError):
    """No task of that name on this Redis."""


class BoardFormatError(BoardError):
    """The task was written by an srl with another board format."""


class BoardDataError(BoardError):
    """A record on the board is malformed (written by something other than srl, or damaged)."""


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
    """Redis server time at which the task became ACTIVE (its timeout counts from here)"""
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
    trainer_uid: str = ""
    """the uid that took the trainer lease last (with ``trainer_epoch``)"""
    trainer_epoch: int = 0
    task_id: str = ""
    """drawn by the client that created the task: a task replacing one of the same name has another"""


@dataclass(frozen=True)
class InferenceAddress:
    """Where the task's central inference server listens (see ``Board.set_inference_address``)."""

    uid: str
    """the server holding the ``inference`` lease"""
    address: str
    """host:port"""
    tls: bool
    """it serves over TLS"""


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
    train_count: int = 0
    """the trainer's train count at its latest publish"""
    server_time: float = 0.0
    """Redis TIME when the heartbeat ran"""
    replaced: bool = False
    """the task of this name is another one now (a client replaced it): nothing was renewed or written"""
    total: float | None = None
    """the counter asked for (``total_of``) summed over every role; None: none asked, or the task is gone"""

    def __bool__(self) -> bool:
        return self.lease_held


@dataclass(frozen=True)
class Event:
    """One line of the task's event log."""

    ts: float
    level: str
    text: str
    source: str


@dataclass(frozen=True)
class DeadLetter:
    """A refused message, as noted on the board (not the message itself)."""

    ts: float
    source: str
    reason: str
    size: int


@dataclass(frozen=True)
class Refusal:
    """A node that refuses the task, and why (its latest reason)."""

    uid: str
    role: str
    reason: str
    ts: float
    """Redis TIME of the refusal"""


@dataclass(frozen=True)
class TaskRecord:
    """What a node reads to build a task, in one round trip: the config, its signature, the task's id."""

    config_json: str
    signature: str
    task_id: str


@dataclass(frozen=True)
class ParamsRecord:
    """The latest params on the board: the hash fields, and the blob they describe."""

    epoch: int
    version: int
    train_count: int
    blob: bytes


# ---------------------------------------------------------------- Lua scripts
# Every script names all the keys it touches in KEYS (cluster-safe). Times come
# from TIME inside the script (replicated by effects, Redis >= 5) or the caller.
#
# A task is its name AND the id its client gave it (``task_id``, written once by create_task):
# a node's board is bound to the id of the task it serves (Board.bound), and every write it makes
# first checks that the task of that name is still that one. A task replaced meanwhile (a client
# with overwrite=True) or deleted (or lost with a Redis restarted empty) is never written to by the
# nodes of the old one, and its leases are never taken back by them.

_TASK_IS_LUA = """
local function task_is(key, id)
  local found = redis.call('HGET', key, 'task_id')
  if not found then return 0 end
  if id ~= '' and found ~= id then return -1 end
  return 1
end
"""

# KEYS: lease, task. ARGV: uid, ttl_ms, task id ('': any task, or none).
_RENEW_LUA = _TASK_IS_LUA + """
if ARGV[3] ~= '' and task_is(KEYS[2], ARGV[3]) ~= 1 then return 0 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_SET_INFERENCE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], 'uid', ARGV[1], 'address', ARGV[2], 'tls', ARGV[3])
return 1
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: trainer lease, epoch, task. ARGV: uid, ttl_ms, task id. The epoch is consumed only by the winner.
_CLAIM_TRAINER_LUA = _TASK_IS_LUA + """
if task_is(KEYS[3], ARGV[3]) ~= 1 then return false end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local epoch = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[3], 'trainer_uid', ARGV[1], 'trainer_epoch', epoch)
  return epoch
end
return false
"""

# KEYS: trainer lease, epoch, task. ARGV: uid, epoch, ttl_ms, task id.
# A trainer whose lease lapsed (a Redis or network outage longer than the TTL) takes it back,
# keeping its epoch, when no other trainer took the lease in between (the epoch did not move).
# Returns 1 taken back, 0 another trainer took over, -1 the task is gone, -2 it was replaced.
_RECLAIM_TRAINER_LUA = _TASK_IS_LUA + """
local mine = task_is(KEYS[3], ARGV[4])
if mine == 0 then return -1 end
if mine == -1 then return -2 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 0 end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"""

# KEYS: task, then the actor slot leases in order. ARGV: uid, ttl_ms, preferred index (0-based, -1: none),
# start, small ('1'/'0'), task id.
# A slot this uid already holds is kept; else the preferred slot if free; else the lowest free one.
_CLAIM_SLOT_LUA = _TASK_IS_LUA + """
if task_is(KEYS[1], ARGV[6]) ~= 1 then return -1 end
local n = #KEYS - 1
local prefer = tonumber(ARGV[3])
if prefer >= 0 and prefer < n then
  local key = KEYS[prefer + 2]
  if redis.call('GET', key) == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
    return prefer
  end
  if redis.call('SET', key, ARGV[1], 'NX', 'PX', ARGV[2]) then return prefer end
end
if ARGV[5] == '1' then
  for i = 2, #KEYS do
    if redis.call('GET', KEYS[i]) == ARGV[1] then
      redis.call('PEXPIRE', KEYS[i], ARGV[2])
      return i - 2
    end
  end
end
local start = tonumber(ARGV[4])
for j = 0, n - 1 do
  local i = (start + j) % n
  if redis.call('SET', KEYS[i + 2], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return i
  end
end
return -1
"""

# KEYS: trainer lease, epoch, params, task, params feed. ARGV: uid, epoch, version, train_count, blob, task id,
# master ('' : none; a master of an older version never stays beside a newer blob).
# The feed is a stream of one entry, the latest version: a node waiting for the next one blocks on it.
_PUBLISH_PARAMS_LUA = _TASK_IS_LUA + """
if task_is(KEYS[4], ARGV[6]) ~= 1 then return 0 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local epoch = tonumber(ARGV[2])
if epoch ~= tonumber(redis.call('GET', KEYS[2]) or '0') then return 0 end
local stored = tonumber(redis.call('HGET', KEYS[4], 'params_epoch') or '')
if not stored or epoch < stored then return 0 end
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', t[2])
redis.call('HSET', KEYS[3], 'epoch', ARGV[2], 'version', ARGV[3], 'train_count', ARGV[4],
           'blob', ARGV[5], 'published_at', now, 'task', ARGV[6])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[3], 'master', ARGV[7]) else redis.call('HDEL', KEYS[3], 'master') end
redis.call('HSET', KEYS[4], 'params_epoch', ARGV[2], 'params_version', ARGV[3], 'train_count', ARGV[4])
redis.call('XADD', KEYS[5], 'MAXLEN', '1', '*', 'epoch', ARGV[2], 'version', ARGV[3])
return 1
"""

# KEYS: params. ARGV: a version the caller holds ('' : none), max blob bytes (-1: any), '1': the master in
# place of the blob when there is one (a trainer restoring).
# The latest params in one round trip: the head always, the blob only when its version is not the one the
# caller holds and it is within the caller's bound (its size is returned, so a huge forged blob never travels).
_GET_PARAMS_LUA = """
local h = redis.call('HMGET', KEYS[1], 'epoch', 'version', 'train_count', 'task')
if not h[1] or not h[2] or not h[3] then return false end
local field = 'blob'
if ARGV[3] == '1' and redis.call('HEXISTS', KEYS[1], 'master') == 1 then field = 'master' end
local size = redis.call('HSTRLEN', KEYS[1], field)
local blob = false
local limit = tonumber(ARGV[2])
if h[2] ~= ARGV[1] and (limit < 0 or size <= limit) then blob = redis.call('HGET', KEYS[1], field) end
return {h[1], h[2], h[3], h[4] or '', size, blob}
"""

# KEYS: trainer lease, epoch, checkpoint, task. ARGV: uid, epoch, train_count, blob, task id.
# The trainer's latest checkpoint, fenced like its params: a client far from the trainer keeps it.
_PUT_CHECKPOINT_LUA = _TASK_IS_LUA + """
if task_is(KEYS[4], ARGV[5]) ~= 1 then return 0 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) ~= tonumber(redis.call('GET', KEYS[2]) or '0') then return 0 end
redis.call('HSET', KEYS[3], 'train_count', ARGV[3], 'blob', ARGV[4])
return 1
"""

# Adds the JSON object of deltas to the JSON totals of a role in a hash; a stored value that is
# not a JSON object of numbers (damaged, or written by someone else) is started over, and so is a
# total that is not a finite number (cjson reads 1e400 or a 400-digit integer as inf, and then
# cannot encode the totals again: every later write of the role's counters would fail).
_ADD_COUNTERS_LUA = _TASK_IS_LUA + """
local function finite(value)
  return type(value) == 'number' and value == value and value > -math.huge and value < math.huge
end
local function add_counters(key, role, deltas_json)
  local totals = {}
  local current = redis.call('HGET', key, role)
  if current then
    local ok, decoded = pcall(cjson.decode, current)
    if ok and type(decoded) == 'table' then
      for name, value in pairs(decoded) do
        if type(name) == 'string' and finite(value) then totals[name] = value end
      end
    end
  end
  for name, delta in pairs(cjson.decode(deltas_json)) do
    local total = (totals[name] or 0) + delta
    if not finite(total) then total = delta end
    totals[name] = total
  end
  redis.call('HSET', key, role, cjson.encode(totals))
end
"""

# Whether a count that carries ``token`` is still to be added, remembering it as its role's last: a
# count sent again (with_retry, or redis-py's own retry) after its reply was lost carries the token of
# the last count its role added, and adds nothing. '' = no token: always added. One writer at a time
# counts with tokens under a role (an actor slot's holder, the trainer lease's holder).
_FIRST_COUNT_LUA = """
local function first_count(key, role, token)
  if token == '' then return true end
  if redis.call('HGET', key, role) == token then return false end
  redis.call('HSET', key, role, token)
  return true
end
"""

# KEYS: counters, task, counted. ARGV: role_id, deltas_json, task id, token ('' = none).
_INCR_COUNTERS_LUA = _ADD_COUNTERS_LUA + _FIRST_COUNT_LUA + """
if task_is(KEYS[2], ARGV[3]) ~= 1 then return 0 end
if first_count(KEYS[3], ARGV[1], ARGV[4]) then add_counters(KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""

# The trainer's count of what one read brought, written before the read is acked, with the batches
# of its last reads whose acks may not have reached the broker (its ledger): a trainer that takes over
# takes their redelivered copies without counting them again, so nothing is counted twice or lost from the counts.
# KEYS: trainer lease, counters, task, ledger, counted. ARGV: uid, deltas_json ('' = none), ledger_json,
# task id, token ('' = none).
# Returns 1 written (or written already: a retry), 0 the lease is not this trainer's (do not ack: the
# next holder gets the batches), -1 the task is gone or was replaced.
_NOTE_RECEIVED_LUA = _ADD_COUNTERS_LUA + _FIRST_COUNT_LUA + """
if task_is(KEYS[3], ARGV[4]) ~= 1 then return -1 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] ~= '' and first_count(KEYS[5], 'trainer', ARGV[5]) then add_counters(KEYS[2], 'trainer', ARGV[2]) end
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
return 1
"""

# KEYS: stats:<role>, roles, task. ARGV: role_id, stats_json, stats_ttl_ms, task id.
_PUT_STATS_LUA = _TASK_IS_LUA + """
if task_is(KEYS[3], ARGV[4]) ~= 1 then return 0 end
if not redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3], 'GET') then
  redis.call('SADD', KEYS[2], ARGV[1])
end
return 1
"""

# KEYS: list, task. ARGV: entry_json, cap, task id.
_PUSH_CAPPED_LUA = _TASK_IS_LUA + """
if task_is(KEYS[2], ARGV[3]) ~= 1 then return 0 end
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
return 1
"""

# KEYS: refusals, task. ARGV: uid, entry_json (without the time), cap, task id.
# One entry per node that refuses the task (the latest reason), stamped with the server's time.
_NOTE_REFUSAL_LUA = _TASK_IS_LUA + """
if task_is(KEYS[2], ARGV[4]) ~= 1 then return 0 end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
local t = redis.call('TIME')
local entry = cjson.decode(ARGV[2])
entry['ts'] = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(entry))
return 1
"""

# KEYS: lease, stats:<role>, roles, counters, task, counted.
# ARGV: uid, ttl_ms, role_id, stats_json ('' = none), stats_ttl_ms, deltas_json ('' = none), task id,
# a counter to total over every role ('' = none), the deltas' count token ('' = none).
# Returns {held, status, params epoch, params version, train_count, time s, time us, the task's id, that
# total (false: none asked)}; nothing is renewed or written unless the task is the one this node serves.
# The token is kept apart from the role's other counts ('<role> heartbeat'): a role's incr_counters between
# a lost heartbeat and its retry must not make the retry count again.
_HEARTBEAT_LUA = _ADD_COUNTERS_LUA + _FIRST_COUNT_LUA + """
local t = redis.call('TIME')
local head = redis.call('HMGET', KEYS[5], 'status', 'params_epoch', 'params_version', 'train_count', 'task_id')
if not head[1] then return {0, false, false, false, false, t[1], t[2], false, false} end
if ARGV[7] ~= '' and head[5] ~= ARGV[7] then
  return {0, head[1], false, false, false, t[1], t[2], head[5], false}
end
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
if ARGV[6] ~= '' and first_count(KEYS[6], ARGV[3] .. ' heartbeat', ARGV[9]) then
  add_counters(KEYS[4], ARGV[3], ARGV[6])
end
local total = false
if ARGV[8] ~= '' then
  total = 0
  for _, value in ipairs(redis.call('HVALS', KEYS[4])) do
    local ok, decoded = pcall(cjson.decode, value)
    if ok and type(decoded) == 'table' and finite(decoded[ARGV[8]]) and finite(total + decoded[ARGV[8]]) then
      total = total + decoded[ARGV[8]]
    end
  end
  total = tostring(total)
end
return {held, head[1], head[2], head[3], head[4], t[1], t[2], head[5], total}
"""

# KEYS: task. ARGV: overwrite ('1'/'0'), then field, value, ...
_CREATE_TASK_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status and ARGV[1] ~= '1' and (status == 'INIT' or status == 'ACTIVE') then return status end
local t = redis.call('TIME')
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('HSET', KEYS[1], 'created_at', t[1] .. '.' .. string.format('%06d', t[2]))
return 'OK'
"""

# KEYS: task. ARGV: task id.
_SET_ACTIVE_LUA = _TASK_IS_LUA + """
if task_is(KEYS[1], ARGV[1]) ~= 1 then return 0 end
if redis.call('HGET', KEYS[1], 'status') == 'INIT' then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'status', 'ACTIVE', 'started_at', t[1] .. '.' .. string.format('%06d', t[2]))
  return 1
end
return 0
"""

# KEYS: task. ARGV: status, reason, task id.
_END_TASK_LUA = _TASK_IS_LUA + """
if task_is(KEYS[1], ARGV[3]) ~= 1 then return 0 end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'INIT' or status == 'ACTIVE' then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'end_reason', ARGV[2],
             'ended_at', t[1] .. '.' .. string.format('%06d', t[2]))
  return 1
end
return 0
"""

# KEYS: task, then keys to remove. Removes them only while no task of this name exists: what nodes of
# a task that vanished (a Redis restarted empty, FLUSHALL) wrote back under its prefix as they stopped.
_DELETE_ORPHANS_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local removed = 0
for i = 2, #KEYS do removed = removed + redis.call('UNLINK', KEYS[i]) end
return removed
"""


# ---------------------------------------------------------------- parsing what was read
def _lease_names(actor_num: int) -> list[str]:
    """The names of a task's leases: ``trainer``, ``inference`` (central inference's server) and ``actor:<i>``
    for each of its slots."""
    return ["trainer", "inference", *(f"actor:{i}" for i in range(max(0, min(actor_num, MAX_ACTORS))))]


def _text(value: bytes | str | None, limit: int = 10_000) -> str | None:
    if value is None:
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _str(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _int(value: Any, name: str, low: int = 0, high: int = _MAX_INT) -> int:
    """A board field as an int in [low, high]; BoardDataError otherwise."""
    try:
        return board_values.integer(value, f"board field {name!r}", low, high)
    except BoardValueError as e:
        raise BoardDataError(str(e)) from None


def _opt_int(value: Any, name: str, high: int = _MAX_INT) -> int | None:
    return None if value is None or value in (b"", "") else _int(value, name, 0, high)


def _float(value: Any, name: str, low: float = 0.0, high: float = 1e12) -> float:
    """A board field as a finite float in [low, high]; BoardDataError otherwise."""
    try:
        return board_values.number(value, f"board field {name!r}", low, high)
    except BoardValueError as e:
        raise BoardDataError(str(e)) from None


def _opt_float(value: Any, name: str, high: float = 1e12) -> float | None:
    return None if value is None or value in (b"", "") else _float(value, name, 0.0, high)


def _field(value: int | float | None) -> str:
    return "" if value is None else repr(int(value) if isinstance(value, bool) else value)


def _json_object(raw: bytes | str | None, limit: int) -> dict[str, Any] | None:
    """``raw`` as a JSON object, or None when it is missing, too large or not one (an entry the readers of lists
    and hashes skip); a number in it that no reader could hold (not finite, beyond a float's range) reads as
    null."""
    if raw is None:
        return None
    try:
        return board_values.json_object(raw, "a board entry", limit)
    except BoardValueError:
        return None


def _server_time(sec: Any, usec: Any) -> float:
    try:
        return int(sec) + int(usec) / 1e6
    except (TypeError, ValueError):
        return time.time()


_STATUS_FIELDS = (
    "status", "end_reason", "created_at", "started_at", "ended_at", "actor_num", "max_train_count",
    "max_steps", "timeout", "params_epoch", "params_version", "train_count", "format", "srl_version",
    "trainer_uid", "trainer_epoch", "task_id",
)


class Board:
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
        self._task_key = self.prefix + "task"
        self._epoch_key = self.prefix + "epoch"
        self._params_key = self.prefix + "params"
        self._feed_key = self.prefix + "params:feed"
        self._feed_usable = True  # False: this Redis user may not XREAD it, await_params polls
        self._counters_key = self.prefix + "counters"
        self._counted_key = self.prefix + "counted"
        self._roles_key = self.prefix + "roles"
        self._events_key = self.prefix + "events"
        self._deadletters_key = self.prefix + "deadletters"
        self._history_key = self.prefix + "history"
        self._resume_key = self.prefix + "resume"
        self._refusals_key = self.prefix + "refusals"
        self._ledger_key = self.prefix + "ledger"
        self._checkpoint_key = self.prefix + "checkpoint"
        self._inference_key = self.prefix + "inference"
        # register_script: EVALSHA, and SCRIPT LOAD + retry on NOSCRIPT (a restarted or flushed Redis).
        self._renew = client.register_script(_RENEW_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._set_inference = client.register_script(_SET_INFERENCE_LUA)
        self._claim_trainer = client.register_script(_CLAIM_TRAINER_LUA)
        self._reclaim_trainer = client.register_script(_RECLAIM_TRAINER_LUA)
        self._claim_slot = client.register_script(_CLAIM_SLOT_LUA)
        self._publish = client.register_script(_PUBLISH_PARAMS_LUA)
        self._incr = client.register_script(_INCR_COUNTERS_LUA)
        self._put_stats = client.register_script(_PUT_STATS_LUA)
        self._push_capped = client.register_script(_PUSH_CAPPED_LUA)
        self._heartbeat = client.register_script(_HEARTBEAT_LUA)
        self._create = client.register_script(_CREATE_TASK_LUA)
        self._set_active = client.register_script(_SET_ACTIVE_LUA)
        self._end = client.register_script(_END_TASK_LUA)
        self._note_received = client.register_script(_NOTE_RECEIVED_LUA)
        self._note_refusal = client.register_script(_NOTE_REFUSAL_LUA)
        self._delete_orphans = client.register_script(_DELETE_ORPHANS_LUA)
        self._put_checkpoint = client.register_script(_PUT_CHECKPOINT_LUA)
        self._get_params = client.register_script(_GET_PARAMS_LUA)

    def __repr__(self) -> str:
        return f"Board(task_name={self.task_name!r}" + (f", task_id={self.task_id!r})" if self.task_id else ")")

    def bound(self, task_id: str) -> Board:
        """This board bound to the task ``task_id`` (same client): its writes land only while the task of
        this name is that one, and its heartbeats say when it is not (``Heartbeat.replaced``)."""
        board = copy.copy(self)
        board.task_id = task_id
        return board

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
        keys = {self._task_key, self._epoch_key, self._params_key, self._feed_key, self._counters_key, self._roles_key,
                self._events_key, self._deadletters_key, self._history_key, self._resume_key, self._counted_key,
                self._refusals_key, self._ledger_key, self._checkpoint_key, self._inference_key,
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

    # ------------------------------------------------------------------ task

    def ping(self) -> bool:
        """True if the Redis answers (raises redis.ConnectionError otherwise)."""
        return bool(self.client.ping())

    def server_time(self) -> float:
        """The Redis server's clock (TIME), in seconds since the epoch."""
        sec, usec = self.client.time()
        return _server_time(sec, usec)

    def create_task(
        self,
        config: Mapping[str, Any] | str,
        *,
        actor_num: int | None = None,
        max_train_count: int | None = None,
        max_steps: int | None = None,
        timeout: float | None = None,
        overwrite: bool = False,
        signature: str = "",
    ) -> TaskStatus:
        """Write a new task in state INIT with ``config`` (a JSON object, or its text: algorithm + fields).

        ``actor_num``, ``max_train_count``, ``max_steps`` and ``timeout`` default
        to the config's keys of those names (actor_num: 1). ``signature``: the
        config's HMAC (``Codec.config_signature``), which nodes with a secret
        demand. Refuses (TaskExistsError) while a task of that name is INIT or
        ACTIVE, unless ``overwrite``; an old task's keys are removed first. The status returned carries
        the new task's ``task_id``: bind the board to it (:meth:`bound`) to write for this task only.
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
        if len(config_json) > MAX_CONFIG_BYTES:
            raise ValueError(f"task config is {len(config_json)} bytes; the most a node reads is {MAX_CONFIG_BYTES}")
        actor_num = _limit(parsed, "actor_num", actor_num, int)
        actor_num = 1 if actor_num is None else actor_num
        max_train_count = _limit(parsed, "max_train_count", max_train_count, int)
        max_steps = _limit(parsed, "max_steps", max_steps, int)
        timeout = _limit(parsed, "timeout", timeout, float)
        if not 1 <= actor_num <= MAX_ACTORS:
            raise ValueError(f"actor_num must be in 1..{MAX_ACTORS}, found {actor_num}")
        state = _text(self.client.hget(self._task_key, "status"))
        if state in ("INIT", "ACTIVE") and not overwrite:
            raise self._exists_error(state)
        task_id = uuid.uuid4().hex[:16]
        fields: list[str] = [
            "task_id", task_id, "status", TaskState.INIT.value, "end_reason", "",
            "started_at", "", "ended_at", "", "actor_num", str(actor_num),
            "max_train_count", _field(max_train_count), "max_steps", _field(max_steps),
            "timeout", _field(timeout), "params_epoch", "0", "params_version", "0", "train_count", "0",
            "format", str(BOARD_FORMAT_VERSION), "srl_version", _srl_version(), "config", config_json,
            "config_sig", signature, "trainer_uid", "", "trainer_epoch", "0",
        ]
        # the old task's record is replaced in one step, so its nodes never see no task here ("gone") but
        # another one ("replaced"), and their writes are refused from then on; its other keys go after
        answer = _text(self._create(keys=[self._task_key], args=["1" if overwrite else "0", *fields]))
        if answer != "OK":  # another client created it between our check and our write
            raise self._exists_error(answer)
        if state is not None:
            self._delete_keys([k for k in self.task_keys() if k != self._task_key])
        status = self.get_status()
        if status is None or status.task_id != task_id:
            raise TaskExistsError(f"task {self.task_name!r} was replaced by another client while this one submitted "
                                  "it; pick another task_name, or submit again")
        return status

    def _exists_error(self, state: str | None) -> TaskExistsError:
        return TaskExistsError(
            f"task {self.task_name!r} already exists and is {state}; wait for it to end, pick another "
            "task_name, pass attach=True to watch it, or overwrite=True to replace it (its actors and trainer "
            "drop it and serve the new one)"
        )

    def get_status(self) -> TaskStatus | None:
        """The task's status, or None if there is no such task; BoardDataError if the record is malformed."""
        raw = dict(zip(_STATUS_FIELDS, self.client.hmget(self._task_key, *_STATUS_FIELDS), strict=True))
        if raw["status"] is None:
            return None
        self._check_format(raw["format"])
        try:
            state = TaskState(_text(raw["status"], 16))
        except ValueError:
            raise BoardDataError(f"task {self.task_name!r} has status {_text(raw['status'], 40)!r}") from None
        return TaskStatus(
            task_name=self.task_name,
            status=state,
            end_reason=_text(raw["end_reason"], 2000) or "",
            created_at=_float(raw["created_at"] or 0, "created_at"),
            started_at=_opt_float(raw["started_at"], "started_at"),
            ended_at=_opt_float(raw["ended_at"], "ended_at"),
            actor_num=_int(raw["actor_num"] or 0, "actor_num", 0, MAX_ACTORS),
            max_train_count=_opt_int(raw["max_train_count"], "max_train_count"),
            max_steps=_opt_int(raw["max_steps"], "max_steps"),
            timeout=_opt_float(raw["timeout"], "timeout"),
            params_epoch=_int(raw["params_epoch"] or 0, "params_epoch"),
            params_version=_int(raw["params_version"] or 0, "params_version"),
            train_count=_int(raw["train_count"] or 0, "train_count"),
            board_format=BOARD_FORMAT_VERSION,
            srl_version=_text(raw["srl_version"], 64) or "",
            trainer_uid=_text(raw["trainer_uid"], 128) or "",
            trainer_epoch=_int(raw["trainer_epoch"] or 0, "trainer_epoch"),
            task_id=_text(raw["task_id"], 64) or "",
        )

    def _check_format(self, raw: bytes | str | None) -> None:
        found = _text(raw, 16)
        if found != str(BOARD_FORMAT_VERSION):
            raise BoardFormatError(
                f"task {self.task_name!r} was written with board format {found}; this srl "
                f"({_srl_version()}) reads board format {BOARD_FORMAT_VERSION}; run the same srl version "
                "on every client, actor and trainer (or recreate the task with overwrite=True)"
            )

    def get_task_config_raw(self) -> tuple[str, str]:
        """``(config JSON text, signature)`` as stored; the caller verifies and parses."""
        record = self.get_task_record()
        return record.config_json, record.signature

    def get_task_record(self) -> TaskRecord:
        """The task's config JSON, its signature and the task's id, as stored (one round trip); the caller
        verifies and parses."""
        raw_config, raw_format, raw_sig, raw_id = self.client.hmget(self._task_key, "config", "format", "config_sig",
                                                                     "task_id")
        if raw_config is None:
            raise TaskNotFoundError(
                f"no task {self.task_name!r} on this Redis; submit it first (Runner.train_distribution)"
            )
        self._check_format(raw_format)
        if len(raw_config) > MAX_CONFIG_BYTES:
            raise BoardDataError(f"task {self.task_name!r} config is {len(raw_config)} bytes, over {MAX_CONFIG_BYTES}")
        try:  # strict: the text must be the stored bytes exactly (a signature covers them)
            config_text = raw_config.decode("utf-8") if isinstance(raw_config, bytes) else raw_config
        except UnicodeDecodeError as e:
            raise BoardDataError(f"task {self.task_name!r} config is not UTF-8 text ({e.reason} at byte {e.start})") \
                from None
        return TaskRecord(config_text, _text(raw_sig, 256) or "", _text(raw_id, 64) or "")

    def get_task_config(self) -> dict[str, Any]:
        """The task's config (JSON object), unverified: for display. Nodes verify the signature first."""
        config_json, _ = self.get_task_config_raw()
        config = _json_object(config_json, MAX_CONFIG_BYTES)
        if config is None:
            raise BoardDataError(f"task {self.task_name!r} config is not a JSON object")
        return config

    def set_active(self) -> bool:
        """INIT -> ACTIVE (the client started it), at the server's time; False if it was not INIT."""
        return bool(self._set_active(keys=[self._task_key], args=[self.task_id]))

    def end_task(self, status: TaskState | str, reason: str) -> bool:
        """Mark the task END or FAILED with ``reason``; False if it had already ended (first one wins), or,
        on a bound board, if the task of this name is another one now (a node failing the task it read
        never ends a newer task that replaced it meanwhile)."""
        state = TaskState(status)
        if not state.finished:
            raise ValueError(f"end_task takes END or FAILED, found {state.value}")
        return bool(self._end(keys=[self._task_key], args=[state.value, _text(reason, 2000) or "", self.task_id]))

    # ---------------------------------------------------------------- leases

    def claim_lease(self, name: str, owner_uid: str, ttl_ms: int) -> bool:
        """Take lease ``name`` for ``ttl_ms`` if nobody holds it (one ``SET NX PX``)."""
        return bool(self.client.set(self.lease_key(name), owner_uid, nx=True, px=_ttl(ttl_ms)))

    def renew_lease(self, name: str, owner_uid: str, ttl_ms: int) -> bool:
        """Extend the lease if ``owner_uid`` still holds it (of this board's task); False means it is lost:
        stop working on it."""
        return bool(self._renew(keys=[self.lease_key(name), self._task_key],
                                args=[owner_uid, _ttl(ttl_ms), self.task_id]))

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
        return _text(holder, 256), int(ttl)

    def lease_holders(self, names: list[str]) -> list[str | None]:
        """The holder of each lease in ``names`` (None: free), in one MGET."""
        if not names:
            return []
        return [_text(holder, 256) for holder in self.client.mget([self.lease_key(n) for n in names])]

    def release_leases_of(self, owner_uid: str, actor_num: int) -> list[str]:
        """Release every lease of the task ``owner_uid`` holds, and return their names: for a node stopped
        while its claim was in flight, when the board may have granted a slot the node never learned of."""
        names = _lease_names(actor_num)
        holders = self.client.mget([self.lease_key(n) for n in names])
        mine = [name for name, holder in zip(names, holders, strict=True) if _text(holder, 256) == owner_uid]
        return [name for name in mine if self.release_lease(name, owner_uid)]

    def held_leases(self, actor_num: int) -> list[str]:
        """The names of the task's leases someone holds now (``trainer``, ``actor:<i>``), in one MGET."""
        names = _lease_names(actor_num)
        holders = self.client.mget([self.lease_key(n) for n in names])
        return [name for name, holder in zip(names, holders, strict=True) if holder is not None]

    def set_inference_address(self, owner_uid: str, address: str, tls: bool) -> bool:
        """Say where central inference is served (``host:port``, over TLS or not): only while ``owner_uid``
        holds the ``inference`` lease (False: it does not, nothing written)."""
        return bool(self._set_inference(keys=[self.lease_key("inference"), self._inference_key],
                                        args=[owner_uid, _text(address, 300) or "", "1" if tls else "0"]))

    def get_inference_address(self) -> InferenceAddress | None:
        """Where central inference is served now: the server holding the ``inference`` lease and the
        address it wrote (None while no server holds it or it has not written one)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.lease_key("inference"))
        pipe.hmget(self._inference_key, "uid", "address", "tls")
        holder, (uid, address, tls) = pipe.execute()
        holder_text, uid_text, address_text = _text(holder, 256), _text(uid, 256), _text(address, 300)
        if holder_text is None or holder_text != uid_text or not address_text:
            return None
        if not _ADDRESS.fullmatch(address_text):
            raise BoardDataError(f"the inference address on the board is not host:port: {address_text[:80]!r}")
        return InferenceAddress(holder_text, address_text, _text(tls, 4) == "1")

    def claim_actor_slot(self, owner_uid: str, actor_num: int, ttl_ms: int, prefer: int | None = None) -> int | None:
        """An actor slot now leased to ``owner_uid``: ``prefer`` if it holds it or it is free (an actor taking
        its slot back passes it); else, up to ``SMALL_TASK_SLOTS`` slots, the one it holds or the lowest
        free one (stable numbers on a laptop); beyond, the first free one from a random start, so a
        thousand actors starting at once do not each walk every slot (a fresh uid holds none, and one
        taking its slot back passes ``prefer``). None if all are taken."""
        if not 1 <= actor_num <= MAX_ACTORS:
            raise ValueError(f"actor_num must be in 1..{MAX_ACTORS}, found {actor_num}")
        keys = [self._task_key, *(self.lease_key(f"actor:{i}") for i in range(actor_num))]
        small = actor_num <= SMALL_TASK_SLOTS
        start = 0 if small else random.randrange(actor_num)
        args: list[str | int] = [owner_uid, _ttl(ttl_ms), -1 if prefer is None else int(prefer), start,
                                 1 if small else 0, self.task_id]
        slot = int(self._claim_slot(keys=keys, args=args))
        return None if slot < 0 else slot

    def claim_trainer(self, owner_uid: str, ttl_ms: int) -> int | None:
        """Take the trainer lease; the new epoch (fencing token) if taken, None if someone holds it."""
        keys = [self.lease_key("trainer"), self._epoch_key, self._task_key]
        epoch = self._claim_trainer(keys=keys, args=[owner_uid, _ttl(ttl_ms), self.task_id])
        return None if epoch is None else int(epoch)

    def reclaim_trainer(self, owner_uid: str, epoch: int, ttl_ms: int) -> Literal["taken", "taken over", "gone",
                                                                                "replaced"]:
        """Take back the trainer lease that lapsed while ``owner_uid`` held it at ``epoch`` (an outage):
        "taken" back, "taken over" by another trainer since (the epoch moved, or it holds it now), or the
        task is "gone" from the board or "replaced" by another of its name."""
        keys = [self.lease_key("trainer"), self._epoch_key, self._task_key]
        answer = int(self._reclaim_trainer(keys=keys, args=[owner_uid, str(epoch), _ttl(ttl_ms), self.task_id]))
        return {1: "taken", -1: "gone", -2: "replaced"}.get(answer, "taken over")  # type: ignore[return-value]

    def heartbeat(
        self,
        lease_name: str,
        owner_uid: str,
        ttl_ms: int,
        role_id: str,
        stats: Mapping[str, Any] | None = None,
        counter_deltas: Mapping[str, int | float] | None = None,
        total_of: str = "",
        token: str = "",
    ) -> Heartbeat:
        """Renew the lease, write stats, add counters, read task status, params head and the server's
        clock: one round trip. A falsy answer (``lease_held`` False) means the lease is lost. ``total_of``:
        a counter to total over every role, in the same round trip (``Heartbeat.total``). ``token``: the
        deltas' :func:`count_token`, the same each time they are sent (:meth:`CounterDeltas.taken`): a
        heartbeat sent again after its reply was lost adds them once."""
        stats_json = "" if stats is None else _stats_json(stats)
        deltas_json = _deltas_json(counter_deltas)
        keys = [self.lease_key(lease_name), self.stats_key(role_id), self._roles_key, self._counters_key,
                self._task_key, self._counted_key]
        held, status, epoch, version, train_count, sec, usec, task_id, total = self._heartbeat(
            keys=keys, args=[owner_uid, _ttl(ttl_ms), role_id, stats_json, self.stats_ttl_ms, deltas_json,
                             self.task_id, total_of, _check_token(token)]
        )
        state = _text(status, 16)
        try:
            task_status = None if state is None else TaskState(state)
        except ValueError:
            raise BoardDataError(f"task {self.task_name!r} has status {state!r}") from None
        return Heartbeat(
            lease_held=bool(held),
            task_status=task_status,
            params_epoch=_int(epoch or 0, "params_epoch"),
            params_version=_int(version or 0, "params_version"),
            train_count=_int(train_count or 0, "train_count"),
            server_time=_server_time(sec, usec),
            replaced=bool(self.task_id and state is not None and _text(task_id, 64) != self.task_id),
            # any finite total (the script sums finite entries only): a forged entry must not fail every heartbeat
            total=None if not total else _float(total, total_of, -sys.float_info.max, sys.float_info.max),
        )

    # ---------------------------------------------------------------- params

    def publish_params(self, owner_uid: str, epoch: int, version: int, blob: bytes, train_count: int,
                       master: bytes | None = None) -> bool:
        """Store params atomically; False (nothing written) unless ``owner_uid`` holds the trainer
        lease and ``epoch`` is the current trainer epoch, not older than the stored params' epoch.
        ``master``: the same version with float32 weights when ``blob``'s are float16, which only a trainer
        taking over reads (``get_params(master=True)``)."""
        keys = [self.lease_key("trainer"), self._epoch_key, self._params_key, self._task_key, self._feed_key]
        args: list[str | bytes] = [owner_uid, str(epoch), str(version), str(train_count), blob, self.task_id,
                                   master or b""]
        return bool(self._publish(keys=keys, args=args))

    def get_params_version(self) -> tuple[int, int] | None:
        """``(epoch, version)`` of the latest params (one HMGET); None before the first publish."""
        head = self.get_params_head()
        return None if head is None else (head[0], head[1])

    def get_params_head(self) -> tuple[int, int, int] | None:
        """``(epoch, version, train_count)`` of the latest params (one HMGET); None before the first publish."""
        epoch, version, train_count = self.client.hmget(self._task_key, "params_epoch", "params_version",
                                                        "train_count")
        if epoch is None or version is None:
            return None
        head = _int(epoch, "params_epoch"), _int(version, "params_version"), _int(train_count or 0, "train_count")
        return None if head[0] == 0 else head

    def get_params(self, max_bytes: int | None = None, master: bool = False) -> ParamsRecord | None:
        """The latest params (one round trip); None before the first publish. ``max_bytes``: a larger blob is a
        BoardDataError (its length is read first, in the same script, so a huge forged blob is never sent).
        ``master``: the float32 weights the trainer published beside float16 ones, when it did (a trainer
        taking over goes on from those)."""
        answer = self._get_params(keys=[self._params_key], args=[*self._get_params_args(None, max_bytes),
                                                                 "1" if master else ""])
        return self._params_answer(answer, None, max_bytes)[1]

    def get_params_unless(self, held_version: int | None, max_bytes: int | None = None
                          ) -> tuple[tuple[int, int, int] | None, ParamsRecord | None]:
        """``(head, record)`` in one round trip: the latest params' ``(epoch, version, train_count)`` and, unless
        their version is ``held_version`` (the caller's), the params themselves (None: not new, none yet, or
        another task's). For a node waiting for the next version: it polls and fetches at once."""
        answer = self._get_params(keys=[self._params_key], args=self._get_params_args(held_version, max_bytes))
        return self._params_answer(answer, held_version, max_bytes)

    def await_params(self, after: bytes, held_version: int | None, block_ms: int, max_bytes: int | None = None
                     ) -> tuple[bytes, tuple[int, int, int] | None, ParamsRecord | None]:
        """``get_params_unless`` once a version is published after the feed entry ``after`` (``b"0-0"``: any),
        or once ``block_ms`` passed: one round trip, the wait in Redis. A node waiting for the next version gets
        it half a round trip after it is published, not at its next poll. Returns the newest feed entry seen
        (the next call's ``after``) with the head and the record."""
        if not self._feed_usable:
            return after, *self.get_params_unless(held_version, max_bytes)
        socket_timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        if socket_timeout:  # well inside it: a wait is not a dead connection
            block_ms = min(block_ms, int(socket_timeout * 500))
        pipe = self.client.pipeline(transaction=False)
        pipe.execute_command("XREAD", "COUNT", 1, "BLOCK", max(1, int(block_ms)), "STREAMS", self._feed_key, after)
        pipe.execute_command("EVALSHA", self._get_params.sha, 1, self._params_key,
                             *self._get_params_args(held_version, max_bytes))
        feed, answer = pipe.execute(raise_on_error=False)
        if isinstance(feed, redis.exceptions.NoPermissionError):  # a user without XREAD: it polls
            logger.warning("this Redis user may not XREAD %s (%s): waiting for params by polling", self._feed_key, feed)
            self._feed_usable = False
        elif isinstance(feed, Exception):
            raise feed
        elif isinstance(feed, list) and feed:  # [[key, [[id, fields]]]]
            entries = feed[0][1] if isinstance(feed[0], list) and len(feed[0]) == 2 else []
            if entries and isinstance(entries[-1][0], bytes):
                after = entries[-1][0]
        if isinstance(answer, redis.exceptions.NoScriptError):  # a restarted Redis: the script is loaded again
            return after, *self.get_params_unless(held_version, max_bytes)
        if isinstance(answer, Exception):
            raise answer
        return after, *self._params_answer(answer, held_version, max_bytes)

    @property
    def awaits_in_redis(self) -> bool:
        """``await_params`` waits in Redis (False: this Redis user may not read the feed; it returns at once)."""
        return self._feed_usable

    @staticmethod
    def _get_params_args(held_version: int | None, max_bytes: int | None) -> list[str | int]:
        return ["" if held_version is None else str(held_version), -1 if max_bytes is None else int(max_bytes)]

    def _params_answer(self, answer: Any, held_version: int | None, max_bytes: int | None
                       ) -> tuple[tuple[int, int, int] | None, ParamsRecord | None]:
        if not answer:
            return None, None
        epoch, version, train_count, task, size, blob = answer
        head = _int(epoch, "epoch"), _int(version, "version"), _int(train_count, "train_count")
        if self.task_id and task and _str(task) != self.task_id:
            return None, None  # the params of the task that replaced this one: an old node never acts with them
        if held_version is not None and head[1] == held_version:
            return head, None
        if max_bytes is not None and int(size) > max_bytes:
            raise BoardDataError(f"params blob is {int(size)} bytes, over the {max_bytes} this network needs")
        if not isinstance(blob, bytes):
            return head, None
        return head, ParamsRecord(head[0], head[1], head[2], blob)

    def put_checkpoint(self, owner_uid: str, epoch: int, train_count: int, blob: bytes) -> bool:
        """Keep the trainer's latest checkpoint on the board (for a client far from the trainer); False
        (nothing written) unless ``owner_uid`` holds the trainer lease at ``epoch`` of this task."""
        keys = [self.lease_key("trainer"), self._epoch_key, self._checkpoint_key, self._task_key]
        return bool(self._put_checkpoint(keys=keys, args=[owner_uid, str(epoch), str(train_count), blob,
                                                          self.task_id]))

    def get_checkpoint_train_count(self) -> int | None:
        """The train_count of the checkpoint on the board (one HGET); None when there is none."""
        raw = self.client.hget(self._checkpoint_key, "train_count")
        return None if raw is None else _int(raw, "checkpoint train_count")

    def get_checkpoint(self, max_bytes: int) -> tuple[int, bytes] | None:
        """``(train_count, blob)`` of the checkpoint on the board; a larger blob is a BoardDataError (its
        length is read first, so a huge forged one is never fetched)."""
        size = int(self.client.hstrlen(self._checkpoint_key, "blob"))
        if size > max_bytes:
            raise BoardDataError(f"the checkpoint on the board is {size} bytes, over the {max_bytes} expected")
        train_count, blob = self.client.hmget(self._checkpoint_key, "train_count", "blob")
        if train_count is None or not isinstance(blob, bytes) or len(blob) > max_bytes:
            return None
        return _int(train_count, "checkpoint train_count"), blob

    def clear_checkpoint(self) -> None:
        """Drop the checkpoint on the board (a client kept it): a replay memory need not stay in Redis."""
        self.client.delete(self._checkpoint_key)

    def set_resume(self, blob: bytes | None) -> None:
        """The checkpoint a new task starts from (a PARAMS message with the trainer's state), or none."""
        if blob is None:
            self.client.delete(self._resume_key)
        else:
            self.client.set(self._resume_key, blob)

    def get_resume(self, max_bytes: int) -> bytes | None:
        """The checkpoint to start from, if the client gave one; a larger one is a BoardDataError (its
        length is read first, so a huge forged value is never fetched)."""
        size = int(self.client.strlen(self._resume_key))
        if size == 0:
            return None
        if size > max_bytes:
            raise BoardDataError(f"the checkpoint to resume from is {size} bytes, over the {max_bytes} this "
                                 "network and its optimizer state need")
        blob = self.client.get(self._resume_key)
        if not isinstance(blob, bytes) or len(blob) > max_bytes:
            return None
        return blob

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
        out: dict[str, dict[str, float]] = {}
        for role, value in self.client.hgetall(self._counters_key).items():
            counters = _json_object(value, MAX_STATS_BYTES)
            if counters is None:
                continue
            totals = {str(k)[:64]: v for k, raw in counters.items() if (v := finite(raw)) is not None}
            name = _str(role)[:128]
            if name == "trainer" and "refused_batches" not in totals and totals.get("bad_messages"):
                # written by a trainer that counted the batches it refused only as bad messages (nothing else
                # it counts is a bad message): they are its refused batches
                totals["refused_batches"] = totals["bad_messages"]
            out[name] = totals
        return out

    def get_counters(self) -> dict[str, float]:
        """Running totals summed over every role."""
        totals: dict[str, float] = {}
        for counters in self.get_role_counters().values():
            for name, value in counters.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def note_received(self, owner_uid: str, deltas: Mapping[str, int | float],
                      ledger: list[tuple[str, int]], token: str = "") -> Literal["noted", "not held", "not ours"]:
        """The trainer's count of one read, before it acks the read, and its ledger: the ``(actor, seq)`` of
        the batches of its last reads whose acks may not have reached the broker yet. "not held": this
        trainer does not hold the lease (do not ack); "not ours": the task is gone or was replaced.
        ``token``: as :meth:`incr_counters`'s (a retry of a count that was added is "noted", adding nothing)."""
        ledger_json = json.dumps(ledger, separators=(",", ":"))
        keys = [self.lease_key("trainer"), self._counters_key, self._task_key, self._ledger_key, self._counted_key]
        answer = int(self._note_received(keys=keys, args=[owner_uid, _deltas_json(deltas), ledger_json,
                                                          self.task_id, _check_token(token)]))
        return {1: "noted", 0: "not held"}.get(answer, "not ours")  # type: ignore[return-value]

    def get_ledgers(self) -> dict[str, list[tuple[str, int]]]:
        """Each trainer's ledger (see :meth:`note_received`); malformed entries are skipped."""
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
        now = self.server_time()
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
        roles = sorted(r for r in (_str(x) for x in self.client.smembers(self._roles_key)) if _ROLE_ID.fullmatch(r))
        if not roles:
            return {}
        now = time.time()
        found: dict[str, dict[str, Any]] = {}
        for role, raw in zip(roles, self.client.mget([self.prefix + "stats:" + r for r in roles]), strict=True):
            stats = _json_object(raw, MAX_STATS_BYTES)
            if stats is None:
                continue
            updated = finite(stats.get("updated_at", 0.0))
            if updated is None:
                continue
            if max_age_s is None or now - updated <= max_age_s:
                found[role] = stats
        return found

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


def _limit(config: Mapping[str, Any], name: str, value: Any, kind: type[int] | type[float]) -> Any:
    """``value``, else ``config[name]``, as ``kind`` (None: no limit)."""
    value = config.get(name) if value is None else value
    if value is None:
        return None
    if kind is int:
        return board_values.integer(value, f"task {name}")
    return board_values.number(value, f"task {name}", 0.0, float(_MAX_INT))


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


def count_token() -> str:
    """A fresh token for one count (:meth:`Board.incr_counters`, :meth:`Board.note_received`): made once per
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
