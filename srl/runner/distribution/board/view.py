"""One look at a task: everything a progress line, a summary or the dashboard shows of it, read in one round trip.

Owns: :class:`TaskView` and :meth:`BoardViews.view`, one pipeline (``transaction=False``) over the keys of
every part: roles and stats, counters, the params head and the config (``task``), refusals and the
server's clock, the leases and where central inference listens. Each value is parsed by the parse its own
getter uses (``accounts``' ``_live_stats``, ``params``' ``_params_head``, ...), so a view reads exactly
what the getters would. Must never: write, parse a value any other way than its getter does, or raise for a
value its reader does not ask for (a damaged config must not hide the counters from a summary).

Which keys to read is decided before the pipeline, from the task's slot count as its caller knows it (its
``TaskStatus.actor_num``, and its ``inference_servers``): the stats of a role outside those slots (none in a run:
every role is a slot, the trainer, an inference server or the evaluator) cost one more MGET.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from srl.runner.distribution.board.accounts import _counter_totals, _live_stats, _role_counters, _stats_roles
from srl.runner.distribution.board.journal import _refusals
from srl.runner.distribution.board.keys import MAX_ACTORS, MAX_INFERENCE_SERVERS, _lease_names, inference_lease
from srl.runner.distribution.board.leases import _INFERENCE_FIELDS, _holder, _inference_address
from srl.runner.distribution.board.params import _HEAD_FIELDS, _params_head
from srl.runner.distribution.board.records import BoardError, InferenceAddress, Refusal, TaskRecord, _server_time
from srl.runner.distribution.board.tasks import _RECORD_FIELDS

_T = TypeVar("_T")

_NODE_ROLES = ("trainer", "evaluator")
"""the roles that report stats besides the actor slots and the inference servers"""


@dataclass(frozen=True)
class TaskView:
    """What :meth:`BoardViews.view` read, parsed. A value whose reader raises (a damaged params head,
    config or inference address) is kept as its error, raised when it is asked for."""

    stats: dict[str, dict[str, Any]]
    """each live role's latest stats, as ``Board.get_all_stats()``"""
    counters: dict[str, float]
    """as ``Board.get_counters()``"""
    refusals: list[Refusal]
    """as ``Board.get_refusals(refusal_age_s)``"""
    holders: dict[str, str | None]
    """the holder of each lease read (None: free), by lease name: ``trainer``, ``inference`` (and
    ``inference:<k>``), ``actor:<i>``"""
    params_head_or_error: tuple[int, int, int] | BoardError | None
    config_or_error: dict[str, Any] | BoardError
    inference_addresses_or_errors: list[InferenceAddress | BoardError | None]
    """where each inference server serves (the first is server 0's)"""

    @property
    def params_head(self) -> tuple[int, int, int] | None:
        """As ``Board.get_params_head()``."""
        return _value(self.params_head_or_error)

    @property
    def config(self) -> dict[str, Any]:
        """As ``Board.get_task_config()`` (unverified: for display)."""
        return _value(self.config_or_error)

    @property
    def inference_address(self) -> InferenceAddress | None:
        """As ``Board.get_inference_address()``."""
        return _value(self.inference_addresses_or_errors[0])

    def inference_address_of(self, server: int) -> InferenceAddress | None:
        """As ``Board.get_inference_address(server)``."""
        return _value(self.inference_addresses_or_errors[server])


class BoardViews:
    """The view's part of :class:`Board`: it owns no key, it reads those of every other part at once."""

    # what Board.__init__ and the other parts give this one
    client: redis.Redis
    prefix: str
    _roles_key: str
    _counters_key: str
    _task_key: str
    _refusals_key: str
    inference_key: Callable[[int], str]
    stats_key: Callable[[str], str]
    lease_key: Callable[[str], str]
    _task_record: Callable[[list[Any]], TaskRecord]
    _task_config: Callable[[str], dict[str, Any]]

    def view(self, actor_num: int, lease_slots: int | None = None, refusal_age_s: float | None = None,
             servers: int = 1) -> TaskView:
        """The task as its nodes last reported it, what they counted, who holds its leases and why nodes refuse
        it: one round trip, however many actors. ``actor_num``: the task's actor slots (``TaskStatus.actor_num``):
        their stats are read with the rest; ``lease_slots``: the actor slots whose lease holder is read (default
        ``actor_num``); ``refusal_age_s``: refusals older than this by the server's clock are left out;
        ``servers``: the task's inference servers (``TaskStatus.inference_servers``)."""
        actor_num = max(0, min(actor_num, MAX_ACTORS))
        servers = max(1, min(servers, MAX_INFERENCE_SERVERS))
        stats_roles = [*_NODE_ROLES, *(inference_lease(k) for k in range(servers)),
                       *(f"actor:{i}" for i in range(actor_num))]
        lease_names = _lease_names(actor_num if lease_slots is None else lease_slots, servers)
        pipe = self.client.pipeline(transaction=False)
        pipe.smembers(self._roles_key)
        pipe.mget([self.stats_key(role) for role in stats_roles])
        pipe.hgetall(self._counters_key)
        pipe.hmget(self._task_key, *_HEAD_FIELDS)
        pipe.hmget(self._task_key, *_RECORD_FIELDS)
        pipe.hgetall(self._refusals_key)
        pipe.time()
        pipe.mget([self.lease_key(name) for name in lease_names])
        for k in range(servers):
            pipe.hmget(self.inference_key(k), *_INFERENCE_FIELDS)
        members, stats, counters, head, record, refusals, (sec, usec), holders, *inference = pipe.execute()

        roles = _stats_roles(members)
        read = dict(zip(stats_roles, stats, strict=True))
        others = [role for role in roles if role not in read]
        if others:  # a role beyond the slots the caller knows of (see the module's docstring)
            read.update(zip(others, self.client.mget([self.stats_key(role) for role in others]), strict=True))
        holder_of = dict(zip(lease_names, holders, strict=True))
        return TaskView(
            stats=_live_stats(roles, [read[role] for role in roles], None),
            counters=_counter_totals(_role_counters(counters)),
            refusals=_refusals(refusals, _server_time(sec, usec), refusal_age_s),
            holders={name: _holder(holder) for name, holder in holder_of.items()},
            params_head_or_error=_or_error(lambda: _params_head(head)),
            config_or_error=_or_error(lambda: self._task_config(self._task_record(record).config_json)),
            inference_addresses_or_errors=[_address_or_error(holder_of[inference_lease(k)], inference[k], k)
                                           for k in range(servers)],
        )


def _address_or_error(holder: Any, fields: list[Any], server: int) -> InferenceAddress | BoardError | None:
    return _or_error(lambda: _inference_address(holder, fields, server))


def _or_error(read: Callable[[], _T]) -> _T | BoardError:
    try:
        return read()
    except BoardError as e:
        return e


def _value(found: _T | BoardError) -> _T:
    if isinstance(found, BoardError):
        raise found
    return found
