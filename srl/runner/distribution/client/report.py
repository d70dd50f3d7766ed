"""What the client (and ``srl status``) says of a task: progress lines, the summary, how to start a node.

Owns: :class:`BoardSnapshot` and :class:`Serving`, what a line needs from the board, read before any line
is formatted (both from one ``Board.view``: ``read_task``); the lines themselves as pure functions of them
(``progress_text``, ``summary_text``, ``batch_accounts``); the readers that take a snapshot and format it
(``progress_lines``, ``summary_lines``); :class:`NodeHints`; how long a task has run by the board's clock.
Must never: read the board while formatting a line: every read is in ``read_task`` or a snapshot's
``read``, one round trip whatever the number of actors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from srl.runner.distribution.board.board import Board, InferenceAddress, Refusal, TaskStatus, TaskView, inference_lease
from srl.runner.distribution.node.stats import ActorStats, InferenceStats, NodeStats, Reports, TrainerStats
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.sending.in_flight import batches_given_back, batches_in_flight, batches_refused
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from srl.runner.progress import eta, format_seconds

logger = logging.getLogger("srl.client")

REFUSAL_SHOWN_S = 30.0
"""a node's refusal of the task is shown while it is this fresh (nodes renew theirs while they refuse)"""


@dataclass(frozen=True)
class BoardSnapshot:
    """What every node last reported and what they counted together: the summary's and a history row's
    whole input, and the first half of a progress line's."""

    reports: Reports
    counters: dict[str, float]
    params_head: tuple[int, int, int] | None
    """``(epoch, version, train_count)`` of the latest params; None before the first publish"""

    @classmethod
    def read(cls, board: Board, actor_num: int = 0, servers: int = 1) -> BoardSnapshot:
        """Read in one round trip (``actor_num``: the task's actor slots, ``servers`` its inference servers,
        whose stats are read in it; any other role's cost one more)."""
        return cls.of(board.view(actor_num, lease_slots=0, servers=servers))

    @classmethod
    def of(cls, view: TaskView) -> BoardSnapshot:
        return cls(Reports.of(view.stats), view.counters, view.params_head)

    @property
    def train_count(self) -> int:
        """The run's train_count: the trainer's stats, or the latest params head when it is newer (params
        are published between heartbeats)."""
        trainer = self.reports.trainer
        return max(trainer.train_count if trainer is not None else 0, self.params_head[2] if self.params_head else 0)


@dataclass(frozen=True)
class Serving:
    """Who serves a task: its slots, the holders of its leases, the nodes that refuse it and where its
    inference server listens: the second half of a progress line's input."""

    actor_num: int
    central: bool
    """the task runs central inference"""
    elastic: bool
    """free actor slots are not missing"""
    trainer: str | None
    inference: list[str | None]
    """the holder of each inference server's lease (None: free); one, unless the task has several servers"""
    actors: list[str | None]
    """the holder of each actor slot (None: free)"""
    refusals: dict[str, list[Refusal]]
    """fresh refusals by role, oldest first (none are read for an ended task)"""
    inference_addresses: list[InferenceAddress | None]
    """where each inference server listens (empty without central inference)"""
    read_at: float
    """this machine's clock when read: how long a node has been missing is counted to it"""

    @classmethod
    def of(cls, view: TaskView, ended: bool, board: Board) -> Serving:
        """From ``view``, read with the refusals of the last ``REFUSAL_SHOWN_S``; ``board`` reads the leases of
        the slots the task's config counts beyond those of its record, when they differ (they do not for a
        task the client submitted)."""
        config = view.config
        actor_num = int(config.get("actor_num", 1))
        central = config.get("inference") == "central"
        servers = len(view.inference_addresses_or_errors)
        refusals: dict[str, list[Refusal]] = {"trainer": [], "actor": [], "inference": []}
        if not ended:
            for refusal in view.refusals:
                refusals.setdefault(refusal.role, []).append(refusal)
        # every lease in one read: a read per slot would cost a round trip each (1,000 slots at 20 ms: 20 s a
        # line, during which the client would see neither the task's end nor its own timeout)
        names = ["trainer", *(inference_lease(k) for k in range(servers)), *(f"actor:{i}" for i in range(actor_num))]
        unread = [name for name in names if name not in view.holders]
        read = {**view.holders, **dict(zip(unread, board.lease_holders(unread), strict=True))}
        holders = [read[name] for name in names]
        return cls(actor_num=actor_num, central=central, elastic=config.get("elastic_actors") is True,
                   trainer=holders[0], inference=holders[1 : 1 + servers], actors=holders[1 + servers :],
                   refusals=refusals, read_at=time.time(),
                   inference_addresses=[view.inference_address_of(k) for k in range(servers)] if central else [])


