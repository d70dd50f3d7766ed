"""Evaluating the latest params in the client, and the run's history rows.

Owns: :class:`Evaluator` (a thread of the client that evaluates the params on the board: the trainer is
not slowed) and the history: a row per progress interval from one board snapshot (``history_text``),
kept in ``log_dir`` and on the board for dashboards (``record_history``). Must never: stop the run it
watches: a failed evaluation is logged and the next one is tried.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from srl.runner.distribution.board.board import Board
from srl.runner.distribution.client.protocol import Runner
from srl.runner.distribution.client.report import BoardSnapshot
from srl.runner.distribution.node.retry import with_retry
from srl.runner.distribution.node.stats import EvaluatorStats, Reports
from srl.runner.distribution.sending.in_flight import batches_in_flight
from srl.runner.distribution.wire.codec import Codec, params_message_bytes, short
from srl.runner.progress import reward_summary
from srl.runner.run_log import RunLog

logger = logging.getLogger("srl.client")


class Evaluator:
    """Evaluates the latest params on the board in a thread of the client (the trainer is not slowed):
    every ``interval`` seconds and/or every ``every`` train steps; rows into eval.csv and the board."""

    def __init__(self, runner: Runner, board: Board, codec: Codec, interval: float | None, every: int | None,
                 episodes: int, run_log: RunLog | None) -> None:
        self.copy = runner.replica()  # its own weights, env and worker
        self.board = board
        self.codec = codec
        self.interval = interval
        self.every = every
        self.episodes = episodes
        self.run_log = run_log
        self.latest: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="srl-evaluator", daemon=True)
        self._lock = threading.Lock()
        self._evaluated_version = -1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        next_time = time.monotonic() + (self.interval or 0.0)
        next_count = self.every or 0
        while not self._stop.wait(0.5):
            try:
                due = self.interval is not None and time.monotonic() >= next_time
                if self.every is not None:
                    trainer = Reports.read(self.board).trainer
                    due = due or (trainer is not None and trainer.train_count >= next_count)
                if not due:
                    continue
                row = self.evaluate_now()
                next_time = time.monotonic() + (self.interval or 0.0)
                if self.every is not None and row is not None:
                    next_count = (int(row["train_count"]) // self.every + 1) * self.every
            except Exception as e:  # an evaluation must never stop the run it watches
                logger.warning("evaluation failed: %s", short(e))
                next_time = time.monotonic() + (self.interval or 5.0)

    def evaluate_now(self, final: bool = False) -> dict[str, Any] | None:
        """Evaluate the latest params (None when there are none yet, or they were evaluated already;
        ``final``: a run's last row, marked final, written even when the periodic evaluation already
        took these params: then its result is recorded again rather than measured twice)."""
        with self._lock:
            record = self.board.get_params(params_message_bytes(self.copy.parameter.to_arrays()))
            if record is None:
                return None
            if record.version == self._evaluated_version:
                if not final or not self.latest:
                    return None
                again: dict[str, Any] = {**self.latest, "final": 1}
                self.latest = again
                if self.run_log is not None:
                    self.run_log.add_eval(again)
                return again
            _, arrays = self.codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
            self.copy.set_parameter_arrays(arrays, record.version, record.train_count)
            rewards = self.copy.evaluate(max_episodes=self.episodes)
            self._evaluated_version = record.version
            env_steps = int(self.board.get_counters().get("env_steps", 0))
            row: dict[str, Any] = {"train_count": record.train_count, "env_steps": env_steps,
                                   "version": record.version, **reward_summary(rewards, "eval")}
            if final:
                row["final"] = 1
            self.latest = row
            if self.run_log is not None:
                self.run_log.add_eval(row)
            self.board.put_stats("evaluator", EvaluatorStats.from_record(row).to_record())
            logger.info("evaluation of params v%d (train %d, env steps %d): %.1f (min %.1f, max %.1f, %d episodes)",
                        record.version, record.train_count, env_steps, row["eval_mean"], row["eval_min"],
                        row["eval_max"], len(rewards))
            return row


def record_history(board: Board, run_log: RunLog | None, evaluator: Evaluator | None) -> None:
    """A history row of the run now: into ``log_dir``'s history.csv when there is one, and on the board."""
    row = with_retry(lambda: history_row(board, evaluator), "reading the run's stats")
    row = run_log.add_history(row) if run_log is not None else {"time": round(time.time(), 3), **row}
    try:
        with_retry(lambda: board.push_history(row), "keeping the run's history on the board")
    except ValueError as e:  # a row too large for the board (thousands of actors): the file has it all
        logger.debug("history row not put on the board: %s", e)


