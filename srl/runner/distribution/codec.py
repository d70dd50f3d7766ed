"""The wire format of experience batches, parameters and the signed task config.

Owns: every byte that crosses a broker or the board between an actor, the
trainer and a client — the frame, its version byte, the optional zlib
compression and the optional HMAC-SHA256 signature. Must never: use pickle (or
anything else that runs code) on bytes read from a broker, raise anything but
:class:`DecodeError` on bad input, or allocate more than ``max_bytes`` while
decoding one message.

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
payload is zlib-compressed, bit 1 means the 32-byte trailer is present. The
payload is an :mod:`srl.base.arrays` container (safetensors): a header of at
most 64 KiB, then buffers that cover the rest exactly.

A batch's arrays are its columns (named ``"c:" + column``) and, optionally, the
initial priorities (``"p"``); its meta is the :class:`BatchHeader`. The trainer
checks them against the algorithm's :class:`~srl.base.schema.Schema`.
A params message's meta carries epoch, version and train count; the reader
checks them against what the board says (an old signed blob written back under
a newer version is refused).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from srl.base.arrays import ArrayFormatError, pack_arrays, unpack_arrays
from srl.base.schema import Schema

MAGIC = b"SRLW"
"""first four bytes of every srl message"""
WIRE_VERSION = 2
"""bumped whenever the frame or the batch/params layout changes incompatibly"""
KIND_BATCH = 1
KIND_PARAMS = 2
FLAG_COMPRESSED = 0x01
FLAG_SIGNED = 0x02
_KNOWN_FLAGS = FLAG_COMPRESSED | FLAG_SIGNED
_KIND_NAMES = {KIND_BATCH: "BATCH", KIND_PARAMS: "PARAMS"}

_FRAME = struct.Struct("<4sBBB")
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
_COLUMN_PREFIX = "c:"
_PRIORITIES = "p"
# Bytes a batch message needs beyond its raw buffers: frame, signature, the safetensors
# header (names, dtypes, shapes, offsets) and the JSON meta. Generous: see Codec.max_rows.
_BATCH_FIXED_OVERHEAD = _FRAME.size + SIGNATURE_BYTES + 8 + 600
_PER_ARRAY_OVERHEAD = 112


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


@dataclass(frozen=True)
class BatchHeader:
    """Who sent a batch and where it sits in that sender's stream."""

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


