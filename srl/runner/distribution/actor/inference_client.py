"""The actor's side of central inference: :class:`InferenceClient`, a ``Worker`` whose ``act`` is one round
trip to the server the board names (``srl.runner.distribution.inference.run``).

Owns the actor's connection: connecting to whichever server holds the lease, one request and one reply per
step, a broken connection raised before any env stepped, and a server that stopped answering and lost its
lease (paused, its host gone) left for the one the board names then. Must never act on a reply it cannot check
(out of order, for another task, an action out of range): the connection is dropped and the episodes start
again.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from srl.base.env import EnvSpec, MultiDiscreteActions
from srl.base.rl import Worker
from srl.runner.distribution.board.board import BOARD_AWAY, Board, InferenceAddress
from srl.runner.distribution.node.retry import Throttle
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.wire.codec import BatchHeader, Codec, DecodeError, short
from srl.runner.distribution.wire.inference import (
    InferenceLostError,
    InferenceRefusedError,
    max_request_bytes,
    reply_schema,
)
from srl.runner.distribution.wire.link import ClientLink, PeerGone, Refusal, Status

logger = logging.getLogger("srl.inference")
_T = TypeVar("_T")

SILENCE_CHECK_S = 5.0
"""seconds without a reply after which an actor looks, every as many seconds, whether its server still holds
the inference lease (a reply may wait long while the queue is full; a paused server's lease lapses)"""
RETURN_S = 10.0
"""how often an actor acting through another server than its own (``slot % servers``, which was missing) looks
whether its own serves again, to go back to it"""


class InferenceClient(Worker):
    """An actor's worker under central inference: ``act`` sends its envs' observations (and what followed
    the previous actions) to the task's inference server and returns the actions it answers.

    It keeps no network and no rows (the server does). A broken connection raises :class:`InferenceLostError`
    from ``act``, before any env stepped: the actor restarts its episodes and the next ``act`` connects
    to whichever server holds the lease then. Of a task's ``servers``, an actor's own is ``slot % servers``;
    while that one is missing it acts through another, and goes back once its own serves again."""

    def __init__(self, board: Board, spec: EnvSpec, num_envs: int, slot: int, sender: str, tag: int,
                 codec: Codec, stop: StopFlag, ca_file: str | None = None, servers: int = 1, half: int = 0,
                 halves: int = 1) -> None:
        self.board = board
        self.num_envs = num_envs
        self.slot = slot
        self.session = slot * halves + half
        """which of the server's sessions its requests are (``actor_index``): the slot, or its half's"""
        self.servers = servers
        self.own_server = slot % servers
        self._server = self.own_server
        """the server this actor acts through now"""
        self._return_at = 0.0
        self.sender = sender
        self.tag = tag
        self.stop = stop
        self.ca_file = ca_file
        obs = np.zeros((num_envs, *spec.obs_shape), spec.obs_dtype)
        self.reply_schema = reply_schema(spec)
        self._action_high = (np.asarray(spec.actions.nvec) - 1 if isinstance(spec.actions, MultiDiscreteActions)
                             else None)
        """each dimension's largest action (MultiDiscrete: the schema bounds them all by the largest)"""
        self.codec = codec.with_max_bytes(max_request_bytes(spec, num_envs))
        self._final = obs
        self._reward = np.zeros(num_envs, np.float32)
        self._terminated = np.zeros(num_envs, bool)
        self._truncated = np.zeros(num_envs, bool)
        self._started = np.ones(num_envs, bool)
        self._seq = 0
        self._link: ClientLink | None = None
        self._server_uid = ""
        self.params_version = 0
        self.connected_to = ""
        self.reconnects = 0
        self._replies = 0
        """replies on the connection now"""
        self._failures = 0
        """connections in a row that broke before their first reply (a server gone that the board still names)"""
        self.episodes_lost = False
        """the connection that broke last had acted: the envs' episodes must start again"""
        self.send_ahead = False
        """send the next request as soon as ``ahead`` gives its observations (an actor of two halves)"""
        self._sent: tuple[np.ndarray, ClientLink, InferenceLostError | None] | None = None
        """the request sent ahead: its observations, the link it went on, and what broke sending it"""
        stop.add_hook(self._interrupt)  # a reply waited for returns at once when the run stops

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        self._started[env_ids] = True

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        self._reward[:] = reward
        self._terminated[:] = terminated
        self._truncated[:] = truncated
        done = terminated | truncated
        self._final = next_obs if done.any() else self._final

    def act(self, obs: np.ndarray) -> np.ndarray:
        if self._sent is not None and self._sent[0] is obs:  # its request went ahead (``ahead``): the reply
            sent_on, error = self._sent[1], self._sent[2]
            self._sent = None
            if error is not None:
                self.lost()
                raise error
            return self._reply(sent_on)
        self._sent = None
        if self._link is not None and self._server != self.own_server and time.monotonic() >= self._return_at:
            self._look_for_own_server()
        link = self._link or self._connect()
        if link is None or self.stop.is_set():
            raise InferenceLostError(f"stopping: {self.stop.reason}")
        try:
            self._call(link.send, self._request(obs), self._stop_reason, self._still_serving, SILENCE_CHECK_S)
        except BaseException:
            self.lost()
            raise
        return self._reply(link)

    def ahead(self, obs: np.ndarray) -> None:
        """With ``send_ahead``: the request for the next ``act`` goes now, on the connection there is (the
        actor steps its other envs meanwhile: double buffering); what breaks is raised by that ``act``."""
        link = self._link
        if not self.send_ahead or link is None or self.stop.is_set() or (
                self._server != self.own_server and time.monotonic() >= self._return_at):
            self._sent = None
            return
        try:
            self._call(link.send, self._request(obs), self._stop_reason, self._still_serving, SILENCE_CHECK_S)
        except InferenceLostError as e:
            self._sent = (obs, link, e)
            return
        self._sent = (obs, link, None)

    def _request(self, obs: np.ndarray) -> bytes:
        """The request for ``obs``: it and what followed the last actions."""
        done = self._terminated | self._truncated
        final = self._final if done.any() else obs
        columns = {"obs": obs, "final_obs": np.ascontiguousarray(final, dtype=obs.dtype), "reward": self._reward,
                   "terminated": self._terminated, "truncated": self._truncated, "started": self._started}
        header = BatchHeader(actor_id=self.sender, actor_index=self.session, epoch=0, seq=self._seq,
                             params_version=0, count=self.num_envs, created_at=time.time(), task=self.tag)
        return self.codec.encode_batch(header, columns, None)

    def _reply(self, link: ClientLink) -> np.ndarray:
        """The actions of the request on its way."""
        try:
            reply = self._call(link.receive, self._stop_reason, self._still_serving, SILENCE_CHECK_S)
            head, cols, _ = self.codec.decode_batch(reply, self.reply_schema)
            if head.seq != self._seq or head.count != self.num_envs or head.task != self.tag:
                raise InferenceLostError(f"a reply out of order or for another task (seq {head.seq}, expected "
                                         f"{self._seq})")
        except DecodeError as e:
            self.lost()
            raise InferenceLostError(f"a reply this actor cannot use: {short(e)}") from None
        except BaseException:
            self.lost()
            raise
        action = cols["action"]
        if self._action_high is not None and (action > self._action_high).any():
            self.lost()
            raise InferenceLostError("a reply with an action beyond its dimension's range")
        self._seq += 1
        self._replies += 1
        self._failures = 0
        self._started[:] = False
        self.params_version = head.params_version
        return np.array(action)

    def _call(self, what: Callable[..., _T], *args: Any) -> _T:
        """``what(*args)`` on the link, its errors as this actor's (refused, or the connection lost)."""
        try:
            return what(*args)
        except Refusal as e:
            if e.status in (Status.UNAUTHENTICATED, Status.PERMISSION_DENIED):
                raise InferenceRefusedError(f"the inference server refused this actor: {e.reason}") from None
            if e.status == Status.INVALID_ARGUMENT:
                raise InferenceRefusedError(f"the inference server refused this actor's request: {e.reason}; is "
                                            "srl the same version on every node?") from None
            raise InferenceLostError(f"inference connection ended ({e.status.name}: {e.reason})") from None
        except PeerGone as e:
            if self.stop.is_set():
                raise InferenceLostError(f"stopping: {self.stop.reason}") from None
            raise InferenceLostError(f"inference connection broke (UNAVAILABLE: {e})") from None
        except TimeoutError as e:
            raise InferenceLostError(f"inference server silent (UNAVAILABLE: {e})") from None

    def _stop_reason(self) -> str | None:
        return self.stop.reason if self.stop.is_set() else None

    def _still_serving(self) -> bool:
        """Whether the server this actor waits on still holds the inference lease (a board away: assume so)."""
        try:
            address = self.board.get_inference_address(self._server)
        except BOARD_AWAY:
            return True
        return address is not None and address.uid == self._server_uid

    def _look_for_own_server(self) -> None:
        """Acting through another server: go back to this actor's own once it serves again (its episodes start
        again there: InferenceLostError)."""
        self._return_at = time.monotonic() + RETURN_S
        try:
            own = self.board.get_inference_address(self.own_server)
        except BOARD_AWAY:
            return
        if own is not None:
            self.lost()
            raise InferenceLostError(f"going back to inference server {self.own_server} ({own.uid}), this actor "
                                     "slot's own, which serves again")

    def _pick(self, addresses: list[InferenceAddress | None]) -> InferenceAddress | None:
        """This actor's own server, or while it is missing another that serves (the slot picks which)."""
        own = addresses[self.own_server]
        if own is not None:
            return own
        serving = [a for a in addresses if a is not None]
        return serving[self.slot % len(serving)] if serving else None

    def _connect(self) -> ClientLink | None:
        """A connection to the server the board names (waiting for one); None once the run stops. A server
        whose certificate does not verify raises InferenceLostError (the actor's loop tries again later)."""
        note = Throttle(10.0)
        delay = 0.05
        if self._failures:  # the last connection broke at once: the server it named is gone; give the standby time
            self.stop.wait(min(0.05 * 2 ** (self._failures - 1), 2.0))
        while not self.stop.is_set():
            try:
                address = self._pick(self.board.get_inference_addresses(self.servers))
            except BOARD_AWAY as e:
                address = None
                if note.ready():
                    logger.warning("cannot read the inference server's address (%s); retrying", short(e))
            if address is not None:
                host, _, port = address.address.rpartition(":")
                try:
                    self._link = ClientLink(host.strip("[]"), int(port), address.tls, self.ca_file,
                                            self.codec.max_bytes)
                except ssl.SSLError as e:
                    self.lost()
                    raise InferenceLostError(f"cannot verify the inference server at {address.address} "
                                             f"(UNAVAILABLE: {short(e)})") from None
                except OSError as e:
                    if note.ready():
                        logger.warning("cannot reach the inference server at %s (%s); retrying", address.address,
                                       short(e))
                else:
                    self._seq = self._replies = 0
                    self._started[:] = True
                    self._server_uid, self._server = address.uid, address.server
                    self._return_at = time.monotonic() + RETURN_S
                    if address.address != self.connected_to:
                        elsewhere = (f" (server {address.server}: this slot's own, {self.own_server}, is missing)"
                                     if address.server != self.own_server else "")
                        logger.info("acting through inference %s at %s%s", address.uid, address.address, elsewhere)
                    self.connected_to = address.address
                    return self._link
            elif note.ready():
                logger.info("waiting for an inference server to take the task (srl inference)")
            self.stop.wait(delay)
            delay = min(delay * 2, 1.0)
        return None

    def _interrupt(self) -> None:
        link = self._link
        if link is not None:
            link.cancel()

    def close(self) -> None:
        self._sent = None
        if self._link is not None:
            self._link.close()
            self._link = None

    def lost(self) -> None:
        """The connection broke: the next ``act`` connects anew (and, when it had acted, every env's episode
        starts again: ``episodes_lost``)."""
        self.close()
        self.reconnects += 1
        self.episodes_lost = self._replies > 0
        self._failures = 0 if self.episodes_lost else self._failures + 1
        self._replies = 0

    def pending(self) -> int:
        return 0

    def take(self) -> None:
        return None
