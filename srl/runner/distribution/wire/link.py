"""Frames over TCP, optionally TLS: the transport of central inference, at both ends.

A connection opens with the actor's :data:`HELLO` (``SRLI`` and the protocol's version). Then each side sends
frames: a 4-byte little-endian length of what follows, a kind byte, the payload:

* ``BATCH``: an srl codec batch, a request from an actor or the actions from the server (the codec, not this
  module, decides what is in it and whether it is trusted);
* ``REFUSED``: the server's last word on a connection it closes: a :class:`Status` byte, then the reason
  (UTF-8).

Owns the framing and the sockets of both ends: :class:`ServerConnection`, non-blocking, one of many in the
server's selector loop, and :class:`ClientLink`, the actor's blocking socket, one round trip at a time, that
another thread can interrupt. Must never: hold more than one frame's worth of a peer's bytes (a frame declared
longer than the limit is refused unread), or block the server's loop on one peer.

Why not gRPC, which this replaced: its Python servers (the threaded one and ``grpc.aio`` alike) spend about
130 µs of CPU per message on loopback, a selector loop over these frames about 10 (docs/inference.md).
"""

from __future__ import annotations

import enum
import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any

PROTOCOL = 1
"""the version of these frames; a peer of another version is refused with it named"""
HELLO = b"SRLI" + struct.pack("<H", PROTOCOL)
"""what an actor sends first on a connection"""
KIND_BATCH = 1
KIND_REFUSED = 2
_HEAD = struct.Struct("<IB")
"""a frame's head: the length of the kind byte and the payload, the kind"""
CONNECT_TIMEOUT_S = 5.0
POLL_S = 0.5
"""how often an actor waiting for a reply looks at why it might stop waiting"""
REASON_LIMIT = 400
"""characters of a refusal's reason that travel"""


class Status(enum.IntEnum):
    """Why the server closed a connection (gRPC's codes and numbers, so the names keep their meaning)."""

    INVALID_ARGUMENT = 3
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class FrameError(Exception):
    """What a peer sent is not a frame this end takes (and the status it is told)."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class PeerGone(ConnectionError):
    """The other end closed the connection, or it broke."""


class Refusal(Exception):
    """The server's ``REFUSED`` frame, as the actor's end reads it."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(f"{status.name}: {reason}")
        self.status = status
        self.reason = reason


def frame(kind: int, payload: bytes) -> bytes:
    return _HEAD.pack(len(payload) + 1, kind) + payload


def refusal_frame(status: Status, reason: str) -> bytes:
    return frame(KIND_REFUSED, bytes([status]) + reason[:REASON_LIMIT].encode("utf-8", "replace"))


def _read_refusal(payload: bytes | bytearray) -> Refusal:
    code = payload[0] if payload else Status.UNAVAILABLE
    status = Status(code) if code in Status._value2member_map_ else Status.UNAVAILABLE
    return Refusal(status, bytes(payload[1:]).decode("utf-8", "replace") or "(no reason given)")


