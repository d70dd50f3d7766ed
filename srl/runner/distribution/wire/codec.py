"""The wire format of experience batches, parameters and the signed task config.

Owns: every byte that crosses a broker or the board between an actor, the
trainer and a client — the frame, its version byte, the optional compression
(zstd; zlib is still read) and the optional HMAC-SHA256 signature. Must never: use pickle (or
anything else that runs code) on bytes read from a broker, raise anything but
:class:`DecodeError` on bad input, or allocate more than twice ``max_bytes``
while decoding one message (a decompressed payload is at most ``max_bytes``;
zlib's output pieces are joined once).

What it trusts: nothing it reads. With a shared secret (``Codec(secret=...)``
or the ``SRL_SECRET`` environment variable) every message is signed with a key
derived from the secret *and the task name*, so signed bytes are valid in one
task only; an unsigned or tampered message is refused *before* it is
decompressed or parsed. Without a secret, a message is checked for shape and
size only: anyone who can write to the broker can inject experience, but never
run code, crash the trainer or make it allocate more than the message's size.

Frame::

    b"SRLW" | u8 wire version | u8 kind | u8 flags | payload | [32-byte HMAC-SHA256]

``kind`` is :data:`KIND_BATCH` or :data:`KIND_PARAMS`; ``flags`` bit 0 means the
payload is zlib-compressed, bit 2 that it is one zstd frame that states its size
(refused unstated or past ``max_bytes`` before anything is allocated), bit 1
that the 32-byte trailer is present.

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

A PARAMS payload is an :mod:`srl.base.arrays` container (safetensors): a header
of at most 64 KiB, then buffers that cover the rest exactly. Its meta carries
epoch, version and train count; the reader checks them against what the board
says (an old signed blob written back under a newer version is refused).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import os
import struct
import sys
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import zstandard

from srl.base.arrays import ArrayFormatError, pack_arrays, unpack_arrays
from srl.base.schema import Schema

MAGIC = b"SRLW"
"""first four bytes of every srl message"""
WIRE_VERSION = 5
"""bumped whenever the frame or the batch/params layout changes incompatibly (4: the task id in a batch;
5: zstd payloads, image columns)"""
KIND_BATCH = 1
KIND_PARAMS = 2
FLAG_COMPRESSED = 0x01
FLAG_SIGNED = 0x02
FLAG_ZSTD = 0x04
_KNOWN_FLAGS = FLAG_COMPRESSED | FLAG_SIGNED | FLAG_ZSTD
COMPRESSIONS = ("zstd", "zlib")
"""what ``Codec(compression=...)`` writes; both are read"""
_KIND_NAMES = {KIND_BATCH: "BATCH", KIND_PARAMS: "PARAMS"}

_FRAME = struct.Struct("<4sBBB")
_ZSTD = threading.local()
"""each thread's zstd contexts (a context is not to be used by two threads at once)"""


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    reader: zstandard.ZstdDecompressor | None = getattr(_ZSTD, "reader", None)
    if reader is None:
        reader = _ZSTD.reader = zstandard.ZstdDecompressor()
    return reader


def _zstd_compress(payload: bytes, level: int) -> bytes:
    writers: dict[int, zstandard.ZstdCompressor] | None = getattr(_ZSTD, "writers", None)
    if writers is None:
        writers = _ZSTD.writers = {}
    writer = writers.get(level)
    if writer is None:
        writer = writers[level] = zstandard.ZstdCompressor(level=level)  # frames state their size
    out: bytes = writer.compress(payload)
    return out
SIGNATURE_BYTES = 32
SECRET_ENV = "SRL_SECRET"
SECRET_FILE_ENV = "SRL_SECRET_FILE"
DEFAULT_MAX_BYTES = 64 * 2**20
"""largest message a codec accepts unless told a tighter bound (the trainer derives one from the task)"""
MAX_MESSAGE_ROWS = 4096
"""most rows one batch message may carry (actors split larger batches; the trainer's size bound)"""
ERROR_TEXT_LIMIT = 200
"""DecodeError texts are cut to this many characters (they end up in logs and the event log)"""

