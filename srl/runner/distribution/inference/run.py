"""Central inference, the SEED RL way: one server acts for every actor of a task; actors only step envs.

Owns: the inference node (``inference_run_forever``, ``srl inference``) — holding the ``inference``
lease (a standby waits to take it over), saying on the board where it listens, loading every params
version the trainer publishes, serving actions to actors over gRPC bidirectional streams, batching the
requests of all actors into one forward pass (bounded by ``max_batch_envs`` and ``max_wait_ms``),
keeping each actor's worker (its envs' recurrent state, its unfinished rows, its Ape-X ε by slot) and
sending the rows those workers finish to the task's queue, as actors do, so the trainer cannot tell the
difference. The protocol is ``wire/inference.py``; the actor's side, ``actor/inference_client.py``.

Must never: trust a request. Every message either way is an srl codec BATCH: signed with the task's
secret when there is one (an actor without it is refused), bounded in size, and checked against the
declared columns (the env's observation dtype, shape and bounds; finite rewards; episode starts where
episodes ended). A bad request is refused, counted and logged with its source; its stream is closed
(the actor reconnects and restarts its episodes); the server goes on.

The transport is gRPC (grpcio) with raw bytes in both directions, no protobuf: one stream per actor,
one request (the envs' observations, and what followed the previous actions) and one reply (the
actions) per step, as SEED RL's actors do. Over TLS when the server has a certificate; a board reached
over TLS demands one.

The loop, per actor and on the server::

    actor: obs -> request(obs, reward, terminated, truncated, final_obs, started) -> actions -> env.step
    server: requests of many actors -> worker.observe / reset per actor -> one policy() for all
            -> worker.act_with per actor -> replies; finished rows -> queue (backpressure waits)
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import numpy as np
import torch

from srl.base.env import (
    allowed_env_modules,
    env_spec,
)
from srl.base.rl import Parameter, Worker, join_policy_io, seed_everything, split_policy_io
from srl.runner.distribution.board.board import BOARD_AWAY, Board, BoardDataError, Heartbeat
from srl.runner.distribution.node.liveness import Beat, BoardWork, LeaseGuard, Liveness
from srl.runner.distribution.node.retry import Throttle
from srl.runner.distribution.node.serve import CounterDeltas, apply_overrides, require_remote, serve
from srl.runner.distribution.node.staged import StagedParams
from srl.runner.distribution.node.stats import InferenceStats
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.queues import check_queue, open_queue
from srl.runner.distribution.sending.sender import RowSender, sender_name
from srl.runner.distribution.settings.options import InferenceOptions
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import (
    MAX_CENTRAL_ACTORS,
    TaskSpec,
    batch_rows,
    max_message_rows,
)
from srl.runner.distribution.wire.codec import (
    DEFAULT_MAX_BYTES,
    BatchHeader,
    DecodeError,
    params_message_bytes,
    short,
    task_tag,
)
from srl.runner.distribution.wire.inference import (
    METHOD,
    grpc_options,
    max_request_bytes,
    reply_schema,
    request_schema,
)
from srl.runner.progress import ensure_logging

logger = logging.getLogger("srl.inference")

MAX_FAILED_BATCHES = 10
"""forward passes failing in a row before the server gives up (a fault of its own, not of a request)"""
FIRST_REQUEST_S = 10.0
"""seconds a new stream has to send its first request before the server closes it (an idle connection
must not hold one of its handler threads)"""
MAX_STREAMS = MAX_CENTRAL_ACTORS + 4
"""streams one server serves at once (gRPC's synchronous server holds a thread per open stream): a task's
actors (``MAX_CENTRAL_ACTORS`` at most, which the client and every node check) and a few spare"""


# ---------------------------------------------------------------------------------------------- the server


class _Refused(Exception):
    """A request the server will not act on (what is wrong with it, for the log and the actor)."""

    def __init__(self, reason: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(reason)
        self.code = code


def _refused(error: Exception) -> _Refused:
    """What a request made its worker raise, as the refusal its actor is told."""
    return error if isinstance(error, _Refused) else _Refused(f"{type(error).__name__}: {short(error)}")


@dataclass
class _Request:
    session: _Session
    obs: np.ndarray
    columns: dict[str, np.ndarray]
    seq: int
    arrived: float = field(default_factory=time.monotonic)
    actions: np.ndarray | None = None
    version: int = 0
    error: _Refused | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _Session:
    """One actor's stream: its worker (its envs' state and unfinished rows); only the batcher touches it."""

    def __init__(self, slot: int, uid: str, worker: Worker, context: grpc.ServicerContext) -> None:
        self.slot = slot
        self.uid = uid
        self.worker = worker
        self.context = context
        self.acted = False
        self.seq = 0
        self.closed = threading.Event()
        self.rows_since = time.monotonic()

    def prepare(self, request: _Request) -> None:
        """Tell the worker what followed its last actions and which episodes start, as ``Rollout`` does."""
        cols = request.columns
        started = cols["started"]
        done = cols["terminated"] | cols["truncated"]
        if not self.acted:
            if not started.all():
                raise _Refused("a stream's first request must start every env's episode (started all true)")
        else:
            # an episode starts only where one ended; one may end without a start (a lost life ends the
            # training signal's episode while the game goes on, as Rollout tells a local worker)
            if (started & ~done).any():
                raise _Refused("episodes may start only in the envs whose episodes just ended")
            final = request.obs.copy()
            final[done] = cols["final_obs"][done]
            self.worker.observe(np.array(cols["reward"]), final, np.array(cols["terminated"]),
                                np.array(cols["truncated"]))
        ids = np.flatnonzero(started)
        if len(ids):
            self.worker.reset(ids, request.obs[ids])


class InferenceRun:
    """One inference server working on one task under the ``inference`` lease."""

    def __init__(self, board: Board, redis_params: RedisParameters, queue_params: Any, task: TaskSpec,
                 options: InferenceOptions) -> None:
        self.board = board
        self.task = task
        self.options = options
        self.lease_guard = LeaseGuard(board, "inference", options.uid, options.lease_ttl, options.heartbeat_interval)
        self.tls = bool(options.tls_cert_file)
        if redis_params.describe().startswith("rediss://") and not self.tls:
            raise ValueError("the board is reached over TLS, so central inference must be too: give the inference "
                             "node tls_cert_file and tls_key_file (--tls-cert-file, --tls-key-file)")
        self.stop = StopFlag()
        self.counters = CounterDeltas()
        config = task.rl_config
        self.config = config
        torch.set_num_threads(options.torch_threads or max(1, config.torch_threads))
        seed_everything(config.seed)
        self.spec = env_spec(task.env_config, allowed_env_modules(options.allow_env_modules))
        config.check_spec(self.spec)
        self.parameter: Parameter = config.make_parameter(self.spec, config.resolve_device())
        probe = self._make_worker(0)
        if not probe.serves_central():
            raise ValueError(f"{config.algorithm}'s worker cannot act with central inference")
        self.envs = config.envs_per_actor
        self.schema = config.schema(self.spec)
        self.request_schema = request_schema(self.spec)
        self.reply_schema = reply_schema(self.spec)
        self.max_request_bytes = max_request_bytes(self.spec, self.envs)
        compress = options.compress if options.compress is not None else self.schema.has_images
        max_params = params_message_bytes(self.parameter.to_arrays())
        self.codec = options.codec(board.task_name, compress=compress,
                                   max_bytes=max(max_params, DEFAULT_MAX_BYTES))
        self.wire = options.codec(board.task_name, compress=False, max_bytes=self.max_request_bytes)
        self.task_tag = task_tag(board.task_id)
        self.rows = RowSender(
            open_queue(queue_params, namespace=redis_params.task_name, role="producer", redis_params=redis_params),
            board, "inference", self.codec, self.schema, max_message_rows(task), task.queue_capacity,
            sender_name(options.uid), self.task_tag, self.stop, self.counters,
        )
        self.max_batch = options.max_batch_envs or self.envs * task.actor_num
        self._sessions: dict[int, _Session] = {}
        self._pending: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._outbox: queue.Queue[tuple[dict[str, np.ndarray], np.ndarray | None, int, int] | None] = queue.Queue(2)
        self._staged = StagedParams()
        self.params_epoch = 0
        self.latest_version = 0
        self.board_work = BoardWork("inference", self.stop)
        self.liveness = Liveness(board, "inference", options.uid, options.lease_ttl, self.stop, self.lease_guard,
                                 self.board_work, self)
        self._rate_from = (0, time.monotonic())  # agent steps, when: the rate's start
        # stats
        self.agent_steps = 0
        self.batches = 0
        self.refused = 0
        self._stats_lock = threading.Lock()
        """the counts below change in the batcher and the handlers, and are read and reset by the board thread"""
        self._batch_envs = 0
        self._batch_wait_s = 0.0
        self._batch_requests = 0
        self._last_batches = 0
        self._failed_batches = 0
        self._retired: list[_Session] = []
        """sessions a newer stream of their slot replaced: their rows are shipped, then they are dropped"""
        self._event_log = Throttle()
        self._dropped_rows = 0
        self._session_counts: dict[int, int] = {}
        try:
            self.server, self.address = self._start_server()
        except BaseException:
            self.rows.close()
            raise

    def _make_worker(self, slot: int, session: int = 1) -> Worker:
        """The worker of actor slot ``slot`` (its ε), for its ``session``-th stream (a stream of its own
        random draws: a slot that reconnects does not repeat them)."""
        config = self.config
        seed = None if config.seed is None else config.seed + 1000 * (slot + 1) + 7919 * (session - 1)
        worker = config.make_worker(self.spec, self.parameter, slot, self.task.actor_num, seed)
        worker.plan(self.task.max_steps, self.task.max_train_count)
        return worker

    # ------------------------------------------------------------ the gRPC server
    def _start_server(self) -> tuple[grpc.Server, str]:
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
        host = opts.listen.rpartition(":")[0]
        advertised = opts.advertise_host or (socket.gethostname() if host in ("0.0.0.0", "[::]", "::") else host)
        return server, f"{advertised}:{port}"

    def _serve_stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        session: _Session | None = None
        first = threading.Timer(FIRST_REQUEST_S, lambda: session is None and context.cancel())
        first.daemon = True
        first.start()  # a connection that says nothing does not keep a handler thread
        try:
            for data in requests:
                try:
                    header, columns = self._open_request(data, session)
                    if session is None:
                        session = self._open_session(header, context)
                    first.cancel()
                    request = _Request(session, np.array(columns["obs"]), columns, header.seq)
                    session.seq += 1
                except _Refused as e:
                    self._refuse(e, context, session)
                    return
                with self._cond:
                    self._pending.append(request)
                    self._cond.notify_all()
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
                reply = BatchHeader(actor_id=self.options.uid, actor_index=session.slot, epoch=self.params_epoch,
                                    seq=request.seq, params_version=request.version, count=self.envs,
                                    created_at=time.time(), task=self.task_tag)
                actions = request.actions.astype(self.reply_schema.columns["action"].dtype, copy=False)
                yield self.wire.encode_batch(reply, {"action": actions}, None)
        finally:
            first.cancel()
            if session is not None:
                session.closed.set()
                with self._cond:
                    self._cond.notify_all()

    def _open_request(self, data: bytes, session: _Session | None) -> tuple[BatchHeader, dict[str, np.ndarray]]:
        try:
            header, columns, _ = self.wire.decode_batch(data, self.request_schema)
        except DecodeError as e:
            code = (grpc.StatusCode.UNAUTHENTICATED if "signature" in str(e) or "signed" in str(e)
                    else grpc.StatusCode.INVALID_ARGUMENT)
            raise _Refused(f"bad request: {e}", code) from None
        if header.task != self.task_tag:
            raise _Refused("the request was made for another task", grpc.StatusCode.FAILED_PRECONDITION)
        if header.count != self.envs:
            raise _Refused(f"a request carries {header.count} envs; this task's actors step {self.envs}")
        if session is not None and (header.actor_index != session.slot or header.seq != session.seq):
            raise _Refused(f"request for slot {header.actor_index} seq {header.seq}; expected slot {session.slot} "
                           f"seq {session.seq}")
        if session is None and header.seq != 0:
            raise _Refused(f"a stream starts at seq 0, found {header.seq}")
        return header, columns

    def _open_session(self, header: BatchHeader, context: grpc.ServicerContext) -> _Session:
        slot, uid = header.actor_index, header.actor_id.rpartition(".")[0]
        if not 0 <= slot < self.task.actor_num:
            raise _Refused(f"slot {slot} is not one of the task's {self.task.actor_num}")
        try:
            holder, _ = self.board.lease_holder(f"actor:{slot}")
        except BOARD_AWAY as e:
            raise _Refused(f"cannot check the actor's lease now ({short(e)})", grpc.StatusCode.UNAVAILABLE) from None
        if holder != uid:
            raise _Refused(f"{uid!r} does not hold actor slot {slot} (its holder: {holder!r})",
                           grpc.StatusCode.PERMISSION_DENIED)
        with self._cond:
            count = self._session_counts[slot] = self._session_counts.get(slot, 0) + 1
        session = _Session(slot, uid, self._make_worker(slot, count), context)
        with self._cond:
            old = self._sessions.get(slot)
            if old is not None:  # the batcher ships its finished rows and drops it; its stream ends
                old.closed.set()
                old.context.cancel()
                self._retired.append(old)
            self._sessions[slot] = session
        logger.info("actor %s connected for slot %d (%s)", uid, slot, context.peer())
        return session

    def _refuse(self, error: _Refused, context: grpc.ServicerContext, session: _Session | None) -> None:
        with self._stats_lock:
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

    # ------------------------------------------------------------ batching
    def _gather(self) -> list[_Request]:
        """The next batch: the oldest request and those that join it within ``max_wait_ms``, at most
        ``max_batch`` envs; at once when every connected actor has a request in."""
        wait = self.options.max_wait_ms / 1000
        with self._cond:
            if not self._pending or self.parameter.version == 0:
                self._cond.wait(0.05)
            if not self._pending or self.parameter.version == 0:
                return []
            deadline = self._pending[0].arrived + wait
            while True:
                live = sum(1 for s in self._sessions.values() if not s.closed.is_set())
                count = len(self._pending)
                if count * self.envs >= self.max_batch or count >= live or self.stop.is_set():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            take = max(1, self.max_batch // self.envs)
            batch = [self._pending.popleft() for _ in range(min(take, len(self._pending)))]
        return batch

    def _act(self, batch: list[_Request]) -> None:
        now = time.monotonic()
        ready: list[tuple[_Request, Any]] = []
        with torch.inference_mode():
            for request in batch:
                if request.session.closed.is_set():
                    request.done.set()
                    continue
                try:
                    request.session.prepare(request)
                    ready.append((request, request.session.worker.policy_inputs(request.obs)))
                except Exception as e:  # what the worker refuses (frames that do not slide): this request only
                    request.error = _refused(e)
                    request.done.set()
            if not ready:
                return
            try:
                outputs = ready[0][0].session.worker.policy(join_policy_io([inputs for _, inputs in ready]))
                parts = split_policy_io(outputs, [len(r.obs) for r, _ in ready])
            except Exception as e:  # the network itself (a device out of memory, a bug): this batch fails
                self._batch_failed(e, [request for request, _ in ready])
                return
            self._failed_batches = 0
            version = self.parameter.version
            for (request, _), part in zip(ready, parts, strict=True):
                try:
                    request.actions = np.asarray(request.session.worker.act_with(request.obs, part))
                    request.version = version
                    request.session.acted = True
                except Exception as e:
                    request.error = _refused(e)
                request.done.set()
        with self._stats_lock:
            self.batches += 1
            self.agent_steps += len(ready) * self.envs
            self._batch_envs += len(ready) * self.envs
            self._batch_requests += len(ready)
            self._batch_wait_s += sum(now - r.arrived for r, _ in ready)

    def _batch_failed(self, error: Exception, requests: list[_Request]) -> None:
        """A forward pass failed: its actors are answered UNAVAILABLE (they reconnect and restart their
        episodes) and their sessions closed; ``MAX_FAILED_BATCHES`` in a row is a fault of this server, not
        of a request: it stops, and the task with it."""
        self._failed_batches += 1
        logger.error("a forward pass for %d actor(s) failed (%d in a row): %s: %s", len(requests),
                     self._failed_batches, type(error).__name__, short(error), exc_info=self._failed_batches == 1)
        for request in requests:
            request.session.closed.set()
            request.done.set()  # no actions: the handler answers UNAVAILABLE
        if self._failed_batches >= MAX_FAILED_BATCHES:
            raise RuntimeError(f"{MAX_FAILED_BATCHES} forward passes in a row failed; the last: "
                               f"{type(error).__name__}: {short(error)}") from error

    def _ship_rows(self, sessions: list[_Session], closing: bool = False) -> None:
        """Hand the rows the sessions' workers finished to the sender (blocks while it is behind: the
        actors then wait for their actions, which is backpressure)."""
        now = time.monotonic()
        rows = batch_rows(self.task, self.options.batch_size)
        for session in sessions:
            worker = session.worker
            pending = worker.pending()
            if not pending or not (closing or pending >= rows
                                   or now - session.rows_since >= self.options.batch_max_age):
                continue
            columns = worker.take()
            session.rows_since = now
            if columns is None:
                continue
            priorities = worker.initial_priorities(columns)
            item = (columns, priorities, session.slot, int(columns["version"].max()) if "version" in columns else 0)
            while True:
                if self.stop.is_set():
                    self._dropped_rows += len(columns["version"])
                    break
                try:
                    self._outbox.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def _reap(self) -> None:
        """Drop the sessions whose streams closed, after shipping the rows their workers finished."""
        with self._cond:
            closed = [s for s in self._sessions.values() if s.closed.is_set()] + self._retired
            self._retired = []
            for session in closed:
                if self._sessions.get(session.slot) is session:
                    del self._sessions[session.slot]
        if closed:
            self._ship_rows(closed, closing=True)
            for session in closed:
                logger.info("actor %s left slot %d; its state is freed", session.uid, session.slot)

    # ------------------------------------------------------------ sending
    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            columns, priorities, slot, version = item
            try:
                self.rows.send(columns, priorities, slot, self.params_epoch, version)
            except Exception as e:
                logger.exception("inference sender crashed")
                self.stop.set(f"sender crashed: {type(e).__name__}: {short(e)}")
                return

    # ------------------------------------------------------------ background: lease, stats, params, actors
    def _board_thread(self) -> None:
        self.liveness.run()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------ heartbeats (node.liveness.Liveness's hooks)
    def report(self) -> Beat:
        now = time.monotonic()
        steps, since = self._rate_from
        rate = (self.agent_steps - steps) / max(now - since, 1e-9)
        self._rate_from = (self.agent_steps, now)
        return Beat(self._stats(rate).to_record(), counts=self.counters)

    def heard(self, answer: Heartbeat) -> None:
        pass

    def take_lease_back(self) -> bool:
        """A server's lease is not taken back: the standby that took it serves the actors now."""
        self.stop.set("lost the inference lease: it was not renewed in time (was this process paused or cut off "
                      "from Redis?)")
        return False

    def in_order(self, answer: Heartbeat) -> None:
        self._check_actor_leases()
        if answer.params_version > 0 and answer.params_version != self.latest_version:  # the head, read with it
            self._fetch_params()

    def pause(self, answer: Literal["ok", "away"]) -> None:
        """Until the next heartbeat, look for new params every ``params_poll_interval``."""
        opts = self.options
        due = self._rate_from[1] + opts.heartbeat_interval
        while not self.stop.wait(opts.params_poll_interval) and time.monotonic() < due:
            if self.board_work.run(self._look_for_params, "board") == "stop":
                return

    def _look_for_params(self) -> None:
        head = self.board.get_params_head()
        version = 0 if head is None else head[1]
        if version > 0 and version != self.latest_version:
            self._fetch_params()

    def _check_actor_leases(self) -> None:
        """Free the state of actors whose slot lease lapsed (a process killed, or paused past its TTL)."""
        with self._cond:
            sessions = [s for s in self._sessions.values() if not s.closed.is_set()]
        holders = self.board.lease_holders([f"actor:{s.slot}" for s in sessions])
        for session, holder in zip(sessions, holders, strict=True):
            if holder != session.uid:
                logger.warning("actor %s lost slot %d (lease lapsed or taken): closing its stream", session.uid,
                               session.slot)
                session.closed.set()
                session.context.cancel()
        with self._cond:
            self._cond.notify_all()

    def _fetch_params(self) -> None:
        try:
            record = self.board.get_params(max_bytes=self.codec.max_bytes)
            if record is None:
                return
            _, arrays = self.codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
        except (DecodeError, BoardDataError) as e:
            logger.error("params on the board cannot be used (%s); keeping version %d", short(e),
                         self.parameter.version)
            self.counters.add(bad_messages=1)
            latest = self.board.get_params_version()
            self.latest_version = latest[1] if latest is not None else self.latest_version
            return
        self._staged.put(record.epoch, record.version, arrays)
        self.latest_version = record.version
        with self._cond:
            self._cond.notify_all()

    def _stats(self, rate: float) -> InferenceStats:
        with self._stats_lock:
            requests = max(self._batch_requests, 1)
            batches = self.batches
            stats = InferenceStats(
                uid=self.options.uid, sessions=len(self._sessions), agent_steps=self.agent_steps,
                agent_steps_per_s=round(rate, 1), batches=batches,
                batch_envs_mean=round(self._batch_envs / max(batches - self._last_batches, 1), 2),
                batch_wait_ms_mean=round(1000 * self._batch_wait_s / requests, 3),
                params_version=self.parameter.version, sent_batches=self.rows.sent_batches,
                refused_requests=self.refused, backpressure_wait_s=round(self.rows.backpressure_wait_s, 3),
            )
            self._batch_envs = self._batch_requests = 0
            self._batch_wait_s = 0.0
            self._last_batches = batches
        return stats

    # ------------------------------------------------------------ the loop
    def run(self) -> str:
        opts = self.options
        if not self.board.set_inference_address(opts.uid, self.address, self.tls):
            self.server.stop(0)
            self.rows.close()
            return "lost the inference lease before it could say where it listens"
        logger.info("inference %s serves %s on %s (%s, batches of up to %d envs, wait %.3g ms)", opts.uid,
                    self.config.algorithm, self.address, "TLS" if self.tls else "no TLS", self.max_batch,
                    opts.max_wait_ms)
        board_thread = threading.Thread(target=self._board_thread, name="srl-inference-board", daemon=True)
        sender_thread = threading.Thread(target=self._send_loop, name="srl-inference-sender", daemon=True)
        self.lease_guard.start()  # renews while the board thread is busy fetching params
        board_thread.start()
        sender_thread.start()
        try:
            while not self.stop.is_set():
                if self._staged.pending and (loaded := self._staged.load(self.parameter)) is not None:
                    self.params_epoch = loaded[0]
                batch = self._gather()
                if batch:
                    self._act(batch)
                    self._ship_rows(list({id(r.session): r.session for r in batch}.values()))
                else:
                    with self._cond:
                        sessions = list(self._sessions.values())
                    self._ship_rows(sessions)
                self._reap()
        finally:
            self.stop.set("inference stopping")
            self.server.stop(grace=1.0)
            with self._cond:
                sessions = list(self._sessions.values())
                self._sessions.clear()
            with contextlib.suppress(Exception):
                self._ship_rows(sessions + self._retired, closing=True)
            if self._dropped_rows:
                logger.info("not sending %d finished rows: %s", self._dropped_rows, self.stop.reason)
            while sender_thread.is_alive():  # the end marker, once there is room (a dead sender needs none)
                try:
                    self._outbox.put(None, timeout=0.1)
                    break
                except queue.Full:
                    continue
            sender_thread.join(timeout=10)
            board_thread.join(timeout=opts.heartbeat_interval + 5)
            self.lease_guard.stop()
            self.rows.finish()  # the broker's word on every put, before the final report takes the counts
            self._final_report()
            self.rows.close()
        return self.stop.reason

    def _final_report(self) -> None:
        opts = self.options
        try:
            stats = self._stats(0.0).to_record()
            self.counters.send(lambda deltas, token: self.board.heartbeat(
                "inference", opts.uid, int(opts.lease_ttl * 1000), "inference", stats, deltas, token=token))
            self.board.release_lease("inference", opts.uid)
        except Exception as e:
            logger.warning("could not report the end of inference %s: %s", opts.uid, e)

    def summary(self) -> str:
        return (f"{self.agent_steps} actions in {self.batches} batches, {self.rows.sent_batches} batches of rows "
                f"sent, {self.refused} requests refused")


