"""How far an actor may step: the replay ratio's allowance (or an asynchronous path's lead on the learner) and
the task's step budget, and its time waiting.

Owns: :class:`Pacing` — from what the actor's heartbeats and params reads tell of the trainer (its epoch,
train_count and params version) and of the run (its env-step total, who holds the slots), the env steps (or
segments) this actor may have made by now, and whether the budget is spent; :class:`WaitClock`, the actor
loop's time spent waiting (for room in the queue, for params, at its rate limit), from which its busy time
follows. Must never: wait or touch the board itself (the actor's threads do, and tell it what they read).
"""

from __future__ import annotations

import logging
import threading
import time

from srl.base.rl import DataPath

logger = logging.getLogger("srl.actor")


class Pacing:
    """One actor's rate limit and step budget; ``note_head`` and ``saw_actors`` come from two threads."""

    def __init__(self, data_path: DataPath, actor_num: int, max_steps: int | None, batch_rows: int,
                 first_rows_steps: int, envs_per_actor: int = 1) -> None:
        self.data_path = data_path
        self.actor_num = actor_num
        self.max_steps = max_steps
        self.version_segments = data_path.segments_per_version(actor_num, envs_per_actor)
        """segments the learner consumes per params version, all actors together (``lead_versions``)"""
        self.slack = batch_rows + first_rows_steps
        """one batch of slack (so the warmup's last transitions are not stuck in an unsent batch) and the steps its
        envs take before their rows come (R2D2's overlapping sequences)"""
        self.latest_train_count = 0
        self.latest_version = 0
        """the newest params version the trainer published, as far as this actor heard"""
        self.budget_seen: tuple[float, int] | None = None
        """with ``max_steps``: the run's env steps on the board at the last heartbeat (this actor's counted), and
        this actor's env steps then (:meth:`budget_spent`)"""
        self.stepping = actor_num
        """the actors supposed to step, this one among them: every slot, or with elastic actors the slots held
        at the last look (:meth:`saw_actors`); the rate limit shares the replay ratio's env steps among them,
        and the budget supposes each took as many steps as this one"""
        self._holders: tuple[str | None, ...] | None = None
        """elastic actors: who held each slot at the last look (None: not looked yet)"""
        self._trained_base: int | None = None  # the trainer's train_count (or params version) when the allowance began
        self._steps_base = 0  # this actor's env steps (or segments) then
        self._trainer_epoch = -1  # the epoch of the params head last seen (a new one: a new trainer)
        self._rebase = False  # a new trainer took over, or the elastic actors there changed
        self._lock = threading.Lock()

    @property
    def paced(self) -> bool:
        """Whether this actor waits for the trainer: a replay ratio, or an asynchronous path's lead."""
        return self.data_path.env_steps_per_train is not None or self.data_path.lead_versions is not None

    def note_head(self, epoch: int, train_count: int, version: int = 0) -> None:
        """Follow the trainer's train_count and params version. A new epoch is a new trainer (the last one
        died): it goes on from its checkpoint's train_count with an empty replay memory (or buffer), so the
        rate limit starts over from here, with a warmup's share, or it would wait for rows this actor waits
        to be allowed to send."""
        with self._lock:  # the heartbeat and the params thread both follow it
            if epoch > self._trainer_epoch >= 1:
                if self.paced:
                    logger.info("a new trainer (epoch %d) goes on from train_count %d: the rate limit starts over "
                                "with a warmup's share", epoch, train_count)
                self.latest_train_count, self.latest_version = train_count, version
                self._rebase = True
            else:
                self.latest_train_count = max(self.latest_train_count, train_count)
                self.latest_version = max(self.latest_version, version)
            self._trainer_epoch = max(self._trainer_epoch, epoch)

    def saw_actors(self, holders: tuple[str | None, ...]) -> None:
        """Elastic actors (and an asynchronous path's lead, whatever the task): who holds the task's slots now.
        Their count is the actors supposed to step. When they changed, this actor's rate limit starts over
        from where it stands, with its share of a warmup among those there: the shares of the replay ratio
        were cut for as many actors as there were, so a newcomer's share taken from what the others had been
        allowed, or what one that left was allowed and did not send, would leave the trainer short of rows,
        and every actor waiting, for ever."""
        there = max(1, sum(holder is not None for holder in holders))
        with self._lock:
            changed = self._holders is not None and holders != self._holders
            self._holders, self.stepping = holders, there
            if changed and self.paced:
                self._rebase = True
        if changed:
            logger.info("%d actor(s) of up to %d there now: the rate limit starts over from here with a "
                        "warmup's share among them", there, self.actor_num)

    def allowed_steps(self, env_steps: int) -> float:
        """Env steps this actor may have taken by now: its share of the warmup plus the replay ratio's env steps
        per train step the trainer made since this actor started (or the trainer, or the elastic actors there,
        changed), plus the slack. The share is among the actors supposed to step: every slot, or with elastic
        actors those held (one actor of a maximum of sixteen fills the warmup alone)."""
        trained = max(0, self.latest_train_count)
        if self._trained_base is None or self._rebase:
            self._rebase = False
            self._trained_base, self._steps_base = trained, env_steps
        share = self.data_path.env_steps_allowed(trained - self._trained_base) / self.stepping
        return self._steps_base + share + self.slack

    def ahead(self, env_steps: int, segments: int | None) -> bool:
        """Whether an actor that took ``env_steps`` and made ``segments`` (None: rows it does not make) is
        ahead of the trainer: of the replay ratio's allowance, or of an asynchronous path's lead."""
        if self.data_path.env_steps_per_train is not None:
            return env_steps >= self.allowed_steps(env_steps)
        if self.data_path.lead_versions is not None and segments is not None:
            return segments >= self.allowed_segments(segments)
        return False

    def served_segments(self, env_steps: int, envs: int) -> int | None:
        """With central inference the server makes an actor's segments: those of its ``envs`` envs after
        ``env_steps`` steps in all, one per ``segment_length`` steps of each env (a restarted session's partial
        segments are counted as made: the pace errs towards waiting). None: not a segment path."""
        length = self.data_path.segment_length
        return env_steps // envs // length * envs if length else None

    def allowed_segments(self, segments: int) -> float:
        """Asynchronous segments (``lead_versions``): the segments this actor may have made by now (``segments``
        made so far): its share among the actors stepping of what the learner consumed since this actor started
        (or the trainer, or the elastic actors there, changed), ``version_segments`` per params version it
        published, and of ``lead_versions`` versions more. Its rows are then trained within about that many
        versions of the params that acted them, not refused as too old after waiting in a full queue."""
        assert self.data_path.lead_versions is not None
        version = max(0, self.latest_version)
        if self._trained_base is None or self._rebase:
            self._rebase = False
            self._trained_base, self._steps_base = version, segments
        versions = version - self._trained_base + self.data_path.lead_versions
        return self._steps_base + versions * self.version_segments / self.stepping

    def budget_spent(self, env_steps: int) -> bool:
        """Whether the task's ``max_steps`` is reached as far as this actor can tell: the run's total at the
        last heartbeat, plus the steps this actor took since, as many times as actors step (the task's slots;
        with elastic actors, the slots held), for the others' steps reach the board only with their
        heartbeats. The trainer ends the task on the board's count; an actor that stepped on until it heard
        would overshoot the budget by a heartbeat or two of every actor's steps."""
        return self.budget_within(env_steps, 0.0)

    def budget_within(self, env_steps: int, steps: float, actors: int | None = None) -> bool:
        """Whether ``steps`` more of this actor (and as many of every other of ``actors``, by default those
        supposed to step) would reach ``max_steps``."""
        seen = self.budget_seen
        if seen is None or self.max_steps is None:
            return False
        total, at = seen
        return total + (env_steps - at + steps) * (actors or self.stepping) >= self.max_steps


class WaitClock:
    """The actor loop's time spent waiting, one wait at a time (``begin``, ``end``), and its busy time."""

    def __init__(self) -> None:
        self.started: float | None = None
        """when the loop began acting (None: not yet)"""
        self._waited_s = 0.0  # every wait of the loop (backpressure, sync, rate limit, first params)
        self._wait_started: float | None = None  # the wait going on now

    def begin(self) -> None:
        self._wait_started = time.monotonic()

    def end(self) -> float:
        """The wait is over: its seconds."""
        started, self._wait_started = self._wait_started, None
        waited = 0.0 if started is None else time.monotonic() - started
        self._waited_s += waited
        return waited

    def busy_s(self) -> float:
        """Seconds the loop has spent not waiting: stepping, acting, sending, loading params."""
        if self.started is None:
            return 0.0
        now = time.monotonic()
        ongoing = self._wait_started
        return max(0.0, now - self.started - self._waited_s - (0.0 if ongoing is None else now - ongoing))
