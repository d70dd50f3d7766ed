"""The batcher: the requests of many actors, one forward pass for all of them, and the rows it finishes.

Owns: :class:`Batcher` — the open sessions by slot and the requests waiting for actions; loading staged
params between two batches; when a batch goes (at most ``max_batch_envs`` envs, at most ``max_wait_ms`` after
the oldest request, at once when every connected actor has one in); the forward pass and each request's
actions; handing the rows the workers finish to the run's sender (backpressure: it blocks); dropping the
sessions whose connections closed. Must never: act with weights from two versions in one batch, fail a
request for another's fault (only the network failing fails a batch), or be called from any thread but the
server's loop, apart from ``open_sessions`` and ``take_means``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from srl.base.rl import Parameter, join_policy_io, split_policy_io
from srl.runner.distribution.inference.session import Request, Session, refused
from srl.runner.distribution.node.staged import StagedParams
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.settings.options import InferenceOptions
from srl.runner.distribution.wire.codec import short

logger = logging.getLogger("srl.inference")

MAX_FAILED_BATCHES = 10
"""forward passes failing in a row before the server gives up (a fault of its own, not of a request)"""
IDLE_S = 0.05
"""the longest the server's loop waits for a request before it looks at its rows, sessions and params"""
LOOK_S = 0.02
"""how often the loop looks at every session between batches (a session that closed is freed this late)"""

Outbox = queue.Queue[tuple[dict[str, np.ndarray], np.ndarray | None, int, int] | None]
"""finished rows on their way to the sender: (columns, priorities, slot, version), None for the end"""


@dataclass(frozen=True)
class BatchMeans:
    """The batches and agent steps so far, and since the last look: envs per batch and a request's wait, on
    average."""

    batches: int
    agent_steps: int
    envs: float
    wait_ms: float