def read_task(board: Board, status: TaskStatus) -> tuple[BoardSnapshot, Serving]:
    """What a progress line says of the task ``status`` is of, read from ``board`` in one round trip."""
    view = board.view(status.actor_num, refusal_age_s=REFUSAL_SHOWN_S, servers=status.inference_servers)
    return BoardSnapshot.of(view), Serving.of(view, status.status.finished, board)


def progress_lines(
    board: Board,
    status: TaskStatus,
    elapsed: float,
    max_train_count: int | None = None,
    max_steps: int | None = None,
    timeout: float | None = None,
    hints: NodeHints | None = None,
) -> list[str]:
    """The client's (and ``srl status``') view of a task, read from ``board``: see :func:`progress_text`."""
    snapshot, serving = read_task(board, status)
    return progress_text(snapshot, serving, status, elapsed, max_train_count, max_steps, timeout, hints)


def progress_text(
    snapshot: BoardSnapshot,
    serving: Serving,
    status: TaskStatus,
    elapsed: float,
    max_train_count: int | None = None,
    max_steps: int | None = None,
    timeout: float | None = None,
    hints: NodeHints | None = None,
) -> list[str]:
    """One line for the task, one per node. A node missing from a running task is said so with how to
    start one, or with why the nodes that tried refuse the task; an ended task's nodes are not asked for."""
    reports, counters = snapshot.reports, snapshot.counters
    actor_num = serving.actor_num
    ended = status.status.finished
    trainer = reports.trainer
    train_count = trainer.train_count if trainer is not None else 0
    env_steps = int(counters.get("env_steps", 0))
    etas = [eta(train_count, max_train_count, elapsed), eta(env_steps, max_steps, elapsed),
            None if timeout is None else timeout - elapsed]
    known = [e for e in etas if e is not None]
    # actors report what they sent at their heartbeats, the trainer what it received as it comes: a batch
    # received (or refused) was sent, whatever the counts say yet
    received, refused = counters.get("received_batches", 0), batches_refused(counters)
    sent = max(counters.get("sent_batches", 0), received + refused)
    in_flight = max(0.0, batches_in_flight(counters))
    stale = counters.get("stale_rows", 0)
    when = f"ended after {format_seconds(elapsed)}" if ended else (
        f"{format_seconds(elapsed)} elapsed, ETA {format_seconds(min(known) if known else None)}")
    evaluation = reports.evaluator
    lines = [
        f"task {status.status.value} {when}"
        f" | train {train_count}{'/' + str(max_train_count) if max_train_count else ''} | env steps {env_steps}"
        f" | batches sent {sent:.0f} received {received:.0f}" + (f" refused {refused:.0f}" if refused else "")
        + f" (in flight ~{in_flight:.0f}) | bad {counters.get('bad_messages', 0):.0f}"
        + (f" | stale rows refused {stale:.0f}" if stale else "")
        + (f" | eval {_g(evaluation.eval_mean)} at train {evaluation.train_count}" if evaluation else "")
    ]
    hints = hints or NodeHints("--host HOST")
    refusals = {role: list(found) for role, found in serving.refusals.items()}  # each is said once

    def missing(role: str, stats: NodeStats | None, label: str) -> str:
        if ended:
            return f"  {label}: none (the task has ended)"
        waited = f"MISSING for {format_seconds(_missing_for(stats, elapsed, serving.read_at))}"
        if refusals.get(role):
            refusal = refusals[role].pop(0)
            return f"  {label}: {waited} — {refusal.uid} refuses the task: {refusal.reason}"
        return f"  {label}: {waited} — start one: {hints.command(role)} (or {role}_run_forever(...))"

    holder = serving.trainer
    latest_version = trainer.params_version if trainer is not None else 0
    if holder is None and (not ended or trainer is None):
        lines.append(missing("trainer", trainer, "trainer"))
    else:
        trainer = trainer or TrainerStats()  # a holder that has not reported yet
        lag = ""
        if trainer.lag_steps_p50 is not None or trainer.lag_p50 is not None:
            lag = (f", policy lag {_g(trainer.lag_steps_p50)}/{_g(trainer.lag_steps_p95)} train steps "
                   f"(p50/p95; {_g(trainer.lag_p50)}/{_g(trainer.lag_p95)} versions)")
        waiting = f" — WAITING for segments from actor slot(s) {trainer.waiting_for}" \
            if trainer.waiting_for and not ended else ""
        lines.append(
            f"  trainer {holder or trainer.uid or '?'} (epoch {trainer.epoch}, {trainer.device or '?'}): "
            f"{trainer.train_per_s} train/s, buffer {trainer.memory}{_buffer_size(trainer)}, "
            f"ingest {trainer.received_per_s} rows/s, "
            f"loss {_g(trainer.loss) if trainer.loss is not None else '-'}, params v{trainer.params_version}"
            f"{lag}{waiting}"
        )
    if serving.central:
        several = len(serving.inference) > 1
        for k, server_holder in enumerate(serving.inference):
            lines.append(_inference_line(inference_lease(k) if several else "inference", server_holder,
                                         serving.inference_addresses[k], reports.servers.get(k), ended, missing))
    free: list[int] = []
    for i, actor_holder in enumerate(serving.actors):
        s = reports.actor(i)
        if actor_holder is None and (not ended or s is None):
            if serving.elastic:
                free.append(i)
            else:
                lines.append(missing("actor", s, f"actor {i}"))
            continue
        s = s or ActorStats()  # a holder that has not reported yet
        versions_behind = max(0, latest_version - s.params_version)
        waiting = f" — WAITING on a full queue for {format_seconds(s.stalled_now_s)}" \
            if s.stalled_now_s >= 1 and not ended else ""
        sync = f", sync-waited {s.sync_wait_s}s" if s.sync_wait_s else ""
        transit = f", {s.in_transit} batch(es) in transit beyond the queue's capacity" if s.in_transit else ""
        lines.append(
            f"  actor {i} {actor_holder or s.uid or '?'}: {s.env_steps_per_s} steps/s ({s.envs} env(s)), "
            f"{s.episodes} episodes, reward {_g(s.reward) if s.reward is not None else '-'}, params "
            f"v{s.params_version} ({versions_behind} behind), stalled {s.backpressure_wait_s}s, rate-limited "
            f"{s.rate_limited_s}s{sync}{transit}{waiting}"
        )
    if free and not ended:
        there = actor_num - len(free)
        if there == 0:
            lines.append(missing("actor", None, f"actors (elastic, up to {actor_num})"))
        else:
            lines.append(f"  actor slot(s) {_ranges(free)}: free (elastic: {there} of up to {actor_num} actors)")
    return lines


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2, 5, 7-8``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _inference_line(label: str, holder: str | None, address: InferenceAddress | None, stats: InferenceStats | None,
                    ended: bool, missing: Callable[[str, NodeStats | None, str], str]) -> str:
    """A central inference server's line (``label``: ``inference``, or its lease's name of several): who holds
    the lease (``holder``), where it listens, how it batches."""
    if holder is None and (not ended or stats is None):
        return missing("inference", stats, label)
    stats = stats or InferenceStats()  # a holder that has not reported yet
    where = f" at {address.address}{' (TLS)' if address.tls else ''}" if address is not None else ""
    refused = f", REFUSED {stats.refused_requests} request(s)" if stats.refused_requests else ""
    return (f"  {label} {holder or stats.uid or '?'}{where}: {stats.sessions} actor(s) connected, "
            f"{stats.agent_steps_per_s} actions/s, {stats.batch_envs_mean} envs per batch, request wait "
            f"{stats.batch_wait_ms_mean} ms, params v{stats.params_version}, stalled {stats.backpressure_wait_s}s"
            f"{refused}")


