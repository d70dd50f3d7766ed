"""The BATCH payload: who sent a batch, its columns' layout, and their rows as raw buffers.

Owns: the batch head and layout bytes, the dtypes a column may have, the layouts remembered by
their bytes, and cutting and joining batches. Must never: see the frame around the payload
(``frame`` seals and opens it) or trust a byte of what it parses: every field is range-checked and
the size checked against ``rows`` exactly, and anything else is :class:`DecodeError`.

A BATCH payload is fixed binary, no JSON (decoding one is a struct unpack, a
dictionary lookup and one ``np.frombuffer`` per column)::

    head    u16 actor-id bytes | u16 layout bytes | u32 rows | u8 priorities dtype (0: none) | 3 bytes (0, unread)
            | i64 actor_index | i64 epoch | i64 seq | i64 params_version | f64 created_at
            | u64 task                                                                         (60 bytes)
    actor id (UTF-8) | layout | zero padding to a multiple of 8
    one buffer per column, in layout order, then the priorities; each rows x row bytes, padded to 8

    layout  u16 columns, then per column: u8 name bytes | name (UTF-8) | u8 dtype | u8 ndim | ndim x u32

dtypes are codes into :data:`WIRE_DTYPES` (little endian). A layout is parsed
once and remembered by its bytes, so a stream of batches of one shape pays for
it once; every message still has its fields range-checked and its size checked
against ``rows`` exactly. The :class:`BatchHeader` is the head; the trainer
checks the columns against the algorithm's :class:`~srl.base.schema.Schema`.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from srl.base.schema import Schema
from srl.runner.distribution.wire.frame import FRAME_OVERHEAD, DecodeError, short

MAX_MESSAGE_ROWS = 4096
"""most rows one batch message may carry (actors split larger batches; the trainer's size bound)"""
_MAX_ACTOR_ID = 256
_MAX_INT = 2**63 - 1
_MAX_TIME = 1e11  # seconds since the epoch; year 5138
WIRE_DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
               "float16", "float32", "float64")
"""the dtypes a batch column may have; code i + 1 on the wire is WIRE_DTYPES[i], little endian"""
_DTYPE_BY_CODE = {i + 1: np.dtype(name).newbyteorder("<") for i, name in enumerate(WIRE_DTYPES)}
_CODE_BY_NAME = {name: i + 1 for i, name in enumerate(WIRE_DTYPES)}
_CODE_BY_DTYPE = {np.dtype(name).newbyteorder("<"): i + 1 for i, name in enumerate(WIRE_DTYPES)}
"""by the dtype itself: a dtype's ``name`` takes numpy 2 µs to make, a dictionary lookup by it 0.07"""
_layouts: dict[tuple[tuple[str, np.dtype, tuple[int, ...]], ...], tuple[bytes, tuple[int, ...]]] = {}
"""the layout bytes and dtype codes encode_batch wrote for columns of these names, dtypes and row shapes"""
_BATCH_HEAD = struct.Struct("<HHIB3xqqqqdQ")
_LAYOUT_COUNT = struct.Struct("<H")
_MAX_COLUMNS = 1024
_MAX_NDIM = 32
_LAYOUT_CACHE_SIZE = 64
_CACHED_LAYOUT_BYTES = 4096
LayoutEntry = tuple[str, np.dtype, tuple[int, ...], int, int]
"""one buffer of a batch: (column name, dtype, row shape, items per row, bytes per row); name '' is the
priorities"""
_entries: dict[bytes, tuple[LayoutEntry, ...]] = {}
"""parsed layouts by their bytes and the priorities' dtype code: a batch's buffers in order"""
# Bytes a batch message needs beyond its raw buffers: frame, signature, head, the longest actor id,
# the layout's count and padding; per array its layout entry (but the name) and padding. An upper
# bound: see Codec.max_rows.
_BATCH_FIXED_OVERHEAD = FRAME_OVERHEAD + _BATCH_HEAD.size + _MAX_ACTOR_ID + _LAYOUT_COUNT.size + 7
_PER_ARRAY_OVERHEAD = 3 + 4 * _MAX_NDIM + 7


