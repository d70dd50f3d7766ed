"""Replay memory interface, the ring storage behind it, and the uniform replay memory.

Owns: the ``Memory`` contract the trainer codes against (``Batch``, ``Sample``,
``Memory``), the fixed-capacity column ring that both memories store rows in
(oldest-first eviction, per-slot write generations), and ``ReplayMemory``,
which samples uniformly with replacement.
Must never: block on I/O, hold its lock across anything but copying rows and
updating indexes, or hand out views into its storage (a sample is copies, so
the caller may use it after another thread has overwritten the slots).
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from srl.base.rl import Buffer
from srl.base.schema import Schema

Batch = dict[str, np.ndarray]
"""Named columns of ``n`` transitions: every array has the same leading length ``n``."""

_STORABLE_KINDS = "biufc"  # bool, signed, unsigned, float, complex: plain numbers only


@dataclass
class Sample:
    """One sampled batch and what is needed to send priorities back for it."""

    batch: dict[str, np.ndarray]
    """gathered rows, copied out of the memory: safe to use after the lock is released"""
    indices: np.ndarray
    """int64 slot of each row, for ``update_priorities``"""
    weights: np.ndarray
    """float32 importance-sampling weights, normalised so the largest is 1 (all ones for uniform)"""
    generations: np.ndarray
    """int64 write generation of each slot when it was sampled, for ``update_priorities``"""


class Memory(Buffer):
    """Experience replay as the trainer uses it (a ``Buffer`` rows are sampled from many times).

    The trainer's ingest thread adds what actors sent; its learning loop
    samples, learns, and feeds the new |TD errors| back::

        # ingest thread                          # learning thread
        batch, priorities = decode(message)       sample = memory.sample(batch_size)
        memory.add(batch, priorities)             td = learn(sample.batch, sample.weights)
        message.ack()                             memory.update_priorities(
                                                      sample.indices, np.abs(td), sample.generations)

    One thread may add while another samples and updates: every method takes
    one short lock. Column names, row shapes and dtypes are fixed by the first
    ``add``; at capacity the oldest rows are overwritten first.
    """

    capacity: int

    @abstractmethod
    def add(self, batch: Batch, priorities: np.ndarray | None = None) -> None:
        """Store ``n`` rows at once, evicting the oldest at capacity.

        ``priorities`` are raw |TD errors| (``n`` of them); None means "as
        important as the most important row seen so far". A batch longer than
        ``capacity`` keeps its last ``capacity`` rows. Raises ValueError when a
        column is missing, extra, or shaped unlike the first batch.
        """

    @abstractmethod
    def sample(self, batch_size: int) -> Sample:
        """Draw ``batch_size`` rows (with replacement). Raises ValueError when empty."""

    @abstractmethod
    def update_priorities(
        self, indices: np.ndarray, priorities: np.ndarray, generations: np.ndarray | None = None
    ) -> None:
        """Set new raw |TD errors| for sampled slots.

        With ``generations`` (from the same ``Sample``), slots overwritten since
        they were sampled are skipped silently: their priority belongs to a row
        that is gone.
        """

    def forget(self, indices: np.ndarray, generations: np.ndarray) -> None:
        """Stop sampling these slots where the memory can (a prioritized one); a uniform memory cannot, and its
        caller draws again instead."""

    @abstractmethod
    def __len__(self) -> int:
        """Rows currently stored: ``min(total_added, capacity)``."""

    @property
    @abstractmethod
    def total_added(self) -> int:
        """Rows ever added, including those since evicted."""

    @property
    @abstractmethod
    def beta(self) -> float:
        """Importance-sampling exponent the next ``sample`` uses (1.0 when sampling is uniform)."""


class Rows(NamedTuple):
    """A batch after validation: arrays ready to copy into the ring."""

    columns: dict[str, np.ndarray]
    n: int
    checked_against_layout: bool
    """False when the ring had no layout yet at validation time (first add)"""


class WrittenRange(NamedTuple):
    """Slots ``[slot_start, slot_stop)`` received batch rows from ``row_start`` on."""

    slot_start: int
    slot_stop: int
    row_start: int

    @property
    def slots(self) -> slice:
        return slice(self.slot_start, self.slot_stop)

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.slot_stop - self.slot_start)


class ColumnRing:
    """Fixed-capacity column storage, written oldest-first like a ring buffer.

    Not thread-safe: the owning memory holds its lock around ``write`` and
    ``gather``. ``conform`` only reads the layout, which is set once and never
    changes, so it runs outside the lock.

    With a ``schema`` (what the trainer always passes: the algorithm's declared
    columns) storage is allocated up front and every batch must match it.
    Without one, storage is allocated by the first write from that batch's row
    shapes and dtypes (handy for tests and tools; never for experience read
    from a broker).
    """

    def __init__(self, capacity: int, schema: Schema | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"ring capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.size = 0
        self.total_added = 0
        self.generations = np.zeros(capacity, dtype=np.int64)
        self._cursor = 0  # next slot to write
        self._columns: dict[str, np.ndarray] = {}
        self._layout: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        if schema is not None:
            self._allocate(schema.allocate(0))

    def conform(self, batch: Mapping[str, np.ndarray]) -> Rows:
        """Validate ``batch`` and cast it to the stored dtypes. Raises ValueError naming the column."""
        if not isinstance(batch, Mapping) or not batch:
            raise ValueError(
                f"a batch is a non-empty dict of column name -> array with one row per transition; "
                f"got {type(batch).__name__} {batch!r:.80}"
            )
        layout = self._layout
        if layout is not None and batch.keys() != layout.keys():
            missing = sorted(layout.keys() - batch.keys())
            unexpected = sorted(batch.keys() - layout.keys())
            raise ValueError(
                f"batch columns {sorted(batch.keys())} differ from the memory's columns "
                f"{sorted(layout.keys())} (its layout; missing: {missing}, "
                f"unexpected: {unexpected}); send every column every time"
            )
        columns: dict[str, np.ndarray] = {}
        n = -1
        first_name = ""
        for name, value in batch.items():
            array = np.asarray(value)
            if array.ndim == 0:
                raise ValueError(f"column {name!r} is a scalar; every column needs a leading row axis, shape (n, ...)")
            if n < 0:
                n, first_name = array.shape[0], name
            elif array.shape[0] != n:
                raise ValueError(
                    f"column {name!r} has {array.shape[0]} rows but column {first_name!r} has {n}; "
                    f"every column of a batch must have the same leading length"
                )
            if layout is None:
                if array.dtype.kind not in _STORABLE_KINDS:
                    raise ValueError(
                        f"column {name!r} has dtype {array.dtype}; a memory stores numbers only "
                        f"(bool, int, uint, float, complex); encode it as a numeric array"
                    )
            else:
                row_shape, dtype = layout[name]
                if array.shape[1:] != row_shape:
                    raise ValueError(
                        f"column {name!r} has row shape {array.shape[1:]} but the memory stores "
                        f"{row_shape} (its layout); send rows of that shape"
                    )
                if array.dtype != dtype:
                    if not np.can_cast(array.dtype, dtype, casting="same_kind"):
                        raise ValueError(
                            f"column {name!r} has dtype {array.dtype}, which cannot be stored as "
                            f"{dtype} (its layout) without changing its kind; "
                            f"send {dtype} values"
                        )
                    array = array.astype(dtype)
            columns[name] = array
        return Rows(columns, n, layout is not None)

    def write(self, rows: Rows) -> list[WrittenRange]:
        """Copy rows into the ring; returns the slot ranges written, in row order."""
        if rows.n == 0:
            return []  # nothing to store, and an empty batch must not fix the layout
        if self._layout is None:
            self._allocate(rows.columns)
        elif not rows.checked_against_layout:
            # Another thread's first add fixed the layout after this batch was validated.
            rows = self.conform(rows.columns)
        n, capacity = rows.n, self.capacity
        kept = min(n, capacity)
        skipped = n - kept  # a batch longer than the ring keeps only its newest rows
        start = (self._cursor + skipped) % capacity
        first = min(kept, capacity - start)
        ranges = [WrittenRange(start, start + first, skipped)]
        if kept > first:
            ranges.append(WrittenRange(0, kept - first, skipped + first))
        for name, array in rows.columns.items():
            column = self._columns[name]
            for r in ranges:
                column[r.slots] = array[r.rows]
        for r in ranges:
            self.generations[r.slots] += 1
        self._cursor = (self._cursor + n) % capacity
        self.size = min(self.size + n, capacity)
        self.total_added += n
        return ranges

    @property
    def nbytes(self) -> int:
        return sum(int(column.nbytes) for column in self._columns.values())

    def oldest_first(self) -> np.ndarray:
        """The filled slots, oldest row first."""
        if self.size < self.capacity:
            return np.arange(self.size, dtype=np.int64)
        return (np.arange(self.capacity, dtype=np.int64) + self._cursor) % self.capacity

    def state(self) -> dict[str, np.ndarray]:
        """The rows held, oldest first, as columns (copies)."""
        return self.gather(self.oldest_first())

    def restore(self, columns: Mapping[str, np.ndarray]) -> list[WrittenRange]:
        """Write saved rows (oldest first) into this empty ring, checked like any batch."""
        if self.size:
            raise ValueError("a saved memory is loaded into an empty one only")
        rows = self.conform(columns)
        if rows.n > self.capacity:
            raise ValueError(f"the saved memory holds {rows.n} rows; this one holds at most {self.capacity}")
        return self.write(rows)

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the rows at ``indices`` (fancy indexing always copies)."""
        return {name: column[indices] for name, column in self._columns.items()}

    def _allocate(self, columns: dict[str, np.ndarray]) -> None:
        self._layout = {name: (tuple(array.shape[1:]), array.dtype) for name, array in columns.items()}
        # np.empty: slots are never read before they are written (reads stay below `size`).
        self._columns = {
            name: np.empty((self.capacity, *shape), dtype=dtype) for name, (shape, dtype) in self._layout.items()
        }