def _tune(sock: socket.socket) -> None:
    """No Nagle delay (a request is one small write awaiting its answer); TCP keepalives, so a connection
    whose peer's host vanished is dropped within about 20 s rather than held for hours."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _hello_problem(data: bytes | bytearray) -> str:
    if data.startswith(b"PRI * HTTP/2"):
        return ("an HTTP/2 (gRPC) client, where this server speaks srl's own inference frames: is srl the same "
                "version on every node?")
    if data[:4] == HELLO[:4] and len(data) >= len(HELLO):
        version = struct.unpack_from("<H", data, 4)[0]
        return (f"inference protocol {version}, where this server speaks {PROTOCOL}: is srl the same version on "
                "every node?")
    return f"not an srl inference connection (it began {bytes(data[:8])!r})"


class ServerConnection:
    """One actor's connection on the server: non-blocking, read and written by the server's loop only.

    ``receive`` returns the payloads of the whole ``BATCH`` frames that arrived (raising :class:`FrameError`
    for what breaks the protocol, :class:`PeerGone` when the actor went); ``send`` queues a frame and writes
    what the socket takes now (``flush`` the rest once it is writable)."""

    def __init__(self, sock: socket.socket, peer: str, max_frame: int, tls: ssl.SSLContext | None) -> None:
        _tune(sock)
        sock.setblocking(False)
        self.sock: socket.socket = (tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                                    if tls is not None else sock)
        self.peer = peer
        self.max_frame = max_frame
        self.handshaking = tls is not None
        self.greeted = False
        self.opened = time.monotonic()
        self._in = bytearray()
        self._out = bytearray()
        self._want_write = False
        """the TLS layer needs the socket writable before it can go on (a handshake, a renegotiation)"""
        self.closing = False
        """a last frame is being written; the connection closes once it is out (or soon after ``closing_since``)"""
        self.closing_since = 0.0
        self.closed = False
        self.session: Any = None
        """what the server keeps for this connection once its first request is in (its actor's session)"""

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        return bool(self._out) or self._want_write

    @property
    def unsent(self) -> int:
        """Bytes queued for the peer that the socket has not taken yet."""
        return len(self._out)

    def receive(self) -> list[bytes]:
        if self.handshaking and not self._handshake():
            return []
        while True:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError):
                break
            except ssl.SSLWantWriteError:
                self._want_write = True
                break
            except (OSError, ssl.SSLError) as e:
                raise PeerGone(f"connection broke: {e}") from None
            if not chunk:
                raise PeerGone("the actor closed its connection")
            self._in += chunk
            if len(self._in) > self.max_frame + _HEAD.size + len(HELLO):
                break  # more than one request's worth: parsed below, and refused if it is not whole frames
        return self._frames()

    def _frames(self) -> list[bytes]:
        data = self._in
        if not self.greeted:
            if len(data) < len(HELLO):
                if not HELLO.startswith(bytes(data)):
                    raise FrameError(Status.INVALID_ARGUMENT, _hello_problem(data))
                return []
            if data[: len(HELLO)] != HELLO:
                raise FrameError(Status.INVALID_ARGUMENT, _hello_problem(data))
            del data[: len(HELLO)]
            self.greeted = True
        payloads = []
        while len(data) >= _HEAD.size:
            length, kind = _HEAD.unpack_from(data)
            if length - 1 > self.max_frame:
                raise FrameError(Status.RESOURCE_EXHAUSTED, f"a frame of {length - 1} bytes, past this task's largest "
                                 f"request ({self.max_frame} bytes)")
            if kind != KIND_BATCH or length < 1:
                raise FrameError(Status.INVALID_ARGUMENT, f"a frame of kind {kind}: an actor sends batches only")
            if len(data) < _HEAD.size - 1 + length:
                break
            payloads.append(bytes(data[_HEAD.size : _HEAD.size - 1 + length]))
            del data[: _HEAD.size - 1 + length]
        if len(data) > self.max_frame + _HEAD.size:
            raise FrameError(Status.RESOURCE_EXHAUSTED, "more bytes than a whole request before its end")
        return payloads

    def _handshake(self) -> bool:
        assert isinstance(self.sock, ssl.SSLSocket)
        try:
            self.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._want_write = False
            return False
        except ssl.SSLWantWriteError:
            self._want_write = True
            return False
        except (OSError, ssl.SSLError) as e:
            raise PeerGone(f"TLS handshake failed: {e}") from None
        self.handshaking = False
        self._want_write = False
        return True

    def send(self, data: bytes) -> None:
        self._out += data
        self.flush()

    def flush(self) -> None:
        """Write what the socket takes now (PeerGone: it broke)."""
        if self.handshaking:
            self._handshake()
            if self.handshaking:
                return
        self._want_write = False
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except (BlockingIOError, ssl.SSLWantWriteError):
                return
            except ssl.SSLWantReadError:
                return
            except (OSError, ssl.SSLError) as e:
                raise PeerGone(f"connection broke: {e}") from None
            del self._out[:sent]

    def refuse(self, status: Status, reason: str) -> None:
        """Say why this connection ends, then end it (once that is written)."""
        if self.closing:
            return
        self.closing = True
        self.closing_since = time.monotonic()
        if self.handshaking:  # nothing can be said before TLS is up: the connection just closes
            self._out.clear()
            return
        try:
            self.send(refusal_frame(status, reason))
        except PeerGone:
            self._out.clear()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


