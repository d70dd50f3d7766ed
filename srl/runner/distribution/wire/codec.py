"""The wire format of experience batches, parameters and the signed task config.

Owns: every byte that crosses a broker or the board between an actor, the
trainer and a client, through :class:`Codec`: the frame around each message
(``frame``: magic, version byte, compression, HMAC), the BATCH payload
(``batch``), the PARAMS payload and the task config's signature (here). Must
never: use pickle (or anything else that runs code) on bytes read from a
broker, or raise anything but :class:`DecodeError` on bad input.

What it trusts: nothing it reads. With a shared secret (``Codec(secret=...)``
or the ``SRL_SECRET`` environment variable) every message is signed with a key
derived from the secret *and the task name*, so signed bytes are valid in one
task only; an unsigned or tampered message is refused *before* it is
decompressed or parsed. Without a secret, a message is checked for shape and
size only: anyone who can write to the broker can inject experience, but never
run code, crash the trainer or make it allocate more than the message's size.

A PARAMS payload is an :mod:`srl.base.arrays` container (safetensors): a header
of at most 64 KiB, then buffers that cover the rest exactly. Its meta carries
epoch, version and train count; the reader checks them against what the board
says (an old signed blob written back under a newer version is refused).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

import numpy as np

from srl.base.arrays import ArrayFormatError, pack_arrays, unpack_arrays
from srl.base.schema import Schema
from srl.runner.distribution.wire.batch import (
    MAX_MESSAGE_ROWS,
    WIRE_DTYPES,
    BatchFrame,
    BatchHeader,
    LayoutEntry,
    batch_message_bytes,
    batch_payload,
    join_frames,
    read_batch,
    row_nbytes,
    rows_within,
    split_columns,
    task_tag,
)
from srl.runner.distribution.wire.frame import (
    COMPRESSIONS,
    DEFAULT_MAX_BYTES,
    ERROR_TEXT_LIMIT,
    FLAG_COMPRESSED,
    FLAG_SIGNED,
    FLAG_ZSTD,
    KIND_BATCH,
    KIND_PARAMS,
    MAGIC,
    SECRET_ENV,
    SECRET_FILE_ENV,
    SIGNATURE_BYTES,
    WIRE_VERSION,
    DecodeError,
    Framer,
    load_secret,
    short,
)

# the names srl, tests and benches read from this module, wherever they are defined
__all__ = [
    "COMPRESSIONS",
    "DEFAULT_MAX_BYTES",
    "ERROR_TEXT_LIMIT",
    "FLAG_COMPRESSED",
    "FLAG_SIGNED",
    "FLAG_ZSTD",
    "KIND_BATCH",
    "KIND_PARAMS",
    "MAGIC",
    "MAX_CHECKPOINT_MEMORY_BYTES",
    "MAX_MESSAGE_ROWS",
    "PARAMS_HEADER_MARGIN",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "SIGNATURE_BYTES",
    "WIRE_DTYPES",
    "WIRE_VERSION",
    "BatchFrame",
    "BatchHeader",
    "Codec",
    "DecodeError",
    "LayoutEntry",
    "batch_message_bytes",
    "checkpoint_message_bytes",
    "join_frames",
    "load_secret",
    "params_message_bytes",
    "row_nbytes",
    "short",
    "split_columns",
    "task_tag",
]

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


class Codec(Framer):
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

    def with_max_bytes(self, max_bytes: int) -> Codec:
        """The same keys and settings with another size bound."""
        other = object.__new__(Codec)
        other.__dict__.update(self.__dict__)
        other.max_bytes = max(1024, int(max_bytes))
        return other

    # ---------------------------------------------------------------- batches

    def encode_batch(
        self, header: BatchHeader, columns: Mapping[str, np.ndarray], priorities: np.ndarray | None
    ) -> bytes:
        """One BATCH message; ValueError if the arrays do not match ``header.count`` or a field is out of
        range, TypeError for a dtype outside :data:`WIRE_DTYPES`."""
        return self._seal(KIND_BATCH, batch_payload(header, columns, priorities))

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
        return read_batch(self._open(data, KIND_BATCH))

    def max_rows(
        self, columns: Mapping[str, np.ndarray], priorities: np.ndarray | None, max_message_bytes: int
    ) -> int:
        """How many rows of a batch shaped like this fit in one message of ``max_message_bytes``.

        A conservative bound (assumes no compression gain, a long header); use
        it with :func:`split_columns` to stay under a broker's message limit.
        """
        limit = min(max_message_bytes, self.max_bytes)
        return rows_within(columns, priorities, limit)

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

    @staticmethod
    def _unpack(payload: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        try:
            return unpack_arrays(payload)
        except ArrayFormatError as e:
            raise DecodeError(f"bad array payload: {e}") from None

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