@dataclass(slots=True)
class BatchHeader:
    """Who sent a batch and where it sits in that sender's stream (not frozen: a frozen dataclass
    takes 1.2 µs to make, this 0.15 µs, and the trainer makes one per message it reads)."""

    actor_id: str
    """unique id of the actor process that sent the batch"""
    actor_index: int
    """the actor slot (0 .. actor_num-1) the sender held"""
    epoch: int
    """the trainer epoch whose params the actor was using (0 before the first params)"""
    seq: int
    """per-actor sequence number: (actor_id, seq) identifies a batch, so duplicates are recognised"""
    params_version: int
    """version of the params that produced the actions"""
    count: int
    """number of rows in the batch"""
    created_at: float
    """time.time() at the actor when the batch was closed"""
    task: int = 0
    """the id of the task the sender served (``task_tag`` of the board's task_id; 0: not said): a trainer
    drops batches of a task that its own replaced, which old actors may send until they notice"""


def task_tag(task_id: str) -> int:
    """A task id (16 hex digits, ``Board.create_task``) as the integer a batch carries (0 for none)."""
    try:
        return int(task_id, 16) if task_id else 0
    except ValueError:
        return 0


def _check_batch(count: int, columns: Mapping[str, np.ndarray], priorities: np.ndarray | None) -> str | None:
    """Why ``columns``/``priorities`` do not form a batch of ``count`` rows, or None (structure only)."""
    for name, column in columns.items():
        if not isinstance(name, str) or not name:
            return f"column names must be non-empty text, found {name!r}"
        if column.ndim == 0 or column.shape[0] != count:
            return f"column {name!r} has shape {column.shape}; expected {count} rows (the header count)"
    if priorities is not None:
        if priorities.shape != (count,) or priorities.dtype.kind != "f":
            return (
                f"priorities have shape {priorities.shape} and dtype {priorities.dtype}; "
                f"expected floats of shape ({count},)"
            )
    return None  # values (finite, in bounds, priorities >= 0) are the schema's check


def row_nbytes(columns: Mapping[str, np.ndarray], priorities: np.ndarray | None = None) -> int:
    """Raw bytes one row of this batch takes on the wire (before compression)."""
    total = 0
    for column in columns.values():
        total += column.dtype.itemsize * int(np.prod(column.shape[1:], dtype=np.int64))
    if priorities is not None:
        total += priorities.dtype.itemsize
    return total


def batch_message_bytes(schema: Schema, rows: int) -> int:
    """An upper bound on the size of one signed BATCH message of ``rows`` rows of ``schema``."""
    arrays = len(schema.columns) + (1 if schema.priorities else 0)
    overhead = _BATCH_FIXED_OVERHEAD + sum(len(n.encode()) for n in schema.columns)
    # zlib may grow incompressible rows by ~0.03% plus a few bytes (Codec.max_rows allows 0.1%)
    return overhead + arrays * _PER_ARRAY_OVERHEAD + math.ceil(rows * schema.row_nbytes * 1.001) + 64