def inference_run_forever(
    redis_params: RedisParameters,
    queue_params: Any = None,
    options: InferenceOptions | None = None,
    **option_overrides: Any,
) -> None:
    """Serve central inference: wait for a task that asks for it, take the ``inference`` lease (or stand
    by to take it over), act for the task's actors, repeat.

    ``queue_params`` None means the experience queue lives in the board's Redis (the server sends the rows).
    Keyword overrides set :class:`InferenceOptions` fields (``listen="0.0.0.0:50051"``, ``run_once=True``...).
    """
    ensure_logging()
    opts = apply_overrides(options or InferenceOptions(), option_overrides, "inference_run_forever")
    opts.validate()
    opts.set_default_uid("inference")
    require_remote(redis_params, "inference_run_forever")
    check_queue(queue_params)
    board = Board(redis_params.connect(), redis_params.task_name)
    where = f"{redis_params.describe()} task {redis_params.task_name!r}"
    logger.info("inference %s ready; waiting for a task with central inference on %s", opts.uid, where)
    ttl_ms = int(opts.lease_ttl * 1000)

    def claim(task_board: Board, task: TaskSpec) -> int | None:
        if task.inference != "central":
            return None
        return 0 if task_board.claim_lease("inference", opts.uid, ttl_ms) else None

    def standby(task_board: Board, task: TaskSpec) -> str:
        if task.inference != "central":
            return "the task acts with local inference (each actor runs its network); waiting for one that does not"
        return "another server holds the inference lease; standing by to take it over"

    try:
        serve("inference", board, where, opts, queue_params, claim=claim, lease_name=lambda _: "inference",
              standby_note=standby,
              build_run=lambda task_board, task, _: InferenceRun(task_board, redis_params, queue_params, task, opts))
    except KeyboardInterrupt:
        logger.info("inference %s interrupted; exiting (its lease is released)", opts.uid)
