"""The runner's weights across the board: a resume going in, checkpoints and final params coming out.

Owns: the checkpoint a run starts from (a file, a log_dir's newest, or the runner's own weights) and its
blob on the board; :class:`BoardCheckpoints`, which keeps in ``log_dir`` the checkpoints the trainer puts
on the board; waiting for the trainer to publish its last weights; loading the final params into the
runner. Must never: write a checkpoint or load params it has not checked (bounded, signed when a secret
is set, weights that fit this runner).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from srl.base.checkpoint import split_checkpoint
from srl.runner.distribution.board.board import Board, BoardError
from srl.runner.distribution.client.protocol import Runner
from srl.runner.distribution.node.retry import Throttle, with_retry
from srl.runner.distribution.wire.codec import (
    Codec,
    DecodeError,
    checkpoint_message_bytes,
    params_message_bytes,
    short,
)
from srl.runner.run_log import RunLog, latest_checkpoint, write_checkpoint

logger = logging.getLogger("srl.client")

Checkpoint = tuple[dict[str, Any], dict[str, np.ndarray]]
"""``(meta, arrays)`` of a checkpoint"""


def read_resume(runner: Runner, path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint to resume from (a file, or the newest under a log_dir), applied to ``runner``."""
    from srl.base.arrays import load_arrays

    source = Path(path)
    if source.is_dir():
        found = latest_checkpoint(source)
        if found is None:
            raise FileNotFoundError(f"resume_from={str(path)!r}: no checkpoints/*/ckpt-*.safetensors in that "
                                    "directory; give a checkpoint file or a log_dir a run wrote")
        source = found
    if not source.exists():
        raise FileNotFoundError(f"resume_from={str(path)!r}: no such file")
    meta, arrays = load_arrays(source)
    runner.load_checkpoint(meta, arrays, str(source))
    logger.info("resuming from %s: train_count %d, env steps %d", source, runner.train_count, runner.env_steps)
    return meta, arrays


def own_resume(runner: Runner) -> Checkpoint | None:
    """The checkpoint of what ``runner`` trained or loaded, to start the run from (None: weights as built):
    the distributed run goes on from there, as another ``train`` call would, instead of training fresh weights
    that replace the runner's at the end."""
    own = runner.own_checkpoint()
    if own is not None:
        logger.info("starting from this runner's own weights: train_count %d, env steps %d (the limits count "
                    "from there)", runner.train_count, runner.env_steps)
    return own


def resume_blob(codec: Codec, runner: Runner, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """The resume checkpoint as the trainer reads it from the board."""
    bound = checkpoint_message_bytes(runner.parameter.to_arrays(), with_memory=True)  # the trainer's bound too
    envelope = {"epoch": 0, "version": runner.parameter.version, "train_count": runner.train_count,
                "checkpoint": meta}
    return codec.with_max_bytes(bound).encode_params(arrays, envelope)


class BoardCheckpoints:
    """Keeps in ``log_dir`` the checkpoints the trainer puts on the board, wherever the trainer runs (a
    notebook's disk vanishes with it): ``log_dir/checkpoints/<task>/ckpt-<train_count>.safetensors``, the
    newest ``keep``. Each is checked like a resume (bounded, signed when a secret is set, weights that fit
    this runner) before it is written."""

    def __init__(self, board: Board, codec: Codec, runner: Runner, run_log: RunLog, keep: int,
                 with_memory: bool) -> None:
        self.board = board
        self.runner = runner
        self.directory = run_log.checkpoint_dir / board.task_name
        self.keep = keep
        self.max_bytes = checkpoint_message_bytes(runner.parameter.to_arrays(), with_memory)
        self.codec = codec.with_max_bytes(self.max_bytes)
        self.kept = -1  # train_count of the last one written (or refused)
        self._look = Throttle(1.0)
        self._complaint = Throttle()

    def fetch(self, now: bool = False) -> Path | None:
        """Write the board's checkpoint if it is newer than the last one kept (looked for once a second
        unless ``now``); its path, or None."""
        if not (now or self._look.ready()):
            return None
        try:
            head = self.board.get_checkpoint_train_count()
            if head is None or head == self.kept:
                return None
            found = self.board.get_checkpoint(self.max_bytes)
            if found is None:
                return None
            train_count, blob = found
            self.kept = train_count
            envelope, arrays = self.codec.decode_params(blob)
            meta = envelope.get("checkpoint")
            if not isinstance(meta, dict):
                raise DecodeError("the checkpoint message carries no checkpoint meta")
            split_checkpoint(meta, arrays, self.runner.rl_config, "the trainer's checkpoint", self.runner.spec)
            path = write_checkpoint(self.directory, train_count, arrays, meta, self.keep)
        except (DecodeError, BoardError, ValueError, OSError) as e:  # a damaged or forged one: the next may do
            self._complain(e)
            return None
        logger.info("kept the trainer's checkpoint of train_count %d: %s", train_count, path)
        return path

    def _complain(self, error: BaseException) -> None:
        if self._complaint.ready():
            logger.warning("the trainer's checkpoint on the board cannot be kept: %s", short(error))


FINAL_PARAMS_WAIT_S = 15.0
"""seconds a cancelling client waits for the trainer to publish its last weights and let go of its lease"""


def await_trainer_end(board: Board, max_wait: float = FINAL_PARAMS_WAIT_S, announce_after: float = 0.0) -> None:
    """After the task ended: wait (bounded; Ctrl-C again skips) until the trainer has seen the end at its next
    heartbeat, written its checkpoint, published the weights it trained up to and released its lease, so the
    runner gets those weights instead of the last periodic ones (a task ended by a cancel, by another client
    or by ``srl stop``; a trainer that ended it published first and lets go at once). The wait is said
    once it has lasted ``announce_after``."""
    holder, _ = with_retry(lambda: board.lease_holder("trainer"), "reading the trainer lease")
    if holder is None:
        return
    started = time.monotonic()
    deadline = started + max_wait
    announced = False
    try:
        while with_retry(lambda: board.lease_holder("trainer"), "reading the trainer lease")[0] is not None:
            if not announced and time.monotonic() - started >= announce_after:
                announced = True
                logger.info("waiting up to %.0fs for trainer %s to publish its final params (Ctrl-C again to skip)",
                            max_wait, holder)
            if time.monotonic() >= deadline:
                logger.warning("trainer %s did not let go within %.0fs: loading the last params it published",
                               holder, max_wait)
                return
            time.sleep(0.1)
    except KeyboardInterrupt:  # only the wait is skipped: the params on the board are loaded all the same
        logger.warning("not waiting for trainer %s: loading the last params it published", holder)


def load_final_params(board: Board, runner: Runner, codec: Codec) -> None:
    """The latest params on the board into ``runner`` (it keeps its weights when there are none)."""
    max_bytes = params_message_bytes(runner.parameter.to_arrays())
    record = with_retry(lambda: board.get_params(max_bytes), "reading the final params")
    if record is None:
        logger.warning("no params on the board: the runner keeps its current weights")
        return
    _, arrays = codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
    runner.set_parameter_arrays(arrays, record.version, record.train_count)
    logger.info("loaded final params (epoch %d, version %d, train_count %d)", record.epoch, record.version,
                record.train_count)
