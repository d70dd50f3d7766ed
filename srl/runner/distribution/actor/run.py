"""``actor_run_forever``: claim an actor slot, step envs, send rows of experience.

Owns: the actor process — waiting for a task, holding its slot lease (a
heartbeat is a lease renewal), pulling params in the background by version,
stepping ``envs_per_actor`` envs through the same ``Rollout`` one process uses,
sending the worker's rows (with their initial priorities where the algorithm
has them), following the algorithm's data path (a replay ratio it may not run
ahead of; in sync mode, waiting for the next params version after each
segment), and backpressure. Must never: drop experience silently. When the
queue is full the actor waits (with backoff), keeps renewing its lease, and
reports how long it stalled. It stops within one heartbeat when the task ends
or its lease is lost. Its params are ``params.py``'s, its rate limit and step
budget ``pacing.py``'s, its heartbeats ``node/liveness.py``'s loop.

The loop::

    while True:
        task = wait_for_active_task()
        slot = claim_actor_slot()            # SET NX PX: one atomic command
        run(task, slot)                      # until END, lease lost or Ctrl-C
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from srl.base.env import allowed_env_modules, env_spec
from srl.base.rl import Columns, Parameter, Worker, seed_everything
from srl.base.rollout import Rollout
from srl.runner.distribution.actor.pacing import Pacing, WaitClock
from srl.runner.distribution.actor.params import ActorParams
from srl.runner.distribution.actor.params_cache import ParamsCache, default_directory, private_directory
from srl.runner.distribution.board.board import Board, Heartbeat
from srl.runner.distribution.node.liveness import Beat, BoardWork, LeaseGuard, Liveness
from srl.runner.distribution.node.priority import lower_priority
from srl.runner.distribution.node.retry import Throttle
from srl.runner.distribution.node.serve import (
    BUDGET_BEAT_S,
    CounterDeltas,
    apply_overrides,
    remove_orphans,
    require_remote,
    serve,
)
from srl.runner.distribution.node.stats import ActorStats
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.queues import check_queue, open_queue
from srl.runner.distribution.sending.sender import RowSender, sender_name
from srl.runner.distribution.settings.options import ActorOptions
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.distribution.settings.task import TaskSpec, batch_rows, max_message_rows
from srl.runner.distribution.wire.codec import (
    DEFAULT_MAX_BYTES,
    params_message_bytes,
    task_tag,
)
from srl.runner.distribution.wire.inference import InferenceLostError
from srl.runner.progress import ensure_logging

if TYPE_CHECKING:  # central inference's parts are loaded by an actor of central inference only
    from srl.runner.distribution.actor.halves import Halves
    from srl.runner.distribution.actor.inference_client import InferenceClient

logger = logging.getLogger("srl.actor")

TOTAL_ASKERS = 16
"""actors whose every heartbeat may ask the run's env-step total (more: each asks that share of the time)"""


