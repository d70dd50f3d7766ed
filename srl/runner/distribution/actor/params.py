"""A local actor's params: followed on the board by version, fetched and decoded in a thread of their own.

Owns: :class:`ActorParams` — the params thread (an actor waiting for the next version waits for it in Redis;
otherwise the head is looked at every ``params_poll_interval``), fetching through the machine's params cache,
decoding, and staging them for the acting thread, which loads them between two acts; and the acting thread's
wait for a newer version (its first, or sync's lockstep). Must never: load params that do not decode or fit
(they are counted as bad, logged, and not fetched again), or make the acting thread wait on Redis.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import numpy as np

from srl.base.rl import Parameter
from srl.runner.distribution.actor.pacing import WaitClock
from srl.runner.distribution.actor.params_cache import ParamsCache
from srl.runner.distribution.board.board import Board, BoardDataError, ParamsRecord
from srl.runner.distribution.node.liveness import BoardWork
from srl.runner.distribution.node.serve import CounterDeltas
from srl.runner.distribution.node.staged import StagedParams
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.settings.options import ActorOptions
from srl.runner.distribution.wire.codec import Codec, DecodeError, short

logger = logging.getLogger("srl.actor")

ONE_TRIP_PARAMS_BYTES = 1 << 20
"""params up to this size are fetched with their version, in one round trip, by an actor waiting for the next
version (sync's lockstep); larger ones go through the machine's params cache (fetched once per machine)"""


class ActorParams:
    """The params of one actor's run: ``run`` is the params thread; the acting thread calls ``apply`` and
    ``wait_for``. ``on_head(epoch, train_count, version)`` is told the trainer's progress each params read
    shows."""

    def __init__(self, board: Board, codec: Codec, parameter: Parameter, max_bytes: int, cache: ParamsCache | None,
                 stop: StopFlag, work: BoardWork, counters: CounterDeltas, options: ActorOptions,
                 on_head: Callable[[int, int, int], None], waits: WaitClock) -> None:
        self.board = board
        self.codec = codec
        self.parameter = parameter
        self.max_bytes = max_bytes
        self.cache = cache
        """the params this machine's actors share (None: each fetches its own)"""
        self.stop = stop
        self.work = work
        self.counters = counters
        self.options = options
        self.on_head = on_head
        self.waits = waits
        self.staged = StagedParams()
        self.epoch = -1
        self.version = -1
        """the params loaded (-1: none yet)"""
        self.latest_version = -1
        """the newest version seen on the board"""
        self.fetched_bytes = 0
        self.sync_wait_s = 0.0
        self.poll_now = threading.Event()  # wakes the params thread for a look (or to stop)
        self._awaiting = threading.Event()  # the acting thread waits for a newer version
        self._feed_after = b"0-0"  # the newest params feed entry seen (Board.await_params)

    def run(self) -> None:
        """The params thread: an actor waiting for the next version (lockstep, or its first) waits for it in
        Redis and has it half a round trip after it is published; else the head is looked at every
        ``params_poll_interval`` and newer params fetched. Its own thread: a heartbeat never waits behind
        params (megabytes over a slow link), nor params behind a heartbeat."""
        opts = self.options
        waited = False  # the last look waited in Redis

        def look() -> None:
            nonlocal waited
            waited = self._awaiting.is_set() and self.max_bytes <= ONE_TRIP_PARAMS_BYTES
            if waited:
                head = self._fetch_if_new(wait_s=min(opts.heartbeat_interval, 1.0))
            else:
                head = self.board.get_params_head()
            if head is not None:
                self.on_head(head[0], head[2], head[1])
                if head[1] > 0 and head[1] != self.latest_version:
                    self._fetch((head[0], head[1]))

        failures = 0
        while not self.stop.is_set():
            answer = self.work.run(look, "params")
            if answer == "stop":
                break
            failures = failures + 1 if answer == "away" else 0
            if failures:  # a reset connection is replaced at once: look again soon, then back off
                self.poll_now.wait(min(opts.heartbeat_interval, 1.0, 0.05 * 2 ** (failures - 1)))
            elif not self._awaiting.is_set():
                self.poll_now.wait(opts.params_poll_interval)
            elif not (waited and self.board.awaits_in_redis):  # else the wait was in Redis
                self.poll_now.wait(opts.params_wait_poll_interval)
            self.poll_now.clear()

    def _fetch_if_new(self, wait_s: float) -> tuple[int, int, int] | None:
        """The params head, with the params staged when their version is not the one held: one round trip,
        for an actor that waits for the next version. The wait is in Redis, up to ``wait_s``, until a version
        is published (``Board.await_params``). The machine's params cache is skipped: small params only,
        where a round trip costs more than the bytes."""
        try:
            self._feed_after, head, record = self.board.await_params(
                self._feed_after, self.latest_version, math.ceil(wait_s * 1000), self.max_bytes)
            if record is not None:
                self.fetched_bytes += len(record.blob)
                self._stage(record, self.codec.decode_params(record.blob, epoch=record.epoch,
                                                             version=record.version)[1])
        except (DecodeError, BoardDataError) as e:
            self._unusable(e)
            return None
        return head

    def _fetch(self, head: tuple[int, int]) -> None:
        """Fetch and decode the latest params (at least ``head``'s (epoch, version); from the machine's
        params cache when another actor here fetched them); the acting thread applies them when the worker
        may load them."""
        try:
            def fetch() -> ParamsRecord | None:
                fetched = self.board.get_params(self.max_bytes)
                self.fetched_bytes += 0 if fetched is None else len(fetched.blob)
                return fetched

            cache = self.cache
            record = fetch() if cache is None else cache.get(head, fetch)
            if record is None:
                return
            try:
                _, arrays = self.codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
            except DecodeError:
                if cache is None or not cache.discard(record):
                    raise
                # a record this machine kept that does not decode: the board's own blob, once
                logger.warning("the params this machine shares for version %d do not decode; fetching them from "
                               "the board", record.version)
                record = fetch()
                if record is None:
                    return
                _, arrays = self.codec.decode_params(record.blob, epoch=record.epoch, version=record.version)
        except (DecodeError, BoardDataError) as e:
            self._unusable(e)
            return
        self._stage(record, arrays)

    def _stage(self, record: ParamsRecord, arrays: dict[str, np.ndarray]) -> None:
        """Hand decoded params to the acting thread (it applies them when the worker may load them)."""
        self.staged.put(record.epoch, record.version, arrays)
        self.latest_version = record.version
        self.on_head(record.epoch, record.train_count, record.version)

    def _unusable(self, error: Exception) -> None:
        """The params on the board do not decode or are out of bounds: counted, and not fetched again."""
        logger.error("params on the board cannot be used (%s); keeping version %d", short(error), self.version)
        self.counters.add(bad_messages=1)
        latest = self.board.get_params_version()
        self.latest_version = latest[1] if latest is not None else self.latest_version  # not this blob again

    def apply(self) -> None:
        """Load the staged params into the network (the acting thread, between two acts)."""
        loaded = self.staged.load(self.parameter)
        if loaded is not None:
            self.epoch, self.version = loaded

    def wait_for(self, newer_than: int, why: str) -> None:
        """Block (heartbeat going on) until params newer than ``newer_than`` are loaded, or the run stops."""
        waited = 0.0
        self._awaiting.set()
        self.poll_now.set()  # look now, then at the waiting cadence
        while not self.stop.is_set() and self.version <= newer_than:
            if self.staged.pending:
                self.apply()  # work, not waiting
                continue
            self.waits.begin()
            self.staged.fresh.wait(0.05)
            self.staged.fresh.clear()
            waited += self.waits.end()
        self._awaiting.clear()
        if why == "sync":
            self.sync_wait_s += waited
