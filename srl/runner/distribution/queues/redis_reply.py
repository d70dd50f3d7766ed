"""What a Redis Streams consumer keeps of a reply: a bounded parse, and an entry's payload or why not.

Owns: :class:`BoundedReplyParser` (the RESP2 parser a consumer's connection reads with, which drops a
payload over the read limit, extra fields and over-long arrays as it reads them off the socket), the
field srl writes a payload under, and :func:`entry_payload` (an entry's fields to its payload, or the
refusal the consumer hands out). Must never: keep more of a reply than its limits allow, or hold a
connection or an opinion about streams beyond one entry's shape.
"""

from __future__ import annotations

import io
from typing import Any

import redis
from redis._parsers.resp2 import _RESP2Parser
from redis._parsers.socket import SENTINEL, SERVER_CLOSED_CONNECTION_ERROR

FIELD = b"d"
"""the one field of an entry srl writes: its payload"""
# A read keeps an entry's id and field name beside its payload: the bytes allowed past the read limit
ENTRY_SLACK = 4096
# Longest array a consumer's reply keeps: entries of one read (get_many reads at most this many),
# an entry's fields (srl writes one), group members
MAX_ARRAY = 4096
_COMPACT_AT = 1 << 20


class Unread:
    """What a bounded reply holds in place of a bulk string or array it did not keep: its size
    (bytes of a string, elements of an array), the bytes read off the socket and dropped."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __repr__(self) -> str:
        return f"Unread({self.size})"


class BoundedReplyParser(_RESP2Parser):
    """redis-py's RESP2 parser that keeps a reply's size bounded whatever the server holds.

    Within one array, bulk strings are kept while their bytes total at most ``max_kept``; a string
    that would go over it, and an array of more than ``max_array`` elements, are read off the
    socket a chunk at a time, dropped, and replaced by ``Unread(size)``. A stream entry is
    ``[id, [field, value, ...]]``, so a read of ``count`` entries keeps at most ``count *
    max_kept`` bytes of payload, however large or many-fielded an entry another writer put: the
    bound the consumer needs without a script, which copies every payload into Lua and back (307
    µs of Redis time a read of 16 entries of 15.5 KB, against 15.5 µs for the plain XREADGROUP).
    Subclassed per queue with its limits (``bounded_parser``).
    """

    max_kept: int = 2**62
    max_array: int = 2**62

    def _read_response(self, disable_decoding: bool = False, timeout: Any = SENTINEL,
                       budget: list[int] | None = None) -> Any:
        buffer = self._buffer
        assert buffer is not None
        kind, rest = self._header(timeout)
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            budget = budget if budget is not None else [self.max_kept]
            if length > budget[0]:
                self._drop(length + 2, timeout)
                return Unread(length)
            budget[0] -= length
            data = buffer.read(length, timeout=timeout)
            return self._decoded(data, disable_decoding)
        if kind == b"*":
            n = int(rest)
            if n < 0:
                return None
            if n > self.max_array:
                for _ in range(n):
                    self._skip(timeout)
                return Unread(n)
            inner = [self.max_kept]
            return [self._read_response(disable_decoding, timeout, inner) for _ in range(n)]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return self._decoded(rest, disable_decoding)
        if kind == b"-":
            error = self.parse_error(rest.decode("utf-8", errors="replace"))
            if isinstance(error, redis.ConnectionError):
                raise error
            return error
        raise redis.exceptions.InvalidResponse(f"Protocol Error: {kind + rest!r}")

    def _decoded(self, data: bytes, disable_decoding: bool) -> Any:
        return data if disable_decoding or self.encoder is None else self.encoder.decode(data)

    def _header(self, timeout: Any) -> tuple[bytes, bytes]:
        """The next reply element's type byte and the rest of its first line."""
        assert self._buffer is not None
        raw = self._buffer.readline(timeout=timeout)
        if not raw:
            raise redis.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
        return raw[:1], raw[1:]

    def _skip(self, timeout: Any) -> None:
        """Read one reply element off the socket and keep none of it."""
        self._compact()
        kind, rest = self._header(timeout)
        if kind == b"$" and int(rest) >= 0:
            self._drop(int(rest) + 2, timeout)
        elif kind == b"*":
            for _ in range(max(0, int(rest))):
                self._skip(timeout)

    def _drop(self, nbytes: int, timeout: Any) -> None:
        """Consume ``nbytes`` of the reply, first what is buffered, then the socket a chunk at a time."""
        buffer = self._buffer
        assert buffer is not None
        held = min(nbytes, buffer.unread_bytes())
        buffer._buffer.seek(held, io.SEEK_CUR)
        nbytes -= held
        sock = buffer._sock
        if nbytes and timeout is not SENTINEL:
            sock.settimeout(timeout)
        try:
            scratch = memoryview(bytearray(min(nbytes, 1 << 16))) if nbytes else memoryview(b"")
            while nbytes > 0:
                got = sock.recv_into(scratch, min(nbytes, len(scratch)))
                if not got:
                    raise redis.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                nbytes -= got
        except TimeoutError as e:  # socket.timeout
            raise redis.TimeoutError("Timeout reading from socket") from e
        finally:
            if timeout is not SENTINEL:
                sock.settimeout(buffer.socket_timeout)
        self._compact()

    def _compact(self) -> None:
        """Let go of the reply's bytes already parsed once they pass 1 MiB: redis-py keeps a whole
        reply in its buffer until the reply ends, and each socket read brings up to 64 KB, so the
        parts dropped would otherwise pile up there (an entry of thousands of 60 KB fields). What
        was kept is copied out already; a read that fails midway disconnects, so nothing rewinds."""
        buffer = self._buffer
        assert buffer is not None
        if buffer.get_pos() < _COMPACT_AT:
            return
        held = buffer._buffer
        rest = held.read()
        held.seek(0)
        held.truncate(0)
        held.write(rest)
        held.seek(0)


def bounded_parser(max_kept: int, max_array: int) -> type[BoundedReplyParser]:
    """A ``BoundedReplyParser`` with these limits, for one client's ``parser_class``."""
    return type("BoundedReplyParser", (BoundedReplyParser,), {"max_kept": max_kept, "max_array": max_array})


def entry_payload(fields: Any, read_limit: int) -> tuple[bytes, str]:
    """An entry's payload and '', or b'' and why it was not read (its fields as a bounded reply holds them)."""
    if isinstance(fields, Unread):
        return b"", f"entry has {fields.size // 2} fields (srl writes one); not read"
    if not isinstance(fields, list):
        return b"", "entry has no fields (not written by srl)"
    for name, value in zip(fields[::2], fields[1::2], strict=False):
        if name != FIELD:
            continue
        size = value.size if isinstance(value, Unread) else len(value) if isinstance(value, bytes) else 0
        if size > read_limit:
            return b"", f"payload of {size} bytes is over the {read_limit}-byte read limit; not read"
        if isinstance(value, Unread):  # the entry's other fields took the read's room
            return b"", (f"entry of over {read_limit} bytes (a {size}-byte payload and other "
                         "fields) is over the read limit; not read")
        return value, ""
    return b"", f"entry has no {FIELD!r} field (not written by srl)"
