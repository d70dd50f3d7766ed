"""A node's share of the CPU: an actor of central inference yields it to the server every actor waits on.

Owns :func:`lower_priority` — the calling thread's Unix nice raised by some amount (on Linux that thread and the
threads it starts from then on, not the process's threads already running: a node's heartbeat keeps its
share), and the function that puts it back. Must never: fail a node (a platform without priorities, or a
priority the process may not take back, is logged and the node goes on).

Why: with central inference on a machine of few cores, the actors and their server share the cores, and the
kernel gives each runnable process the same share. The server is the one stage every actor waits on; while
it waits for a core, every actor soon waits for it, and cores go idle (on a 2-core machine, the
server of 4 actors x 32 MinAtar envs at nice 0 ran on 0.65 of a core and 1.65 cores were busy; with 4 x 8 and
the actors at nice 10 it took 0.94 of one. Central ÷ local rose from 0.67 to 0.70 at 4 x 8 envs and from 0.65
to 0.72 at 4 x 32, each pair in one run: ``docs/benchmarks.md``, "The server's share of the CPU").
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger("srl.node")


def _thread_id() -> int:
    """What ``setpriority`` takes for the calling thread alone (Linux), else the process (0)."""
    return threading.get_native_id() if sys.platform.startswith("linux") else 0


def lower_priority(by: int, why: str) -> Callable[[], None]:
    """Raise the calling thread's nice by ``by`` (0: nothing); the function that puts it back where the process
    may (an unprivileged process may not lower a nice: its thread then keeps the raised one, which is said)."""
    if by <= 0 or not hasattr(os, "setpriority"):
        return lambda: None
    who = _thread_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, who)
        after = min(19, before + by)
        os.setpriority(os.PRIO_PROCESS, who, after)
    except OSError as e:
        logger.info("could not lower this node's CPU priority (%s): %s", why, e)
        return lambda: None
    logger.debug("nice %d -> %d (%s)", before, after, why)

    def restore() -> None:
        if _thread_id() != who and who != 0:
            return  # another thread: the one lowered is its own
        try:
            os.setpriority(os.PRIO_PROCESS, who, before)
        except OSError:  # lowering a nice needs CAP_SYS_NICE: the thread keeps the raised one
            logger.debug("this thread keeps nice %d (putting back %d needs privileges)", after, before)

    return restore
