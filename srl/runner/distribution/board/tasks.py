"""The task's record on the board: creating it, its status, its config and signature, its start and end,
and the checkpoint a new task resumes from; and the server's clock.

Owns the keys ``task`` (one hash: the task's id, status, times, limits, config and signature; the params
head and the trainer's uid and epoch in it are written by the scripts of ``params`` and ``leases``) and
``resume``. Must never: create a task over one still INIT or ACTIVE unless told to overwrite, end a task
twice, or read a record of another board format as if it were this one's.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import redis

from srl.runner.distribution.board import values as board_values
from srl.runner.distribution.board.keys import BOARD_FORMAT_VERSION, MAX_ACTORS, MAX_INFERENCE_SERVERS
from srl.runner.distribution.board.records import (
    _MAX_INT,
    BoardDataError,
    BoardFormatError,
    TaskExistsError,
    TaskNotFoundError,
    TaskRecord,
    TaskState,
    TaskStatus,
    _float,
    _int,
    _json_object,
    _opt_float,
    _opt_int,
    _server_time,
    _text,
)
from srl.runner.distribution.board.scripts import _CREATE_TASK_LUA, _END_TASK_LUA, _SET_ACTIVE_LUA

MAX_CONFIG_BYTES = 1 << 20
"""largest task config JSON read from the board"""
_RECORD_FIELDS = ("config", "format", "config_sig", "task_id")
"""the fields of ``task`` a node builds the task from, in the order :meth:`BoardTasks._task_record` reads them"""

_STATUS_FIELDS = (
    "status", "end_reason", "created_at", "started_at", "ended_at", "actor_num", "max_train_count",
    "max_steps", "timeout", "params_epoch", "params_version", "train_count", "format", "srl_version",
    "trainer_uid", "trainer_epoch", "task_id", "inference_servers",
)


class BoardTasks:
    """The task record's part of :class:`Board`: create, read and end the task."""

    # what Board.__init__ and the other parts give this one
    client: redis.Redis
    task_name: str
    prefix: str
    task_id: str
    task_keys: Callable[[], list[str]]
    _delete_keys: Callable[[list[str]], int]

    def _init_tasks(self) -> None:
        """Name this part's keys and register its scripts (from ``Board.__init__``)."""
        self._task_key = self.prefix + "task"
        self._resume_key = self.prefix + "resume"
        self._create = self.client.register_script(_CREATE_TASK_LUA)
        self._set_active = self.client.register_script(_SET_ACTIVE_LUA)
        self._end = self.client.register_script(_END_TASK_LUA)

    # ---------------------------------------------------------------- the server

    def ping(self) -> bool:
        """True if the Redis answers (raises redis.ConnectionError otherwise)."""
        return bool(self.client.ping())

    def server_time(self) -> float:
        """The Redis server's clock (TIME), in seconds since the epoch."""
        sec, usec = self.client.time()
        return _server_time(sec, usec)

    # ---------------------------------------------------------------- the task

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
        servers = _limit(parsed, "inference_servers", None, int)
        servers = 1 if servers is None else servers
        if not 1 <= servers <= MAX_INFERENCE_SERVERS:
            raise ValueError(f"inference_servers must be in 1..{MAX_INFERENCE_SERVERS}, found {servers}")
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
            "config_sig", signature, "trainer_uid", "", "trainer_epoch", "0", "inference_servers", str(servers),
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
            inference_servers=_int(raw["inference_servers"] or 1, "inference_servers", 1, MAX_INFERENCE_SERVERS),
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
        return self._task_record(self.client.hmget(self._task_key, *_RECORD_FIELDS))

    def _task_record(self, fields: list[Any]) -> TaskRecord:
        """The task's record from the ``task`` fields :data:`_RECORD_FIELDS` as read (HMGET). TaskNotFoundError:
        there is no task; BoardFormatError: another board format's; BoardDataError: its config is damaged."""
        raw_config, raw_format, raw_sig, raw_id = fields
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
        return self._task_config(config_json)

    def _task_config(self, config_json: str) -> dict[str, Any]:
        """The task's config JSON text (of its record) as a JSON object; BoardDataError: it is not one."""
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

    # ---------------------------------------------------------------- resume

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


def _srl_version() -> str:
    return str(getattr(sys.modules.get("srl"), "__version__", "unknown"))


def _field(value: int | float | None) -> str:
    return "" if value is None else repr(int(value) if isinstance(value, bool) else value)


def _limit(config: Mapping[str, Any], name: str, value: Any, kind: type[int] | type[float]) -> Any:
    """``value``, else ``config[name]``, as ``kind`` (None: no limit)."""
    value = config.get(name) if value is None else value
    if value is None:
        return None
    if kind is int:
        return board_values.integer(value, f"task {name}")
    return board_values.number(value, f"task {name}", 0.0, float(_MAX_INT))
