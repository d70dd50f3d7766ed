"""The gRPC side of the inference server: where it listens, and one handler per actor's stream.

Owns: :class:`ActorStreams` — the gRPC server (TLS when the node has a certificate, a bounded number of
streams, the address actors are told) and each stream's handler: reading its requests (``RequestCheck``),
opening its session once the actor's slot lease is checked, handing each request to the batcher and
answering with its actions, and refusing a bad request (counted, logged and put on the board at most once
per interval, its stream aborted with the refusal's status code). Must never: act itself (only the
batcher's loop touches workers), or let one stream's refusal end another stream or the server.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
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
from srl.runner.distribution.wire.inference import (
    METHOD,
    grpc_options,
    max_request_bytes,
    reply_schema,
    request_schema,
)

logger = logging.getLogger("srl.inference")

FIRST_REQUEST_S = 10.0
"""seconds a new stream has to send its first request before the server closes it (an idle connection
must not hold one of its handler threads)"""
MAX_STREAMS = MAX_CENTRAL_ACTORS + 4
"""streams one server serves at once (gRPC's synchronous server holds a thread per open stream): a task's
actors (``MAX_CENTRAL_ACTORS`` at most, which the client and every node check) and a few spare"""


class ActorStreams:
    """The actors' streams of one inference server: ``start`` listens (and says where), ``stop`` ends them.

    ``make_worker(slot, session)`` is the worker of a slot's ``session``-th stream."""

    def __init__(self, board: Board, task: TaskSpec, options: InferenceOptions, spec: EnvSpec, batcher: Batcher,
                 make_worker: Callable[[int, int], Worker], stop: StopFlag, counters: CounterDeltas) -> None:
        self.board = board
        self.task = task
        self.options = options
        self.batcher = batcher
        self.make_worker = make_worker
        self.stop = stop
        self.counters = counters
        self.envs = task.rl_config.envs_per_actor
        self.tls = bool(options.tls_cert_file)
        self.max_request_bytes = max_request_bytes(spec, self.envs)
        self.wire = options.codec(board.task_name, compress=False, max_bytes=self.max_request_bytes)
        self.task_tag = task_tag(board.task_id)
        self.check = RequestCheck(self.wire, request_schema(spec), self.task_tag, self.envs)
        self.action_dtype = reply_schema(spec).columns["action"].dtype
        self.server: grpc.Server | None = None
        self.refused = 0
        self._lock = threading.Lock()
        """guards ``refused`` and the stream counts, which every handler thread changes"""
        self._event_log = Throttle()
        self._stream_counts: dict[int, int] = {}

    def start(self) -> str:
        """Listen; the address actors reach this server at."""
        opts = self.options
        workers = min(MAX_STREAMS, self.task.actor_num + 4)
        # gRPC's own bound is looser than the codec's: a request somewhat too large is refused and counted by the
        # codec with a reason; one past 4x (and 1 MiB) is cut off by gRPC before it is read at all
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="srl-inference"),
                             options=grpc_options(4 * self.max_request_bytes + 2**20),
                             maximum_concurrent_rpcs=workers)
        handler = grpc.stream_stream_rpc_method_handler(self._serve_stream)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            METHOD.split("/")[1], {METHOD.split("/")[2]: handler}),))
        if self.tls:
            key = Path(opts.tls_key_file).read_bytes()
            cert = Path(opts.tls_cert_file).read_bytes()
            port = server.add_secure_port(opts.listen, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(opts.listen)
        if port == 0:
            raise OSError(f"cannot listen on {opts.listen}: the address is taken or not this machine's")
        server.start()
        self.server = server
        host = opts.listen.rpartition(":")[0]
        advertised = opts.advertise_host or (socket.gethostname() if host in ("0.0.0.0", "[::]", "::") else host)
        return f"{advertised}:{port}"

    def stop_serving(self, grace: float | None) -> None:
        """End every stream (after ``grace`` seconds for those under way)."""
        if self.server is not None:
            self.server.stop(grace)

    def _serve_stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        session: Session | None = None
        first = threading.Timer(FIRST_REQUEST_S, lambda: session is None and context.cancel())
        first.daemon = True
        first.start()  # a connection that says nothing does not keep a handler thread
        try:
            for data in requests:
                try:
                    header, columns = self.check.read(data, session)
                    if session is None:
                        session = self._open_session(header, context)
                    first.cancel()
                    request = Request(session, np.array(columns["obs"]), columns, header.seq)
                    session.seq += 1
                except Refused as e:
                    self._refuse(e, context, session)
                    return
                self.batcher.submit(request)
                while not request.done.wait(0.1):
                    if self.stop.is_set() or session.closed.is_set():
                        context.abort(grpc.StatusCode.UNAVAILABLE, f"inference server stopping: {self.stop.reason}"
                                      if self.stop.is_set() else "this actor's session was closed")
                if request.error is not None:
                    self._refuse(request.error, context, session)
                    return
                if request.actions is None:  # its session closed while the request waited (a newer one took it)
                    context.abort(grpc.StatusCode.UNAVAILABLE, "this actor's session was closed")
                    return  # abort raises; this line is never reached
                reply = BatchHeader(actor_id=self.options.uid, actor_index=session.slot,
                                    epoch=self.batcher.params_epoch, seq=request.seq, params_version=request.version,
                                    count=self.envs, created_at=time.time(), task=self.task_tag)
                actions = request.actions.astype(self.action_dtype, copy=False)
                yield self.wire.encode_batch(reply, {"action": actions}, None)
        finally:
            first.cancel()
            if session is not None:
                session.closed.set()
                self.batcher.wake()

    def _open_session(self, header: BatchHeader, context: grpc.ServicerContext) -> Session:
        slot, uid = header.actor_index, header.actor_id.rpartition(".")[0]
        if not 0 <= slot < self.task.actor_num:
            raise Refused(f"slot {slot} is not one of the task's {self.task.actor_num}")
        try:
            holder, _ = self.board.lease_holder(f"actor:{slot}")
        except BOARD_AWAY as e:
            raise Refused(f"cannot check the actor's lease now ({short(e)})", grpc.StatusCode.UNAVAILABLE) from None
        if holder != uid:
            raise Refused(f"{uid!r} does not hold actor slot {slot} (its holder: {holder!r})",
                          grpc.StatusCode.PERMISSION_DENIED)
        with self._lock:
            count = self._stream_counts[slot] = self._stream_counts.get(slot, 0) + 1
        session = Session(slot, uid, self.make_worker(slot, count), context)
        self.batcher.admit(session)
        logger.info("actor %s connected for slot %d (%s)", uid, slot, context.peer())
        return session

    def _refuse(self, error: Refused, context: grpc.ServicerContext, session: Session | None) -> None:
        with self._lock:
            self.refused += 1
        self.counters.add(bad_messages=1)
        who = f"slot {session.slot} ({session.uid})" if session is not None else "an unknown actor"
        if self._event_log.ready():  # once per interval: a flood of bad requests must not flood the log or board
            logger.warning("refused a request from %s at %s: %s (%d refused so far)", who, context.peer(),
                           short(error), self.refused)
            with contextlib.suppress(*BOARD_AWAY):
                self.board.log_event(f"inference refused a request from {who}: {short(error, 300)}",
                                     level="WARNING", source=self.options.uid)
        context.abort(error.code, short(error, 400))
