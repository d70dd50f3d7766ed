"""What the board hands back: its errors, a task's states, the records read from it, and the reading of
one field into one of theirs.

Owns: the board's error types and record dataclasses, and the bounded readers of a field (through the one
bounded reader, ``board_values``): a malformed field is a :class:`BoardDataError`, never a stray
``ValueError`` or ``OverflowError``; a malformed entry of a list or hash reads as None, for the caller to
skip. Must never: touch Redis. The ``_``-named readers are the board parts' own: nothing outside
``board/`` uses them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from srl.runner.distribution.board import values as board_values
from srl.runner.distribution.board.values import BoardValueError
from srl.runner.distribution.node.retry import TRANSIENT_ERRORS

_MAX_INT = board_values.MAX_INT


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
    inference_servers: int = 1
    """central inference servers the task's actor slots are shared among (its config's ``inference_servers``)"""


@dataclass(frozen=True)
class InferenceAddress:
    """Where one of the task's central inference servers listens (see ``Board.set_inference_address``)."""

    uid: str
    """the server holding the lease (``inference``, or ``inference:<server>``)"""
    address: str
    """host:port"""
    tls: bool
    """it serves over TLS"""
    server: int = 0
    """which of the task's servers it is"""


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

