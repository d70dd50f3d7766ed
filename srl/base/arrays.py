"""A safe container for named numpy arrays plus a JSON meta: the safetensors format.

Owns: the byte layout of parameters and checkpoints (a params message is this
container framed by ``srl.runner.distribution.wire.codec``; experience batches have
a fixed binary layout of their own there). Must never: run code
while decoding, or allocate more than the bytes it was given.

Why safetensors: its parser (Rust) refuses overlapping, non-contiguous and
out-of-range offsets, a header that does not describe the buffer exactly, and
shapes whose size overflows; so decoding allocates at most the size of the
input. A checkpoint is a plain ``.safetensors`` file that other tools open.
srl's meta travels as one JSON string under the ``"srl"`` key of
``__metadata__`` (safetensors metadata is text to text).

What this module adds: a cap on the header (``max_header_bytes``, checked
before anything is parsed), plain numeric dtypes only, and one error type,
:class:`ArrayFormatError`, for whatever is wrong with the bytes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from srl.base.files import write_whole

MAX_HEADER_BYTES = 64 * 1024
"""largest safetensors header (names, dtypes, shapes, offsets and the JSON meta) accepted"""
META_KEY = "srl"

_HEADER_LEN = struct.Struct("<Q")
# safetensors dtype code -> numpy (little endian); BF16 and FP8 have no numpy dtype and are refused.
_DTYPES: dict[str, np.dtype] = {
    code: np.dtype(name).newbyteorder("<")
    for code, name in {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
        "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "F32": "float32", "F64": "float64",
    }.items()
}
ALLOWED_DTYPES = frozenset(d.name for d in _DTYPES.values())


class ArrayFormatError(ValueError):
    """The bytes are not a valid srl array container."""


def pack_arrays(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> bytes:
    """Encode named arrays and a JSON-able ``meta``; TypeError for a dtype outside the allowed set."""
    for name, array in arrays.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise TypeError(f"array names are non-empty text (not '__metadata__'), got {name!r}")
        if np.asarray(array).dtype.name not in ALLOWED_DTYPES:
            raise TypeError(f"array {name!r} has dtype {np.asarray(array).dtype}; allowed: {sorted(ALLOWED_DTYPES)}")
    meta_json = json.dumps(dict(meta or {}), separators=(",", ":"), allow_nan=False)
    # ascontiguousarray turns a 0-d array into shape (1,): keep each array's own shape
    contiguous = {name: np.ascontiguousarray(array).reshape(np.shape(array)) for name, array in arrays.items()}
    data: bytes = safetensors.numpy.save(contiguous, metadata={META_KEY: meta_json})
    return data


def unpack_arrays(
    blob: bytes | bytearray | memoryview, *, max_header_bytes: int = MAX_HEADER_BYTES
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Decode what :func:`pack_arrays` wrote: ``(meta, arrays)``; :class:`ArrayFormatError` on anything else.

    The arrays are writable copies (they do not keep ``blob`` alive).
    """
    data = blob if isinstance(blob, bytes) else bytes(blob)
    if len(data) < _HEADER_LEN.size:
        raise ArrayFormatError(f"{len(data)} bytes is shorter than the {_HEADER_LEN.size}-byte length prefix")
    (header_len,) = _HEADER_LEN.unpack_from(data, 0)
    if header_len > max_header_bytes:
        raise ArrayFormatError(f"header of {header_len} bytes is over the {max_header_bytes}-byte limit")
    if _HEADER_LEN.size + header_len > len(data):
        raise ArrayFormatError(f"header of {header_len} bytes runs past the end ({len(data)} bytes)")
    try:
        tensors = safetensors.deserialize(data)
        # The header is valid JSON now (the Rust parser checked it, nesting included).
        header = json.loads(data[_HEADER_LEN.size : _HEADER_LEN.size + header_len])
        meta_json = (header.get("__metadata__") or {}).get(META_KEY, "{}")
        meta = json.loads(meta_json)
    except (safetensors.SafetensorError, ValueError, TypeError, AttributeError, RecursionError) as e:
        raise ArrayFormatError(f"malformed container: {str(e)[:200]}") from None
    if not isinstance(meta, dict):
        raise ArrayFormatError(f"meta must be a JSON object, found {type(meta).__name__}")
    arrays: dict[str, np.ndarray] = {}
    for name, info in tensors:
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ArrayFormatError(f"array {name!r} has dtype {info['dtype']}; allowed: {sorted(_DTYPES)}")
        # safetensors (0.4 on) hands each tensor over as a bytearray of its own: the array is writable and
        # keeps only that alive. Its stub says bytes, over which an array would be read-only: copied then.
        data = info["data"]
        buffer = data if isinstance(data, bytearray) else bytearray(data)
        arrays[name] = np.frombuffer(buffer, dtype=dtype).reshape(info["shape"])
    return meta, arrays


def save_arrays(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """Write a ``.safetensors`` file whole and durably: a crash or a power loss leaves the old file or the new
    one, never half; a full disk raises OSError naming ``path`` and leaves the old one and nothing beside it."""
    write_whole(path, [pack_arrays(arrays, meta)], durable=True)


def load_arrays(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a file written by :func:`save_arrays`; ArrayFormatError if it is not one."""
    return unpack_arrays(Path(path).read_bytes(), max_header_bytes=16 * MAX_HEADER_BYTES)
