"""Central inference, the SEED RL way: one server acts for every actor of a task; actors only step envs.

Owns: the inference node (``inference_run_forever``, ``srl inference``) and :class:`InferenceRun`, one
server's work on one task: holding one of the task's inference leases (``inference``, and ``inference:<k>``
for a task of several servers; a standby waits to take one over) through
``node/liveness.py``'s hooks, saying on the board where it listens, fetching every params version the
trainer publishes, closing the streams of actors whose slot lease lapsed, sending the rows the actors'
workers finish to the task's queue (as actors do, so the trainer cannot tell the difference), its stats,
and the end in order. The actors' connections are ``streams.py``'s, their sessions and the checks of a request
``session.py``'s, the forward pass for all of them ``batcher.py``'s; one loop drives the connections and the
batcher. The protocol is ``wire/inference.py`` and ``wire/link.py``; the actor's side,
``actor/inference_client.py``.

Must never: trust a request. Every message either way is an srl codec BATCH: signed with the task's
secret when there is one (an actor without it is refused), bounded in size, and checked against the
declared columns (the env's observation dtype, shape and bounds; finite rewards; episode starts where
episodes ended). A bad request is refused, counted and logged with its source; its connection is closed
(the actor reconnects and restarts its episodes); the server goes on.

The transport is srl's own frames over TCP (``wire/link.py``): one connection per actor, one request (the
envs' observations, and what followed the previous actions) and one reply (the actions) per step, as SEED
RL's actors do. Over TLS when the server has a certificate; a board reached over TLS demands one.

The loop, per actor and on the server (one thread: no hand-off between threads per request)::

    actor: obs -> request(obs, reward, terminated, truncated, final_obs, started) -> actions -> env.step
    server: poll every connection -> requests -> worker.observe / reset per actor -> one policy() for all
            -> worker.act_with per actor -> replies; finished rows -> queue (backpressure waits)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Literal

import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from srl.base.env import (
    allowed_env_modules,
    env_spec,
)
from srl.base.rl import Parameter, Worker, seed_everything
from srl.runner.distribution.board.board import BOARD_AWAY, Board, BoardDataError, Heartbeat, inference_lease
from srl.runner.distribution.inference.batcher import Batcher, Outbox
from srl.runner.distribution.inference.session import Session
from srl.runner.distribution.inference.streams import ActorStreams
from srl.runner.distribution.node.liveness import Beat, BoardWork, LeaseGuard, Liveness
from srl.runner.distribution.node.serve import CounterDeltas, apply_overrides, require_remote, serve
from srl.runner.distribution.node.stats import InferenceStats
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.queues import check_queue, open_queue
from srl.runner.distribution.sending.sender import RowSender, sender_name
from srl.runner.distribution.settings.options import InferenceOptions
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import (
    TaskSpec,
    batch_rows,
    max_message_rows,
)
from srl.runner.distribution.wire.codec import (
    DEFAULT_MAX_BYTES,
    DecodeError,
    params_message_bytes,
    short,
    task_tag,
)
from srl.runner.progress import ensure_logging

logger = logging.getLogger("srl.inference")


class InferenceRun:
    """One inference server working on one task under the lease of its server index ``server`` (``inference``
    for 0, ``inference:<server>`` for the others of a task of several)."""

    def __init__(self, board: Board, redis_params: RedisParameters, queue_params: Any, task: TaskSpec,
                 options: InferenceOptions, server: int = 0) -> None:
        self.board = board
        self.task = task
        self.options = options
        self.server = server
        self.lease = inference_lease(server)
        self.lease_guard = LeaseGuard(board, self.lease, options.uid, options.lease_ttl, options.heartbeat_interval)
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
        compress = options.compress if options.compress is not None else self.schema.has_images
        max_params = params_message_bytes(self.parameter.to_arrays())
        self.codec = options.codec(board.task_name, compress=compress,
                                   max_bytes=max(max_params, DEFAULT_MAX_BYTES))
        self.max_batch = options.max_batch_envs or self.envs * task.actor_num
        self._outbox: Outbox = queue.Queue(2)
        self.batcher = Batcher(self.parameter, self.envs // task.halves, self.max_batch,
                               batch_rows(task, options.batch_size),
                               options, self.stop, self._outbox)
        # the loop checks a new connection's slot lease on a client of its own whose commands give up within a
        # second: a slow or refusing board must not hold every actor's actions for a socket timeout
        lease_board = Board(redis_params.connect(socket_timeout=1.0, socket_connect_timeout=1.0,
                                                 retry=Retry(NoBackoff(), 0)), board.task_name).bound(board.task_id)
        self.streams = ActorStreams(board, task, options, self.spec, self.batcher, self._make_worker, self.stop,
                                    self.counters, lease_board)
        self.task_tag = task_tag(board.task_id)
        self.rows = RowSender(
            open_queue(queue_params, namespace=redis_params.task_name, role="producer", redis_params=redis_params),
            board, self.lease, self.codec, self.schema, max_message_rows(task), task.queue_capacity,
            sender_name(options.uid), self.task_tag, self.stop, self.counters,
        )
        self.latest_version = 0
        self.board_work = BoardWork("inference", self.stop)
        self.liveness = Liveness(board, self.lease, options.uid, options.lease_ttl, self.stop, self.lease_guard,
                                 self.board_work, self)
        self._rate_from = (0, time.monotonic())  # agent steps, when: the rate's start
        try:
            self.address = self.streams.start()
        except BaseException:
            self.rows.close()
            raise

    def _make_worker(self, key: int, session: int = 1) -> Worker:
        """The worker of session ``key`` (an actor slot, or of an actor of two halves ``slot * 2 + half``: a
        worker of half the envs, as if of a slot of its own: Ape-X's ε of those very envs), for its
        ``session``-th connection (a stream of its own random draws: a slot that reconnects does not repeat
        them)."""
        config = self.config
        seed = None if config.seed is None else config.seed + 1000 * (key + 1) + 7919 * (session - 1)
        if self.task.halves == 1:
            return self._planned(config.make_worker(self.spec, self.parameter, key, self.task.actor_num, seed))
        halved = dataclasses.replace(config, envs_per_actor=config.envs_per_actor // self.task.halves)
        return self._planned(halved.make_worker(self.spec, self.parameter, key,
                                                self.task.actor_num * self.task.halves, seed))

    def _planned(self, worker: Worker) -> Worker:
        worker.plan(self.task.max_steps, self.task.max_train_count)
        return worker

    # ------------------------------------------------------------ what the batcher and the streams count
    @property
    def agent_steps(self) -> int:
        return self.batcher.agent_steps

    @property
    def batches(self) -> int:
        return self.batcher.batches

    @property
    def refused(self) -> int:
        return self.streams.refused

    @property
    def _sessions(self) -> dict[int, Session]:
        return self.batcher.sessions

    @property
    def _retired(self) -> list[Session]:
        return self.batcher.retired

    # ------------------------------------------------------------ sending
    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            columns, priorities, slot, version = item
            try:
                self.rows.send(columns, priorities, slot, self.batcher.params_epoch, version)
            except Exception as e:
                logger.exception("inference sender crashed")
                self.stop.set(f"sender crashed: {type(e).__name__}: {short(e)}")
                return

    # ------------------------------------------------------------ background: lease, stats, params, actors
    def _board_thread(self) -> None:
        self.liveness.run()
        self.streams.wake()

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
        self.stop.set(f"lost the {self.lease} lease: it was not renewed in time (was this process paused or cut "
                      "off from Redis?)")
        return False

    def in_order(self, answer: Heartbeat) -> None:
        self._check_actor_leases()
        self._log_events()
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

    def _log_events(self) -> None:
        """Put the loop's refusals on the board's event log (the loop hands them over: it never waits on the
        board for a log line)."""
        while self.streams.events:
            text = self.streams.events.popleft()
            with contextlib.suppress(*BOARD_AWAY):
                self.board.log_event(text, level="WARNING", source=self.options.uid)

    def _check_actor_leases(self) -> None:
        """Free the state of actors whose slot lease lapsed (a process killed, or paused past its TTL)."""
        sessions = self.batcher.open_sessions()
        holders = self.board.lease_holders([f"actor:{s.slot}" for s in sessions])
        for session, holder in zip(sessions, holders, strict=True):
            if holder != session.uid:
                logger.warning("actor %s lost slot %d (lease lapsed or taken): closing its connection", session.uid,
                               session.slot)
                session.closed.set()
        self.streams.wake()

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
        self.batcher.staged.put(record.epoch, record.version, arrays)
        self.latest_version = record.version
        self.streams.wake()

    def _stats(self, rate: float) -> InferenceStats:
        means = self.batcher.take_means()
        return InferenceStats(
            uid=self.options.uid, sessions=len({s.slot for s in self.batcher.open_sessions()}),
            agent_steps=means.agent_steps,
            agent_steps_per_s=round(rate, 1), batches=means.batches, batch_envs_mean=means.envs,
            batch_wait_ms_mean=means.wait_ms, params_version=self.parameter.version,
            sent_batches=self.rows.sent_batches, refused_requests=self.refused,
            backpressure_wait_s=round(self.rows.backpressure_wait_s, 3),
        )

    # ------------------------------------------------------------ the loop
    def run(self) -> str:
        opts = self.options
        if not self.board.set_inference_address(opts.uid, self.address, self.tls, self.server):
            self.streams.stop_serving(0)
            self.rows.close()
            return f"lost the {self.lease} lease before it could say where it listens"
        of = f" (server {self.server} of {self.task.inference_servers})" if self.task.inference_servers > 1 else ""
        logger.info("inference %s serves %s on %s%s (%s, batches of up to %d envs, wait %.3g ms)", opts.uid,
                    self.config.algorithm, self.address, of, "TLS" if self.tls else "no TLS", self.max_batch,
                    opts.max_wait_ms)
        board_thread = threading.Thread(target=self._board_thread, name="srl-inference-board", daemon=True)
        sender_thread = threading.Thread(target=self._send_loop, name="srl-inference-sender", daemon=True)
        self.lease_guard.start()  # renews while the board thread is busy fetching params
        board_thread.start()
        sender_thread.start()
        self.stop.add_hook(self.streams.wake)
        try:
            while not self.stop.is_set():
                self.streams.poll(self.batcher.wait_s())
                self.streams.answer(self.batcher.turn())
        finally:
            self.stop.set("inference stopping")
            self.streams.stop_serving(1.0)
            with contextlib.suppress(Exception):
                self.batcher.close()
            if self.batcher.dropped_rows:
                logger.info("not sending %d finished rows: %s", self.batcher.dropped_rows, self.stop.reason)
            while sender_thread.is_alive():  # the end marker, once there is room (a dead sender needs none)
                try:
                    self._outbox.put(None, timeout=0.1)
                    break
                except queue.Full:
                    continue
            sender_thread.join(timeout=10)
            board_thread.join(timeout=opts.heartbeat_interval + 5)
            self.rows.finish()  # the broker's word on every put, before the final report takes the counts
            self.lease_guard.stop()  # kept until now: the client awaits the lease's release for the last counts
            self._final_report()
            self.rows.close()
        return self.stop.reason

    def _final_report(self) -> None:
        opts = self.options
        try:
            stats = self._stats(0.0).to_record()
            self.counters.send(lambda deltas, token: self.board.heartbeat(
                self.lease, opts.uid, int(opts.lease_ttl * 1000), self.lease, stats, deltas, token=token))
            self.board.release_lease(self.lease, opts.uid)
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
        """The first of the task's server leases free (its index), or None: every one is held."""
        if task.inference != "central":
            return None
        for server in range(task.inference_servers):
            if task_board.claim_lease(inference_lease(server), opts.uid, ttl_ms):
                return server
        return None

    def standby(task_board: Board, task: TaskSpec) -> str:
        if task.inference != "central":
            return "the task acts with local inference (each actor runs its network); waiting for one that does not"
        if task.inference_servers > 1:
            return (f"the task's {task.inference_servers} inference servers are all there; standing by to take one "
                    "over")
        return "another server holds the inference lease; standing by to take it over"

    try:
        serve("inference", board, where, opts, queue_params, claim=claim, lease_name=inference_lease,
              standby_note=standby,
              build_run=lambda task_board, task, server: InferenceRun(task_board, redis_params, queue_params, task,
                                                                      opts, server))
    except KeyboardInterrupt:
        logger.info("inference %s interrupted; exiting (its lease is released)", opts.uid)