_MAX_ACTOR_ID = 256
_MAX_INT = 2**63 - 1
_MAX_TIME = 1e11  # seconds since the epoch; year 5138
WIRE_DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
               "float16", "float32", "float64")
"""the dtypes a batch column may have; code i + 1 on the wire is WIRE_DTYPES[i], little endian"""
_DTYPE_BY_CODE = {i + 1: np.dtype(name).newbyteorder("<") for i, name in enumerate(WIRE_DTYPES)}
_CODE_BY_NAME = {name: i + 1 for i, name in enumerate(WIRE_DTYPES)}
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
_BATCH_FIXED_OVERHEAD = _FRAME.size + SIGNATURE_BYTES + _BATCH_HEAD.size + _MAX_ACTOR_ID + _LAYOUT_COUNT.size + 7
_PER_ARRAY_OVERHEAD = 3 + 4 * _MAX_NDIM + 7


def _srl_version() -> str:
    return str(getattr(sys.modules.get("srl"), "__version__", "unknown"))


def short(text: object, limit: int = ERROR_TEXT_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, for logs and events fed by untrusted input."""
    s = str(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


class DecodeError(ValueError):
    """The bytes are not a valid message for this srl: count it, log its source, go on.

    The text is cut to :data:`ERROR_TEXT_LIMIT` characters.
    """

    def __init__(self, message: str) -> None:
        super().__init__(short(message))


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


def load_secret(secret: bytes | str | None) -> bytes | None:
    """The shared secret: the argument, else ``$SRL_SECRET``, else the file ``$SRL_SECRET_FILE``; None when unset."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV, "")
        path = os.environ.get(SECRET_FILE_ENV, "")
        if not secret and path:
            try:
                with open(path, "rb") as f:
                    secret = f.read().strip()
            except OSError as e:
                raise ValueError(f"{SECRET_FILE_ENV}={path!r} cannot be read: {e}") from e
    if isinstance(secret, str):
        secret = secret.encode()
    return secret or None


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


PARAMS_HEADER_MARGIN = 256 * 1024
"""bytes a params message may exceed the raw size of the network's arrays by (frame, header, meta)"""


def params_message_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """An upper bound on the size of a PARAMS message carrying ``arrays`` (a node's own network)."""
    return sum(int(a.nbytes) for a in arrays.values()) + PARAMS_HEADER_MARGIN


MAX_CHECKPOINT_MEMORY_BYTES = 256 * 1024 * 1024
"""most bytes of replay memory a checkpoint on the board carries (a larger memory stays out of it)"""


def checkpoint_message_bytes(weights: Mapping[str, np.ndarray], with_memory: bool = False) -> int:
    """An upper bound on the size of a PARAMS message carrying a checkpoint of a network with ``weights``:
    the weights, a target net, two optimizer moments and meta (eight times the weights, and 1 MiB), and with
    ``with_memory`` the replay memory's rows (at most ``MAX_CHECKPOINT_MEMORY_BYTES``)."""
    return 8 * params_message_bytes(weights) + (1 << 20) + (MAX_CHECKPOINT_MEMORY_BYTES if with_memory else 0)


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
    code = _CODE_BY_NAME.get(array.dtype.name)
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


class Codec:
    """Encodes and decodes srl messages; one instance per process and task is enough (it is thread-safe).

    ``secret``: the shared HMAC key; None reads ``SRL_SECRET`` (or the file
    named by ``SRL_SECRET_FILE``; unset or empty: unsigned). With a secret,
    unsigned messages are refused; without one, signed messages are refused
    too (a half-configured deployment should fail loudly, not silently skip
    verification). ``task``: the task name bound into every signature.
    ``compress``: compress payloads with ``compression`` ("zstd" or "zlib") at
    ``compress_level`` when encoding (decoding accepts any). ``max_bytes``: the
    largest message accepted, and the largest payload a compressed message may
    expand to.
    """

    def __init__(
        self,
        secret: bytes | str | None = None,
        compress: bool = False,
        compress_level: int = 1,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        task: str = "",
        compression: str = "zstd",
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, found {compression!r}")
        if not (0 <= compress_level <= 9 if compression == "zlib" else 1 <= compress_level <= 19):
            raise ValueError(f"compress_level must be {'0..9' if compression == 'zlib' else '1..19'} "
                             f"({compression}), found {compress_level}")
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be at least 1024, found {max_bytes}")
        key = load_secret(secret)
        self.task = task
        self._mac = None
        if key is not None:
            task_key = hmac.new(key, b"srl-task\x00" + task.encode(), hashlib.sha256).digest()
            self._mac = hmac.new(task_key, digestmod=hashlib.sha256)
        self.compress = compress
        self.compression = compression
        self.compress_level = compress_level
        self.max_bytes = max_bytes

    @property
    def signed(self) -> bool:
        """Whether this codec signs what it writes and demands signatures on what it reads."""
        return self._mac is not None

    def with_max_bytes(self, max_bytes: int) -> Codec:
        """The same keys and settings with another size bound."""
        other = object.__new__(Codec)
        other.__dict__.update(self.__dict__)
        other.max_bytes = max(1024, int(max_bytes))
        return other

    # ------------------------------------------------------------------ frame

    def _seal(self, kind: int, payload: bytes) -> bytes:
        flags = 0
        if self.compress and self.compression == "zstd":
            payload = _zstd_compress(payload, self.compress_level)
            flags |= FLAG_ZSTD
        elif self.compress:
            payload = zlib.compress(payload, self.compress_level)
            flags |= FLAG_COMPRESSED
        if self._mac is not None:
            flags |= FLAG_SIGNED
        head = _FRAME.pack(MAGIC, WIRE_VERSION, kind, flags)
        if self._mac is None:
            frame = head + payload
        else:
            mac = self._mac.copy()
            mac.update(head)
            mac.update(payload)
            frame = b"".join((head, payload, mac.digest()))
        if len(frame) > self.max_bytes:
            raise ValueError(
                f"encoded {_KIND_NAMES[kind]} message is {len(frame)} bytes, over max_bytes={self.max_bytes}; "
                "split the batch (split_columns / Codec.max_rows) or raise max_bytes everywhere"
            )
        return frame

    def _open(self, data: bytes | bytearray | memoryview, kind: int) -> bytes | memoryview:
        """Check the frame and signature; the (decompressed) payload: a view of ``data`` when that is
        ``bytes`` (which nothing can change after the check), else a private copy."""
        try:
            view = memoryview(data).cast("B")
        except TypeError as e:
            raise DecodeError(f"expected bytes, found {type(data).__name__}: {e}") from None
        size = len(view)
        if size > self.max_bytes:
            raise DecodeError(f"message is {size} bytes, over max_bytes={self.max_bytes}")
        if size < _FRAME.size:
            raise DecodeError(f"truncated: {size} bytes is shorter than the {_FRAME.size}-byte frame header")
        magic, version, found_kind, flags = _FRAME.unpack_from(view, 0)
        if magic != MAGIC:
            raise DecodeError(f"not an srl message: expected magic {MAGIC!r}, found {bytes(magic)!r}")
        if version != WIRE_VERSION:
            raise DecodeError(
                f"message uses srl wire version {version}; this srl ({_srl_version()}) reads wire version "
                f"{WIRE_VERSION}; run the same srl version on every actor, trainer and client"
            )
        if found_kind != kind:
            raise DecodeError(
                f"expected a {_KIND_NAMES[kind]} message, found kind {_KIND_NAMES.get(found_kind, found_kind)}"
            )
        if flags & ~_KNOWN_FLAGS:
            raise DecodeError(f"unknown flag bits {flags:#04x} (this srl knows {_KNOWN_FLAGS:#04x})")
        end = size
        if flags & FLAG_SIGNED:
            if self._mac is None:
                raise DecodeError(
                    f"message is signed but no secret is set here; set {SECRET_ENV} (or Codec(secret=...)) "
                    "to the same value on every actor, trainer and client"
                )
            end = size - SIGNATURE_BYTES
            if end < _FRAME.size:
                raise DecodeError(f"truncated: {size} bytes cannot hold the frame header and a signature")
            mac = self._mac.copy()
            mac.update(view[:end])
            if not hmac.compare_digest(mac.digest(), view[end:]):
                raise DecodeError(
                    "bad signature: the message was tampered with, signed with another secret, "
                    "or made for another task"
                )
        elif self._mac is not None:
            raise DecodeError(
                f"unsigned message refused: a secret is set here; set {SECRET_ENV} on the sender too"
            )
        payload = view[_FRAME.size : end]
        if flags & FLAG_COMPRESSED and flags & FLAG_ZSTD:
            raise DecodeError("flags say the payload is both zlib and zstd compressed")
        if flags & FLAG_COMPRESSED:
            return self._inflate(payload)
        if flags & FLAG_ZSTD:
            return self._unzstd(payload)
        return payload if isinstance(data, bytes) else bytes(payload)

    def _inflate(self, payload: memoryview) -> bytes:
        inflater = zlib.decompressobj()
        try:
            out = inflater.decompress(payload, self.max_bytes)
        except zlib.error as e:
            raise DecodeError(f"corrupt compressed payload: {e}") from None
        if inflater.unconsumed_tail or (not inflater.eof and len(out) >= self.max_bytes):
            raise DecodeError(f"compressed payload expands past max_bytes={self.max_bytes}; refused")
        if not inflater.eof:
            raise DecodeError("truncated compressed payload")
        if inflater.unused_data:
            raise DecodeError(f"{len(inflater.unused_data)} stray bytes after the compressed payload")
        return out

    def _unzstd(self, payload: memoryview) -> bytes:
        """One zstd frame that states its size, at most ``max_bytes``: the size is checked before anything
        is allocated, and libzstd refuses a frame whose output differs from what it states."""
        try:
            size = zstandard.frame_content_size(payload)
        except zstandard.ZstdError as e:
            raise DecodeError(f"corrupt zstd payload: {short(e)}") from None
        if size < 0:
            raise DecodeError("zstd payload does not state its size; refused")
        if size > self.max_bytes:
            raise DecodeError(f"compressed payload expands to {size} bytes, past max_bytes={self.max_bytes}; refused")
        try:
            out: bytes = _zstd_decompressor().decompress(payload, max_output_size=max(size, 1), allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise DecodeError(f"corrupt zstd payload: {short(e)}") from None
        if len(out) != size:
            raise DecodeError(f"zstd payload stated {size} bytes and gave {len(out)}")
        return out

    @staticmethod
    def _unpack(payload: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        try:
            return unpack_arrays(payload)
        except ArrayFormatError as e:
            raise DecodeError(f"bad array payload: {e}") from None

    # ---------------------------------------------------------------- batches

    def encode_batch(
        self, header: BatchHeader, columns: Mapping[str, np.ndarray], priorities: np.ndarray | None
    ) -> bytes:
        """One BATCH message; ValueError if the arrays do not match ``header.count`` or a field is out of
        range, TypeError for a dtype outside :data:`WIRE_DTYPES`."""
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
        layout = [_LAYOUT_COUNT.pack(len(columns))]
        buffers: list[Any] = []
        for name, column in columns.items():
            try:
                raw_name, row_shape = name.encode(), column.shape[1:]
            except UnicodeEncodeError:
                raise ValueError(f"column {name[:80]!r}: a name must be text UTF-8 can encode") from None
            if len(raw_name) > 255 or len(row_shape) > _MAX_NDIM or max(row_shape, default=0) >= 2**32:
                raise ValueError(f"column {name[:80]!r}: a name is at most 255 bytes of UTF-8, a row at most "
                                 f"{_MAX_NDIM} dimensions below 2**32; found shape {column.shape}")
            code = _wire_code(name, column)
            layout.append(struct.pack(f"<B{len(raw_name)}sBB{len(row_shape)}I", len(raw_name), raw_name, code,
                                      len(row_shape), *row_shape))
            buffers += _padded(column, code)
        priorities_code = 0
        if priorities is not None:
            priorities_code = _wire_code("priorities", priorities)
            buffers += _padded(priorities, priorities_code)
        layout_bytes = b"".join(layout)
        if len(layout_bytes) > 0xFFFF:
            raise ValueError(f"cannot encode batch from {header.actor_id!r}: its {len(columns)} columns' names and "
                             f"shapes take {len(layout_bytes)} bytes; at most 65535")
        actor = header.actor_id.encode()
        head = _BATCH_HEAD.pack(
            len(actor), len(layout_bytes), header.count, priorities_code,
            header.actor_index, header.epoch, header.seq, header.params_version, header.created_at, header.task,
        )
        size = len(head) + len(actor) + len(layout_bytes)
        return self._seal(KIND_BATCH, b"".join((head, actor, layout_bytes, bytes(-size % 8), *buffers)))

    def decode_batch(
        self, data: bytes | bytearray | memoryview, schema: Schema | None = None
    ) -> tuple[BatchHeader, dict[str, np.ndarray], np.ndarray | None]:
        """The header, columns and priorities of a BATCH message, or DecodeError.

        With ``schema`` the columns must be exactly its columns (names, dtypes,
        row shapes, finite, within bounds), and priorities only where it allows
        them: a batch that passes can go into a buffer built from ``schema``.
        The arrays are read-only views of one private copy of the payload.
        """
        frame = self.open_batch(data)
        columns, priorities = frame.arrays(schema)
        return frame.header, columns, priorities

    def open_batch(self, data: bytes | bytearray | memoryview) -> BatchFrame:
        """A BATCH message checked as ``decode_batch`` checks it (frame, signature, head, layout, every
        buffer's size), its arrays not yet made: ``BatchFrame.arrays`` makes them, and
        ``join_frames`` makes those of many frames as one block, a copy per column instead of an
        array per column per message. DecodeError for anything but what ``encode_batch`` writes."""
        payload = self._open(data, KIND_BATCH)
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

    def max_rows(
        self, columns: Mapping[str, np.ndarray], priorities: np.ndarray | None, max_message_bytes: int
    ) -> int:
        """How many rows of a batch shaped like this fit in one message of ``max_message_bytes``.

        A conservative bound (assumes no compression gain, a long header); use
        it with :func:`split_columns` to stay under a broker's message limit.
        """
        limit = min(max_message_bytes, self.max_bytes)
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

    # ----------------------------------------------------------------- params

    def encode_params(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> bytes:
        """One PARAMS message: named tensors and a JSON-able ``meta`` (epoch, version, train_count, ...)."""
        return self._seal(KIND_PARAMS, pack_arrays(dict(arrays), dict(meta)))

    def decode_params(
        self,
        data: bytes | bytearray | memoryview,
        *,
        epoch: int | None = None,
        version: int | None = None,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(meta, arrays)`` of a PARAMS message, or DecodeError.

        ``epoch``/``version``: what the board's record says about this blob; the
        blob's own (signed) meta must say the same.
        """
        meta, arrays = self._unpack(bytes(self._open(data, KIND_PARAMS)))
        for key, expected in (("epoch", epoch), ("version", version)):
            if expected is not None and meta.get(key) != expected:
                raise DecodeError(
                    f"params blob says {key} {short(repr(meta.get(key)), 40)} but the board says {expected}: "
                    "an old blob written back, or a forged record"
                )
        return meta, arrays

    # ----------------------------------------------------------------- task config

    def config_signature(self, config_json: str) -> str:
        """Hex HMAC of the task's config JSON (bound to the task name); '' without a secret."""
        if self._mac is None:
            return ""
        mac = self._mac.copy()
        mac.update(b"srl-task-config\x00" + config_json.encode())
        return mac.hexdigest()

    def check_config_signature(self, config_json: str, signature: str) -> None:
        """Raise DecodeError unless ``signature`` is this codec's signature of ``config_json``.

        With no secret here, a signed config is refused too (the nodes and the
        client must agree on whether tasks are signed).
        """
        if self._mac is None:
            if signature:
                raise DecodeError(
                    f"the task config is signed but no secret is set on this node; set {SECRET_ENV} "
                    f"(or {SECRET_FILE_ENV}) to the client's secret"
                )
            return
        if not signature:
            raise DecodeError(
                f"unsigned task config refused: this node has a secret ({SECRET_ENV}); the client must "
                "submit with the same secret"
            )
        if not hmac.compare_digest(self.config_signature(config_json), signature):
            raise DecodeError(
                "task config signature does not match: it was changed on the board after the client "
                f"signed it, or signed with another secret: is {SECRET_ENV} the same everywhere?"
            )
