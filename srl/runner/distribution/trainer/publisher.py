"""The trainer process's params publication: the main thread hands weights over, the publish thread writes.

Owns: :class:`Publisher`: encoding the learner's weights as params version ``gate.version`` (signed,
with epoch, train_count, takeover state), the one pending blob the publish thread writes next (a newer one replaces
an older one not yet written: versions that come faster than the board takes them are merged), when the
next publication is due (``min_publish_interval``), and the run's last weights. Must never: write params
without the trainer's epoch (``Board.publish_params`` fences every write), give a version to two sets of
weights, or copy, encode or sign weights under the gate's lock (the ingest waits on it: a large network's
copy off the device and its signature would hold every read back).

The calls::

    main thread:   publisher.request(train_count)          # after an update the data path publishes
                   publisher.due()                          # a version the board lacks, and time for it
    publish thread: publisher.flush()                       # writes the pending blob, if any
    at the end:    publisher.request_final(train_count)     # weights trained since get a version of their own
                   publisher.wait(stop) / publisher.flush() # written before the run lets go of its lease
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from srl.base.rl import Parameter
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.trainer.versions import VersionGate
from srl.runner.distribution.wire.codec import Codec

FLOAT16_MAX = float(np.finfo(np.float16).max)


def half_precision(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32 arrays as float16 where every value fits (one that does not stays float32); a loader casts
    them back to its parameters' dtype."""
    out = {}
    for name, array in arrays.items():
        fits = array.dtype == np.float32 and (array.size == 0 or float(np.abs(array).max()) <= FLOAT16_MAX)
        out[name] = array.astype(np.float16) if fits else array
    return out


class Publisher:
    """One trainer run's publications, under its epoch."""

    def __init__(
        self,
        board: Board,
        codec: Codec,
        uid: str,
        epoch: int,
        parameter: Parameter,
        algorithm: str,
        gate: VersionGate,
        min_interval: float,
        take_lease_back: Callable[[], bool],
        float16: bool = False,
        takeover_state: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.board = board
        self.codec = codec
        self.uid = uid
        self.epoch = epoch
        self.parameter = parameter
        self.algorithm = algorithm
        self.gate = gate
        self.min_interval = min_interval
        self.take_lease_back = take_lease_back
        self.float16 = float16
        """publish float32 weights as float16 but the last version (``request_final``); the float32 ones go
        with them for a trainer that takes the run over (actors never read those)"""
        self.takeover_state = takeover_state
        """what a trainer taking the run over needs beyond the weights (``Learner.takeover_state``)"""
        """called when the board refuses a write for a lapsed lease; True: held again, write once more"""
        self.wake = threading.Event()
        """set when a blob is pending: the publish thread writes it at once"""
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # one write at a time, so the board's versions only go up
        self._pending: tuple[int, int, bytes, bytes | None] | None = None
        self.published_version = 0
        """the newest version on the board (written by this run, or found there when it started)"""
        self.requested = (0, -1)
        """(version, train_count) last handed to the publish thread"""
        self._last = 0.0

    def restored(self, version: int) -> None:
        """The board (or a checkpoint) has ``version`` already: the numbering goes on from it."""
        self.published_version = version

    def request(self, train_count: int, final: bool = False) -> int:
        """Hand the learner's weights, as params version ``gate.version``, to the publish thread (as float16
        with ``float16``, unless ``final``). The main thread's, called without ``gate.lock``: the gate notes
        the publication under it, and the weights (which only the main thread changes) are copied, encoded
        and signed after, while the ingest goes on."""
        gate = self.gate
        with gate.lock:  # the arrivals and the lag the ingest thread writes under it
            version = gate.version
            gate.published(version, train_count)
        self.parameter.version = version
        self.requested = (version, train_count)
        self._last = time.monotonic()
        arrays = self.parameter.to_arrays()
        meta: dict[str, Any] = {"epoch": self.epoch, "version": version, "train_count": train_count,
                                "algorithm": self.algorithm}
        takeover = self.takeover_state()
        if takeover:
            meta["takeover"] = takeover
        master = None
        if self.float16 and not final:
            master = self.codec.encode_params(arrays, meta)  # a standby goes on from these, not their rounding
            arrays = half_precision(arrays)
        blob = self.codec.encode_params(arrays, meta)
        with self._lock:
            self._pending = (version, train_count, blob, master)
        self.wake.set()
        return version

    def pending(self) -> bool:
        with self._lock:
            return self._pending is not None

    def flush(self) -> None:
        """Write the pending blob (the publish thread's, or the run's at its end); kept for the next try when
        the board is away, unless a newer one came meanwhile. Writes from two threads go one after the other,
        each taking the newest blob when its turn comes."""
        with self._writing:
            with self._lock:
                pending, self._pending = self._pending, None
            if pending is None:
                return
            version, train_count, blob, master = pending
            try:
                ok = self.board.publish_params(self.uid, self.epoch, version, blob, train_count, master)
                if not ok and self.take_lease_back():
                    ok = self.board.publish_params(self.uid, self.epoch, version, blob, train_count, master)
            except BaseException:
                with self._lock:
                    if self._pending is None:  # keep it for the next try, unless a newer one came
                        self._pending = pending
                raise
            if ok:
                self.published_version = version

    def due(self) -> bool:
        """A version the board does not have yet, and ``min_interval`` since the last publication
        (versions that come faster are merged: the next publication skips to the newest)."""
        if self.gate.version <= self.requested[0]:
            return False
        return time.monotonic() - self._last >= self.min_interval

    def request_final(self, train_count: int) -> bool:
        """Hand the weights over as the run's last params: those trained past the last publication get a
        version of their own, one past it, whatever the data path's rule would count (a version names one
        set of weights). False when the board has them already."""
        if train_count > self.requested[1]:
            self.gate.version = max(self.gate.version, self.requested[0] + 1)
        if (self.gate.version, train_count) == self.requested:
            return False
        self.request(train_count, final=True)
        return True

    def wait(self, stop: StopFlag) -> bool:
        """Wait until the last requested version is on the board (False when the run stopped first)."""
        version = self.requested[0]
        while self.published_version < version:
            if stop.is_set():
                return False
            time.sleep(0.01)
        return True