class ActorRun:
    """One actor working on one task in one slot."""

    def __init__(
        self,
        board: Board,
        redis_params: RedisParameters,
        queue_params: Any,
        task: TaskSpec,
        slot: int,
        options: ActorOptions,
    ) -> None:
        self.board = board
        self.task = task
        self.slot = slot
        self.options = options
        self.lease_name = f"actor:{slot}"
        self.lease_guard = LeaseGuard(board, self.lease_name, options.uid, options.lease_ttl,
                                      options.heartbeat_interval)
        self.stop = StopFlag()
        self.counters = CounterDeltas()
        self.board_work = BoardWork("actor", self.stop)
        config = task.rl_config
        torch.set_num_threads(max(1, config.torch_threads))
        seed = None if config.seed is None else config.seed + 1000 * (slot + 1)
        seed_everything(seed)
        allow = allowed_env_modules(options.allow_env_modules)
        self.spec = env_spec(task.env_config, allow)
        config.check_spec(self.spec)
        self.data_path = config.resolved(self.spec).data_path()
        self.batch_rows = batch_rows(task, options.batch_size)  # the rows a batch is sent at (once, not every step)
        self.pacing = Pacing(self.data_path, task.actor_num, task.max_steps, self.batch_rows,
                             self.data_path.first_rows_steps(config.envs_per_actor), config.envs_per_actor)
        self.segments_made = 0  # the segments (rows) its worker finished and this actor sent
        self.waits = WaitClock()
        self.sender = sender_name(options.uid)  # (sender, seq) names a batch for the trainer's dedupe
        self.task_tag = task_tag(board.task_id)
        self.rows: RowSender | None = None
        self.worker: Worker
        self.inference: InferenceClient | Halves | None = None
        """with central inference: the task's inference server acts; this actor steps envs, keeps no network"""
        self.parameter: Parameter | None = None
        self.params: ActorParams | None = None
        """a local actor's params (None: with central inference the server holds them)"""
        if task.inference == "central":
            self.codec = options.codec(board.task_name)
            ca = options.inference_ca_file or redis_params.ssl_ca_certs
            from srl.runner.distribution.actor.halves import central_rollout

            self.inference, self.rollout, self.worker = central_rollout(
                task, board, self.spec, slot, self.sender, self.task_tag, self.codec, self.stop, ca, seed, allow)
        else:
            self.parameter = config.make_parameter(self.spec, config.resolve_device())
            self.worker = config.make_worker(self.spec, self.parameter, slot, task.actor_num, seed)
            self.worker.plan(task.max_steps, task.max_train_count)
            schema = config.schema(self.spec)
            compress = options.compress if options.compress is not None else schema.has_images
            max_params_bytes = params_message_bytes(self.parameter.to_arrays())
            self.codec = options.codec(board.task_name, compress=compress,
                                       max_bytes=max(max_params_bytes, DEFAULT_MAX_BYTES))
            cache = None
            if options.params_cache_dir != "":
                directory = private_directory(Path(options.params_cache_dir) if options.params_cache_dir
                                              else default_directory())
                if directory is not None:
                    cache = ParamsCache(directory, f"{redis_params.describe()} {board.task_id}")
            self.params = ActorParams(board, self.codec, self.parameter, max_params_bytes, cache, self.stop,
                                      self.board_work, self.counters, options, self.pacing.note_head, self.waits)
            queue = open_queue(queue_params, namespace=redis_params.task_name, role="producer",
                               redis_params=redis_params)
            self.rows = RowSender(queue, board, self.lease_name, self.codec, schema, max_message_rows(task),
                                  task.queue_capacity, self.sender, self.task_tag, self.stop, self.counters,
                                  self.waits.begin, self.waits.end, ahead=options.send_ahead)
            try:
                self.rollout = Rollout(task.env_config, self.worker, config.envs_per_actor, seed,
                                       config.vectorization, allow)
            except BaseException:
                self.rows.close()
                raise
        self.slot_lost = False  # another actor took this run's slot
        self._board_log = Throttle()
        # stats the heartbeat reports
        self.env_steps = 0
        self._steps_counted = 0  # of env_steps, those handed to the board's counters
        self._beat_now = threading.Event()  # wakes the heartbeat: the budget's last steps to count, or a stop
        self.stop.add_hook(self._beat_now.set)
        self.episodes = 0
        self._last_rate = 0.0  # env steps/s at the last heartbeat
        # a heartbeat that asks the run's total costs Redis a look at every role's counters: with many actors
        # each asks every few heartbeats, and beats less often near the budget, so the board's work for it
        # stays what TOTAL_ASKERS actors asking at every beat cost
        self._share = max(1.0, self.task.actor_num / TOTAL_ASKERS)
        self._beats = 0
        self._rate_from = (0, time.monotonic())  # env steps, when: the rate's start
        self._near = False  # the budget is near (it only comes nearer)
        self._counted_at_beat = 0
        self.liveness = Liveness(board, self.lease_name, options.uid, options.lease_ttl, self.stop, self.lease_guard,
                                 self.board_work, self)
        self.throttled_s = 0.0
        self.recent_rewards: list[float] = []

    # ------------------------------------------------------------ heartbeats (node.liveness.Liveness's hooks)
    def report(self) -> Beat:
        """Stats and counters; the run's total env steps asked every few beats (every beat near the budget)."""
        now = time.monotonic()
        steps, since = self._rate_from
        if now - since >= self.options.heartbeat_interval / 2:  # not over the short beats near the budget: bursty
            self._last_rate = (self.env_steps - steps) / max(now - since, 1e-9)
            self._rate_from = (self.env_steps, now)
        self._counted_at_beat = self._count_steps()
        ask = self.task.max_steps is not None and (self._near or self._beats % math.ceil(self._share) == 0)
        self._beats += 1
        return Beat(self._stats(self._last_rate), total_of="env_steps" if ask else "", counts=self.counters)

    def heard(self, answer: Heartbeat) -> None:
        opts = self.options
        turn = self._beats - 1
        pacing = self.pacing
        if answer.total is not None:
            pacing.budget_seen = (answer.total, self._counted_at_beat)
        # the budget ends within two heartbeats (the others' counts are up to one old, and the next comes a
        # heartbeat on): every actor counts its steps more often, so that what each supposes of the others
        # (their steps since their last count) is a short time's worth
        self._near = self._near or pacing.budget_within(self.env_steps, 2 * self._last_rate * opts.heartbeat_interval,
                                                        self.task.actor_num)
        # elastic actors under a replay ratio, and any under an asynchronous lead (shares of empty slots would
        # stall it), look who is there every few beats: every beat while few are, so that the board answers
        # about TOTAL_ASKERS such looks a heartbeat however many come
        cadence = math.ceil(max(1.0, pacing.stepping / TOTAL_ASKERS))
        elastic = self.task.elastic_actors
        looks = pacing.paced and (elastic or self.data_path.lead_versions is not None) and turn % cadence == 0
        if (elastic and self._near and answer.total is not None) or looks:
            # one MGET, spaced so that the board gets about TOTAL_ASKERS such looks a heartbeat fleet-wide
            pacing.saw_actors(tuple(self.board.lease_holders([f"actor:{i}" for i in range(self.task.actor_num)])))

    def in_order(self, answer: Heartbeat) -> None:
        self.pacing.note_head(answer.params_epoch, answer.train_count, answer.params_version)
        params = self.params
        if params is not None and answer.params_version > 0 and answer.params_version != params.latest_version:
            params.poll_now.set()  # the params thread looks now

    def pause(self, answer: Literal["ok", "away"]) -> None:
        opts = self.options
        wait = min(opts.heartbeat_interval, 1.0) if answer == "away" else opts.heartbeat_interval
        if self._near:
            wait = min(wait, BUDGET_BEAT_S * self._share)
        self._beat_now.wait(wait)
        self._beat_now.clear()

    def _count_steps(self) -> int:
        """Hand the env steps taken since the last count to the board's counters: each heartbeat brings all of
        them. Returns this actor's env steps counted so far."""
        steps = self.env_steps
        self.counters.add(env_steps=steps - self._steps_counted)
        self._steps_counted = steps
        return steps

    # ------------------------------------------------------------ the step budget and the rate limit
    def _hold_for_budget(self) -> None:
        """The budget looks spent: send what is pending, count these steps on the board now, and wait until
        the task ends, or a heartbeat's count shows steps left (other actors took fewer than supposed)."""
        self._flush()
        self._beat_now.set()
        self.waits.begin()
        while not self.stop.is_set() and self.pacing.budget_spent(self.env_steps):
            self.stop.wait(0.01)
        self.waits.end()

    def take_lease_back(self) -> bool:
        """The slot lease lapsed (an outage, a pause): take the same slot back if it is still free."""
        opts = self.options
        slot = self.board.claim_actor_slot(opts.uid, self.task.actor_num, int(opts.lease_ttl * 1000),
                                           prefer=self.slot)
        if slot == self.slot:
            away = self.lease_guard.since_renewed()  # a cut link raises nothing: its commands just hang
            text = f"actor {opts.uid} took its lapsed slot {slot} back ({away:.0f}s without the board)"
            logger.warning("%s", text)
            self.board.log_event(text, level="WARNING", source=opts.uid)
            return True
        if slot is not None:  # another slot was free, ours was not: give it back, stand by
            self.board.release_lease(f"actor:{slot}", opts.uid)
        self.slot_lost = True
        self.stop.set(f"lost actor slot {self.slot}: its lease was not renewed in time and another actor took "
                      "it (was this process paused or cut off from Redis?)")
        return False

    def _stats(self, env_steps_per_s: float) -> dict[str, Any]:
        rows = self.rows
        stalled_since = None if rows is None else rows.stalled_since
        stalled_now = 0.0 if stalled_since is None else time.monotonic() - stalled_since
        params = self.params
        inference = self.inference
        params_version = params.version if params is not None else inference.params_version if inference else -1
        latest_version = params.latest_version if params is not None else -1
        recent = self.recent_rewards[-10:]
        return ActorStats(
            uid=self.options.uid,
            slot=self.slot,
            env_steps=self.env_steps,
            env_steps_per_s=round(env_steps_per_s, 1),
            envs=self.rollout.num_envs,
            episodes=self.episodes,
            sent_batches=0 if rows is None else rows.sent_batches,
            params_shared=0 if params is None or params.cache is None else params.cache.shared,
            params_fetched_bytes=0 if params is None else params.fetched_bytes,
            params_version=params_version,
            params_lag=max(0, latest_version - params_version),
            backpressure_wait_s=round((0.0 if rows is None else rows.backpressure_wait_s) + stalled_now, 3),
            stalled_now_s=round(stalled_now, 3),
            rate_limited_s=round(self.throttled_s, 3),
            in_transit=0 if rows is None else rows.in_transit,
            sync_wait_s=round(0.0 if params is None else params.sync_wait_s, 3),
            busy_s=round(self.waits.busy_s(), 3),
            reward=round(float(np.mean(recent)), 3) if recent else None,
            reward_min=round(float(np.min(recent)), 3) if recent else None,
            reward_max=round(float(np.max(recent)), 3) if recent else None,
            extra={k: round(v, 5) for k, v in self.worker.stats().items()},
        ).to_record()

    def _ahead(self) -> bool:
        """Ahead of the trainer (``Pacing.ahead``): the segments its worker made, or its server (central)."""
        made = (self.segments_made + self.worker.pending() if self.params is not None
                else self.pacing.served_segments(self.env_steps, self.rollout.num_envs))
        return self.pacing.ahead(self.env_steps, made)

    def _throttle(self) -> None:
        """Ahead of the trainer: send what is pending, then wait for it to train (fresh data, not a backlog)."""
        self._flush()
        self.waits.begin()
        while not self.stop.is_set() and self._ahead():
            self.stop.wait(0.01)
        self.throttled_s += self.waits.end()

    # ------------------------------------------------------------ sending
    def _flush(self) -> int | None:
        """Send the worker's finished rows; the newest params version among them (None: nothing sent)."""
        columns = self.worker.take()
        if columns is None:
            return None
        self.segments_made += len(next(iter(columns.values())))
        self._send(columns)
        return int(columns["version"].max()) if "version" in columns and len(columns["version"]) else None

    def _send(self, columns: Columns) -> None:
        assert self.rows is not None and self.params is not None  # a central actor's worker finishes no rows
        self.rows.send(columns, self.worker.initial_priorities(columns), self.slot, self.params.epoch,
                       self.params.version)

    # ------------------------------------------------------------ the loop
    def run(self) -> str:
        """Act until the task ends or the slot is lost; returns why it stopped."""
        opts = self.options
        path = self.data_path
        threads = [threading.Thread(target=self.liveness.run, name="srl-actor-board", daemon=True)]
        params = self.params
        if params is not None:  # with central inference the server holds the params
            threads.append(threading.Thread(target=params.run, name="srl-actor-params", daemon=True))
        self.lease_guard.start()  # renews while a heartbeat is late (a slow board)
        for thread in threads:
            thread.start()
        stats = ", ".join(f"{k}={v:.4g}" for k, v in self.worker.stats().items())
        logger.info("actor %s holds slot %d of %d (%d env(s)%s); env %s", opts.uid, self.slot, self.task.actor_num,
                    self.rollout.num_envs, f", {stats}" if stats else "", self.task.env_config)
        batch_started = self.waits.started = time.monotonic()
        restore_priority = lower_priority(opts.central_nice if self.inference is not None else 0, "yield to the server")
        try:
            if params is not None:
                params.wait_for(0, "first")  # act with the trainer's weights from the first step
            while not self.stop.is_set():
                if params is not None and params.staged.pending and self.worker.may_load_params():
                    params.apply()
                if self.pacing.budget_spent(self.env_steps):
                    self._hold_for_budget()
                    batch_started = time.monotonic()
                    continue
                if self.pacing.paced and self._ahead():
                    self._throttle()
                    batch_started = time.monotonic()
                    continue
                try:
                    episodes = self.rollout.step()
                except InferenceLostError as e:  # the server went (or was replaced): episodes start again
                    assert self.inference is not None
                    if self.stop.is_set():
                        continue
                    if self.inference.episodes_lost:
                        logger.warning("%s; restarting this actor's episodes", e)
                        self.rollout.restart()
                    elif self._board_log.ready():
                        logger.warning("%s; reconnecting", e)
                    continue
                for episode in episodes:
                    self.episodes += 1
                    self.recent_rewards.append(episode.total_reward)
                    del self.recent_rewards[:-20]
                    self.counters.add(episodes=1)
                self.env_steps += self.rollout.envs_per_step
                pending = self.worker.pending()
                aged = pending and time.monotonic() - batch_started >= opts.batch_max_age
                if pending >= self.batch_rows or aged:
                    sent_version = self._flush()
                    batch_started = time.monotonic()
                    if path.sync and sent_version is not None and params is not None:  # lockstep: new params next
                        params.wait_for(sent_version, "sync")
        finally:
            restore_priority()
            self.stop.set("actor stopping")
            if params is not None:
                params.poll_now.set()
            for thread in threads:
                thread.join(timeout=opts.heartbeat_interval + opts.params_poll_interval + 5)
            if self.rows is not None:  # the lease is kept while the broker confirms: the client awaits its release
                self.rows.finish()  # the sending thread's last put counted before the final report takes the counts
            self.lease_guard.stop()
            self._final_report()
            self.rollout.close()
            if self.rows is not None:
                self.rows.close()
            if self.inference is not None:
                self.inference.close()
            if params is not None and params.cache is not None:
                params.cache.clear()
            if self.liveness.task_gone:
                remove_orphans(self.board)
        self.board_work.raise_failure()
        return self.stop.reason

    def _final_report(self) -> None:
        """Flush counters and final stats (the client's end-of-run summary reads them), and release the slot
        so a standby can take it at once."""
        opts = self.options
        # the stats of a slot another actor took are that actor's now: only this run's counts still go
        stats = None if self.slot_lost else self._stats(self._last_rate)
        self._count_steps()
        try:
            self.counters.send(  # a last heartbeat: counters and stats in one round trip
                lambda deltas, token: self.board.heartbeat(self.lease_name, opts.uid, int(opts.lease_ttl * 1000),
                                                           self.lease_name, stats, deltas, token=token))
            self.board.release_lease(self.lease_name, opts.uid)
        except Exception as e:  # the board may be gone; the lease then simply expires
            logger.warning("could not report the end of actor %s: %s", opts.uid, e)

    def summary(self) -> str:
        if self.inference is not None:
            return (f"slot {self.slot}, {self.env_steps} env steps, central inference at "
                    f"{self.inference.connected_to or 'none'} ({self.inference.reconnects} reconnect(s))")
        rows = self.rows
        assert rows is not None
        return (f"slot {self.slot}, {self.env_steps} env steps, {rows.sent_batches} batches, "
                f"stalled {rows.backpressure_wait_s:.1f}s")


