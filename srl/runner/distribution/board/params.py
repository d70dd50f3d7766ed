"""The task's params on the board: publishing them (fenced by the trainer's lease and epoch), reading them
by version, waiting on their feed for the next one, and the trainer's latest checkpoint.

Owns the keys ``params``, ``params:feed`` and ``checkpoint`` (and writes the params head into ``task``).
Must never: write params or a checkpoint for a trainer that does not hold the lease at the current epoch,
fetch a blob over the reader's bound, or hand a node of a replaced task the params of the task that
replaced it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis

from srl.runner.distribution.board.records import BoardDataError, ParamsRecord, _int, _str
from srl.runner.distribution.board.scripts import _GET_PARAMS_LUA, _PUBLISH_PARAMS_LUA, _PUT_CHECKPOINT_LUA

logger = logging.getLogger("srl.board")

_HEAD_FIELDS = ("params_epoch", "params_version", "train_count")
"""the fields of ``task`` that hold the params head"""


class BoardParams:
    """The params' part of :class:`Board`: publish, read and await them; keep the trainer's checkpoint."""

    # what Board.__init__ and the other parts give this one
    client: redis.Redis
    prefix: str
    task_id: str
    _task_key: str
    _epoch_key: str
    lease_key: Callable[[str], str]

    def _init_params(self) -> None:
        """Name this part's keys and register its scripts (from ``Board.__init__``)."""
        self._params_key = self.prefix + "params"
        self._feed_key = self.prefix + "params:feed"
        self._feed_usable = True  # False: this Redis user may not XREAD it, await_params polls
        self._checkpoint_key = self.prefix + "checkpoint"
        self._publish = self.client.register_script(_PUBLISH_PARAMS_LUA)
        self._put_checkpoint = self.client.register_script(_PUT_CHECKPOINT_LUA)
        self._get_params = self.client.register_script(_GET_PARAMS_LUA)

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
        return _params_head(self.client.hmget(self._task_key, *_HEAD_FIELDS))

    def get_params(self, max_bytes: int | None = None, master: bool = False) -> ParamsRecord | None:
        """The latest params (one round trip); None before the first publish. ``max_bytes``: a larger blob is a
        BoardDataError (its length is read first, in the same script, so a huge forged blob is never sent).
        ``master``: the float32 weights the trainer published beside float16 ones, when it did (a trainer
        taking over goes on from those)."""
        answer = self._get_params(keys=[self._params_key], args=[*self._get_params_args(None, max_bytes),
                                                                 "1" if master else ""])
        return self._params_answer(answer, None, max_bytes)[1]

    def get_newer_params(self, held_version: int | None, max_bytes: int | None = None
                          ) -> tuple[tuple[int, int, int] | None, ParamsRecord | None]:
        """``(head, record)`` in one round trip: the latest params' ``(epoch, version, train_count)`` and, unless
        their version is ``held_version`` (the caller's), the params themselves (None: not new, none yet, or
        another task's). For a node waiting for the next version: it polls and fetches at once."""
        answer = self._get_params(keys=[self._params_key], args=self._get_params_args(held_version, max_bytes))
        return self._params_answer(answer, held_version, max_bytes)

    def await_params(self, after: bytes, held_version: int | None, block_ms: int, max_bytes: int | None = None
                     ) -> tuple[bytes, tuple[int, int, int] | None, ParamsRecord | None]:
        """``get_newer_params`` once a version is published after the feed entry ``after`` (``b"0-0"``: any),
        or once ``block_ms`` passed: one round trip, the wait in Redis. A node waiting for the next version gets
        it half a round trip after it is published, not at its next poll. Returns the newest feed entry seen
        (the next call's ``after``) with the head and the record."""
        if not self._feed_usable:
            return after, *self.get_newer_params(held_version, max_bytes)
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
            return after, *self.get_newer_params(held_version, max_bytes)
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


def _params_head(fields: list[Any]) -> tuple[int, int, int] | None:
    """The params head from the ``task`` fields :data:`_HEAD_FIELDS` as read (HMGET); None before the first
    publish. BoardDataError: a field is not an integer."""
    epoch, version, train_count = fields
    if epoch is None or version is None:
        return None
    head = _int(epoch, "params_epoch"), _int(version, "params_version"), _int(train_count or 0, "train_count")
    return None if head[0] == 0 else head
