"""A safe container for named numpy arrays: JSON header, then raw buffers.

Owns: the byte layout used for parameters, saved checkpoints and (wrapped by
``srl.runner.distribution.codec``) experience batches. Must never: run code
while decoding. Only plain numeric dtypes are accepted; object arrays, and any
header that does not describe the buffer exactly, are refused.

Layout::

    b"SRLA" | u8 layout version | u32 header length (little endian) | header JSON | buffers

The header is ``{"meta": {...}, "arrays": [[name, dtype, shape, offset, nbytes], ...]}``.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

MAGIC = b"SRLA"
LAYOUT_VERSION = 1
_PREFIX = struct.Struct("<4sBI")

ALLOWED_DTYPES = frozenset(
    ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
     "float16", "float32", "float64"]
)
_LE_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES}


class ArrayFormatError(ValueError):
    """The bytes are not a valid srl array container."""


def pack_arrays(arrays: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> bytes:
    """Encode named arrays and a JSON-able ``meta`` dict."""
    entries: list[list[Any]] = []
    buffers: list[bytes] = []
    offset = 0
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        dtype = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        a = a.astype(dtype, copy=False)
        if dtype.name not in ALLOWED_DTYPES:
            raise TypeError(f"array {name!r} has dtype {dtype.name}; allowed: {sorted(ALLOWED_DTYPES)}")
        raw = a.tobytes()
        entries.append([name, dtype.name, list(a.shape), offset, len(raw)])
        buffers.append(raw)
        offset += len(raw)
    header = json.dumps({"meta": meta or {}, "arrays": entries}, separators=(",", ":")).encode()
    return b"".join([_PREFIX.pack(MAGIC, LAYOUT_VERSION, len(header)), header, *buffers])


def unpack_arrays(
    blob: bytes | memoryview, *, copy: bool = True
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Decode what :func:`pack_arrays` wrote. Raises :class:`ArrayFormatError` on anything else.

    With ``copy=False`` the arrays are read-only views into ``blob``.
    """
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise ArrayFormatError(f"{len(view)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise ArrayFormatError(f"expected magic {MAGIC!r}, found {bytes(magic)!r}")
    if version != LAYOUT_VERSION:
        raise ArrayFormatError(f"array layout version {version}; this srl reads version {LAYOUT_VERSION}")
    start = _PREFIX.size + header_len
    if start > len(view):
        raise ArrayFormatError(f"header length {header_len} runs past the end ({len(view)} bytes)")
    try:
        header = json.loads(bytes(view[_PREFIX.size : start]))
        meta = header["meta"]
        entries = header["arrays"]
        if not isinstance(meta, dict) or not isinstance(entries, list):
            raise TypeError("meta must be an object and arrays a list")
    except (ValueError, KeyError, TypeError) as e:
        raise ArrayFormatError(f"malformed header: {e}") from e
    body_len = len(view) - start
    arrays: dict[str, np.ndarray] = {}
    for entry in entries:
        try:
            name, dtype_name, shape, offset, nbytes = entry
            shape = tuple(int(s) for s in shape)
            offset, nbytes = int(offset), int(nbytes)
        except (ValueError, TypeError) as e:
            raise ArrayFormatError(f"malformed array entry {entry!r}: {e}") from e
        if not isinstance(name, str) or dtype_name not in ALLOWED_DTYPES:
            raise ArrayFormatError(f"array entry {entry!r}: name must be text and dtype one of the allowed")
        dtype = _LE_DTYPES[dtype_name]
        if any(s < 0 for s in shape) or math.prod(shape) * dtype.itemsize != nbytes:
            raise ArrayFormatError(f"array {name!r}: shape {shape} of {dtype_name} does not fill {nbytes} bytes")
        if offset < 0 or offset + nbytes > body_len:
            raise ArrayFormatError(f"array {name!r}: bytes {offset}..{offset + nbytes} run past the body")
        a = np.frombuffer(view, dtype=dtype, count=nbytes // dtype.itemsize, offset=start + offset).reshape(shape)
        arrays[name] = a.copy() if copy else a
    return meta, arrays