def actor_run_forever(
    redis_params: RedisParameters,
    queue_params: Any = None,
    options: ActorOptions | None = None,
    **option_overrides: Any,
) -> None:
    """Serve as an actor: wait for a task, claim a free slot, act, repeat.

    ``queue_params`` None means the experience queue lives in the board's Redis.
    Keyword overrides set :class:`ActorOptions` fields (``run_once=True``, ``batch_size=128``...).
    """
    ensure_logging()
    opts = apply_overrides(options or ActorOptions(), option_overrides, "actor_run_forever")
    opts.validate()
    opts.set_default_uid("actor")
    require_remote(redis_params, "actor_run_forever")
    check_queue(queue_params)  # an unknown scheme, a malformed URL, a missing library: now, not when a task comes
    board = Board(redis_params.connect(), redis_params.task_name)
    where = f"{redis_params.describe()} task {redis_params.task_name!r}"
    logger.info("actor %s ready; waiting for a task on %s", opts.uid, where)
    ttl_ms = int(opts.lease_ttl * 1000)
    try:
        serve(
            "actor", board, where, opts, queue_params,
            claim=lambda task_board, task: task_board.claim_actor_slot(opts.uid, task.actor_num, ttl_ms),
            lease_name=lambda slot: f"actor:{slot}",
            standby_note=lambda task_board, task: (f"all {task.actor_num} actor slots are held; standing by to take "
                                                   "one that frees"),
            build_run=lambda task_board, task, slot: ActorRun(task_board, redis_params, queue_params, task, slot,
                                                              opts),
        )
    except KeyboardInterrupt:
        logger.info("actor %s interrupted; exiting (any slot it held is released)", opts.uid)