class Batcher:
    """The acting side of one inference server, driven by the server's loop (``inference/run.py``)::

        while not stopped:
            streams.poll(batcher.wait_s())          # requests in: batcher.admit(session), batcher.submit(request)
            streams.answer(batcher.turn())          # params, a batch acted for, its rows, closed sessions
        batcher.close()                             # the rows every session finished
    """

    def __init__(self, parameter: Parameter, envs: int, max_batch: int, rows: int, options: InferenceOptions,
                 stop: StopFlag, outbox: Outbox) -> None:
        self.parameter = parameter
        self.envs = envs
        self.max_batch = max_batch
        self.rows = rows
        """rows a worker finishes before they are sent (sooner when they are ``batch_max_age`` old)"""
        self.options = options
        self.stop = stop
        self.outbox = outbox
        self.staged = StagedParams()
        self.params_epoch = 0
        self.sessions: dict[int, Session] = {}
        self.pending: deque[Request] = deque()
        self._sessions_lock = threading.Lock()
        """guards ``sessions`` against the board thread's look (``open_sessions``)"""
        self.retired: list[Session] = []
        """sessions a newer connection of their slot replaced: their rows are shipped, then they are dropped"""
        self.agent_steps = 0
        self.batches = 0
        self.dropped_rows = 0
        self._lock = threading.Lock()
        """the counts below change in the loop, and are read and reset by the board thread"""
        self._batch_envs = 0
        self._batch_wait_s = 0.0
        self._batch_requests = 0
        self._last_batches = 0
        self._failed_batches = 0
        self._look_at = 0.0
        """when ``turn`` next looks at every session (aged rows, closed sessions), not only a batch's"""

    # ------------------------------------------------------------ what the connections bring
    def admit(self, session: Session) -> None:
        """A new connection's session; it replaces its slot's older one."""
        with self._sessions_lock:
            old = self.sessions.get(session.key)
            if old is not None:  # the batcher ships its finished rows and drops it; its connection ends
                old.closed.set()
                self.retired.append(old)
            self.sessions[session.key] = session

    def submit(self, request: Request) -> None:
        self.pending.append(request)

    def open_sessions(self) -> list[Session]:
        with self._sessions_lock:
            return [s for s in self.sessions.values() if not s.closed.is_set()]

    def take_means(self) -> BatchMeans:
        """The means since the last call (which starts them again)."""
        with self._lock:
            requests = max(self._batch_requests, 1)
            batches = self.batches
            means = BatchMeans(batches, self.agent_steps,
                               round(self._batch_envs / max(batches - self._last_batches, 1), 2),
                               round(1000 * self._batch_wait_s / requests, 3))
            self._batch_envs = self._batch_requests = 0
            self._batch_wait_s = 0.0
            self._last_batches = batches
        return means

    # ------------------------------------------------------------ the loop's side
    def wait_s(self) -> float:
        """How long the loop may wait for more requests before the next ``turn`` (0: a batch is due)."""
        if not self.pending or (self.parameter.version == 0 and not self.staged.pending):
            return IDLE_S
        if self._due():
            return 0.0
        return max(0.0, min(IDLE_S, self.pending[0].arrived + self.options.max_wait_ms / 1000 - time.monotonic()))

    def _due(self) -> bool:
        count = len(self.pending)
        if count * self.envs >= self.max_batch or self.stop.is_set():
            return True
        live = len({s.slot for s in self.sessions.values() if not s.closed.is_set()})  # one request each at most
        return count >= live or time.monotonic() >= self.pending[0].arrived + self.options.max_wait_ms / 1000

    def turn(self) -> list[Request]:
        """Load the params staged since the last batch; act for the batch that is due (returned: each request
        with its actions, its refusal, or neither when its session closed or its batch failed); ship finished
        rows; drop the sessions whose connections closed."""
        if self.staged.pending and (loaded := self.staged.load(self.parameter)) is not None:
            self.params_epoch = loaded[0]
        batch: list[Request] = []
        if self.pending and self.parameter.version > 0 and self._due():
            take = max(1, self.max_batch // self.envs)
            batch = [self.pending.popleft() for _ in range(min(take, len(self.pending)))]
            self._act(batch)
            self._ship_rows(list({id(r.session): r.session for r in batch}.values()))
        now = time.monotonic()
        if now >= self._look_at or self.retired:  # every session's aged rows, and the closed ones: now and then
            self._look_at = now + LOOK_S
            self._ship_rows(list(self.sessions.values()))
            self._reap()
        return batch

    def close(self) -> None:
        """The end: every session is dropped, after shipping the rows its worker finished."""
        with self._sessions_lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        self._ship_rows(sessions + self.retired, closing=True)

    def _act(self, batch: list[Request]) -> None:
        now = time.monotonic()
        ready: list[tuple[Request, Any]] = []
        with torch.inference_mode():
            for request in batch:
                if request.session.closed.is_set():
                    continue
                try:
                    request.session.prepare(request)
                    ready.append((request, request.session.worker.policy_inputs(request.obs)))
                except Exception as e:  # what the worker refuses (frames that do not slide): this request only
                    request.error = refused(e)
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
                    request.error = refused(e)
        with self._lock:
            self.batches += 1
            self.agent_steps += len(ready) * self.envs
            self._batch_envs += len(ready) * self.envs
            self._batch_requests += len(ready)
            self._batch_wait_s += sum(now - r.arrived for r, _ in ready)

    def _batch_failed(self, error: Exception, requests: list[Request]) -> None:
        """A forward pass failed: its actors are told UNAVAILABLE (they reconnect and restart their episodes)
        and their sessions closed; ``MAX_FAILED_BATCHES`` in a row is a fault of this server, not of a
        request: it stops, and the task with it."""
        self._failed_batches += 1
        logger.error("a forward pass for %d actor(s) failed (%d in a row): %s: %s", len(requests),
                     self._failed_batches, type(error).__name__, short(error), exc_info=self._failed_batches == 1)
        for request in requests:
            request.session.closed.set()  # no actions: the loop tells its actor UNAVAILABLE
        self._look_at = 0.0
        if self._failed_batches >= MAX_FAILED_BATCHES:
            raise RuntimeError(f"{MAX_FAILED_BATCHES} forward passes in a row failed; the last: "
                               f"{type(error).__name__}: {short(error)}") from error

    def _ship_rows(self, sessions: list[Session], closing: bool = False) -> None:
        """Hand the rows the sessions' workers finished to the sender (blocks while it is behind: the
        actors then wait for their actions, which is backpressure)."""
        now = time.monotonic()
        for session in sessions:
            worker = session.worker
            pending = worker.pending()
            if not pending or not (closing or pending >= self.rows
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
                    self.dropped_rows += len(columns["version"])
                    break
                try:
                    self.outbox.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def _reap(self) -> None:
        """Drop the sessions whose connections closed, after shipping the rows their workers finished."""
        with self._sessions_lock:
            closed = [s for s in self.sessions.values() if s.closed.is_set()] + self.retired
            self.retired = []
            for session in closed:
                if self.sessions.get(session.key) is session:
                    del self.sessions[session.key]
        if closed:
            self.pending = deque(r for r in self.pending if not r.session.closed.is_set())
            self._ship_rows(closed, closing=True)
            for session in closed:
                logger.info("actor %s left slot %d%s; its state is freed", session.uid, session.slot,
                            f" (half {session.half})" if session.key != session.slot else "")
