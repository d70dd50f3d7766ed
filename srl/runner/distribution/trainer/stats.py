"""What a trainer's heartbeats say of its run: its stats, with the rates since the last heartbeat.

Owns: :class:`RunStats` — the run's :class:`~srl.runner.distribution.node.stats.TrainerStats` record (the
learner's train_count and last scalars, the buffer, what the ingest counted, the params version and the
policy lag) and its rates (train steps/s, rows received/s), measured over at least half a heartbeat
interval (the short beats near the budget's end are bursty). Must never: touch the board (the board thread
sends what it returns).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from srl.base.rl import Buffer, Learner
from srl.runner.distribution.node.stats import TrainerStats
from srl.runner.distribution.trainer.ingest import Ingest
from srl.runner.distribution.trainer.sizing import buffer_capacity
from srl.runner.distribution.trainer.versions import VersionGate

if TYPE_CHECKING:
    import torch


class RunStats:
    """One trainer run's stats; the main thread notes the learner's scalars, the board thread reports."""

    def __init__(self, uid: str, epoch: int, device: torch.device, learner: Learner, buffer: Buffer, gate: VersionGate,
                 ingest: Ingest, heartbeat_interval: float) -> None:
        self.uid = uid
        self.epoch = epoch
        self.device = device
        self.learner = learner
        self.buffer = buffer
        self.gate = gate
        self.ingest = ingest
        self.heartbeat_interval = heartbeat_interval
        self.last_stats: dict[str, float] = {}
        """the learner's scalars at its last update"""
        self._last_rates = (0.0, 0.0)  # train steps/s, rows received/s at the last heartbeat
        self._beat_counts = (learner.train_count, 0, time.monotonic())  # train_count, rows received, when

    def learned(self, scalars: Mapping[str, float]) -> None:
        """The learner's scalars after an update."""
        self.last_stats = {k: v for k, v in scalars.items() if k != "gradient_steps"}

    def beat(self) -> dict[str, Any]:
        """The record for a heartbeat, with the rates since the last one."""
        now = time.monotonic()
        last_train, last_recv, last_time = self._beat_counts
        if now - last_time >= self.heartbeat_interval / 2:  # not over the short beats: bursty
            dt = now - last_time
            train_count, received = self.learner.train_count, self.ingest.received_transitions
            self._last_rates = ((train_count - last_train) / dt, (received - last_recv) / dt)
            self._beat_counts = (train_count, received, now)
        return self.record()

    def record(self) -> dict[str, Any]:
        """The record, with the rates of the last heartbeat."""
        train_per_s, received_per_s = self._last_rates
        learner = {k: round(v, 6) for k, v in self.last_stats.items()}
        lag = {k: round(v, 2) for k, v in self.gate.lag.summary().items()}
        ingest = self.ingest
        return TrainerStats(
            uid=self.uid,
            epoch=self.epoch,
            train_count=self.learner.train_count,
            train_per_s=round(train_per_s, 1),
            received_per_s=round(received_per_s, 1),
            memory=len(self.buffer),
            memory_bytes=self.buffer.nbytes,
            memory_capacity=buffer_capacity(self.buffer),
            received_batches=ingest.received_batches,
            bad_messages=ingest.bad_messages,
            duplicates=ingest.duplicates,
            stale_rows=ingest.stale_rows,
            params_version=self.gate.version,
            waiting_for=",".join(str(i) for i in self.gate.waiting_for),
            device=str(self.device),
            loss=learner.pop("loss", None),
            lag_p50=lag.get("lag_p50"), lag_p95=lag.get("lag_p95"), lag_max=lag.get("lag_max"),
            lag_steps_p50=lag.get("lag_steps_p50"), lag_steps_p95=lag.get("lag_steps_p95"),
            lag_steps_max=lag.get("lag_steps_max"),
            extra=learner,
        ).to_record()
