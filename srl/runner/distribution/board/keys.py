"""The key layout of a task on the board: the name of every key, and what each holds.

Owns: the prefix of a task's keys and the names under it (the lease, role and queue names key names carry),
and finding the tasks on a Redis by their records (:func:`list_tasks`). Must never: read or write a key's
value (the board's parts do, each its own keys; :meth:`Board.task_keys` lists them all).

Every key of a task lives under ``srl:{<task_name>}:`` — the braces are literal: a Redis Cluster hash tag,
so a task's keys share one slot and the multi-key scripts also run on a cluster.

Keys (``P`` = ``srl:{<task_name>}:``)::

    P task            hash   task_id (the client's, one per submission), status, times, limits,
                             config JSON + signature, params head (epoch, version, train_count),
                             the trainer's uid and epoch
    P epoch           string trainer epoch, INCR'd by the script that grants the trainer lease
    P params          hash   epoch, version, train_count, blob, published_at; master: the same version's
                             float32 weights when blob's are float16 (a trainer taking over restores them)
    P params:feed     stream one entry, the latest (epoch, version): a node awaiting the next blocks on it
    P lease:trainer   string owner uid, PX ttl
    P lease:inference string owner uid, PX ttl (the central inference server; with several, server 0)
    P lease:inference:<k>  string  the same for server k (1 .. the task's inference_servers - 1)
    P lease:actor:<i> string owner uid, PX ttl
    P inference       hash   uid, address, tls: where the holder of lease:inference serves
    P inference:<k>   hash   the same for server k
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

Which part of the board owns each: ``tasks`` the task record and resume; ``leases`` the epoch, the
leases and ``inference``; ``params`` params, ``params:feed`` and checkpoint; ``accounts`` counters, counted,
ledger, roles and stats; ``journal`` events, dead letters, refusals and history.
"""

from __future__ import annotations

import re

import redis

from srl.runner.distribution.board.records import _str

BOARD_FORMAT_VERSION = 3
"""version of the key layout and field encoding above; bumped on any incompatible change (3: task ids)"""
MAX_ACTORS = 100_000
"""most actor slots a task may have"""
MAX_INFERENCE_SERVERS = 64
"""most central inference servers a task may share its actor slots among"""

_TASK_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_ROLE_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_LEASE_NAME = re.compile(r"trainer|inference(?::(?P<server>[1-9][0-9]?))?|actor:(?P<slot>0|[1-9][0-9]{0,5})")
_SCAN_COUNT = 500


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
    return int(match["slot"]) if match and match["slot"] is not None else None


def inference_lease(server: int) -> str:
    """The lease name of central inference's server ``server``: ``inference`` for 0 (as with one server),
    ``inference:<k>`` for the others."""
    return "inference" if server == 0 else f"inference:{server}"


def inference_server(lease_name: str) -> int | None:
    """The server index of an inference lease name (``"inference"`` -> 0, ``"inference:2"`` -> 2); None for
    anything else."""
    match = _LEASE_NAME.fullmatch(lease_name)
    if not match or not lease_name.startswith("inference"):
        return None
    return int(match["server"]) if match["server"] is not None else 0


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


def _lease_names(actor_num: int, servers: int = 1) -> list[str]:
    """The names of a task's leases: ``trainer``, ``inference`` (central inference's servers: ``inference``, then
    ``inference:<k>`` for each of its ``servers`` beyond the first) and ``actor:<i>`` for each of its slots."""
    return ["trainer", *(inference_lease(k) for k in range(max(1, min(servers, MAX_INFERENCE_SERVERS)))),
            *(f"actor:{i}" for i in range(max(0, min(actor_num, MAX_ACTORS))))]


def _check_role(role_id: str) -> str:
    if not _ROLE_ID.fullmatch(role_id):
        raise ValueError(f"role id {role_id!r}: use 1-128 letters, digits, '_', '.', ':', '-'")
    return role_id
