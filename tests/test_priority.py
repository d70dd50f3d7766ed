"""A node's share of the CPU (``node/priority.py``): the calling thread's nice only, and put back."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from srl.runner.distribution.node.priority import lower_priority
from srl.runner.distribution.settings.options import ActorOptions
from tests.nodes import thread_nices

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def thread_nice(tid: int) -> int:
    """A thread of this process's nice as the kernel holds it."""
    return thread_nices(os.getpid())[tid]


def test_the_calling_thread_yields_and_the_threads_already_running_keep_their_share() -> None:
    result: dict[str, int] = {}
    running = threading.Event()
    done = threading.Event()

    def other() -> None:  # a heartbeat's thread, say: started before
        result["other"] = threading.get_native_id()
        running.set()
        done.wait(30)

    def acting() -> None:
        restore = lower_priority(7, "a test")
        result["lowered"] = thread_nice(threading.get_native_id())
        child = threading.Thread(target=lambda: result.__setitem__("child", thread_nice(threading.get_native_id())))
        child.start()
        child.join()
        result["other_then"] = thread_nice(result["other"])
        restore()
        result["after"] = thread_nice(threading.get_native_id())

    before = thread_nice(threading.get_native_id())
    keeper = threading.Thread(target=other)
    keeper.start()
    assert running.wait(30)
    worker = threading.Thread(target=acting)
    worker.start()
    worker.join(30)
    done.set()
    keeper.join(30)
    assert result["lowered"] == min(19, before + 7)
    assert result["child"] == result["lowered"]  # what the acting thread starts after, yields too
    assert result["other_then"] == before  # the thread already running keeps its share
    assert thread_nice(threading.get_native_id()) == before  # and so does the caller's process
    expected_after = before if os.geteuid() == 0 else result["lowered"]  # lowering a nice needs privileges
    assert result["after"] == expected_after


def test_nothing_is_lowered_by_zero() -> None:
    before = thread_nice(threading.get_native_id())
    lower_priority(0, "a test")()
    assert thread_nice(threading.get_native_id()) == before


def test_an_actors_nice_is_checked() -> None:
    ActorOptions(central_nice=0).validate()
    with pytest.raises(ValueError, match="central_nice"):
        ActorOptions(central_nice=20).validate()
