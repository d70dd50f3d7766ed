"""What a trainer run starts from and what it leaves behind.

Owns: :class:`TrainerCheckpoints`: at the start, the params on the board when this run takes over a task
(``restore``: the float32 weights, version, train_count and the learner's ``takeover_state`` go on; the
optimizer starts fresh), or, for a new task, the checkpoint its client put on the board (``resume``: weights,
optimizer state, counters and the replay memory when it holds one), and the run's env steps so far
(``run_env_steps``: schedules over the budget go on from them);
while training and at the end, checkpoints under ``checkpoint_dir/<task>/`` and on the board, for a client
with a log_dir wherever this trainer runs. Must never: trust what it reads (bounded, signed when a secret
is set, every array checked against this network), or let a full disk or a board that is away stop
training.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from srl.base.checkpoint import build_checkpoint, checkpoint_memory, split_checkpoint, task_config
from srl.base.rl import Buffer, Learner, Parameter
from srl.runner.distribution.board.board import BOARD_AWAY, Board, BoardError
from srl.runner.distribution.node.retry import Throttle, with_retry
from srl.runner.distribution.settings.options import TrainerOptions
from srl.runner.distribution.settings.task import TaskConfigError, TaskSpec
from srl.runner.distribution.trainer.publisher import Publisher
from srl.runner.distribution.trainer.versions import VersionGate
from srl.runner.distribution.wire.codec import (
    MAX_CHECKPOINT_MEMORY_BYTES,
    Codec,
    DecodeError,
    checkpoint_message_bytes,
    short,
)
from srl.runner.run_log import write_checkpoint

logger = logging.getLogger("srl.trainer")

_BOARD_AWAY_OR_TOO_BIG: tuple[type[BaseException], ...] = (*BOARD_AWAY, ValueError)  # ValueError: over a bound


class TrainerCheckpoints:
    """One trainer run's start and checkpoints (its epoch, its learner, its buffer)."""

    def __init__(
        self,
        board: Board,
        codec: Codec,
        task: TaskSpec,
        options: TrainerOptions,
        epoch: int,
        parameter: Parameter,
        learner: Learner,
        buffer: Buffer,
        gate: VersionGate,
        publisher: Publisher,
        max_params_bytes: int,
    ) -> None:
        self.board = board
        self.codec = codec
        self.task = task
        self.options = options
        self.epoch = epoch
        self.parameter = parameter
        self.learner = learner
        self.buffer = buffer
        self.gate = gate
        self.publisher = publisher
        self.max_params_bytes = max_params_bytes
        self.rows_base = 0
        """rows the run started with in its buffer (a checkpoint's replay memory)"""
        self._memory_log = Throttle(3600.0)
        self._next_local = math.inf  # when the next checkpoint is due under checkpoint_dir (``schedule``)
        self._next_on_board = math.inf  # and on the board

    def _at_version(self, version: int, train_count: int) -> None:
        """The run goes on from ``version`` (on the board already) at ``train_count``."""
        self.gate.version = self.parameter.version = version
        self.publisher.restored(version)
        self.learner.train_count = train_count
        self.gate.lag.published(version, train_count)

    def restore(self, resumed: bool) -> None:
        """Continue from the params on the board (a takeover or a restart); ``resumed``: this run started
        from a checkpoint instead."""
        try:  # the float32 weights when the trainer published float16 ones: go on from those, not their rounding
            record = with_retry(lambda: self.board.get_params(self.max_params_bytes, master=True), "reading params")
        except BoardError as e:
            logger.error("params on the board cannot be read (%s); starting from fresh weights", short(e))
            return
        if record is None:
            if not resumed:
                logger.info("no params on the board: starting from fresh weights")
            return
        try:
            meta, arrays = self.codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
            self.parameter.from_arrays(arrays)
        except (DecodeError, ValueError) as e:
            logger.error("params on the board (epoch %d, version %d) cannot be restored: %s; starting fresh",
                         record.epoch, record.version, short(e))
            # fresh weights, a version of their own: the numbering goes on (actors only ever move forward)
            self.publisher.restored(record.version)
            self.gate.version = self.parameter.version = record.version + 1
            return
        self._at_version(record.version, record.train_count)
        self.learner.on_parameters_loaded()
        takeover = meta.get("takeover", {})
        try:
            if not isinstance(takeover, dict):
                raise ValueError(f"expected an object, got {short(repr(takeover), 40)}")
            self.learner.load_takeover_state(takeover)
        except (ValueError, TypeError) as e:  # the weights are good: only the statistics start again
            logger.error("the learner state in the params on the board cannot be restored (%s); it starts fresh",
                         short(e))
        logger.info("trainer at epoch %d restored the params of epoch %d version %d: train_count continues from %d",
                    self.epoch, record.epoch, record.version, record.train_count)

    def run_env_steps(self) -> int:
        """The run's env steps so far, as its actors (and a checkpoint it resumed from) counted them on the
        board: a schedule over the run's budget goes on from there (0 when they cannot be read)."""
        try:
            steps = with_retry(self.board.get_counters, "reading the run's env steps").get("env_steps", 0.0)
        except BoardError as e:
            logger.error("the run's env steps cannot be read (%s); schedules count from 0", short(e))
            return 0
        return int(min(steps, 2**62)) if math.isfinite(steps) and steps > 0 else 0

    def resume(self) -> bool:
        """A new task (no params yet): start from the checkpoint the client put on the board, if any.
        Treated as hostile: bounded, signed when a secret is set, every array checked against this
        network and optimizer; one that does not fit is a TaskConfigError (the task ends FAILED)."""
        if with_retry(self.board.get_params_version, "reading the params version") is not None:
            return False  # a takeover: restore() continues from the board's params
        bound = checkpoint_message_bytes(self.parameter.to_arrays(), with_memory=True)
        try:
            blob = with_retry(lambda: self.board.get_resume(bound), "reading the checkpoint to resume from")
        except BoardError as e:
            raise TaskConfigError(f"the checkpoint to resume from cannot be used: {short(e)}") from None
        if blob is None:
            return False
        try:
            meta, arrays = self.codec.with_max_bytes(bound).decode_params(blob)
            checkpoint = meta.get("checkpoint")
            if not isinstance(checkpoint, dict):
                raise DecodeError("the resume message carries no checkpoint meta")
            weights, state = split_checkpoint(checkpoint, arrays, self.task.rl_config, "the resume blob")
            self.parameter.from_arrays(weights)
            self.learner.on_parameters_loaded()
            if state is not None:
                self.learner.load_state_arrays(*state)
        except (DecodeError, ValueError, KeyError, TypeError) as e:
            raise TaskConfigError(f"the checkpoint to resume from does not fit this task: {short(e)}") from None
        memory = checkpoint_memory(checkpoint, arrays)
        if memory is not None:
            try:
                self.buffer.load_state_arrays(*memory)
                self.rows_base = len(self.buffer)
                logger.info("the checkpoint's replay memory is back: %d rows", len(self.buffer))
            except (ValueError, TypeError) as e:  # another capacity or columns: the run refills it
                logger.warning("the checkpoint's replay memory does not fit this task (%s); starting with an "
                               "empty one", short(e))
        self._at_version(int(checkpoint["version"]), int(checkpoint["train_count"]))
        logger.info("resumed from a checkpoint: version %d, train_count %d, env steps %d%s", self.gate.version,
                    self.learner.train_count, checkpoint["env_steps"],
                    "" if state is not None else " (weights only: the optimizer starts fresh)")
        return True

    def schedule(self) -> None:
        """Training starts: the first checkpoints are due an interval from now (``keep_when_due``)."""
        if self.options.checkpoint_dir:
            self._next_local = time.monotonic() + self.options.checkpoint_interval
        if self.task.checkpoint_interval is not None:
            self._next_on_board = time.monotonic() + max(1.0, self.task.checkpoint_interval)

    def keep_when_due(self, env_steps: int) -> None:
        """Keep the checkpoints that are due (under ``checkpoint_dir`` every ``checkpoint_interval`` seconds,
        on the board every task's ``checkpoint_interval``, at least 1 s), and set when the next ones are."""
        now = time.monotonic()
        local, on_board = now >= self._next_local, now >= self._next_on_board
        if not (local or on_board):
            return
        self.keep(env_steps, local=local, on_board=on_board)
        if local:
            self._next_local = time.monotonic() + self.options.checkpoint_interval
        if on_board:
            self._next_on_board = time.monotonic() + max(1.0, self.task.checkpoint_interval or 0.0)

    def keep(self, env_steps: int, *, local: bool = True, on_board: bool = True) -> Path | None:
        """Keep a checkpoint: under ``checkpoint_dir/<task>/`` when a directory is set (``local``), and on the
        board when the task asks for one (``on_board``: a client with a log_dir keeps it there, wherever this
        trainer runs). The local file's path, or None. Neither a full disk nor a board that is away stops
        training."""
        opts, task = self.options, self.task
        to_dir = local and bool(opts.checkpoint_dir)
        to_board = on_board and task.checkpoint_interval is not None
        if not (to_dir or to_board):
            return None
        memory = self._memory_state() if to_board and task.checkpoint_memory else None
        arrays, meta = build_checkpoint(self.parameter, self.learner, task_config(task.rl_config, task.env_config),
                                        self.learner.train_count, env_steps, 0, memory=memory)
        path = None
        if to_dir:
            directory = Path(opts.checkpoint_dir) / self.board.task_name
            try:
                path = write_checkpoint(directory, self.learner.train_count, arrays, meta, opts.keep_checkpoints)
                logger.info("checkpoint %s (train_count %d)", path, self.learner.train_count)
            except OSError as e:  # a full disk must not stop training
                logger.error("could not write a checkpoint in %s: %s", directory, e)
        if to_board:
            self._checkpoint_on_board(arrays, meta, memory is not None)
        return path

    def _memory_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """The replay memory for a checkpoint on the board, when it keeps one and it fits the board's bound
        (told before anything is copied)."""
        size = self.buffer.state_nbytes()
        if size is None:
            return None
        if size > MAX_CHECKPOINT_MEMORY_BYTES:
            if self._memory_log.ready():
                logger.warning("the replay memory (%.0f MiB) is over the %d MiB a checkpoint on the board carries: "
                               "checkpoints go without it", size / 2**20, MAX_CHECKPOINT_MEMORY_BYTES >> 20)
            return None
        return self.buffer.state_arrays()

    def _checkpoint_on_board(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], with_memory: bool) -> None:
        codec = self.codec.with_max_bytes(checkpoint_message_bytes(self.parameter.to_arrays(), with_memory))
        try:
            blob = codec.encode_params(arrays, {"epoch": self.epoch, "version": self.gate.version,
                                                "train_count": self.learner.train_count, "checkpoint": meta})
            if self.board.put_checkpoint(self.options.uid, self.epoch, self.learner.train_count, blob):
                logger.info("checkpoint on the board (train_count %d, %.1f MiB)", self.learner.train_count,
                            len(blob) / 2**20)
        except _BOARD_AWAY_OR_TOO_BIG as e:
            logger.error("could not put a checkpoint on the board: %s", short(e))