def summary_lines(board: Board, status: TaskStatus, elapsed: float, queued: int | None = None) -> list[str]:
    """The end of a run, read from ``board``: see :func:`summary_text`."""
    return summary_text(BoardSnapshot.read(board, status.actor_num, status.inference_servers), status, elapsed,
                        queued)


def summary_text(snapshot: BoardSnapshot, status: TaskStatus, elapsed: float, queued: int | None = None) -> list[str]:
    """The end of a run in a few lines: totals and rates over the whole run, the batches accounted for
    (sent = received + refused + still queued), then each node as it last reported (its id, what it
    did), so even a run shorter than one progress interval says who did what."""
    reports, counters, head = snapshot.reports, snapshot.counters, snapshot.params_head
    trainer = reports.trainer
    train_count = snapshot.train_count
    env_steps = int(counters.get("env_steps", 0))
    per_s = 1.0 / elapsed if elapsed > 0 else 0.0
    lines = [
        f"run {status.status.value} after {format_seconds(elapsed)} ({status.end_reason or 'no reason given'}): "
        f"train {train_count} ({train_count * per_s:.0f}/s), env steps {env_steps} ({env_steps * per_s:.0f}/s), "
        f"episodes {counters.get('episodes', 0):.0f}, duplicates {counters.get('duplicates', 0):.0f}, "
        f"stale rows refused {counters.get('stale_rows', 0):.0f}",
        "  " + batch_accounts(counters, queued),
    ]
    if trainer is not None:
        lag = f", policy lag p50 {_g(trainer.lag_steps_p50)} train steps" if trainer.lag_steps_p50 is not None else ""
        lines.append(f"  trainer {trainer.uid or '?'} (epoch {trainer.epoch}, {trainer.device or '?'}): "
                     f"params v{head[1] if head else trainer.params_version}, "
                     f"last loss {_g(trainer.loss) if trainer.loss is not None else '-'}{lag}")
    else:
        lines.append("  trainer: never reported")
    for k, i in reports.servers.items():
        label = inference_lease(k) if status.inference_servers > 1 else "inference"
        lines.append(f"  {label} {i.uid or '?'}: {i.agent_steps} actions in {i.batches} batches, "
                     f"{i.sent_batches} batches of rows sent, {i.refused_requests} request(s) refused, "
                     f"stalled {i.backpressure_wait_s}s")
    for index, s in reports.actors.items():
        lines.append(
            f"  actor {index} {s.uid or '?'}: {s.env_steps} env steps, {s.episodes} episodes, last reward "
            f"{_g(s.reward) if s.reward is not None else '-'}, stalled {s.backpressure_wait_s}s, rate-limited "
            f"{s.rate_limited_s}s"
        )
    if not reports.actors:
        lines.append("  actors: none reported")
    return lines


