"""Segments used once: the buffer of on-policy algorithms (PPO) and IMPALA-style learners.

Owns: ``SegmentBuffer`` — a bounded FIFO of rows (each row a segment of T
steps of one env), preallocated from the algorithm's schema. The trainer takes
segments out (all of them, or a batch of the oldest) and they are gone; when
it is full the trainer's ingest stops reading the queue, so the queue fills and
actors wait (backpressure), nothing is dropped. Must never: block, overwrite a
segment not yet taken, or hand out views into its storage.
"""

from __future__ import annotations

import threading

import numpy as np

from srl.base.rl import Buffer, Columns
from srl.base.schema import Schema


class SegmentBuffer(Buffer):
    """A bounded FIFO of ``capacity`` rows of ``schema``."""

    def __init__(self, capacity: int, schema: Schema) -> None:
        if capacity < 1:
            raise ValueError(f"segment buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.schema = schema
        self._columns = schema.allocate(capacity)
        self._head = 0  # oldest row
        self._size = 0
        self._lock = threading.Lock()
        self.total_added = 0

    def add(self, columns: Columns, priorities: np.ndarray | None = None) -> None:
        problem = self.schema.problem(columns)
        if problem is not None:
            raise ValueError(f"rows do not fit the segment buffer: {problem}")
        n = len(next(iter(columns.values())))
        with self._lock:
            if n > self.capacity - self._size:
                raise ValueError(
                    f"segment buffer full: {self._size}/{self.capacity} rows held, {n} more offered; "
                    "check room() before adding (the trainer's ingest waits for room)"
                )
            slots = (self._head + self._size + np.arange(n)) % self.capacity
            for name, column in self._columns.items():
                column[slots] = columns[name]
            self._size += n
            self.total_added += n

    def grow(self, rows: int) -> bool:
        """A larger ring, the rows held copied over oldest first (the learner's ``take`` order is kept)."""
        with self._lock:
            if rows <= self.capacity:
                return False
            columns = self.schema.allocate(rows)
            slots = (self._head + np.arange(self._size)) % self.capacity
            for name, column in self._columns.items():
                columns[name][:self._size] = column[slots]
            self._columns, self.capacity, self._head = columns, rows, 0
        return True

    def take(self, n: int | None = None) -> Columns | None:
        """The ``n`` oldest rows (all of them when None), removed from the buffer; None if it holds
        fewer than ``n`` (or none)."""
        with self._lock:
            count = self._size if n is None else n
            if count <= 0 or count > self._size:
                return None
            slots = (self._head + np.arange(count)) % self.capacity
            out = {name: column[slots] for name, column in self._columns.items()}  # fancy indexing copies
            self._head = (self._head + count) % self.capacity
            self._size -= count
        return out

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        return sum(int(column.nbytes) for column in self._columns.values())

    def room(self) -> int:
        return self.capacity - self._size
