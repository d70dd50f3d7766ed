"""Progress lines for long runs, and the default log handler.

Owns: how srl tells a person what a run is doing (elapsed/ETA, rates, recent
rewards, loss). Must never: decide anything about the run itself.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import Any

import numpy as np

logger = logging.getLogger("srl")


def ensure_logging(level: int = logging.INFO) -> None:
    """Give the ``srl`` logger a stderr handler unless the application configured logging."""
    root = logging.getLogger()
    if logger.handlers or root.handlers:
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:  # a level the application chose stays
        logger.setLevel(level)
    logger.propagate = False


def reward_summary(rewards: list[float], prefix: str) -> dict[str, float | None]:
    """``{prefix}_mean/_min/_max`` of episode rewards (None each when there are none)."""
    if not rewards:
        return {f"{prefix}_mean": None, f"{prefix}_min": None, f"{prefix}_max": None}
    return {f"{prefix}_mean": round(float(np.mean(rewards)), 4), f"{prefix}_min": round(float(min(rewards)), 4),
            f"{prefix}_max": round(float(max(rewards)), 4)}


def format_seconds(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{(seconds % 3600) // 60:02.0f}m"


def eta(done: float, total: float | None, elapsed: float) -> float | None:
    """Seconds left at the current rate, or None when it cannot be told."""
    if not total or done <= 0:
        return None
    return elapsed * (total - done) / done


class TrainProgress:
    """Rates and a line every ``interval`` seconds for ``Runner.train``."""

    def __init__(
        self, interval: float | None, max_train_count: int | None, max_steps: int | None, timeout: float | None,
        bar: bool | None = None,
    ) -> None:
        self.interval = interval
        self.max_train_count = max_train_count
        self.max_steps = max_steps
        self.timeout = timeout
        self.start = time.perf_counter()
        self._last_time = self.start
        self._last_steps = 0
        self._last_train = 0
        self.rewards: deque[float] = deque(maxlen=10)
        self.loss: float | None = None
        self.stats: dict[str, float] = {}
        """the latest update's statistics (loss and the algorithm's own)"""
        self.eval: float | None = None
        self._bar: Any = None
        if interval is not None and (bar or (bar is None and sys.stderr.isatty())):
            self._bar = _make_bar(max_train_count, max_steps)
            if self._bar is not None:
                self.interval = min(interval, 0.5)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def due(self, now: float) -> bool:
        return self.interval is not None and now - self._last_time >= self.interval

    def report(self, steps: int, train_count: int, episodes: int, now: float | None = None) -> None:
        """Move the bar, or log a progress line."""
        if self._bar is None:
            logger.info("%s", self.line(steps, train_count, episodes, now))
            return
        self._bar.n = train_count if self.max_train_count else steps
        reward = sum(self.rewards) / len(self.rewards) if self.rewards else None
        postfix = {"env": steps, "train": train_count, "episodes": episodes,
                   "reward": "-" if reward is None else f"{reward:.1f}",
                   "loss": "-" if self.loss is None else f"{self.loss:.3g}"}
        if self.eval is not None:
            postfix["eval"] = f"{self.eval:.1f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()
        self._last_time = time.perf_counter() if now is None else now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def line(self, steps: int, train_count: int, episodes: int, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        dt = max(now - self._last_time, 1e-9)
        steps_rate = (steps - self._last_steps) / dt
        train_rate = (train_count - self._last_train) / dt
        self._last_time, self._last_steps, self._last_train = now, steps, train_count
        elapsed = now - self.start
        etas = [
            eta(train_count, self.max_train_count, elapsed),
            eta(steps, self.max_steps, elapsed),
            None if self.timeout is None else self.timeout - elapsed,
        ]
        known = [e for e in etas if e is not None]
        left = min(known) if known else None
        reward = f"{sum(self.rewards) / len(self.rewards):.1f} (last {len(self.rewards)})" if self.rewards else "-"
        loss = f"{self.loss:.4g}" if self.loss is not None else "-"
        total = f"/{self.max_train_count}" if self.max_train_count else ""
        evaluation = "" if self.eval is None else f" | eval {self.eval:.1f}"
        return (
            f"{format_seconds(elapsed)} elapsed, ETA {format_seconds(left)} | train {train_count}{total} "
            f"{train_rate:.0f}/s | env {steps} steps {steps_rate:.0f}/s, {episodes} episodes | "
            f"reward {reward} | loss {loss}{evaluation}"
        )


def _make_bar(max_train_count: int | None, max_steps: int | None) -> Any:
    """A tqdm bar over train steps (else env steps), or None without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    total = max_train_count or max_steps
    return tqdm(total=total, unit=" train" if max_train_count else " steps", dynamic_ncols=True, leave=True)
