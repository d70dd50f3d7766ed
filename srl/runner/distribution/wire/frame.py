"""The frame around every srl message: magic, wire version, kind, flags, compression, signature.

Owns: the frame's bytes, the optional compression (zstd; zlib is still read), the optional
HMAC-SHA256 signature and the size bound, and :class:`DecodeError`. Must never: look inside a
payload (``batch`` and ``codec`` do), decompress or parse anything before its signature is checked,
or allocate more than twice ``max_bytes`` while opening one message (a decompressed payload is at
most ``max_bytes``; zlib's output pieces are joined once).

Frame::

    b"SRLW" | u8 wire version | u8 kind | u8 flags | payload | [32-byte HMAC-SHA256]

``kind`` is :data:`KIND_BATCH` or :data:`KIND_PARAMS`; ``flags`` bit 0 means the
payload is zlib-compressed, bit 2 that it is one zstd frame that states its size
(refused unstated or past ``max_bytes`` before anything is allocated), bit 1
that the 32-byte trailer is present.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import sys
import threading
import zlib

import zstandard

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
SIGNATURE_BYTES = 32
SECRET_ENV = "SRL_SECRET"
SECRET_FILE_ENV = "SRL_SECRET_FILE"
DEFAULT_MAX_BYTES = 64 * 2**20
"""largest message a codec accepts unless told a tighter bound (the trainer derives one from the task)"""
ERROR_TEXT_LIMIT = 200
"""DecodeError texts are cut to this many characters (they end up in logs and the event log)"""
FRAME_OVERHEAD = _FRAME.size + SIGNATURE_BYTES
"""bytes a frame adds to its payload at most (head and signature), compression aside"""
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


class Framer:
    """Seals payloads into frames and opens frames back into payloads (see the module docstring);
    :class:`~srl.runner.distribution.wire.codec.Codec` builds on it and documents its arguments."""

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
