"""Who works on the task: its leases, the trainer's epoch (the fencing token), where central inference
listens, and the heartbeat that renews a lease.

Owns the keys ``lease:trainer``, ``lease:inference``, ``lease:actor:<i>``, ``epoch`` and ``inference``. A
heartbeat also writes its role's stats and counters (``accounts``' keys) in the same script: one round trip.
Must never: take a lease by get-then-set (a claim is one ``SET NX PX`` or a script), renew or take back a
lease for a task that is gone or was replaced, or let a trainer keep an epoch another trainer moved on.
"""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal

import redis

from srl.runner.distribution.board.accounts import _check_token, _deltas_json, _stats_json
from srl.runner.distribution.board.keys import _LEASE_NAME, MAX_ACTORS, _lease_names, inference_lease
from srl.runner.distribution.board.records import (
    BoardDataError,
    Heartbeat,
    InferenceAddress,
    TaskState,
    _float,
    _int,
    _server_time,
    _text,
)
from srl.runner.distribution.board.scripts import (
    _CLAIM_SLOT_LUA,
    _CLAIM_TRAINER_LUA,
    _HEARTBEAT_LUA,
    _RECLAIM_TRAINER_LUA,
    _RELEASE_LUA,
    _RENEW_LUA,
    _SET_INFERENCE_LUA,
)

SMALL_TASK_SLOTS = 64
"""up to this many slots an actor takes the lowest free one; beyond, the first free one from a random start"""

_INFERENCE_FIELDS = ("uid", "address", "tls")
"""the fields of ``inference``, in the order :func:`_inference_address` reads them"""
_ADDRESS = re.compile(r"[A-Za-z0-9._\-]{1,253}:[0-9]{1,5}|\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")


class BoardLeases:
    """The leases' part of :class:`Board`: claim, renew, release and read them, and heartbeat."""

    # what Board.__init__ and the other parts give this one
    client: redis.Redis
    task_name: str
    task_id: str
    prefix: str
    stats_ttl_ms: int
    _task_key: str
    _roles_key: str
    _counters_key: str
    _counted_key: str
    stats_key: Callable[[str], str]

    def _init_leases(self) -> None:
        """Name this part's keys and register its scripts (from ``Board.__init__``)."""
        self._epoch_key = self.prefix + "epoch"
        self._renew = self.client.register_script(_RENEW_LUA)
        self._release = self.client.register_script(_RELEASE_LUA)
        self._set_inference = self.client.register_script(_SET_INFERENCE_LUA)
        self._claim_trainer = self.client.register_script(_CLAIM_TRAINER_LUA)
        self._reclaim_trainer = self.client.register_script(_RECLAIM_TRAINER_LUA)
        self._claim_slot = self.client.register_script(_CLAIM_SLOT_LUA)
        self._heartbeat = self.client.register_script(_HEARTBEAT_LUA)

    def lease_key(self, name: str) -> str:
        if not _LEASE_NAME.fullmatch(name):
            raise ValueError(f"lease name {name!r}: expected 'trainer', 'inference[:<server>]' or 'actor:<index>'")
        return self.prefix + "lease:" + name

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
        return [_holder(holder) for holder in self.client.mget([self.lease_key(n) for n in names])]

    def release_leases_of(self, owner_uid: str, actor_num: int, servers: int = 1) -> list[str]:
        """Release every lease of the task ``owner_uid`` holds, and return their names: for a node stopped
        while its claim was in flight, when the board may have granted a slot the node never learned of."""
        names = _lease_names(actor_num, servers)
        holders = self.client.mget([self.lease_key(n) for n in names])
        mine = [name for name, holder in zip(names, holders, strict=True) if _text(holder, 256) == owner_uid]
        return [name for name in mine if self.release_lease(name, owner_uid)]

    def held_leases(self, actor_num: int, servers: int = 1) -> list[str]:
        """The names of the task's leases someone holds now (``trainer``, ``inference``, ``actor:<i>``), in
        one MGET."""
        names = _lease_names(actor_num, servers)
        holders = self.client.mget([self.lease_key(n) for n in names])
        return [name for name, holder in zip(names, holders, strict=True) if holder is not None]

    def inference_key(self, server: int = 0) -> str:
        """Where inference server ``server`` says it listens (``inference``; ``inference:<k>`` beyond the first)."""
        return self.prefix + inference_lease(server)

    def set_inference_address(self, owner_uid: str, address: str, tls: bool, server: int = 0) -> bool:
        """Say where central inference server ``server`` serves (``host:port``, over TLS or not): only while
        ``owner_uid`` holds its lease (False: it does not, nothing written)."""
        return bool(self._set_inference(keys=[self.lease_key(inference_lease(server)), self.inference_key(server)],
                                        args=[owner_uid, _text(address, 300) or "", "1" if tls else "0"]))

    def get_inference_address(self, server: int = 0) -> InferenceAddress | None:
        """Where central inference server ``server`` serves now: the server holding its lease and the address
        it wrote (None while no server holds it or it has not written one; BoardDataError: not host:port)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.lease_key(inference_lease(server)))
        pipe.hmget(self.inference_key(server), *_INFERENCE_FIELDS)
        holder, fields = pipe.execute()
        return _inference_address(holder, fields, server)

    def get_inference_addresses(self, servers: int) -> list[InferenceAddress | None]:
        """Where each of ``servers`` central inference servers serves now, in one round trip: None for one
        with no holder, no address yet, or one that is not host:port (the others serve meanwhile)."""
        pipe = self.client.pipeline(transaction=False)
        for k in range(servers):
            pipe.get(self.lease_key(inference_lease(k)))
            pipe.hmget(self.inference_key(k), *_INFERENCE_FIELDS)
        answers = pipe.execute()
        found: list[InferenceAddress | None] = []
        for k in range(servers):
            try:
                found.append(_inference_address(answers[2 * k], answers[2 * k + 1], k))
            except BoardDataError:
                found.append(None)
        return found

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


def _holder(raw: bytes | str | None) -> str | None:
    """A lease's value as read: its holder's uid (None: free)."""
    return _text(raw, 256)


def _inference_address(holder: bytes | str | None, fields: list[Any], server: int = 0) -> InferenceAddress | None:
    """Where central inference server ``server`` serves, from its lease and the :data:`_INFERENCE_FIELDS` of
    its address hash as read: None unless the holder wrote an address. BoardDataError: it is not host:port."""
    uid, address, tls = fields
    holder_text, uid_text, address_text = _holder(holder), _text(uid, 256), _text(address, 300)
    if holder_text is None or holder_text != uid_text or not address_text:
        return None
    if not _ADDRESS.fullmatch(address_text):
        raise BoardDataError(f"the inference address on the board is not host:port: {address_text[:80]!r}")
    return InferenceAddress(holder_text, address_text, _text(tls, 4) == "1", server)


def _ttl(ttl_ms: int) -> int:
    if int(ttl_ms) < 1:
        raise ValueError(f"a lease ttl must be >= 1 ms, found {ttl_ms}")
    return int(ttl_ms)
