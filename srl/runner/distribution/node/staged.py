"""Params between two threads: a background thread fetches and decodes a version, the acting thread loads it.

Owns: :class:`StagedParams`, shared by the actor (local inference) and the inference server, so the
weights change between two acts, never during one, and the acting thread never waits for Redis. Must
never: load weights that do not fit the network (they are refused, logged, and the old ones kept).
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from srl.base.rl import Parameter
from srl.runner.distribution.wire.codec import short

logger = logging.getLogger("srl.params")


class StagedParams:
    """The newest params version fetched and not yet loaded (a newer one replaces it).

    The loop that uses it::

        background:     staged.put(epoch, version, arrays)        # decoded, checked (the actor's params thread)
        acting thread:  if staged.pending: loaded = staged.load(parameter)   # between two acts
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: tuple[int, int, dict[str, np.ndarray]] | None = None
        self.fresh = threading.Event()
        """set when a version is put (a thread waiting for params wakes on it)"""

    def put(self, epoch: int, version: int, arrays: dict[str, np.ndarray]) -> None:
        with self._lock:
            self._staged = (epoch, version, arrays)
        self.fresh.set()

    @property
    def pending(self) -> bool:
        return self._staged is not None

    def load(self, parameter: Parameter) -> tuple[int, int] | None:
        """Load the staged version into ``parameter`` (its ``version`` set too); its ``(epoch, version)``, or
        None when none is staged or it does not fit this network (said in the log; the weights stay)."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return None
        epoch, version, arrays = staged
        try:
            parameter.from_arrays(arrays)
        except ValueError as e:
            logger.error("params version %d do not fit this network: %s", version, short(e))
            return None
        parameter.version = version
        return epoch, version
