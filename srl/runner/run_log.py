"""What a run leaves behind in ``log_dir``: its history, its evaluations, TensorBoard events, checkpoints.

Owns: the files. ``history.csv`` has one row per progress interval (what the
progress lines say, as numbers), ``eval.csv`` one row per evaluation,
``events.out.tfevents.*`` the same scalars for TensorBoard (when the
``tensorboard`` package is installed: ``pip install srl[tensorboard]``), and
``checkpoints/`` the weights, optimizer state and counters (safetensors, no
pickle). A run that resumes in the same directory appends to the same files.
Must never: decide anything about the run.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from srl.base.arrays import save_arrays
from srl.base.files import write_whole

logger = logging.getLogger("srl.runner")

HISTORY_FILE = "history.csv"
EVAL_FILE = "eval.csv"
CHECKPOINT_DIR = "checkpoints"

Row = Mapping[str, float | int | str | None]

# TensorBoard groups, by column prefix (the first that matches)
_GROUPS = (("reward", "rollout"), ("episode", "rollout"), ("actor", "actors"),
           ("env_steps", "rollout"), ("lag", "lag"), ("queue", "queue"))
_NOT_SCALARS = {"time", "wall_s", "train_count", "env_steps"}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class CsvLog:
    """A CSV file whose columns may grow: a row with a new column rewrites the file with the wider header
    (old rows get empty cells), so every row stays readable by a plain CSV reader."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = []
        if path.exists():  # a resumed run goes on in the same file
            with path.open(newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or [])
                self.rows = [dict(r) for r in reader]

    def append(self, row: Row) -> None:
        clean = {k: ("" if v is None else v) for k, v in row.items()}
        new = [k for k in clean if k not in self.columns]
        self.rows.append(clean)
        if new or not self.path.exists():
            self.columns += new
            text = io.StringIO(newline="")
            writer = csv.DictWriter(text, self.columns, restval="")
            writer.writeheader()
            writer.writerows(self.rows)
            write_whole(self.path, [text.getvalue().encode()], durable=True)  # the whole history is at stake
            return
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self.columns, restval="").writerow(clean)

    def last(self, column: str) -> float | None:
        """The latest number in ``column`` (None if there is none)."""
        for row in reversed(self.rows):
            try:
                return float(row.get(column, ""))
            except (TypeError, ValueError):
                continue
        return None


class RunLog:
    """``log_dir``'s files for one run (one process: ``Runner.train``; distributed: the client)."""

    def __init__(self, log_dir: str | os.PathLike[str], tensorboard: bool | None = None) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.history = CsvLog(self.dir / HISTORY_FILE)
        self.evals = CsvLog(self.dir / EVAL_FILE)
        self.checkpoint_dir = self.dir / CHECKPOINT_DIR
        self._writer: Any = None
        # a resumed run's wall clock goes on from where the previous one stopped
        self.wall_offset = self.history.last("wall_s") or 0.0
        self.started = time.monotonic()
        if tensorboard is None:
            tensorboard = importlib.util.find_spec("tensorboard") is not None
            if not tensorboard:
                logger.info("log_dir %s: history.csv and eval.csv only; pip install srl[tensorboard] for "
                            "TensorBoard event files", self.dir)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.dir))

    def wall_s(self) -> float:
        """Seconds of this run (and of the runs it resumes) so far."""
        return self.wall_offset + time.monotonic() - self.started

    def add_history(self, row: Row) -> dict[str, Any]:
        """One progress interval: ``row`` with ``time`` and ``wall_s`` added; returns the row written."""
        full = {"time": round(time.time(), 3), "wall_s": round(self.wall_s(), 3), **row}
        self.history.append(full)
        self._scalars(full, "")
        return full

    def add_eval(self, row: Row) -> dict[str, Any]:
        full = {"time": round(time.time(), 3), "wall_s": round(self.wall_s(), 3), **row}
        self.evals.append(full)
        self._scalars(full, "eval/")
        return full

    def _scalars(self, row: Mapping[str, Any], group: str) -> None:
        if self._writer is None:
            return
        step = int(_number(row.get("env_steps")) or _number(row.get("train_count")) or 0)
        for key, value in row.items():
            number = _number(value)
            if number is None or key in _NOT_SCALARS or (not group and key.startswith("eval")):
                continue  # (a history row's latest evaluation repeats eval.csv's: TensorBoard has those)
            tag = group + key if group else next((f"{g}/{key}" for p, g in _GROUPS if key.startswith(p)),
                                                 f"train/{key}")
            self._writer.add_scalar(tag, number, step, walltime=float(row.get("time") or time.time()))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _oldest_first(paths: list[Path]) -> list[Path]:
    """``paths`` in the order they were written, oldest first: by modification time, then (files of one run
    written within one tick of a coarse clock) by name, which is the train count. Not by name alone: a new
    run of a task in the same directory counts from 0, below the files an earlier run left there. Files
    removed meanwhile (another writer pruning the same directory) are left out."""
    stamped: list[tuple[int, str, Path]] = []
    for path in paths:
        try:
            stamped.append((path.stat().st_mtime_ns, path.name, path))
        except FileNotFoundError:
            continue
    return [path for _, _, path in sorted(stamped)]


def latest_checkpoint(log_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint written last under ``log_dir`` (its ``checkpoints/`` and a task's ``checkpoints/<task>/``
    included): the newest run's newest, even when an earlier run there reached more train steps; None if
    there is none."""
    root = Path(log_dir)
    found = [*root.glob("ckpt-*.safetensors"), *root.glob(f"{CHECKPOINT_DIR}/ckpt-*.safetensors"),
             *root.glob(f"{CHECKPOINT_DIR}/*/ckpt-*.safetensors")]
    ordered = _oldest_first(found)
    return ordered[-1] if ordered else None


def write_checkpoint(directory: Path, train_count: int, arrays: Mapping[str, np.ndarray],
                     meta: Mapping[str, Any], keep: int) -> Path:
    """``directory/ckpt-<train_count>.safetensors``; only the ``keep`` periodic checkpoints written last stay,
    this one always among them (``final.safetensors`` is never removed). An earlier run's files in the same
    directory go first, oldest first."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{train_count:010d}.safetensors"
    save_arrays(path, dict(arrays), dict(meta))
    if keep > 0:
        others = _oldest_first([p for p in directory.glob("ckpt-*.safetensors") if p != path])
        for old in others[:max(len(others) - (keep - 1), 0)]:
            old.unlink(missing_ok=True)
    return path