def split_columns(
    columns: Mapping[str, np.ndarray], priorities: np.ndarray | None, max_rows: int,
    cut_before: np.ndarray | None = None,
) -> list[tuple[dict[str, np.ndarray], np.ndarray | None]]:
    """Cut a batch into consecutive chunks of at most ``max_rows`` rows (views, no copies). ``cut_before``: a
    bool per row, the only rows a chunk may begin at (frame rows: where an env's stream starts); ValueError
    when rows between two of them are more than ``max_rows``."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, found {max_rows}")
    lengths = {len(c) for c in columns.values()}
    if priorities is not None:
        lengths.add(len(priorities))
    if len(lengths) > 1:
        raise ValueError(f"columns and priorities have different lengths {sorted(lengths)}")
    count = lengths.pop() if lengths else 0
    chunks: list[tuple[dict[str, np.ndarray], np.ndarray | None]] = []
    bounds = [*range(0, count, max_rows), count]
    if cut_before is not None and count:
        starts = [*(int(i) for i in np.flatnonzero(cut_before)), count]
        if starts[0] != 0:
            raise ValueError("the first row must be one a chunk may begin at")
        bounds = [0]
        for here, following in itertools.pairwise(starts):
            if following - here > max_rows:
                raise ValueError(f"{following - here} rows must travel together (an env's frames in one batch), "
                                 f"more than the {max_rows} a message may carry; lower the actor's batch_size")
            if following - bounds[-1] > max_rows:
                bounds.append(here)
        bounds.append(count)
    for start, stop in itertools.pairwise(bounds):
        chunks.append(
            (
                {name: column[start:stop] for name, column in columns.items()},
                None if priorities is None else priorities[start:stop],
            )
        )
    return chunks


def _header_problem(header: BatchHeader) -> str | None:
    """Why ``header`` is not a batch head srl writes, or None (the same check on both ends)."""
    if (type(header.actor_index) is int and type(header.epoch) is int and type(header.seq) is int
            and type(header.params_version) is int and type(header.count) is int and type(header.task) is int
            and type(header.actor_id) is str and type(header.created_at) is float
            and 0 <= header.actor_index <= _MAX_INT and 0 <= header.epoch <= _MAX_INT and 0 <= header.seq <= _MAX_INT
            and 0 <= header.params_version <= _MAX_INT and 0 <= header.count < 2**32 and 0 <= header.task < 2**64
            and 0 <= header.created_at <= _MAX_TIME and 0 < len(header.actor_id) <= _MAX_ACTOR_ID
            and header.actor_id.isascii()):
        return None  # what every head srl writes is: the checks below name what is wrong with one that is not
    actor = header.actor_id
    try:
        size = len(actor.encode()) if isinstance(actor, str) else -1
    except UnicodeEncodeError:  # a lone surrogate
        size = -1
    if not 0 < size <= _MAX_ACTOR_ID:
        return f"batch header field 'actor_id' must be 1..{_MAX_ACTOR_ID} bytes of text, found {short(repr(actor), 60)}"
    for key in ("actor_index", "epoch", "seq", "params_version"):
        value = getattr(header, key)
        if type(value) is not int or not 0 <= value <= _MAX_INT:
            return f"batch header field {key!r} must be an integer in 0..2**63-1, found {short(repr(value), 60)}"
    if type(header.count) is not int or not 0 <= header.count < 2**32:
        return f"batch header field 'count' must be an integer in 0..2**32-1, found {short(repr(header.count), 60)}"
    created = header.created_at
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created <= _MAX_TIME:
        return f"batch header field 'created_at' must be a time in seconds, found {short(repr(created), 60)}"
    if type(header.task) is not int or not 0 <= header.task < 2**64:
        return f"batch header field 'task' must be an integer in 0..2**64-1, found {short(repr(header.task), 60)}"
    return None


def _wire_code(name: str, array: np.ndarray) -> int:
    code = _CODE_BY_DTYPE.get(array.dtype) or _CODE_BY_NAME.get(array.dtype.name)
    if code is None:
        raise TypeError(f"column {name[:80]!r} has dtype {array.dtype}; allowed: {list(WIRE_DTYPES)}")
    return code


def _padded(array: np.ndarray, code: int) -> tuple[np.ndarray, bytes]:
    """The array's bytes, little endian and C-ordered, and the zeros that pad them to a multiple of 8."""
    data = np.ascontiguousarray(array, dtype=_DTYPE_BY_CODE[code]).reshape(-1).view(np.uint8)
    return data, bytes(-len(data) % 8)