def batch_accounts(counters: dict[str, float], queued: int | None) -> str:
    """Where every batch the actors sent went: ``sent = received + refused + still queued``, or what does not
    add up, named. ``queued``: the queue's depth when the broker tells it (None: it cannot, and the rest
    is what the queue still holds or had in flight)."""
    text = _batch_accounts(counters, queued)
    replaced = int(counters.get("other_task_batches", 0))
    return text + (f" ({replaced} batches of the task this one replaced were dropped)" if replaced else "")


def _batch_accounts(counters: dict[str, float], queued: int | None) -> str:
    sent = int(counters.get("sent_batches", 0))
    given_back = int(batches_given_back(counters))
    received = int(counters.get("received_batches", 0)) - given_back  # those are counted as still queued
    refused = int(batches_refused(counters))
    got = f"received {received}" + (
        f" (and {given_back} more counted as received whose reads went back to the queue, unacked, when a "
        "trainer's lease lapsed or its queue connection was lost: still queued)" if given_back else "")
    if queued is None:
        rest = sent - received - refused
        if rest >= 0:
            return (f"batches: sent {sent} = {got} + refused {refused} + {rest} still queued or in flight (this "
                    "broker does not tell its queue's depth)")
        return (f"batches: sent {sent}, {got} + refused {refused}: {-rest} more arrived than the senders counted as "
                "sent (an actor or an inference server stopped before its last sends were counted)")
    missing = sent - received - refused - queued
    if missing == 0:
        return f"batches: sent {sent} = {got} + refused {refused} + still queued {queued}: all accounted for"
    if missing > 0:
        return f"batches: sent {sent}, {got} + refused {refused} + still queued {queued}: {missing} NOT ACCOUNTED FOR"
    republished = int(counters.get("republished_batches", 0))
    if -missing <= republished:
        return (f"batches: sent {sent}, {got} + refused {refused} + still queued {queued}: {-missing} more than the "
                f"senders counted as sent: {republished} batch(es) were published again after a broker connection "
                "was lost before the broker confirmed them, and the broker holds a copy of those it had taken "
                "(at-least-once: the trainer drops a copy it reads as a duplicate)")
    return (f"batches: sent {sent}, {got} + refused {refused} + still queued {queued}: {-missing} more than the "
            "senders counted as sent (an actor or an inference server stopped before its last sends were counted, "
            "or a trainer died between counting a read and acking it: those batches count as received and as "
            "still queued until the next trainer takes them again)")