def _int_field(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise DecodeError(
            f"batch header field {key!r} must be an integer in 0..2**63-1, found {short(repr(value), 60)}"
        )
    return value


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
    overhead = _BATCH_FIXED_OVERHEAD + sum(_PER_ARRAY_OVERHEAD + len(n) for n in schema.columns)
    return overhead + arrays * _PER_ARRAY_OVERHEAD + rows * schema.row_nbytes + 64


PARAMS_HEADER_MARGIN = 256 * 1024
"""bytes a params message may exceed the raw size of the network's arrays by (frame, header, meta)"""


def params_message_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """An upper bound on the size of a PARAMS message carrying ``arrays`` (a node's own network)."""
    return sum(int(a.nbytes) for a in arrays.values()) + PARAMS_HEADER_MARGIN


def split_columns(
    columns: Mapping[str, np.ndarray], priorities: np.ndarray | None, max_rows: int
) -> list[tuple[dict[str, np.ndarray], np.ndarray | None]]:
    """Cut a batch into consecutive chunks of at most ``max_rows`` rows (views, no copies)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, found {max_rows}")
    lengths = {len(c) for c in columns.values()}
    if priorities is not None:
        lengths.add(len(priorities))
    if len(lengths) > 1:
        raise ValueError(f"columns and priorities have different lengths {sorted(lengths)}")
    count = lengths.pop() if lengths else 0
    chunks: list[tuple[dict[str, np.ndarray], np.ndarray | None]] = []
    for start in range(0, count, max_rows):
        stop = start + max_rows
        chunks.append(
            (
                {name: column[start:stop] for name, column in columns.items()},
                None if priorities is None else priorities[start:stop],
            )
        )
    return chunks


class Codec:
    """Encodes and decodes srl messages; one instance per process and task is enough (it is thread-safe).

    ``secret``: the shared HMAC key; None reads ``SRL_SECRET`` (or the file
    named by ``SRL_SECRET_FILE``; unset or empty: unsigned). With a secret,
    unsigned messages are refused; without one, signed messages are refused
    too (a half-configured deployment should fail loudly, not silently skip
    verification). ``task``: the task name bound into every signature.
    ``compress``: zlib-compress payloads at ``compress_level`` when encoding
    (decoding accepts either). ``max_bytes``: the largest message accepted,
    and the largest payload a compressed message may expand to.
    """

    def __init__(
        self,
        secret: bytes | str | None = None,
        compress: bool = False,
        compress_level: int = 1,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        task: str = "",
    ) -> None:
        if not 0 <= compress_level <= 9:
            raise ValueError(f"compress_level must be 0..9 (zlib), found {compress_level}")
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be at least 1024, found {max_bytes}")
        key = load_secret(secret)
        self.task = task
        self._mac = None
        if key is not None:
            task_key = hmac.new(key, b"srl-task\x00" + task.encode(), hashlib.sha256).digest()
            self._mac = hmac.new(task_key, digestmod=hashlib.sha256)
        self.compress = compress
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
        if self.compress:
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

    def _open(self, data: bytes | bytearray | memoryview, kind: int) -> bytes:
        """Check the frame and signature; the (decompressed) payload."""
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
        if flags & FLAG_COMPRESSED:
            return self._inflate(payload)
        return bytes(payload)

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
        """One BATCH message; raises ValueError if the arrays do not match ``header.count``."""
        problem = _check_batch(header.count, columns, priorities)
        if problem is None and priorities is not None and header.count and not (
            np.isfinite(priorities).all() and priorities.min() >= 0
        ):
            problem = "priorities must be finite and >= 0"
        if problem is not None:
            raise ValueError(f"cannot encode batch from {header.actor_id!r}: {problem}")
        arrays = {_COLUMN_PREFIX + name: column for name, column in columns.items()}
        if priorities is not None:
            arrays[_PRIORITIES] = priorities
        meta = {
            "actor_id": header.actor_id,
            "actor_index": header.actor_index,
            "epoch": header.epoch,
            "seq": header.seq,
            "params_version": header.params_version,
            "count": header.count,
            "created_at": header.created_at,
        }
        return self._seal(KIND_BATCH, pack_arrays(arrays, meta))

    def decode_batch(
        self, data: bytes | bytearray | memoryview, schema: Schema | None = None
    ) -> tuple[BatchHeader, dict[str, np.ndarray], np.ndarray | None]:
        """The header, columns and priorities of a BATCH message, or DecodeError.

        With ``schema`` the columns must be exactly its columns (names, dtypes,
        row shapes, finite, within bounds), and priorities only where it allows
        them: a batch that passes can go into a buffer built from ``schema``.
        """
        meta, arrays = self._unpack(self._open(data, KIND_BATCH))
        actor_id = meta.get("actor_id")
        created_at = meta.get("created_at")
        if not isinstance(actor_id, str) or not 0 < len(actor_id) <= _MAX_ACTOR_ID:
            raise DecodeError(
                f"batch header field 'actor_id' must be 1..{_MAX_ACTOR_ID} characters, "
                f"found {short(repr(actor_id), 60)}"
            )
        # An int is range-checked before any float conversion (10**400 overflows float()).
        if isinstance(created_at, bool) or not (
            (isinstance(created_at, int) and 0 <= created_at <= _MAX_TIME)
            or (isinstance(created_at, float) and 0.0 <= created_at <= _MAX_TIME)
        ):
            raise DecodeError(
                f"batch header field 'created_at' must be a time in seconds, found {short(repr(created_at), 60)}"
            )
        header = BatchHeader(
            actor_id=actor_id,
            actor_index=_int_field(meta, "actor_index"),
            epoch=_int_field(meta, "epoch"),
            seq=_int_field(meta, "seq"),
            params_version=_int_field(meta, "params_version"),
            count=_int_field(meta, "count"),
            created_at=float(created_at),
        )
        priorities = arrays.pop(_PRIORITIES, None)
        columns: dict[str, np.ndarray] = {}
        for name, array in arrays.items():
            if not name.startswith(_COLUMN_PREFIX):
                raise DecodeError(f"unexpected array {name!r} in a batch")
            columns[name[len(_COLUMN_PREFIX) :]] = array
        problem = _check_batch(header.count, columns, priorities)
        if problem is None and schema is not None:
            problem = schema.problem(columns, priorities)
        if problem is not None:
            raise DecodeError(f"batch from {header.actor_id!r} seq {header.seq}: {problem}")
        return header, columns, priorities

    def max_rows(
        self, columns: Mapping[str, np.ndarray], priorities: np.ndarray | None, max_message_bytes: int
    ) -> int:
        """How many rows of a batch shaped like this fit in one message of ``max_message_bytes``.

        A conservative bound (assumes no compression gain, a long header); use
        it with :func:`split_columns` to stay under a broker's message limit.
        """
        limit = min(max_message_bytes, self.max_bytes)
        overhead = _BATCH_FIXED_OVERHEAD + sum(_PER_ARRAY_OVERHEAD + len(n) for n in columns)
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
        meta, arrays = self._unpack(self._open(data, KIND_PARAMS))
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
                "signed it, or signed with another secret"
            )
