"""Local actor and trainer processes for ``train_distribution`` on one machine.

Owns: starting children with ``python -m srl.runner.distribution.client.local_nodes``
and handing them their parameters as JSON through the environment (not the
command line, where passwords would show in ``ps``). Plain subprocesses, not
multiprocessing: spawning would re-import the user's script, which need not
have an ``if __name__ == "__main__"`` guard.

A child outlives no client: each reads a pipe whose only writer is the
client, and when the client dies, however it dies (a killed notebook kernel,
SIGKILL), the kernel closes that pipe and the child stops as on Ctrl-C
instead of training on until the task's budget with nobody watching.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from srl.base.config import config_from_dict, config_to_dict
from srl.runner.distribution.queues import parameter_classes
from srl.runner.distribution.settings.redis_parameters import RedisParameters

logger = logging.getLogger("srl.client")

SPEC_ENV = "SRL_LOCAL_NODE"
PARENT_FD_ENV = "SRL_LOCAL_NODE_PARENT_FD"
ORPHAN_GRACE_S = 60.0
"""seconds a local node whose client is gone has to stop as on Ctrl-C before it exits at once"""




class LocalNode(subprocess.Popen[bytes]):
    """A local child and the write end of the pipe it watches (closed by :func:`release`)."""

    parent_pipe: int | None = None


def _params_to_data(params: Any) -> Any:
    if params is None or isinstance(params, str):
        return params
    if type(params).__name__ not in parameter_classes():
        raise TypeError(f"cannot hand {type(params).__name__} to a local process")
    return {"type": type(params).__name__, "fields": config_to_dict(params)}


def _params_from_data(data: Any) -> Any:
    if data is None or isinstance(data, str):
        return data
    return config_from_dict(parameter_classes()[data["type"]], data["fields"])


def start(
    role: str, redis_params: RedisParameters, queue_params: Any, options: dict[str, Any]
) -> LocalNode:
    spec = {
        "role": role,
        "redis": _params_to_data(redis_params),
        "queue": _params_to_data(queue_params),
        "options": options,
    }
    read_end, write_end = os.pipe()  # neither end is inherited by anything but what pass_fds names
    env = {**os.environ, SPEC_ENV: json.dumps(spec), PARENT_FD_ENV: str(read_end)}
    try:
        proc = LocalNode([sys.executable, "-m", "srl.runner.distribution.client.local_nodes"], env=env,
                         pass_fds=(read_end,))
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    proc.parent_pipe = write_end
    return proc


def release(proc: LocalNode) -> None:
    """Close the write end of the pipe ``proc`` watches (once it is gone, or to tell it the client is)."""
    if proc.parent_pipe is not None:
        os.close(proc.parent_pipe)
        proc.parent_pipe = None


def watch_parent(fd: int, grace: float = ORPHAN_GRACE_S) -> None:
    """Once the pipe ``fd`` reads end-of-file (its writer, the client, is gone), stop this process as Ctrl-C
    does, and exit at once if that takes longer than ``grace`` seconds."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a child of a background job inherits "ignore"
    main_thread = threading.main_thread().ident
    assert main_thread is not None

    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            return
        logger.warning("the client that started this local node is gone: stopping")
        signal.pthread_kill(main_thread, signal.SIGINT)  # to the main thread: a blocking call there returns
        time.sleep(grace)
        logger.error("still running %.0f s after its client went: exiting", grace)
        os._exit(1)

    threading.Thread(target=watch, name="srl-parent-watch", daemon=True).start()


def start_all(
    redis_params: RedisParameters,
    queue_params: Any,
    actor_num: int,
    secret: str | None,
    actor_options: dict[str, Any],
    trainer_options: dict[str, Any],
    inference_options: dict[str, Any] | None = None,
    inference_servers: int = 1,
) -> list[LocalNode]:
    """One trainer (first in the list), ``inference_servers`` inference servers when ``inference_options`` are
    given (central inference, listening on loopback unless they say otherwise) and ``actor_num`` actors, each
    serving one task."""
    common = {"run_once": True, **({"secret": secret} if secret else {})}
    procs: list[LocalNode] = []
    try:
        procs.append(start("trainer", redis_params, queue_params, {**common, **trainer_options}))
        if inference_options is not None:
            for _ in range(inference_servers):
                procs.append(start("inference", redis_params, queue_params,
                                   {**common, "listen": "127.0.0.1:0", **inference_options}))
        for _ in range(actor_num):
            procs.append(start("actor", redis_params, queue_params, {**common, **actor_options}))
    except BaseException:
        for p in procs:  # their pipes close: they stop as on Ctrl-C
            release(p)
        raise
    servers = "" if inference_options is None else "an inference server " if inference_servers == 1 else (
        f"{inference_servers} inference servers ")
    logger.info("started a local trainer, %sand %d local actor(s) (pids %s)", servers, actor_num,
                [p.pid for p in procs])
    return procs


def stop_all(procs: list[LocalNode], grace: float = 15.0) -> None:
    """Let run-once children finish their task, then interrupt, then kill what is left. However this ends
    (a second Ctrl-C included), their pipes close, so a child left running stops on its own."""
    try:
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        for p in procs:
            release(p)


def main() -> None:
    spec = json.loads(os.environ.pop(SPEC_ENV))
    parent_fd = os.environ.pop(PARENT_FD_ENV, None)
    if parent_fd is not None:
        watch_parent(int(parent_fd))
    redis_params = _params_from_data(spec["redis"])
    queue_params = _params_from_data(spec["queue"])
    # a local node runs as a user's node script does, through the public API: the client imports no role
    import srl.runner.distribution as distribution

    if spec["role"] == "trainer":
        distribution.trainer_run_forever(redis_params, queue_params, **spec["options"])
    elif spec["role"] == "inference":
        distribution.inference_run_forever(redis_params, queue_params, **spec["options"])
    else:
        distribution.actor_run_forever(redis_params, queue_params, **spec["options"])


if __name__ == "__main__":
    main()
