"""A node's liveness: the one heartbeat loop every role runs, and the lease kept while a heartbeat is late.

Owns: :class:`Liveness` — a heartbeat is the lease's renewal; the rules for what its answer says (the task
gone, replaced by another of its name, no longer ACTIVE, the lease lapsed) are written here once, and a role
plugs in :class:`Heartbeating`: what its heartbeat carries, what it reads from the answer, what a lapsed lease
means to it (take it back, or stop) and when it beats next. :class:`LeaseGuard` renews from a thread of its
own while a heartbeat is late; :class:`BoardWork` is how background threads do board work (a board away is
waited out and said so; refused credentials or a crash stop the node). Must never: know what a role does
inside a run.

    while not stopped:                              # Liveness.run, in the role's board thread
        answer = heartbeat(role.report())           # renew the lease, stats, counters; read the task
        role.heard(answer)
        gone / replaced / lease lapsed and not role.take_lease_back() / task not ACTIVE: stop, say why
        role.in_order(answer)
        role.pause(...)                             # until the next heartbeat is due
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from srl.runner.distribution.board.board import BOARD_AWAY, Board, Heartbeat
from srl.runner.distribution.node.retry import Throttle
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.settings.credentials import CredentialsError
from srl.runner.distribution.settings.redis_parameters import refusal_code
from srl.runner.distribution.settings.task import TASK_GONE, TASK_REPLACED
from srl.runner.distribution.wire.codec import short

logger = logging.getLogger("srl.node")


@dataclass
class Beat:
    """What one heartbeat carries: the role's stats and counter deltas, and the counter whose run total it asks."""

    stats: dict[str, Any] | None
    total_of: str = ""
    counts: Any = field(default=None)
    """the role's :class:`~srl.runner.distribution.node.serve.CounterDeltas`, sent with it (None: none)"""


class Heartbeating(Protocol):
    """What a role plugs into :class:`Liveness`; every method runs in the role's board thread."""

    def report(self) -> Beat:
        """What this heartbeat carries (board work a role reports with it, such as dead letters, goes here)."""
        ...

    def heard(self, answer: Heartbeat) -> None:
        """What the role reads from every answer, before the rules (a budget's total, the server's clock)."""
        ...

    def take_lease_back(self) -> bool:
        """The lease lapsed: True once taken back; False having stopped the node, saying why."""
        ...

    def in_order(self, answer: Heartbeat) -> None:
        """The lease held and the task ACTIVE: the role's own follow-up (params to fetch, who holds slots)."""
        ...

    def pause(self, answer: Literal["ok", "away"]) -> None:
        """Wait until the next heartbeat is due (or the node stops)."""
        ...


class BoardWork:
    """How a node's background threads (heartbeats, params, publications) do their board work, and what
    ended them: a board that is away is logged every few seconds and tried again, the node goes on; refused
    credentials or a crash stop the node (``refused_by``, ``fatal``; :meth:`raise_failure` after the run)."""

    def __init__(self, node: str, stop: StopFlag, while_away: str = "retrying") -> None:
        self.node = node
        self.stop = stop
        self.while_away = while_away
        """what the node does meanwhile, for the log line"""
        self.fatal: str | None = None
        self.refused_by: CredentialsError | None = None
        self.away_since: float | None = None
        self._log = Throttle()

    def run(self, work: Callable[[], None], thread: str) -> Literal["ok", "away", "stop"]:
        """Do ``work`` for ``thread``: "ok", "away" (try again later) or "stop" (the node is stopping)."""
        try:
            work()
        except BOARD_AWAY as e:
            if self.away_since is None:
                self.away_since = time.monotonic()
            if self._log.ready():
                code = refusal_code(e)
                logger.warning("board %s for %.0fs (%s); %s",
                               "unreachable or unreadable" if code is None else f"refusing with {code}",
                               time.monotonic() - self.away_since, short(e, 400), self.while_away)
            return "away"
        except CredentialsError as e:  # a password rotated, a permission revoked: this node stops, not the task
            if self.refused_by is None:
                logger.error("%s", e)
                self.refused_by = e
            self.stop.set(f"refused: {e}")
            return "stop"
        except Exception as e:
            logger.exception("%s %s thread crashed", self.node, thread)
            self.fatal = self.fatal or f"{thread} thread crashed: {type(e).__name__}: {short(e)}"
            self.stop.set(self.fatal)
            return "stop"
        self.away_since = None
        return "stop" if self.stop.is_set() else "ok"

    def raise_failure(self) -> None:
        """After the run: raise what stopped a background thread, if anything did."""
        if self.refused_by is not None:
            raise self.refused_by
        if self.fatal:
            raise RuntimeError(self.fatal)


