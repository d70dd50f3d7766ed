"""``srl plot LOG_DIR`` / ``runner.plot(log_dir)``: PNGs of a run next to its history.

Owns: turning ``history.csv`` and ``eval.csv`` into ``reward.png`` (episode reward and evaluations
against env steps and against wall time), ``loss.png`` (the loss and the algorithm's other
statistics against train steps) and ``throughput.png`` (env steps/s, train steps/s, queue in
flight). Needs matplotlib (``pip install srl[plot]``). Must never: change the files it reads.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from srl.runner.run_log import EVAL_FILE, HISTORY_FILE

LOSS_COLUMNS = ("loss", "policy_loss", "value_loss", "entropy", "approx_kl", "q_mean", "td_error", "rho_mean")
RATE_COLUMNS = ("env_steps_per_s", "train_per_s", "received_per_s", "queue_in_flight")


def _read(path: Path) -> dict[str, list[float]]:
    """Columns of a CSV as floats (a cell that is not a number is NaN)."""
    columns: dict[str, list[float]] = {}
    if not path.exists():
        return columns
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        names = list(reader.fieldnames or [])
        for name in names:
            columns[name] = []
        for row in reader:
            for name in names:
                try:
                    columns[name].append(float(row.get(name) or "nan"))
                except ValueError:
                    columns[name].append(float("nan"))
    return columns


def plot(log_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the PNGs for the run in ``log_dir``; returns their paths."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("srl plot needs matplotlib: pip install 'srl[plot]'") from None
    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

    root = Path(log_dir)
    history, evals = _read(root / HISTORY_FILE), _read(root / EVAL_FILE)
    if not history.get("train_count"):
        raise FileNotFoundError(f"{root / HISTORY_FILE} is missing or empty: train with log_dir={str(root)!r} first")
    written: list[Path] = []

    fig, (by_steps, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, x_name, label in ((by_steps, "env_steps", "env steps"), (by_time, "wall_s", "wall time (s)")):
        if "reward_mean" in history:
            axis.plot(history[x_name], history["reward_mean"], label="episode reward (recent mean)")
            if "reward_min" in history and "reward_max" in history:
                axis.fill_between(history[x_name], history["reward_min"], history["reward_max"], alpha=0.2,
                                  label="recent min..max")
        if evals.get("eval_mean"):
            axis.plot(evals[x_name], evals["eval_mean"], "o-", label="evaluation")
        axis.set_xlabel(label)
        axis.set_ylabel("reward")
        axis.grid(alpha=0.3)
    by_steps.legend(loc="best")
    fig.suptitle(f"{root.name}: reward")
    written.append(_save(fig, root / "reward.png"))

    for columns, x_name, x_label, title, file in (
            (LOSS_COLUMNS, "train_count", "train steps", "losses", "loss.png"),
            (RATE_COLUMNS, "wall_s", "wall time (s)", "throughput", "throughput.png")):
        names = [c for c in columns if c in history]
        if names:
            written.append(_stacked(plt, history, names, x_name, x_label, f"{root.name}: {title}", root / file))
    return written


def _stacked(plt: Any, history: dict[str, list[float]], names: list[str], x_name: str, x_label: str,
             title: str, path: Path) -> Path:
    """One panel per column, against a shared x axis."""
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.2 * len(names)), sharex=True, squeeze=False)
    for axis, name in zip(axes[:, 0], names, strict=True):
        axis.plot(history[x_name], history[name])
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(x_label)
    fig.suptitle(title)
    return _save(fig, path)


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=100)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