def saved_rows(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any],
               kind: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A saved memory's rows (``rows/<column>``) and its other arrays, once its meta says it is a ``kind``
    memory; ValueError otherwise."""
    if meta.get("kind") != kind:
        raise ValueError(f"the saved memory is a {str(meta.get('kind'))[:40]!r} memory; this one is {kind!r}")
    rows = {k[len("rows/"):]: v for k, v in arrays.items() if k.startswith("rows/")}
    if not rows:
        raise ValueError("the saved memory holds no rows")
    return rows, {k: v for k, v in arrays.items() if not k.startswith("rows/")}


def check_batch_size(batch_size: int) -> None:
    """Refuse a batch size that cannot be sampled, with what to pass instead."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")


def empty_memory_error(kind: str) -> ValueError:
    return ValueError(
        f"cannot sample from an empty {kind}: add() at least one batch first "
        f"(a trainer usually waits until len(memory) reaches a warm-up size)"
    )


class ReplayMemory(Memory):
    """Uniform replay: every stored row is equally likely; priorities are ignored."""

    def __init__(self, capacity: int, seed: int | None = None, schema: Schema | None = None) -> None:
        self.capacity = capacity
        self._ring = ColumnRing(capacity, schema)
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def add(self, batch: Batch, priorities: np.ndarray | None = None) -> None:
        rows = self._ring.conform(batch)
        if priorities is not None and np.shape(priorities) != (rows.n,):
            raise ValueError(f"priorities has shape {np.shape(priorities)}; expected ({rows.n},), one per row")
        with self._lock:
            self._ring.write(rows)

    def sample(self, batch_size: int) -> Sample:
        check_batch_size(batch_size)
        with self._lock:
            size = self._ring.size
            if size == 0:
                raise empty_memory_error("ReplayMemory")
            indices = self._rng.integers(0, size, batch_size, dtype=np.int64)
            batch = self._ring.gather(indices)
            generations = self._ring.generations[indices]
        return Sample(batch, indices, np.ones(batch_size, dtype=np.float32), generations)

    def update_priorities(
        self, indices: np.ndarray, priorities: np.ndarray, generations: np.ndarray | None = None
    ) -> None:
        # Uniform sampling has no priorities; accepting the call lets the trainer loop stay memory-agnostic.
        return None

    def __len__(self) -> int:
        return self._ring.size

    @property
    def total_added(self) -> int:
        return self._ring.total_added

    @property
    def nbytes(self) -> int:
        return self._ring.nbytes

    @property
    def beta(self) -> float:
        return 1.0

    def state_nbytes(self) -> int:
        return self._ring.nbytes // self.capacity * len(self)

    def state_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        with self._lock:
            return {f"rows/{name}": column for name, column in self._ring.state().items()}, {"kind": "replay"}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        columns, _ = saved_rows(arrays, meta, "replay")
        with self._lock:
            self._ring.restore(columns)
