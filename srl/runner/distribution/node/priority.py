"""A node's share of the CPU: an actor of central inference yields it to the server every actor waits on.

Owns :func:`lower_priority` — the calling thread's Unix nice raised by some amount (on Linux that thread and the
threads it starts from then on, not the process's threads already running: a node's heartbeat keeps its
share), and the function that puts it back. Must never: fail a node (a platform without priorities, or a
priority the process may not take back, is logged and the node goes on).

Why: with central inference on a machine of few cores, the actors and their server share the cores, and the
kernel gives each runnable process the same share. The server is the one stage every actor waits on; while
it waits for a core, every actor soon waits for it, and cores go idle (on a 2-core machine, 4 actors of a
MinAtar task and their server: 1.65 cores busy, central ÷ local 0.57; with the actors at nice 10 the server
takes the core it needs, 1.9 busy, 0.79; ``docs/benchmarks.md``, "The server's share of the CPU").
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
        os.setpriority(os.PRIO_PROCESS, who, min(19, before + by))
    except OSError as e:
        logger.info("could not lower this node's CPU priority (%s): %s", why, e)
        return lambda: None
    logger.debug("nice %d -> %d (%s)", before, min(19, before + by), why)

    def restore() -> None:
        if _thread_id() != who and who != 0:
            return  # another thread: the one lowered is its own
        try:
            os.setpriority(os.PRIO_PROCESS, who, before)
        except OSError:  # lowering a nice needs CAP_SYS_NICE: the thread keeps the raised one
            logger.debug("this thread keeps nice %d (putting back %d needs privileges)", min(19, before + by),
                         before)

    return restore
