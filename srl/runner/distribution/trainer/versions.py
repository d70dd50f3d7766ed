"""The trainer's params version, and which rows it takes at that version.

Owns: :class:`VersionGate`, the one place the trainer process's ingest thread and main thread meet: the
version the learner's weights have now, the algorithm's version policy applied to the rows that come
(``DataPath``: sync takes only the current version, ``max_policy_lag`` bounds the age, otherwise any
version already published), who delivered rows of the current version (sync PPO's wait), and
:class:`PolicyLag`, the lag of the rows taken, in versions and in train steps. Must never: let the version
move between a block's check and its insert (the ingest thread checks and adds rows under its lock, waiting
there for room in the buffer; the main thread trains and moves the version under it), or do I/O under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from srl.base.rl import DataPath

logger = logging.getLogger("srl.trainer")


class PolicyLag:
    """How old the params were that accepted rows were acted with, in versions and in train steps.

    The trainer notes the train count of each version it publishes; a row of version v that
    arrives when the latest version is V is ``V - v`` versions and ``train_count(V) -
    train_count(v)`` train steps behind. Kept for the last ``window`` rows (Sample Factory's
    ``version_diff``).
    """

    def __init__(self, window: int = 4096, versions_kept: int = 100_000) -> None:
        self.window = window
        self._runs: deque[tuple[int, int, int]] = deque()  # (versions behind, steps behind or -1, rows)
        self._rows = 0  # rows in _runs: under window + the oldest run's rows
        self._train_at: OrderedDict[int, int] = OrderedDict()
        self._kept = versions_kept

    def published(self, version: int, train_count: int) -> None:
        self._train_at[version] = train_count
        while len(self._train_at) > self._kept:
            self._train_at.popitem(last=False)

    def note(self, versions: np.ndarray, current: int) -> None:
        """Note rows acted with ``versions`` arriving when the latest version is ``current`` (one run
        per version, not one entry per row: a read brings thousands of rows of a few versions)."""
        if versions.size == 0:
            return
        first = int(versions[0])
        if (versions == first).all():  # the common case: one version in a read
            runs: Any = ((first, versions.size),)
        else:
            runs = zip(*np.unique(versions, return_counts=True), strict=True)
        now = self._train_at.get(current)
        for version, count in runs:
            behind = max(0, current - int(version))
            then = self._train_at.get(int(version))
            steps = -1 if now is None or then is None else max(0, now - then)
            self._runs.append((behind, steps, int(count)))
            self._rows += int(count)
        while self._runs and self._rows - self._runs[0][2] >= self.window:  # runs wholly out of the window
            self._rows -= self._runs.popleft()[2]

    def summary(self) -> dict[str, float]:
        """p50/p95/max of the lag of the last ``window`` rows, in versions (``lag_*``) and train steps
        (``lag_steps_*``)."""
        out: dict[str, float] = {}
        if not self._runs:
            return out
        behind, steps, counts = (np.array(column, dtype=np.int64) for column in zip(*self._runs, strict=True))
        for name, values in (("lag", behind), ("lag_steps", steps)):
            rows = np.repeat(values, counts)[-self.window:]
            known = rows[rows >= 0]
            if known.size:
                out[f"{name}_p50"] = float(np.percentile(known, 50))
                out[f"{name}_p95"] = float(np.percentile(known, 95))
                out[f"{name}_max"] = float(known.max())
        return out


class VersionGate:
    """The current params version and the data path's policy for the rows that come.

    The ingest thread, for each block of valid rows::

        with gate.lock:
            keep = gate.keep(columns["version"])       # None: all of them
            gate.lag.note(kept versions, gate.version)
            buffer.add(kept rows)
            gate.arrived(slot, n) for each sender

    The main thread trains and, under the same lock, moves ``version`` (``DataPath.next_version``); a
    publication resets who delivered (``published``). Sync: ``sync_ready`` says when an update may go.
    """

    def __init__(self, data_path: DataPath) -> None:
        self.data_path = data_path
        self.version = 0
        self.lock = threading.Lock()
        self.lag = PolicyLag()
        self._arrivals: dict[int, int] = {}  # rows of the current version by actor slot (sync's wait)
        self._waiting_since: float | None = None
        self.waiting_for: list[int] = []
        """sync: the actor slots whose segments of this version have not come"""

    def first_version(self, on_board: int) -> int:
        """Set and return the version this run's first weights are published as, ``on_board`` being the newest
        the board (or a checkpoint) has: at least the learner's first. Sync: one past the board's. A trainer
        that restores version v from the board cannot tell whether the one before it took v's segments: it
        may have read and acked all of them and died training on them (they are gone with it), or none.
        Every actor that sent its segment of v waits for a newer version, so publishing v again would leave
        them waiting for ever; v + 1 (the same weights) moves every actor on. What this costs is at most one
        round of segments acted with v that come after it: refused as stale, counted. Called before the
        ingest starts, so that no row of the old version is taken at the new one."""
        version = max(self.version, DataPath.FIRST_VERSION)
        if self.data_path.sync and on_board >= version:
            version = on_board + 1
        with self.lock:
            self.version = version
        return version

    def keep(self, versions: np.ndarray) -> np.ndarray | None:
        """Which rows the data path accepts at the current version (None: all of them)."""
        path = self.data_path
        if path.sync:
            keep = versions == self.version
        elif path.max_policy_lag is not None:
            keep = (versions <= self.version) & (self.version - versions <= path.max_policy_lag)
        else:  # any age, but never a version not yet published (a forged or confused sender)
            keep = versions <= self.version
        return None if keep.all() else keep

    def arrived(self, senders: Iterable[tuple[int, int]]) -> None:
        """Rows of the current version came from these ``(actor slot, rows)`` (called under ``lock``)."""
        for slot, rows in senders:
            if rows:
                self._arrivals[slot] = self._arrivals.get(slot, 0) + rows

    def published(self, version: int, train_count: int) -> None:
        """``version`` went out at ``train_count``: the lag counts from it; arrivals count anew."""
        self.lag.published(version, train_count)
        self._arrivals = {}

    def sync_ready(self, have: int, needed: int, slots: Sequence[int]) -> bool:
        """Sync: the segments of this version of every actor in ``slots`` are in (``have`` of ``needed``), or
        ``sync_wait_s`` passed with at least ``min_segments`` (then the log says which actors it goes on
        without)."""
        path = self.data_path
        if have >= needed:
            self.waiting_for = []
            return True
        if have == 0:
            self._waiting_since = None
            return False
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        self.waiting_for = [i for i in slots if i not in self._arrivals]
        if have >= path.min_segments and now - self._waiting_since >= path.sync_wait_s:
            logger.warning("version %d: going on with %d of %d segments after %.0fs; no segments from actor slot(s) "
                           "%s", self.version, have, needed, now - self._waiting_since, self.waiting_for)
            return True
        return False

    def missing(self, slots: Sequence[int]) -> int:
        """Sync: how many messages of ``slots`` the next update waits for: those that have sent nothing of this
        version yet (each sends a message), or, when every one has, all of them again (the next version's,
        which come about together once it is published)."""
        arrived = self._arrivals
        missing = sum(1 for i in slots if i not in arrived)
        return missing or len(slots)

    def updated(self) -> None:
        """Sync: an update was made; the wait for the next version's segments starts when they come."""
        self._waiting_since = None
