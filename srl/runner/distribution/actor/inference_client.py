"""The actor's side of central inference: :class:`InferenceClient`, a ``Worker`` whose ``act`` is one round
trip to the server the board names (``srl.runner.distribution.inference.run``).

Owns the actor's stream: connecting to whichever server holds the lease, one request and one reply per step,
a broken stream raised before any env stepped. Must never act on a reply it cannot check (out of order,
for another task, an action out of range): the stream is dropped and the episodes start again.
"""

from __future__ import annotations

import logging
import queue
import time
from pathlib import Path

import grpc
import numpy as np

from srl.base.env import EnvSpec, MultiDiscreteActions
from srl.base.rl import Worker
from srl.runner.distribution.board.board import BOARD_AWAY, Board, InferenceAddress
from srl.runner.distribution.node.retry import Throttle
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.wire.codec import BatchHeader, Codec, DecodeError, short
from srl.runner.distribution.wire.inference import (
    METHOD,
    InferenceLostError,
    InferenceRefusedError,
    grpc_options,
    max_request_bytes,
    reply_schema,
)

logger = logging.getLogger("srl.inference")


class InferenceClient(Worker):
    """An actor's worker under central inference: ``act`` sends its envs' observations (and what followed
    the previous actions) to the task's inference server and returns the actions it answers.

    It keeps no network and no rows (the server does). A broken stream raises :class:`InferenceLostError`
    from ``act``, before any env stepped: the actor restarts its episodes and the next ``act`` connects
    to whichever server holds the lease then."""

    def __init__(self, board: Board, spec: EnvSpec, num_envs: int, slot: int, sender: str, tag: int,
                 codec: Codec, stop: StopFlag, ca_file: str | None = None) -> None:
        self.board = board
        self.num_envs = num_envs
        self.slot = slot
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
        self._stream: _Stream | None = None
        self.params_version = 0
        self.connected_to = ""
        self.reconnects = 0
        self._replies = 0
        """replies on the stream now"""
        self._failures = 0
        """streams in a row that broke before their first reply (a server gone that the board still names)"""
        self.episodes_lost = False
        """the stream that broke last had acted: the envs' episodes must start again"""
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
        stream = self._stream or self._connect()
        if stream is None or self.stop.is_set():
            raise InferenceLostError(f"stopping: {self.stop.reason}")
        done = self._terminated | self._truncated
        final = self._final if done.any() else obs
        columns = {"obs": obs, "final_obs": np.ascontiguousarray(final, dtype=obs.dtype), "reward": self._reward,
                   "terminated": self._terminated, "truncated": self._truncated, "started": self._started}
        header = BatchHeader(actor_id=self.sender, actor_index=self.slot, epoch=0, seq=self._seq, params_version=0,
                             count=self.num_envs, created_at=time.time(), task=self.tag)
        try:
            reply = stream.round_trip(self.codec.encode_batch(header, columns, None), self.stop)
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

    def _connect(self) -> _Stream | None:
        """A stream to the server the board names (waiting for one); None once the run stops."""
        note = Throttle(10.0)
        delay = 0.05
        if self._failures:  # the last stream broke at once: the server it named is gone; give the standby time
            self.stop.wait(min(0.05 * 2 ** (self._failures - 1), 2.0))
        while not self.stop.is_set():
            try:
                address = self.board.get_inference_address()
            except BOARD_AWAY as e:
                address = None
                if note.ready():
                    logger.warning("cannot read the inference server's address (%s); retrying", short(e))
            if address is not None:
                try:
                    self._stream = _Stream(address, self.ca_file, self.codec.max_bytes)
                    self._seq = self._replies = 0
                    self._started[:] = True
                    if address.address != self.connected_to:
                        logger.info("acting through inference %s at %s", address.uid, address.address)
                    self.connected_to = address.address
                    return self._stream
                except (OSError, grpc.RpcError) as e:
                    if note.ready():
                        logger.warning("cannot reach the inference server at %s (%s); retrying", address.address,
                                       short(e))
            elif note.ready():
                logger.info("waiting for an inference server to take the task (srl inference)")
            self.stop.wait(delay)
            delay = min(delay * 2, 1.0)
        return None

    def _interrupt(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def lost(self) -> None:
        """The stream broke: the next ``act`` connects anew (and, when it had acted, every env's episode
        starts again: ``episodes_lost``)."""
        self.close()
        self.reconnects += 1
        self.episodes_lost = self._replies > 0
        self._failures = 0 if self.episodes_lost else self._failures + 1

    def pending(self) -> int:
        return 0

    def take(self) -> None:
        return None


class _Stream:
    """One bidirectional stream to a server: requests in, replies out, one at a time, in the caller's
    thread (``cancel`` from another thread makes a blocked ``round_trip`` return)."""

    def __init__(self, address: InferenceAddress, ca_file: str | None, max_bytes: int) -> None:
        options = grpc_options(max_bytes)
        if address.tls:
            roots = Path(ca_file).read_bytes() if ca_file else None
            self.channel = grpc.secure_channel(address.address, grpc.ssl_channel_credentials(roots), options=options)
        else:
            self.channel = grpc.insecure_channel(address.address, options=options)
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self.call = self.channel.stream_stream(METHOD)(iter(self._requests.get, None))
        self._replies = iter(self.call)

    def round_trip(self, request: bytes, stop: StopFlag) -> bytes:
        self._requests.put(request)
        try:
            reply: bytes = next(self._replies)
            return reply
        except StopIteration:
            raise InferenceLostError("the inference server closed the stream") from None
        except grpc.RpcError as e:
            if stop.is_set():
                raise InferenceLostError(f"stopping: {stop.reason}") from None
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise InferenceRefusedError(f"the inference server refused this actor: {details}") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InferenceRefusedError(f"the inference server refused this actor's request: {details}; is "
                                            "srl the same version on every node?") from None
            raise InferenceLostError(f"inference stream broke ({code.name if code else 'error'}: {details})") from None

    def cancel(self) -> None:
        self.call.cancel()

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()
        self.channel.close()
