"""The server's side of the actors' connections: where it listens, and every connection in one loop.

Owns: :class:`ActorStreams` — the listening socket (TLS when the node has a certificate), a bounded number of
connections, the address actors are told; ``poll``: reading every connection that has bytes (``wire/link.py``'s
frames), checking each request (``RequestCheck``), opening a connection's session once the actor's slot lease
is checked, handing requests to the batcher; ``answer``: the actions of a batch, one reply each; ending the
connections whose session closed; refusing what is bad (counted, logged and put on the board at most once per
interval, the connection ended with the refusal's status). Must never: act itself (the batcher does), block the
loop on one actor, or let one connection's refusal end another or the server.

One thread does all of it, the batcher's forward pass included (``inference/run.py``'s loop): a request is read,
acted for and answered with no hand-off between threads, the CPU per request that made a thread per stream slow.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from srl.base.env import EnvSpec
from srl.base.rl import Worker
from srl.runner.distribution.board.board import BOARD_AWAY, Board
from srl.runner.distribution.inference.batcher import Batcher
from srl.runner.distribution.inference.session import Refused, Request, RequestCheck, Session
from srl.runner.distribution.node.retry import Throttle
from srl.runner.distribution.node.serve import CounterDeltas
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.settings.options import InferenceOptions
from srl.runner.distribution.settings.task import MAX_CENTRAL_ACTORS, TaskSpec
from srl.runner.distribution.wire.codec import BatchHeader, short, task_tag
from srl.runner.distribution.wire.inference import max_request_bytes, reply_schema, request_schema
from srl.runner.distribution.wire.link import KIND_BATCH, FrameError, PeerGone, ServerConnection, Status, frame

logger = logging.getLogger("srl.inference")

FIRST_REQUEST_S = 10.0
"""seconds a new connection has to send its first request before the server closes it (an idle connection
must not hold a place)"""
TIDY_S = 0.02
"""how often the loop looks at every connection when nothing asked it to (a first request late, a close slow)"""
ACCEPT_PAUSE_S = 1.0
"""seconds the server stops listening after it could not take a connection (out of file descriptors)"""
UNSENT_LIMIT = 1 << 20
"""bytes of replies a connection may leave unread before the server stops reading its requests"""
CLOSE_S = 1.0
"""seconds a connection being refused has to take its last frame before it is closed anyway"""
MAX_STREAMS = MAX_CENTRAL_ACTORS + 4
"""connections one server holds at once: a task's actors (``MAX_CENTRAL_ACTORS`` at most, which the client and
every node check) and a few spare (a replaced actor's, a refused one's)"""
_LISTENER, _WAKE = object(), object()


class ActorStreams:
    """The actors' connections of one inference server: ``start`` listens (and says where), ``poll`` and
    ``answer`` serve, ``stop_serving`` ends them all.

    ``make_worker(key, session)`` is the worker of a session's ``session``-th connection (``key``: the slot, or
    with actors of two halves the slot's half, ``slot * 2 + half``)."""

    def __init__(self, board: Board, task: TaskSpec, options: InferenceOptions, spec: EnvSpec, batcher: Batcher,
                 make_worker: Callable[[int, int], Worker], stop: StopFlag, counters: CounterDeltas,
                 lease_board: Board | None = None) -> None:
        self.board = board
        self.task = task
        self.options = options
        self.batcher = batcher
        self.make_worker = make_worker
        self.stop = stop
        self.counters = counters
        self.halves = task.halves
        self.envs = task.rl_config.envs_per_actor // self.halves
        """envs per request: an actor's, or half of them (double buffering)"""
        self.tls = bool(options.tls_cert_file)
        self.max_request_bytes = max_request_bytes(spec, self.envs)
        self.wire = options.codec(board.task_name, compress=False, max_bytes=self.max_request_bytes)
        self.task_tag = task_tag(board.task_id)
        self.check = RequestCheck(self.wire, request_schema(spec), self.task_tag, self.envs)
        self.action_dtype = reply_schema(spec).columns["action"].dtype
        self.max_connections = min(MAX_STREAMS * self.halves, task.actor_num * self.halves + 4)
        self.refused = 0
        self._event_log = Throttle()
        self._accept_log = Throttle()
        self._failure_log = Throttle()
        self.events: deque[str] = deque(maxlen=16)
        """refusals to put on the board's event log: the board thread writes them (``InferenceRun``)"""
        self.lease_board = lease_board or board
        """the board the loop checks an actor's slot lease on (a client whose commands give up soon)"""
        self._listen_again_at = 0.0
        self._stream_counts: dict[int, int] = {}
        self._connections: set[ServerConnection] = set()
        self._tidy_at = 0.0
        """when ``poll`` next looks at every connection (0: at once, something changed)"""
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._tls_context: ssl.SSLContext | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_lock = threading.Lock()

    def start(self) -> str:
        """Listen; the address actors reach this server at."""
        opts = self.options
        host, _, port_text = opts.listen.rpartition(":")
        bind_host = host.strip("[]")
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((bind_host, int(port_text)))
        except (OSError, ValueError) as e:
            listener.close()
            raise OSError(f"cannot listen on {opts.listen}: {e} (is the address taken, or not this machine's?)"
                          ) from None
        listener.listen(128)
        listener.setblocking(False)
        if self.tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(opts.tls_cert_file, opts.tls_key_file)
            self._tls_context = context
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        port = listener.getsockname()[1]
        advertised = opts.advertise_host or (socket.gethostname() if bind_host in ("0.0.0.0", "::", "") else bind_host)
        return f"{advertised}:{port}"

    def wake(self) -> None:
        """Make a ``poll`` under way return (from any thread): a session closed, params arrived, a stop."""
        with self._wake_lock, contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    # ------------------------------------------------------------ the loop's side
    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` for bytes; read what came (requests go to the batcher), write what waited;
        end the connections whose session closed or that said nothing in time."""
        for key, events in self._selector.select(timeout):
            if key.data is _LISTENER:
                self._accept()
            elif key.data is _WAKE:
                with contextlib.suppress(BlockingIOError, OSError):
                    self._wake_r.recv(4096)
                self._tidy_at = 0.0
            else:
                connection: ServerConnection = key.data
                if events & selectors.EVENT_WRITE:
                    self._flush(connection)
                if events & selectors.EVENT_READ and not connection.closed and not connection.closing:
                    self._read(connection)
        now = time.monotonic()
        if self._listen_again_at and now >= self._listen_again_at and self._listener is not None:
            self._listen_again_at = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
        if now >= self._tidy_at:
            self._tidy_at = now + TIDY_S
            self._tidy()

    def answer(self, requests: list[Request]) -> None:
        """The replies of a batch the batcher acted for (or the refusals)."""
        for request in requests:
            session = request.session
            connection = session.connection
            if connection.closed or connection.closing:
                continue
            if request.error is not None:
                self._refuse(request.error, connection, session)
                continue
            if request.actions is None:  # its session closed (a newer connection took the slot; its batch failed)
                self._tidy_at = 0.0  # _tidy ends the connection
                continue
            reply = BatchHeader(actor_id=self.options.uid, actor_index=session.key,
                                epoch=self.batcher.params_epoch, seq=request.seq, params_version=request.version,
                                count=self.envs, created_at=time.time(), task=self.task_tag)
            actions = request.actions.astype(self.action_dtype, copy=False)
            session.seq_waiting = False
            try:
                connection.send(frame(KIND_BATCH, self.wire.encode_batch(reply, {"action": actions}, None)))
            except PeerGone:
                self._drop(connection)
                continue
            except Exception as e:  # an action the reply cannot carry: this server's fault, this connection's end
                self._failed(connection, e)
                continue
            self._watch(connection)

    def _failed(self, connection: ServerConnection, error: Exception) -> None:
        """What went wrong here serving one connection ends that connection (UNAVAILABLE: the actor reconnects),
        said with its traceback once per interval, never the server."""
        if self._failure_log.ready():
            logger.error("serving %s failed: %s: %s", connection.peer, type(error).__name__, short(error),
                         exc_info=error)
        session: Session | None = connection.session
        if session is not None:
            session.closed.set()
        connection.refuse(Status.UNAVAILABLE, f"the server failed serving this actor: {type(error).__name__}")
        self._tidy_at = 0.0
        self._watch(connection)

    def stop_serving(self, grace: float | None) -> None:
        """End every connection (telling each actor why) and stop listening."""
        for connection in list(self._connections):
            connection.refuse(Status.UNAVAILABLE, f"inference server stopping: {self.stop.reason}")
        deadline = time.monotonic() + (grace or 0.0)
        while any(c.wants_write and not c.closed for c in self._connections) and time.monotonic() < deadline:
            for connection in list(self._connections):
                self._flush(connection)
            time.sleep(0.01)
        for connection in list(self._connections):
            self._drop(connection)
        if self._listener is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------ connections
    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: stop listening a second (the listener stays
                # readable, and the loop would spin on it), then take connections again
                if self._accept_log.ready():
                    logger.warning("cannot accept a connection: %s; not listening for %g s", e, ACCEPT_PAUSE_S)
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(self._listener)
                self._listen_again_at = time.monotonic() + ACCEPT_PAUSE_S
                return
            peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
            try:
                connection = ServerConnection(sock, peer, self.max_request_bytes, self._tls_context)
            except (OSError, ValueError) as e:  # a peer that reset before it was taken: it is gone
                sock.close()
                logger.debug("a connection from %s went before it was taken: %s", peer, e)
                continue
            self._connections.add(connection)
            self._selector.register(connection, selectors.EVENT_READ, connection)
            if len(self._connections) > self.max_connections:
                self._refuse(Refused(f"this server holds {self.max_connections} connections for the task's "
                                     f"{self.task.actor_num} actors already", Status.UNAVAILABLE), connection, None)

    def _read(self, connection: ServerConnection) -> None:
        try:
            self._take_requests(connection)
        except Exception as e:  # this server's fault with this connection, not the actor's: it alone ends
            self._failed(connection, e)

    def _take_requests(self, connection: ServerConnection) -> None:
        session: Session | None = connection.session
        try:
            payloads = connection.receive()
        except PeerGone:
            self._drop(connection)
            return
        except FrameError as e:
            self._refuse(Refused(str(e), e.status), connection, session)
            return
        for data in payloads:
            try:
                if session is not None and session.seq_waiting:
                    raise Refused("a request before the reply to the one before: an actor sends one at a time")
                header, columns = self.check.read(data, session)
                if session is None:
                    session = self._open_session(header, connection)
                request = Request(session, np.array(columns["obs"]), columns, header.seq)
                session.seq += 1
            except Refused as e:
                self._refuse(e, connection, session)
                return
            session.seq_waiting = True
            self.batcher.submit(request)

    def _open_session(self, header: BatchHeader, connection: ServerConnection) -> Session:
        key, uid = header.actor_index, header.actor_id.rpartition(".")[0]
        slot, half = divmod(key, self.halves)
        if not 0 <= slot < self.task.actor_num:
            raise Refused(f"slot {slot} is not one of the task's {self.task.actor_num}")
        try:  # on the loop's own client, whose commands give up soon: a slow board holds no one's actions long
            holder, _ = self.lease_board.lease_holder(f"actor:{slot}")
        except BOARD_AWAY as e:
            raise Refused(f"cannot check the actor's lease now ({short(e)})", Status.UNAVAILABLE) from None
        if holder != uid:
            raise Refused(f"{uid!r} does not hold actor slot {slot} (its holder: {holder!r})",
                          Status.PERMISSION_DENIED)
        count = self._stream_counts[key] = self._stream_counts.get(key, 0) + 1
        session = Session(slot, uid, self.make_worker(key, count), connection, half, self.halves)
        connection.session = session
        self.batcher.admit(session)
        self._tidy_at = 0.0  # a session it replaced ends its connection
        of = f" (half {half} of its envs)" if self.halves > 1 else ""
        logger.info("actor %s connected for slot %d%s (%s)", uid, slot, of, connection.peer)
        return session

    def _tidy(self) -> None:
        """End the connections whose session closed, that took too long to close, or that never spoke."""
        now = time.monotonic()
        for connection in list(self._connections):
            session: Session | None = connection.session
            if connection.closing:
                if not connection.wants_write or now - connection.closing_since > CLOSE_S:
                    self._drop(connection)
            elif session is not None and session.closed.is_set():
                connection.refuse(Status.UNAVAILABLE, "this actor's session was closed")
                self._watch(connection)
            elif session is None and now - connection.opened > FIRST_REQUEST_S:
                self._drop(connection)

    def _flush(self, connection: ServerConnection) -> None:
        try:
            connection.flush()
        except PeerGone:
            self._drop(connection)
            return
        if connection.closing and not connection.wants_write:
            self._drop(connection)
        else:
            self._watch(connection)

    def _watch(self, connection: ServerConnection) -> None:
        """Select the connection for writing only while it has something to write, and for reading only while
        it is not being closed (what a refused actor sends after is not read) and takes its replies (one that
        sends requests without reading replies stops being read before they pile up); one closing with nothing
        left to write is closed."""
        if connection.closed:
            return
        if connection.closing and not connection.wants_write:
            self._drop(connection)
            return
        reading = not connection.closing and connection.unsent <= UNSENT_LIMIT
        events = (selectors.EVENT_WRITE if connection.wants_write else 0) | (selectors.EVENT_READ if reading else 0)
        with contextlib.suppress(KeyError, ValueError):
            if self._selector.get_key(connection).events != events:
                self._selector.modify(connection, events, connection)

    def _drop(self, connection: ServerConnection) -> None:
        session: Session | None = connection.session
        if session is not None and not session.closed.is_set():
            session.closed.set()
        if connection in self._connections:
            self._connections.discard(connection)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(connection)
        connection.close()

    def _refuse(self, error: Refused, connection: ServerConnection, session: Session | None) -> None:
        self.refused += 1
        self.counters.add(bad_messages=1)
        who = f"slot {session.slot} ({session.uid})" if session is not None else "an unknown actor"
        if self._event_log.ready():  # once per interval: a flood of bad requests must not flood the log or board
            logger.warning("refused a request from %s at %s: %s (%d refused so far)", who, connection.peer,
                           short(error), self.refused)
            self.events.append(f"inference refused a request from {who}: {short(error, 300)}")  # the board thread
            # writes it: the loop never waits on the board for a log line
        if session is not None:
            session.closed.set()
        connection.refuse(error.code, short(error, 400))
        self._tidy_at = 0.0  # closed once its last frame is out
        self._watch(connection)