def _parse_layout(data: bytes) -> tuple[LayoutEntry, ...]:
    """The columns a batch layout describes; DecodeError for anything but what encode_batch writes."""
    try:
        (n,) = _LAYOUT_COUNT.unpack_from(data, 0)
        if not 0 < n <= _MAX_COLUMNS:
            raise DecodeError(f"batch layout names {n} columns; 1..{_MAX_COLUMNS} expected")
        entries = []
        names: set[str] = set()
        offset = _LAYOUT_COUNT.size
        for _ in range(n):
            name_len = data[offset]
            name = data[offset + 1 : offset + 1 + name_len].decode()
            if len(name.encode()) != name_len or not name or name in names:
                raise DecodeError(f"batch layout column name {short(repr(name), 60)} is empty, cut or repeated")
            offset += 1 + name_len
            code, ndim = data[offset], data[offset + 1]
            dtype = _DTYPE_BY_CODE.get(code)
            if dtype is None or ndim > _MAX_NDIM:
                raise DecodeError(f"batch column {name!r}: dtype code {code} (1..{len(WIRE_DTYPES)} known), "
                                  f"{ndim} dimensions (at most {_MAX_NDIM})")
            shape = struct.unpack_from(f"<{ndim}I", data, offset + 2)
            offset += 2 + 4 * ndim
            items = math.prod(shape)
            names.add(name)
            entries.append((name, dtype, shape, items, items * dtype.itemsize))
    except (IndexError, struct.error, UnicodeDecodeError):
        raise DecodeError("batch layout is cut short or not text where names belong") from None
    if offset != len(data):
        raise DecodeError(f"batch layout has {len(data) - offset} stray bytes after its {n} columns")
    return tuple(entries)


def _parse_entries(layout: bytes, priorities_code: int) -> tuple[LayoutEntry, ...]:
    """A batch's buffers in order: its layout's columns, then the priorities (name '') if it has them."""
    entries = _parse_layout(layout)
    if priorities_code:
        dtype = _DTYPE_BY_CODE.get(priorities_code)
        if dtype is None or dtype.kind != "f":
            raise DecodeError(f"batch priorities dtype code {priorities_code} is not a float type")
        entries += (("", dtype, (), 1, dtype.itemsize),)
    return entries


class BatchFrame(NamedTuple):
    """A checked BATCH message whose arrays are not made yet (``Codec.open_batch``)."""

    header: BatchHeader
    layout: bytes
    """the layout's bytes and the priorities' dtype code: frames with the same one join"""
    entries: tuple[LayoutEntry, ...]
    starts: tuple[int, ...]
    """each buffer's offset in ``payload``"""
    payload: bytes | memoryview

    def arrays(self, schema: Schema | None = None) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """The columns and priorities: read-only views of a copy of the payload (aligned: a view into
        the message itself starts 7 bytes in, where numpy's reductions run at half speed). With
        ``schema``, DecodeError unless they are its rows (see ``Codec.decode_batch``)."""
        count = self.header.count
        payload = bytes(self.payload) if isinstance(self.payload, memoryview) else self.payload
        columns: dict[str, np.ndarray] = {}
        for entry, start in zip(self.entries, self.starts, strict=True):
            columns[entry[0]] = _array(payload, entry, count, start, self.header)
        priorities = columns.pop("", None)
        problem = None if schema is None else schema.problem(columns, priorities)
        if problem is not None:
            raise DecodeError(f"batch from {self.header.actor_id!r} seq {self.header.seq}: {problem}")
        return columns, priorities


def _array(data: bytes | memoryview, entry: LayoutEntry, count: int, start: int, header: BatchHeader) -> np.ndarray:
    name, dtype, shape, items, _ = entry
    try:
        return np.frombuffer(data, dtype, count * items, start).reshape((count, *shape))
    except ValueError as e:  # an empty shape whose other dimensions overflow numpy's sizes
        raise DecodeError(f"batch from {header.actor_id!r} seq {header.seq}: column {name!r} of shape "
                          f"{(count, *shape)}: {e}") from None