class ClientLink:
    """The actor's connection to its inference server: ``round_trip`` sends a request and returns the reply
    (``send`` and ``receive`` apart: a request may be on its way while the actor does something else).

    It waits for the reply as long as the server keeps it (backpressure holds replies back), looking every
    ``POLL_S`` at ``stop`` and, past ``check_after`` seconds, at ``still_serving()`` (False: the server lost
    its lease, the wait is over). ``cancel`` from another thread ends a wait at once."""

    def __init__(self, host: str, port: int, tls: bool, ca_file: str | None, max_frame: int) -> None:
        self.max_frame = max_frame
        self.host = host
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        try:
            _tune(sock)
            if tls:
                context = ssl.create_default_context(cafile=ca_file)
                sock = context.wrap_socket(sock, server_hostname=host)
            sock.sendall(HELLO)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._cancelled = False

    def round_trip(self, request: bytes, stop_reason: Callable[[], str | None],
                   still_serving: Callable[[], bool], check_after: float) -> bytes:
        """The reply to ``request``: ``send`` then ``receive``."""
        self.send(request, stop_reason, still_serving, check_after)
        return self.receive(stop_reason, still_serving, check_after)

    def send(self, request: bytes, stop_reason: Callable[[], str | None], still_serving: Callable[[], bool],
             check_after: float) -> None:
        """Send a request, waiting as ``receive`` does while the server reads nothing (its queue full, it holds
        its replies and reads no request: backpressure). Raises PeerGone, or TimeoutError once
        ``still_serving`` says no."""
        data = memoryview(frame(KIND_BATCH, request))
        waited = _Waiting(stop_reason, still_serving, check_after)
        self.sock.settimeout(POLL_S)
        while data:
            try:
                sent = self.sock.send(data)
            except TimeoutError:
                waited.check()
                continue
            except (OSError, ValueError) as e:
                raise PeerGone(self._broke(stop_reason, e, "cannot send to the server")) from None
            data = data[sent:]

    def receive(self, stop_reason: Callable[[], str | None], still_serving: Callable[[], bool],
                check_after: float) -> bytes:
        """The next reply. Raises :class:`Refusal` (the server's word), :class:`PeerGone`, or TimeoutError once
        ``still_serving`` says no."""
        head = self._read(_HEAD.size, stop_reason, still_serving, check_after)
        length, kind = _HEAD.unpack(head)
        if not 1 <= length <= self.max_frame + 1:
            raise PeerGone(f"a reply frame of {length} bytes, past the most this actor takes ({self.max_frame})")
        payload = self._read(length - 1, stop_reason, still_serving, check_after)
        if kind == KIND_REFUSED:
            raise _read_refusal(payload)
        if kind != KIND_BATCH:
            raise PeerGone(f"a reply frame of kind {kind}")
        return payload

    def _read(self, n: int, stop_reason: Callable[[], str | None], still_serving: Callable[[], bool],
              check_after: float) -> bytes:
        data = bytearray()
        waited = _Waiting(stop_reason, still_serving, check_after)
        self.sock.settimeout(POLL_S)
        while len(data) < n:
            try:
                chunk = self.sock.recv(n - len(data))
            except TimeoutError:
                waited.check()
                continue
            except (OSError, ValueError) as e:  # ValueError: a TLS socket shut down by ``cancel`` mid-read
                raise PeerGone(self._broke(stop_reason, e, "connection broke")) from None
            if not chunk:
                reason = stop_reason() if self._cancelled else None
                raise PeerGone(f"stopping: {reason}" if reason is not None else "the server closed the connection")
            data += chunk
        return bytes(data)

    def _broke(self, stop_reason: Callable[[], str | None], error: Exception, what: str) -> str:
        reason = stop_reason() if self._cancelled else None
        return f"stopping: {reason}" if reason is not None else f"{what}: {error}"

    def cancel(self) -> None:
        """End a wait under way (from another thread): the TCP socket's own shutdown, below any TLS layer, so a
        read under way returns at once."""
        self._cancelled = True
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _Waiting:
    """A wait for the server, looked at every ``POLL_S``: over once the run stops (PeerGone), or once, past
    ``check_after`` seconds and every as many after, ``still_serving()`` says no (TimeoutError)."""

    def __init__(self, stop_reason: Callable[[], str | None], still_serving: Callable[[], bool],
                 check_after: float) -> None:
        self.stop_reason = stop_reason
        self.still_serving = still_serving
        self.check_after = check_after
        self.started = self.checked = time.monotonic()

    def check(self) -> None:
        reason = self.stop_reason()
        if reason is not None:
            raise PeerGone(f"stopping: {reason}")
        now = time.monotonic()
        if now - self.started >= self.check_after and now - self.checked >= self.check_after:
            self.checked = now
            if not self.still_serving():
                raise TimeoutError(f"no answer for {now - self.started:.0f} s and the server no longer holds its "
                                   "lease")