def history_row(board: Board, evaluator: Evaluator | None) -> dict[str, Any]:
    """One row of the run's history, read from ``board``: see :func:`history_text`."""
    return history_text(BoardSnapshot.read(board), evaluator.latest.get("eval_mean") if evaluator is not None else None)


def history_text(snapshot: BoardSnapshot, eval_mean: float | None) -> dict[str, Any]:
    """One row of the run's history: counters, the trainer's stats (loss, the algorithm's own, rates, lag),
    each actor's rate, stalls and rewards, the latest evaluation's mean."""
    reports, counters = snapshot.reports, snapshot.counters
    trainer, actors = reports.trainer, reports.actors
    row: dict[str, Any] = {
        "train_count": snapshot.train_count,
        "env_steps": int(counters.get("env_steps", 0)),
        "episodes": int(counters.get("episodes", 0)),
    }
    means = [a.reward for a in actors.values() if a.reward is not None]
    row.update(reward_summary(means, "reward"))  # the actors' last 10 episodes: mean of their means...
    lows = [a.reward_min for a in actors.values() if a.reward_min is not None]
    highs = [a.reward_max for a in actors.values() if a.reward_max is not None]
    if lows and highs:  # ...and the extremes over all of them
        row["reward_min"], row["reward_max"] = min(lows), max(highs)
    row["eval_mean"] = eval_mean
    row["env_steps_per_s"] = round(sum(a.env_steps_per_s for a in actors.values()), 2)
    row["queue_in_flight"] = max(0.0, batches_in_flight(counters))
    for name in ("sent_batches", "received_batches", "refused_batches", "bad_messages", "stale_rows", "duplicates"):
        row[name] = counters.get(name, 0)
    if trainer is not None:
        record = trainer.to_record()  # its numbers, by the names the stats dataclass gives them
        row.update({k: v for k, v in record.items()
                    if k not in _NOT_HISTORY and _num(v) is not None})
    if reports.servers:  # every server's together: actions and refusals summed, batches and waits on average
        servers = list(reports.servers.values())
        row.update({"inference_actions_per_s": round(sum(s.agent_steps_per_s for s in servers), 1),
                    "inference_batch_envs": round(sum(s.batch_envs_mean for s in servers) / len(servers), 2),
                    "inference_wait_ms": round(sum(s.batch_wait_ms_mean for s in servers) / len(servers), 3),
                    "inference_refused": sum(s.refused_requests for s in servers)})
    for slot, actor in actors.items():
        row.update({f"actor{slot}_env_steps_per_s": actor.env_steps_per_s,
                    f"actor{slot}_backpressure_wait_s": actor.backpressure_wait_s,
                    f"actor{slot}_rate_limited_s": actor.rate_limited_s,
                    f"actor{slot}_sync_wait_s": actor.sync_wait_s,
                    f"actor{slot}_params_lag": actor.params_lag})
    return row


_NOT_HISTORY = {"uid", "epoch", "train_count", "device", "waiting_for", "bad_messages", "duplicates", "stale_rows",
                "received_batches"}
"""trainer stats that are not history columns (the counters' totals are)"""


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None
