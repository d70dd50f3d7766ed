"""What each node reports at its heartbeat, as one definition per role.

Owns: :class:`ActorStats`, :class:`TrainerStats` and :class:`EvaluatorStats`, the records a node writes
to the board (``Board.heartbeat``, ``Board.put_stats``) and everything else reads: the client's progress
lines, end-of-run summary and history rows, ``srl status``, and the dashboard (its page reads these field
names: ``tests/test_house.py`` checks it). A role's algorithm-specific numbers (DQN's epsilon, a learner's
losses, the policy lag's percentiles) travel in ``extra``, flat beside the fields.

Must never: trust what it reads. ``from_record`` takes whatever a board holds: a field of the wrong type
reads as its default, ``extra`` keeps finite numbers only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from srl.runner.distribution.board.board import Board, actor_slot, inference_server
from srl.runner.distribution.board.values import finite

StatsT = TypeVar("StatsT", bound="NodeStats")

_TEXT_LIMIT = 200
_EXTRA_LIMIT = 64


@dataclass
class NodeStats:
    """What every role reports: who it is."""

    uid: str = ""
    """the node's name on the board"""
    updated_at: float = 0.0
    """the node's clock when it wrote this (the board adds it)"""
    extra: dict[str, float] = field(default_factory=dict)
    """numbers of the role's algorithm (epsilon, losses, lag percentiles), written flat beside the fields"""

    def to_record(self) -> dict[str, Any]:
        """The flat record the board keeps (``extra`` beside the fields; ``updated_at`` is the board's)."""
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("extra", "updated_at")}
        return {**record, **{k: v for k, v in self.extra.items() if k not in record}}  # fields first

    @classmethod
    def from_record(cls: type[StatsT], record: Any) -> StatsT:
        """Stats from a board record; what does not fit a field (wrong type, not finite) reads as its default,
        and numbers no field names go to ``extra``."""
        record = record if isinstance(record, dict) else {}
        values: dict[str, Any] = {}
        names = set()
        for f in dataclasses.fields(cls):
            names.add(f.name)
            if f.name == "extra" or f.name not in record:
                continue
            annotation = str(f.type)
            value = _fitting(record[f.name], annotation)
            if value is not None or annotation.endswith("| None"):
                values[f.name] = value
        extra = {str(k)[:64]: number for k, v in list(record.items())[:_EXTRA_LIMIT + len(names)]
                 if k not in names and (number := finite(v)) is not None}
        return cls(**values, extra=extra)


def _fitting(value: Any, annotation: str) -> Any:
    """``value`` as the field's type (annotations are strings: ``from __future__ import annotations``),
    or None when it does not fit."""
    if annotation.startswith("int"):
        number = finite(value)
        return int(number) if number is not None and number.is_integer() else None
    if annotation.startswith("float"):
        return finite(value)
    if annotation == "str":
        return value[:_TEXT_LIMIT] if isinstance(value, str) else None
    return None


@dataclass
class ActorStats(NodeStats):
    """An actor's heartbeat (role ``actor:<slot>``)."""

    slot: int = 0
    """the actor slot it holds"""
    env_steps: int = 0
    """env steps of this run, all its envs together"""
    env_steps_per_s: float = 0.0
    """env steps per second since the previous heartbeat"""
    envs: int = 1
    """envs it steps at once"""
    episodes: int = 0
    """episodes finished"""
    sent_batches: int = 0
    """batch messages sent"""
    params_shared: int = 0
    """params versions it read from its machine's params cache (another actor there fetched them)"""
    params_fetched_bytes: int = 0
    """bytes of params it fetched from the board (0 with central inference: it holds no network)"""
    params_version: int = 0
    """the params version it acts with"""
    params_lag: int = 0
    """versions the newest params are ahead of the ones it acts with"""
    backpressure_wait_s: float = 0.0
    """seconds waited on a full queue (the wait going on included)"""
    stalled_now_s: float = 0.0
    """seconds the wait on a full queue going on now has lasted (0: not waiting)"""
    rate_limited_s: float = 0.0
    """seconds waited for the trainer to train (the replay ratio)"""
    in_transit: int = 0
    """batches its sender lets be on their way beyond the queue's capacity (a slow link's two round trips at its
    rate, measured; 0 on a LAN): why the queue may hold more than its capacity"""
    sync_wait_s: float = 0.0
    """seconds waited for the next params version (sync PPO's lockstep)"""
    busy_s: float = 0.0
    """seconds not waiting: stepping, acting, sending, loading params"""
    reward: float | None = None
    """mean return of its last 10 episodes (None: none finished yet)"""
    reward_min: float | None = None
    """lowest return of those"""
    reward_max: float | None = None
    """highest return of those"""