class LeaseGuard:
    """Keeps lease ``name`` from a thread of its own whenever the run's heartbeat is late.

    A run renews its lease with its heartbeat, in the thread that also moves params (megabytes over a slow
    link), publishes them and reads the task: a renewal must never wait behind one of those. The guard
    renews (on its own connection from the client's pool) only when no renewal happened for
    ``interval_s``: while the heartbeat is on time it sends nothing. The run says :meth:`renewed` after
    each heartbeat that held the lease, with the time it sent it. A renewal that finds the lease gone stops the
    guard's renewals until the run took it back (its heartbeat finds out, and decides). Before a run's
    first heartbeat (claiming, building: torch's imports, a replay memory of gigabytes, a CUDA context),
    nothing says :meth:`renewed`, so the guard renews every ``interval_s``, for ``max_s`` at most: a start
    that hangs must not hold the slot for ever.

        with LeaseGuard(board, "trainer", uid, ttl_s, interval_s) as guard:
            sent = time.monotonic(); ... heartbeat(...) held: guard.renewed(sent) ...
    """

    def __init__(self, board: Board, name: str, uid: str, ttl_s: float, interval_s: float,
                 max_s: float = float("inf")) -> None:
        self.board = board
        self.name = name
        self.uid = uid
        self.interval_s = interval_s
        self.max_s = max_s
        self.late_renewals = 0
        """renewals the guard made because the heartbeat was late"""
        self._ttl_ms = int(ttl_s * 1000)
        self._last = time.monotonic()
        self.armed = True
        """False from a renewal that found the lease gone until the run says :meth:`renewed` again"""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"srl-lease-{name}", daemon=True)

    def renewed(self, sent_at: float) -> None:
        """The run's heartbeat sent at ``sent_at`` (``time.monotonic()``) renewed the lease, or the run took it
        back since. The renewal dates from the sending, not the answer: an answer held up by a cut link
        reports a renewal made before the cut, and the lease runs out a TTL after that."""
        self._last = max(self._last, sent_at)
        self.armed = True

    def since_renewed(self) -> float:
        """Seconds since the lease was last renewed (by a heartbeat or by the guard)."""
        return time.monotonic() - self._last

    def lapsed(self) -> bool:
        """The lease may be another node's now: a renewal found it gone, or none was made within its TTL (the
        board out of reach); until the run takes it back."""
        return not self.armed or self.since_renewed() * 1000 > self._ttl_ms

    def start(self) -> LeaseGuard:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> LeaseGuard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _keep(self) -> None:
        give_up_at = time.monotonic() + self.max_s
        failed = False
        retry_at = 0.0  # after a failed renewal: the next try, an interval later (not at once, again and again)
        while not self._done.wait(max(0.0, self._last + self.interval_s - time.monotonic(),
                                      retry_at - time.monotonic()) if self.armed else self.interval_s):
            now = time.monotonic()
            if now >= give_up_at:
                logger.warning("%s has not started its run within %.0f s of taking lease %s; no longer renewing "
                               "it, so a standby can take over (max_start_s)", self.uid, self.max_s, self.name)
                return
            if not self.armed or now - self._last < self.interval_s or now < retry_at:
                continue
            try:
                held = self.board.renew_lease(self.name, self.uid, self._ttl_ms)
            except Exception as e:  # a blip, a failover (READONLY), a full Redis: the next tick retries
                if not failed:
                    logger.warning("renewing lease %s failed (%s); retrying", self.name, short(e))
                failed = True
                retry_at = time.monotonic() + self.interval_s
                continue
            failed = False
            if not held:  # lost all the same: the run finds out at its next heartbeat
                self.armed = False
                continue
            self._last = now
            self.late_renewals += 1


def keep_lease(board: Board, name: str, uid: str, ttl_s: float, interval_s: float,
               max_s: float = float("inf")) -> LeaseGuard:
    """Renew lease ``name`` every ``interval_s`` while a block runs that sends no heartbeats (a run being
    built, a trainer's last publication), for ``max_s`` at most: a :class:`LeaseGuard` nobody tells."""
    return LeaseGuard(board, name, uid, ttl_s, interval_s, max_s)


class Liveness:
    """One node's heartbeats under lease ``lease_name``, and what each answer means for its run.

    ``task_gone``, ``task_replaced`` and ``task_ended`` say what a heartbeat found; the role reads them when its run
    ends (what to write back, what to keep)."""

    def __init__(self, board: Board, lease_name: str, uid: str, ttl_s: float, stop: StopFlag, guard: LeaseGuard,
                 work: BoardWork, role: Heartbeating) -> None:
        self.board = board
        self.lease_name = lease_name
        self.uid = uid
        self.ttl_ms = int(ttl_s * 1000)
        self.stop = stop
        self.guard = guard
        self.work = work
        self.role = role
        self.task_gone = False
        """the task vanished from the board (what the run would write back is removed)"""
        self.task_replaced = False
        """another task of this name replaced it"""
        self.task_ended = False
        """the task ended on the board (the client's cancel, a limit)"""

    def beat(self) -> None:
        """One heartbeat and the rules for its answer."""
        beat = self.role.report()
        sent = time.monotonic()

        def write(deltas: dict[str, float] | None, token: str) -> Heartbeat:
            return self.board.heartbeat(self.lease_name, self.uid, self.ttl_ms, self.lease_name, beat.stats, deltas,
                                        total_of=beat.total_of, token=token)

        answer = write(None, "") if beat.counts is None else beat.counts.send(write)
        self.role.heard(answer)
        if answer.task_status is None:
            self.task_left(TASK_GONE, gone=True)
            return
        if answer.replaced:
            self.task_left(TASK_REPLACED)
            return
        if not answer.lease_held and not self.role.take_lease_back():
            return
        self.guard.renewed(sent)
        if answer.task_status != "ACTIVE":
            self.task_ended = True
            status = self.board.get_status()
            reason = status.end_reason if status is not None else ""
            self.stop.set(f"task {answer.task_status.value}: {reason or 'no reason given'}")
            return
        self.role.in_order(answer)

    def task_left(self, reason: str, *, gone: bool = False) -> None:
        """The task this run serves is no longer on the board (gone, or replaced by another of its name): stop."""
        self.task_gone = self.task_gone or gone
        self.task_replaced = self.task_replaced or not gone
        if not self.stop.is_set():
            logger.error("%s", reason)
        self.stop.set(reason)

    def run(self) -> None:
        """Heartbeats until the node stops (the role's board thread)."""
        while not self.stop.is_set():
            answer = self.work.run(self.beat, "board")
            if answer == "stop":
                break
            self.role.pause(answer)