def join_frames(frames: Sequence[BatchFrame]) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The rows of one or more frames of one layout as one block: per column, the frames' buffers
    joined in one copy (ValueError when the layouts differ or there is no frame). The same arrays as
    concatenating each frame's ``arrays()``, without making them."""
    if not frames:
        raise ValueError("join_frames needs at least one frame")
    first = frames[0]
    if any(frame.layout != first.layout for frame in frames):
        raise ValueError("batches carry different columns")
    total = sum(frame.header.count for frame in frames)
    views = [memoryview(frame.payload) for frame in frames]  # slices of a view copy nothing
    columns: dict[str, np.ndarray] = {}
    for i, entry in enumerate(first.entries):
        row_bytes = entry[4]
        joined = b"".join([view[frame.starts[i] : frame.starts[i] + frame.header.count * row_bytes]
                           for frame, view in zip(frames, views, strict=True)])
        columns[entry[0]] = _array(joined, entry, total, 0, first.header)
    priorities = columns.pop("", None)
    return columns, priorities


def batch_payload(header: BatchHeader, columns: Mapping[str, np.ndarray], priorities: np.ndarray | None) -> bytes:
    """The payload of a BATCH message (see ``Codec.encode_batch``, which frames it)."""
    problem = _check_batch(header.count, columns, priorities)
    if problem is None and priorities is not None and header.count and not (
        np.isfinite(priorities).all() and priorities.min() >= 0
    ):
        problem = "priorities must be finite and >= 0"
    if problem is None:
        problem = _header_problem(header)
    if problem is not None:
        raise ValueError(f"cannot encode batch from {header.actor_id!r}: {problem}")
    if not 0 < len(columns) <= _MAX_COLUMNS:
        raise ValueError(f"cannot encode batch from {header.actor_id!r}: 1..{_MAX_COLUMNS} columns, "
                         f"found {len(columns)}")
    layout_bytes, codes = _layout(header, columns)
    buffers: list[Any] = []
    for column, code in zip(columns.values(), codes, strict=True):
        buffers += _padded(column, code)
    priorities_code = 0
    if priorities is not None:
        priorities_code = _wire_code("priorities", priorities)
        buffers += _padded(priorities, priorities_code)
    actor = header.actor_id.encode()
    head = _BATCH_HEAD.pack(
        len(actor), len(layout_bytes), header.count, priorities_code,
        header.actor_index, header.epoch, header.seq, header.params_version, header.created_at, header.task,
    )
    size = len(head) + len(actor) + len(layout_bytes)
    return b"".join((head, actor, layout_bytes, bytes(-size % 8), *buffers))


def _layout(header: BatchHeader, columns: Mapping[str, np.ndarray]) -> tuple[bytes, tuple[int, ...]]:
    """The layout bytes of ``columns`` and each one's dtype code (remembered for the next batch alike)."""
    key = tuple((name, column.dtype, column.shape[1:]) for name, column in columns.items())
    known = _layouts.get(key)
    if known is not None:
        return known
    layout = [_LAYOUT_COUNT.pack(len(columns))]
    codes = []
    for name, column in columns.items():
        try:
            raw_name, row_shape = name.encode(), column.shape[1:]
        except UnicodeEncodeError:
            raise ValueError(f"column {name[:80]!r}: a name must be text UTF-8 can encode") from None
        if len(raw_name) > 255 or len(row_shape) > _MAX_NDIM or max(row_shape, default=0) >= 2**32:
            raise ValueError(f"column {name[:80]!r}: a name is at most 255 bytes of UTF-8, a row at most "
                             f"{_MAX_NDIM} dimensions below 2**32; found shape {column.shape}")
        code = _wire_code(name, column)
        codes.append(code)
        layout.append(struct.pack(f"<B{len(raw_name)}sBB{len(row_shape)}I", len(raw_name), raw_name, code,
                                  len(row_shape), *row_shape))
    layout_bytes = b"".join(layout)
    if len(layout_bytes) > 0xFFFF:
        raise ValueError(f"cannot encode batch from {header.actor_id!r}: its {len(columns)} columns' names and "
                         f"shapes take {len(layout_bytes)} bytes; at most 65535")
    if len(layout_bytes) <= _CACHED_LAYOUT_BYTES:
        if len(_layouts) >= _LAYOUT_CACHE_SIZE:
            _layouts.clear()
        _layouts[key] = (layout_bytes, tuple(codes))
    return layout_bytes, tuple(codes)


