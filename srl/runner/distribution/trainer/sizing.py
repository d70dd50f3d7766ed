"""How big a trainer's buffer may be: what it may take of the machine's memory, and its read window.

Owns: the bound on the buffer's bytes (``--max-buffer-bytes``, else three quarters of the machine's memory),
the check at the start (a buffer over it is a MemoryError that says what to make smaller), and whether a
learner's FIFO grows with the queue's round trip (:class:`~srl.runner.distribution.trainer.ingest.ReadWindow`)
and how far, within that bound. Must never: touch the buffer's rows (its arrays are reserved, not yet
touched, when they are checked).
"""

from __future__ import annotations

import logging
import os

from srl.base.rl import Buffer
from srl.base.schema import Schema
from srl.runner.distribution.settings.options import TrainerOptions
from srl.runner.distribution.trainer.ingest import ReadWindow

logger = logging.getLogger("srl.trainer")


def machine_memory_bytes() -> int:
    """Physical memory of this machine (0 when it cannot be told)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def buffer_capacity(buffer: Buffer) -> int:
    """The rows ``buffer`` holds when full (0: not said)."""
    capacity = getattr(buffer, "capacity", 0)
    return capacity if isinstance(capacity, int) else 0


def memory_limit(options: TrainerOptions) -> int:
    """The bytes this trainer's buffer may take (0: no bound)."""
    return options.max_buffer_bytes or int(0.75 * machine_memory_bytes())


def check_memory_fits(buffer: Buffer, schema: Schema, limit: int) -> None:
    """Log what ``buffer`` reserved; a MemoryError when that is over ``limit``."""
    needed = buffer.nbytes
    rows = buffer_capacity(buffer)
    per_row = f"{needed // rows:,} bytes per stored row" if rows else f"{schema.row_nbytes} bytes per row"
    logger.info("buffer: %s rows reserved in %.2f GiB (%s)", f"{rows:,}" if rows else "?", needed / 2**30, per_row)
    if limit and needed > limit:
        raise MemoryError(
            f"the task's buffer needs {needed / 2**30:.2f} GiB ({per_row}); this "
            f"trainer allows {limit / 2**30:.2f} GiB (--max-buffer-bytes); make the buffer smaller "
            "(e.g. memory.capacity)"
        )


def read_window(buffer: Buffer, sync: bool, limit: int, message_rows: int) -> ReadWindow | None:
    """A bounded FIFO the learner trains from as rows come (IMPALA, APPO) grows with the queue's round trip,
    up to 16 times its size and within ``limit`` bytes; a sync update's buffer and a replay memory do not."""
    rows = buffer_capacity(buffer)
    if sync or buffer.room() is None or not rows:
        return None
    most = min(16 * rows, limit // max(1, buffer.nbytes // rows))
    return ReadWindow(buffer, rows, most, message_rows) if most > rows else None
