"""One actor's session on the inference server, and what a request must be for the server to act on it.

Owns: :class:`Session` (an actor's connection: its slot, its next seq, its worker holding its envs' recurrent
state and unfinished rows), :class:`Request` (one step of an actor's envs, waiting for its actions),
:class:`Refused` (why a request is not acted on, and the status its actor is told) and
:class:`RequestCheck` (decoding a request with the task's wire codec and checking its task, size, slot and
seq). Must never: trust a request (what is wrong with one raises ``Refused``), or touch a worker from any
thread but the batcher's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from srl.base.rl import Worker
from srl.base.schema import Schema
from srl.runner.distribution.wire.codec import BatchHeader, Codec, DecodeError, short
from srl.runner.distribution.wire.link import Status

if TYPE_CHECKING:
    from srl.runner.distribution.wire.link import ServerConnection


class Refused(Exception):
    """A request the server will not act on (what is wrong with it, for the log and the actor)."""

    def __init__(self, reason: str, code: Status = Status.INVALID_ARGUMENT) -> None:
        super().__init__(reason)
        self.code = code


def refused(error: Exception) -> Refused:
    """What a request made its worker raise, as the refusal its actor is told."""
    return error if isinstance(error, Refused) else Refused(f"{type(error).__name__}: {short(error)}")


@dataclass
class Request:
    session: Session
    obs: np.ndarray
    columns: dict[str, np.ndarray]
    seq: int
    arrived: float = field(default_factory=time.monotonic)
    actions: np.ndarray | None = None
    version: int = 0
    error: Refused | None = None


class Session:
    """One actor's connection: its worker (its envs' state and unfinished rows); only the server's loop
    touches it, but for ``closed``, which any thread may set (the loop then ends the connection)."""

    def __init__(self, slot: int, uid: str, worker: Worker, connection: ServerConnection, half: int = 0,
                 halves: int = 1) -> None:
        self.slot = slot
        """the actor slot"""
        self.key = slot * halves + half
        """which of the server's sessions it is, as its requests say (``actor_index``): the slot, or with actors
        of two halves (double buffering) the slot's half"""
        self.half = half
        self.uid = uid
        self.worker = worker
        self.connection = connection
        self.acted = False
        self.seq = 0
        self.seq_waiting = False
        """a request of it waits for its actions (an actor sends one at a time)"""
        self.closed = threading.Event()
        self.rows_since = time.monotonic()

    def prepare(self, request: Request) -> None:
        """Tell the worker what followed its last actions and which episodes start, as ``Rollout`` does."""
        cols = request.columns
        started = cols["started"]
        done = cols["terminated"] | cols["truncated"]
        if not self.acted:
            if not started.all():
                raise Refused("a stream's first request must start every env's episode (started all true)")
        else:
            # an episode starts only where one ended; one may end without a start (a lost life ends the
            # training signal's episode while the game goes on, as Rollout tells a local worker)
            if (started & ~done).any():
                raise Refused("episodes may start only in the envs whose episodes just ended")
            final = request.obs.copy()
            final[done] = cols["final_obs"][done]
            self.worker.observe(np.array(cols["reward"]), final, np.array(cols["terminated"]),
                                np.array(cols["truncated"]))
        ids = np.flatnonzero(started)
        if len(ids):
            self.worker.reset(ids, request.obs[ids])


@dataclass(frozen=True)
class RequestCheck:
    """How a request is read: decoded by ``wire`` (signed, bounded, checked against ``schema``), then
    checked against the task (``task_tag``, ``envs`` per actor) and its connection (slot and seq)."""

    wire: Codec
    schema: Schema
    task_tag: int
    envs: int

    def read(self, data: bytes, session: Session | None) -> tuple[BatchHeader, dict[str, np.ndarray]]:
        """The header and columns of a request on ``session``'s connection (None: its first)."""
        try:
            header, columns, _ = self.wire.decode_batch(data, self.schema)
        except DecodeError as e:
            code = (Status.UNAUTHENTICATED if "signature" in str(e) or "signed" in str(e)
                    else Status.INVALID_ARGUMENT)
            raise Refused(f"bad request: {e}", code) from None
        if header.task != self.task_tag:
            raise Refused("the request was made for another task", Status.FAILED_PRECONDITION)
        if header.count != self.envs:
            raise Refused(f"a request carries {header.count} envs; this task's actors step {self.envs}")
        if session is not None and (header.actor_index != session.key or header.seq != session.seq):
            raise Refused(f"request for session {header.actor_index} seq {header.seq}; expected {session.key} "
                          f"seq {session.seq}")
        if session is None and header.seq != 0:
            raise Refused(f"a stream starts at seq 0, found {header.seq}")
        return header, columns