def read_batch(payload: bytes | memoryview) -> BatchFrame:
    """A BATCH payload checked (head, layout, every buffer's size) as a frame whose arrays are not made yet
    (see ``Codec.open_batch``, which opens the frame first)."""
    size = len(payload)
    if size < _BATCH_HEAD.size:
        raise DecodeError(f"truncated batch: {size} bytes is shorter than its {_BATCH_HEAD.size}-byte head")
    (actor_len, layout_len, count, priorities_code, actor_index, epoch, seq, params_version,
     created_at, task) = _BATCH_HEAD.unpack_from(payload, 0)
    offset = _BATCH_HEAD.size + actor_len + layout_len
    if offset > size:
        raise DecodeError(f"truncated batch: its head names {actor_len + layout_len} bytes of actor id and "
                          f"layout, {size - _BATCH_HEAD.size} follow")
    try:
        actor_id = str(payload[_BATCH_HEAD.size : _BATCH_HEAD.size + actor_len], "utf-8")
    except UnicodeDecodeError:
        raise DecodeError("batch header field 'actor_id' is not UTF-8 text") from None
    header = BatchHeader(actor_id, actor_index, epoch, seq, params_version, count, created_at, task)
    if problem := _header_problem(header):
        raise DecodeError(problem)
    layout_bytes = bytes(payload[offset - layout_len : offset])
    key = layout_bytes + bytes((priorities_code,))
    entries = _entries.get(key)
    if entries is None:
        entries = _parse_entries(layout_bytes, priorities_code)
        if len(layout_bytes) <= _CACHED_LAYOUT_BYTES:  # the cache stays small whatever is sent
            if len(_entries) >= _LAYOUT_CACHE_SIZE:
                _entries.clear()  # many layouts: not one task's actors; parse each anew
            _entries[key] = entries
    starts = []  # each buffer's offset, padded to 8
    end = offset + (-offset % 8)
    for entry in entries:
        starts.append(end)
        n = count * entry[4]
        end += n + (-n % 8)
    if end != size:
        columns = len(entries) - (1 if priorities_code else 0)
        raise DecodeError(f"batch from {actor_id!r} seq {seq}: {count} rows of its {columns} columns "
                          f"{'and priorities ' if priorities_code else ''}take {end} bytes of payload; "
                          f"the message has {size}")
    return BatchFrame(header, key, entries, tuple(starts), payload)


def rows_within(columns: Mapping[str, np.ndarray], priorities: np.ndarray | None, limit: int) -> int:
    """How many rows of a batch shaped like this fit in one message of ``limit`` bytes (see ``Codec.max_rows``)."""
    overhead = _BATCH_FIXED_OVERHEAD + sum(_PER_ARRAY_OVERHEAD + len(n.encode()) for n in columns)
    if priorities is not None:
        overhead += _PER_ARRAY_OVERHEAD
    per_row = max(1, row_nbytes(columns, priorities))
    # zlib's worst case grows incompressible data by ~0.03% plus a few bytes.
    rows = int((limit - overhead - 64) / (per_row * 1.001))
    if rows < 1:
        raise ValueError(
            f"one row of this batch needs {per_row} bytes (+{overhead} of header) but a message "
            f"may hold {limit}; raise the broker's message limit or shrink the observation"
        )
    return rows
