"""Proportional prioritized replay (Schaul et al. 2016, as used by Ape-X).

Owns: ``ProportionalMemory``: rows in a ``ColumnRing``, priorities in a
``SumTree``, the max priority given to rows that arrive without one, the
annealed importance-sampling exponent beta, and the one lock that keeps them
consistent while an ingest thread adds and the learning thread samples.
Must never: block on I/O or hold the lock longer than the copies and index
updates themselves (priority transforms and weights are computed outside it),
nor apply a priority to a slot that was overwritten after it was sampled.

Row ``i`` is drawn with probability ``P(i) = p_i / sum_j p_j`` where the stored
priority is ``p_i = (|td_i| + epsilon) ** alpha``. Its importance weight is
``w_i = (N * P(i)) ** -beta / max_k w_k`` over the sampled batch, with beta
moving linearly from ``beta_initial`` to 1 over ``beta_steps`` calls to sample.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from srl.base.schema import Schema
from srl.rl.memories.replay import (
    Batch,
    ColumnRing,
    Memory,
    Sample,
    check_batch_size,
    empty_memory_error,
    saved_rows,
)
from srl.rl.memories.sum_tree import SumTree


class ProportionalMemory(Memory):
    """Prioritized replay: rows are sampled in proportion to ``(|td| + epsilon) ** alpha``."""

    def __init__(
        self,
        capacity: int,
        alpha: float = 0.6,
        beta_initial: float = 0.4,
        beta_steps: int = 100_000,
        priority_epsilon: float = 1e-4,
        seed: int | None = None,
        schema: Schema | None = None,
    ) -> None:
        # MemoryConfig.validate gives the user-facing messages; these guard direct construction.
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if not 0.0 <= beta_initial <= 1.0:
            raise ValueError(f"beta_initial must be in [0, 1], got {beta_initial}")
        if beta_steps < 0:
            raise ValueError(f"beta_steps must be >= 0, got {beta_steps}")
        if not (priority_epsilon > 0.0 and math.isfinite(priority_epsilon)):
            raise ValueError(f"priority_epsilon must be a positive finite number, got {priority_epsilon}")
        self.capacity = capacity
        self.alpha = float(alpha)
        self.beta_initial = float(beta_initial)
        self.beta_steps = int(beta_steps)
        self.priority_epsilon = float(priority_epsilon)
        self._ring = ColumnRing(capacity, schema)
        self._tree = SumTree(capacity)
        # Stored (already exponentiated) priority given to rows added without one, so new
        # experience is sampled at least once before its TD error is known.
        self._max_priority = 1.0
        self._sample_calls = 0
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    @property
    def tree(self) -> SumTree:
        """The priority tree, for tests and diagnostics: read it only while no other thread writes."""
        return self._tree

    def add(self, batch: Batch, priorities: np.ndarray | None = None) -> None:
        rows = self._ring.conform(batch)
        stored = None if priorities is None else self._stored_priorities(priorities, rows.n)
        with self._lock:
            ranges = self._ring.write(rows)
            for r in ranges:
                if stored is None:
                    self._tree.set_range(r.slot_start, r.slot_stop, self._max_priority)
                else:
                    self._tree.set_range(r.slot_start, r.slot_stop, stored[r.rows])
            if stored is not None and stored.size:
                self._max_priority = max(self._max_priority, float(stored.max()))

    def sample(self, batch_size: int) -> Sample:
        check_batch_size(batch_size)
        unit_draws = self._rng.random(batch_size)
        with self._lock:
            size = self._ring.size
            if size == 0:
                raise empty_memory_error("ProportionalMemory")
            indices = self._tree.find_stratified(unit_draws)
            # Round-off can push a draw at the very end of the mass into an empty padding
            # leaf; the last filled slot always has priority > 0 (epsilon > 0), so clamp there.
            np.minimum(indices, size - 1, out=indices)
            priorities = self._tree.get(indices)
            batch = self._ring.gather(indices)
            generations = self._ring.generations[indices]
            beta = self._beta_at(self._sample_calls)
            self._sample_calls += 1
        # w_i / max_k w_k = (N P_i)^-beta / (N P_min)^-beta = (p_min / p_i)^beta: N and the total cancel.
        # A forgotten slot (priority 0) is drawn only by the round-off clamp above; the caller drops it.
        live = priorities > 0
        p_min = priorities[live].min() if live.any() else 1.0
        weights = np.where(live, p_min / np.where(live, priorities, 1.0), 1.0) ** beta
        return Sample(batch, indices, weights.astype(np.float32), generations)

    def update_priorities(
        self, indices: np.ndarray, priorities: np.ndarray, generations: np.ndarray | None = None
    ) -> None:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.ndim != 1:
            raise ValueError(f"indices must be one-dimensional, got shape {indices.shape}")
        n = indices.shape[0]
        if n == 0:
            return
        stored = self._stored_priorities(priorities, n)
        if generations is not None:
            generations = np.asarray(generations, dtype=np.int64)
            if generations.shape != (n,):
                raise ValueError(
                    f"generations has shape {generations.shape}; expected ({n},), one per index "
                    f"(pass sample.generations from the same Sample)"
                )
        low, high = int(indices.min()), int(indices.max())
        with self._lock:
            if low < 0 or high >= self._ring.size:
                raise ValueError(
                    f"indices must be filled slots in [0, {self._ring.size}); got values from {low} "
                    f"to {high}. Pass sample.indices from this memory's sample()"
                )
            if generations is not None:
                current = self._ring.generations[indices] == generations
                if not current.all():
                    indices, stored = indices[current], stored[current]
            self._tree.set(indices, stored)
            if stored.size:
                self._max_priority = max(self._max_priority, float(stored.max()))

    def forget(self, indices: np.ndarray, generations: np.ndarray) -> None:
        """Never sample these slots again (until they are written anew): their priority becomes 0."""
        with self._lock:
            current = self._ring.generations[indices] == generations
            self._tree.set(indices[current], np.zeros(int(current.sum())))

    def __len__(self) -> int:
        return self._ring.size

    @property
    def total_added(self) -> int:
        return self._ring.total_added

    @property
    def nbytes(self) -> int:
        return self._ring.nbytes + self._tree.nbytes

    @property
    def beta(self) -> float:
        return self._beta_at(self._sample_calls)

    def state_nbytes(self) -> int:
        return (self._ring.nbytes // self.capacity + 8) * len(self)  # the rows and a float64 priority each

    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        with self._lock:
            order = self._ring.oldest_first()
            arrays = {f"rows/{name}": column for name, column in self._ring.gather(order).items()}
            arrays["priorities"] = self._tree.get(order)
            return arrays, {"kind": "proportional", "max_priority": self._max_priority,
                            "sample_calls": self._sample_calls}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        columns, rest = saved_rows(arrays, meta, "proportional")
        stored = np.asarray(rest.get("priorities", np.zeros(0)), dtype=np.float64)
        n = len(next(iter(columns.values())))
        if stored.shape != (n,) or not (np.isfinite(stored).all() and (stored > 0).all()):
            raise ValueError(f"the saved memory's priorities are not {n} finite positive numbers")
        max_priority, calls = meta.get("max_priority"), meta.get("sample_calls")
        if not isinstance(max_priority, (int, float)) or isinstance(max_priority, bool) \
                or not (math.isfinite(max_priority) and max_priority > 0):
            raise ValueError(f"the saved memory's max_priority {str(max_priority)[:40]} is not a positive number")
        if not isinstance(calls, int) or isinstance(calls, bool) or not 0 <= calls < 2**62:
            raise ValueError(f"the saved memory's sample_calls {str(calls)[:40]} is not a count")
        with self._lock:
            for r in self._ring.restore(columns):
                self._tree.set_range(r.slot_start, r.slot_stop, stored[r.rows])
            self._max_priority = max(float(max_priority), float(stored.max()))
            self._sample_calls = calls

    def _beta_at(self, sample_calls: int) -> float:
        if sample_calls >= self.beta_steps:
            return 1.0
        return self.beta_initial + (1.0 - self.beta_initial) * sample_calls / self.beta_steps

    def _stored_priorities(self, priorities: np.ndarray, n: int) -> np.ndarray:
        """Raw |TD errors| -> what the tree stores; refuses values that would poison its sums."""
        raw = np.asarray(priorities, dtype=np.float64)
        if raw.shape != (n,):
            raise ValueError(f"priorities has shape {raw.shape}; expected ({n},), one per row")
        stored = (np.abs(raw) + self.priority_epsilon) ** self.alpha
        # One NaN or inf would make every later sample meaningless; fail at the source instead.
        if not np.isfinite(stored).all():
            bad = raw[~np.isfinite(stored)][:3]
            raise ValueError(
                f"priorities must be finite |TD errors|; got {bad.tolist()} among them. "
                f"Check the loss for NaN/inf before sending priorities"
            )
        return stored