@dataclass
class TrainerStats(NodeStats):
    """The trainer's heartbeat (role ``trainer``); ``extra`` holds its learner's own numbers (the algorithm's
    ``TrainStats`` fields but the loss)."""

    epoch: int = 0
    """its trainer epoch (the fencing token of its lease)"""
    train_count: int = 0
    """gradient steps made"""
    train_per_s: float = 0.0
    """train steps per second since the previous heartbeat"""
    received_per_s: float = 0.0
    """rows received per second since the previous heartbeat"""
    memory: int = 0
    """rows in its buffer (replay memory)"""
    memory_bytes: int = 0
    """bytes its buffer's storage takes, all reserved when it started"""
    memory_capacity: int = 0
    """rows its buffer holds when full (memory_bytes / memory_capacity: bytes per stored transition)"""
    received_batches: int = 0
    """batches received by this run"""
    bad_messages: int = 0
    """messages refused by this run"""
    duplicates: int = 0
    """duplicate batches skipped by this run"""
    stale_rows: int = 0
    """rows refused for their params version by this run"""
    params_version: int = 0
    """the params version of its weights"""
    waiting_for: str = ""
    """sync: the actor slots whose segments it waits for, comma-separated"""
    device: str = ""
    """the torch device it learns on"""
    loss: float | None = None
    """the loss of its latest update"""
    lag_p50: float | None = None
    """policy lag of the rows it accepted lately, in params versions: median"""
    lag_p95: float | None = None
    lag_max: float | None = None
    lag_steps_p50: float | None = None
    """the same in train steps"""
    lag_steps_p95: float | None = None
    lag_steps_max: float | None = None


@dataclass
class EvaluatorStats(NodeStats):
    """The client's latest evaluation of the params on the board (role ``evaluator``)."""

    train_count: int = 0
    """train steps of the params evaluated"""
    env_steps: int = 0
    """env steps when they were evaluated"""
    version: int = 0
    """their params version"""
    eval_mean: float | None = None
    """mean return over the evaluation's episodes"""
    eval_min: float | None = None
    eval_max: float | None = None
    final: int = 0
    """1 for a run's last evaluation"""


@dataclass
class InferenceStats(NodeStats):
    """The central inference server's heartbeat (role ``inference``)."""

    sessions: int = 0
    """actors connected now"""
    agent_steps: int = 0
    """actions chosen (one per env per step) in this run"""
    agent_steps_per_s: float = 0.0
    """actions per second since the previous heartbeat"""
    batches: int = 0
    """forward passes run"""
    batch_envs_mean: float = 0.0
    """envs per forward pass, since the previous heartbeat"""
    batch_wait_ms_mean: float = 0.0
    """milliseconds a request waited for its batch to form, since the previous heartbeat"""
    params_version: int = 0
    """the params version it acts with"""
    sent_batches: int = 0
    """batch messages of rows sent to the queue"""
    refused_requests: int = 0
    """requests refused (a bad signature, shape, value or order): their streams were closed"""
    backpressure_wait_s: float = 0.0
    """seconds waited on a full queue"""


@dataclass
class Reports:
    """Every role's latest stats on a task's board, typed (roles that never reported, or whose stats
    expired, are absent)."""

    trainer: TrainerStats | None = None
    actors: dict[int, ActorStats] = field(default_factory=dict)
    """by slot"""
    evaluator: EvaluatorStats | None = None
    servers: dict[int, InferenceStats] = field(default_factory=dict)
    """the central inference servers', by index (0: the one of lease ``inference``)"""

    @classmethod
    def read(cls, board: Board) -> Reports:
        return cls.of(board.get_all_stats())

    @classmethod
    def of(cls, raw: dict[str, dict[str, Any]]) -> Reports:
        """From each role's stats record, by role id (``Board.get_all_stats()``, ``TaskView.stats``)."""
        actors = {slot: ActorStats.from_record(record) for role, record in sorted(raw.items())
                  if (slot := actor_slot(role)) is not None}
        servers = {server: InferenceStats.from_record(record) for role, record in raw.items()
                   if (server := inference_server(role)) is not None}
        return cls(
            trainer=TrainerStats.from_record(raw["trainer"]) if "trainer" in raw else None,
            actors=dict(sorted(actors.items())),
            evaluator=EvaluatorStats.from_record(raw["evaluator"]) if "evaluator" in raw else None,
            servers=dict(sorted(servers.items())),
        )

    @property
    def inference(self) -> InferenceStats | None:
        """The first inference server's (the only one of a task with one)."""
        return self.servers.get(0)

    def actor(self, slot: int) -> ActorStats | None:
        return self.actors.get(slot)
