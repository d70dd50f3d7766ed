"""Messages written by hand, field by field: what anyone who can write to a queue or the board can send.

Independent of the codec's encoder on purpose (it follows the wire layout in the docstrings of
``srl/runner/distribution/wire/frame.py`` and ``wire/batch.py``), so every field can lie.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Mapping

import numpy as np

from srl.runner.distribution.wire.codec import FLAG_COMPRESSED, KIND_BATCH, MAGIC, WIRE_DTYPES, WIRE_VERSION

HEAD = struct.Struct("<HHIB3xqqqqdQ")
"""a batch's head: actor-id bytes, layout bytes, rows, priorities dtype, actor_index, epoch, seq, version, time"""
CODES = {name: i + 1 for i, name in enumerate(WIRE_DTYPES)}


def frame(payload: bytes, compressed: bool = False, kind: int = KIND_BATCH) -> bytes:
    """An unsigned frame of ``kind`` around ``payload``."""
    body = zlib.compress(payload, 9) if compressed else payload
    return struct.pack("<4sBBB", MAGIC, WIRE_VERSION, kind, FLAG_COMPRESSED if compressed else 0) + body


def layout(columns: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]] | None = None) -> bytes:
    """The layout bytes describing ``columns`` (``shapes`` may claim other row shapes)."""
    parts = [struct.pack("<H", len(columns))]
    for name, column in columns.items():
        raw = name.encode()
        shape = (shapes or {}).get(name, column.shape[1:])
        parts.append(struct.pack(f"<B{len(raw)}sBB{len(shape)}I", len(raw), raw, CODES[column.dtype.name],
                                 len(shape), *shape))
    return b"".join(parts)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 8)


def forge_batch(
    columns: Mapping[str, np.ndarray],
    priorities: np.ndarray | None = None,
    *,
    actor: bytes = b"intruder",
    actor_index: int = 0,
    epoch: int = 0,
    seq: int = 0,
    params_version: int = 0,
    created_at: float | None = None,
    count: int | None = None,
    task: int = 0,
    priorities_code: int | None = None,
    layout_bytes: bytes | None = None,
    body: bytes | None = None,
    compressed: bool = False,
    framed: bool = True,
) -> bytes:
    """A batch message whose every field is the caller's choice (defaults: the truth about ``columns``)."""
    rows = len(next(iter(columns.values()))) if columns else 0
    lay = layout(columns) if layout_bytes is None else layout_bytes
    code = (0 if priorities is None else CODES[priorities.dtype.name]) if priorities_code is None else priorities_code
    head = HEAD.pack(len(actor), len(lay), rows if count is None else count, code, actor_index, epoch, seq,
                     params_version, time.time() if created_at is None else created_at, task)
    if body is None:
        arrays = [*columns.values(), *([] if priorities is None else [priorities])]
        body = b"".join(padded(np.ascontiguousarray(a).tobytes()) for a in arrays)
    payload = padded(head + actor + lay) + body
    return frame(payload, compressed) if framed else payload


def raw_container(header: dict, body: bytes, pad_to: int | None = None) -> bytes:
    """A safetensors container (a params payload) written by hand, offsets and all."""
    text = json.dumps(header).encode()
    if pad_to is not None:
        text = text + b" " * (pad_to - len(text))
    return struct.pack("<Q", len(text)) + text + body