def queue_depth(queue_params: Any, redis_params: RedisParameters) -> int | None:
    """Batches left in the task's queue, where the broker can tell (None where it cannot, or is away)."""
    try:
        with open_queue(queue_params, namespace=redis_params.task_name, role="producer",
                        redis_params=redis_params) as queue:
            return queue.depth()
    except Exception as e:  # the summary goes on without it
        logger.debug("could not read the queue's depth: %s", e)
        return None


def task_elapsed(board: Board, status: TaskStatus) -> float:
    """Seconds the task has run (since it became ACTIVE, or was created), by the Redis server's clock:
    to its end once it ended."""
    began = status.started_at or status.created_at
    until = status.ended_at if status.status.finished and status.ended_at else board.server_time()
    return max(0.0, until - began)


@dataclass(frozen=True)
class NodeHints:
    """How to start a node that reaches this task, for the lines that say one is missing."""

    board_args: str
    queue_args: str = ""

    @classmethod
    def of(cls, redis_params: RedisParameters, queue_describe: str | None = None) -> NodeHints:
        """From the board's parameters and the task's queue (its ``describe()``; None: the board's Redis)."""
        if redis_params.url is not None:
            board = f"--url {redis_params.describe()}"
        else:
            board = f"--host {redis_params.host or 'HOST'}"
            if redis_params.port != 6379:
                board += f" --port {redis_params.port}"
            if redis_params.db:
                board += f" --db {redis_params.db}"
        if redis_params.task_name != "srl":
            board += f" --task-name {redis_params.task_name}"
        if redis_params.password is not None or redis_params.password_file is not None:
            board += " --password-file FILE"
        queue = ""
        if queue_describe and "://" in queue_describe:
            queue = f" --queue-url {queue_describe}"
        return cls(board, queue)

    def command(self, role: str) -> str:
        return f"srl {role} {self.board_args}{self.queue_args}"


def _buffer_size(trainer: TrainerStats) -> str:
    """`` (1.2 GiB, 7,590 B/row)``: what the trainer's buffer reserved, when it said."""
    if not trainer.memory_bytes:
        return ""
    per_row = f", {trainer.memory_bytes // trainer.memory_capacity:,} B/row" if trainer.memory_capacity else ""
    return f" ({trainer.memory_bytes / 2**30:.2f} GiB{per_row})"


def _g(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def _missing_for(stats: NodeStats | None, elapsed: float, now: float) -> float:
    """Seconds since the role last reported (to ``now``, this machine's clock), or since the task started when
    it never did."""
    if stats is not None and stats.updated_at:
        return max(0.0, now - stats.updated_at)
    return elapsed
