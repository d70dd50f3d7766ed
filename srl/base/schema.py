"""The columns an algorithm's worker emits: names, dtypes, row shapes and value bounds.

Owns: ``Column`` and ``Schema``, declared by each algorithm for an env spec
(``RLConfig.schema``). The same declaration sizes the trainer's buffer before
any experience arrives and is what the codec checks every incoming batch
against, so a batch that does not fit is refused before it reaches memory.
Must never: trust a batch's own description of itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from srl.base.arrays import ALLOWED_DTYPES


@dataclass(frozen=True)
class Column:
    """One column: every row has ``shape`` and ``dtype``; values lie in ``[low, high]``."""

    dtype: str
    """numpy dtype name: "float32", "int64", "bool", ..."""
    shape: tuple[int, ...] = ()
    """shape of one row (a transition's obs: (obs_dim,); a segment's obs: (T, obs_dim))"""
    low: float | None = None
    """smallest allowed value (None: no bound; float columns must be finite either way)"""
    high: float | None = None
    """largest allowed value (None: no bound)"""

    def __post_init__(self) -> None:
        if self.dtype not in ALLOWED_DTYPES:
            raise ValueError(f"column dtype {self.dtype!r} is not one of {sorted(ALLOWED_DTYPES)}")
        if any(not isinstance(s, int) or s < 0 for s in self.shape):
            raise ValueError(f"column row shape {self.shape!r} must be non-negative ints")

    @property
    def row_nbytes(self) -> int:
        return np.dtype(self.dtype).itemsize * math.prod(self.shape)


def _dtype_bounds_hold(column: Column) -> bool:
    """Whether every value of an integer or bool ``column``'s dtype lies within its bounds."""
    dtype = np.dtype(column.dtype)
    if dtype.kind == "b":
        low_of, high_of = 0, 1
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        low_of, high_of = int(info.min), int(info.max)
    else:
        return False
    return (column.low is None or column.low <= low_of) and (column.high is None or column.high >= high_of)


@dataclass(frozen=True)
class Schema:
    """The columns of one kind of row, and whether rows may carry initial priorities."""

    columns: Mapping[str, Column]
    priorities: bool = False
    """batches may carry one initial priority (|TD error| >= 0) per row"""
    counted_by: str | None = None
    """a bool column: only its true rows count as rows received (frame rows: the transitions among them);
    None: every row counts"""
    split_at: str | None = None
    """a bool column: a batch may be cut into messages only before its true rows (frame rows: where an env's
    stream starts); None: anywhere"""
    check: Callable[[Mapping[str, np.ndarray]], str | None] | None = field(default=None, compare=False)
    """a check of the rows as a whole after the columns passed theirs (frame rows: every reference inside
    the batch); the reason they do not hold, or None"""
    names: tuple[str, ...] = field(init=False)
    _dtypes: Mapping[str, np.dtype] = field(init=False, repr=False, compare=False)
    _unbounded: Mapping[str, bool] = field(init=False, repr=False, compare=False)
    """per column: its dtype alone keeps every value within its bounds (uint8 in 0..255): nothing to check"""

    def __post_init__(self) -> None:
        if not self.columns:
            raise ValueError("a schema needs at least one column")
        object.__setattr__(self, "names", tuple(sorted(self.columns)))
        object.__setattr__(self, "_dtypes", {name: np.dtype(c.dtype) for name, c in self.columns.items()})
        object.__setattr__(self, "_unbounded", {name: _dtype_bounds_hold(c) for name, c in self.columns.items()})

    @property
    def row_nbytes(self) -> int:
        """Bytes one row takes (priorities included when declared)."""
        return sum(c.row_nbytes for c in self.columns.values()) + (4 if self.priorities else 0)

    def counted(self, columns: Mapping[str, np.ndarray]) -> int:
        """How many of these rows count as rows received (see ``counted_by``)."""
        if self.counted_by is None:
            return len(next(iter(columns.values())))
        return int(np.count_nonzero(columns[self.counted_by]))

    @property
    def has_images(self) -> bool:
        """Whether a column holds images (uint8 or bool rows of 1 KiB and more): what compresses well."""
        return any(c.dtype in ("uint8", "bool") and c.row_nbytes >= 1024 for c in self.columns.values())

    def allocate(self, rows: int) -> dict[str, np.ndarray]:
        """Storage for ``rows`` rows of every column (what a buffer holds)."""
        return {name: np.zeros((rows, *c.shape), dtype=c.dtype) for name, c in self.columns.items()}

    def problem(self, columns: Mapping[str, np.ndarray], priorities: np.ndarray | None = None) -> str | None:
        """Why ``columns`` (and ``priorities``) are not rows of this schema, or None when they are.

        Checks the exact set of names, each dtype and row shape, one row count for
        all, finite floats, and the declared bounds.
        """
        if columns.keys() != self.columns.keys():
            missing = sorted(self.columns.keys() - columns.keys())
            unexpected = sorted(columns.keys() - self.columns.keys())
            return f"columns {sorted(columns)[:8]} are not the expected {list(self.names)} " \
                   f"(missing {missing}, unexpected {unexpected[:8]})"
        count = -1
        for name, column in self.columns.items():
            array = columns[name]
            if not isinstance(array, np.ndarray):
                return f"column {name!r} is a {type(array).__name__}, not an array"
            if array.dtype != self._dtypes[name]:
                return f"column {name!r} has dtype {array.dtype.name}, expected {column.dtype}"
            if array.shape[1:] != column.shape or array.ndim != 1 + len(column.shape):
                return f"column {name!r} has shape {array.shape}, expected (rows, {', '.join(map(str, column.shape))})"
            if count < 0:
                count = array.shape[0]
            elif array.shape[0] != count:
                return f"column {name!r} has {array.shape[0]} rows, other columns {count}"
            if array.size == 0:
                continue
            is_float = array.dtype.kind == "f"
            if not is_float and self._unbounded[name]:
                continue
            # min and max carry a NaN or an infinity through: two reductions check finiteness and bounds
            low, high = array.min(), array.max()
            if is_float and not (math.isfinite(low) and math.isfinite(high)):
                return f"column {name!r} holds NaN or infinite values"
            if column.low is not None and low < column.low:
                return f"column {name!r} holds {low!r}, below its lower bound {column.low}"
            if column.high is not None and high > column.high:
                return f"column {name!r} holds {high!r}, above its upper bound {column.high}"
        if priorities is not None:
            if not self.priorities:
                return "priorities sent, but this algorithm's rows carry none"
            if priorities.dtype.kind != "f" or priorities.shape != (count,):
                return (f"priorities have shape {priorities.shape} and dtype {priorities.dtype}; "
                        f"expected ({count},) floats")
            # a NaN or +inf makes the max non-finite; the min catches what is below zero (-inf too)
            if count and not (math.isfinite(priorities.max()) and priorities.min() >= 0):
                return "priorities must be finite and >= 0"
        if self.check is not None:
            return self.check(columns)
        return None
