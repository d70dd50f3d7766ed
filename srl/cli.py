"""The ``srl`` command: ``srl actor``, ``srl trainer``, ``srl status``, ``srl stop``, ``srl dashboard``,
``srl plot``.

Owns: turning command lines into the same parameter dataclasses the Python API
takes. Options are derived from those dataclasses (name, type, default, and
the docstring under each field as help), never re-declared by hand.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import logging
import os
import re
import signal
import sys
import textwrap
import time
import types
import typing
from typing import Any, get_type_hints

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from srl.dashboard import DashboardOptions
from srl.runner.distribution.settings.credentials import CredentialsError
from srl.runner.distribution.settings.options import ActorOptions, InferenceOptions, TrainerOptions
from srl.runner.distribution.settings.redis_parameters import RedisParameters

SKIP_FIELDS = {"redis_options", "password", "secret"}
"""never options: a password or secret on a command line is visible to every user of the machine (ps);
they come from files (--password-file, --secret-file) or the environment (SRL_REDIS_PASSWORD, SRL_SECRET)"""

ENV_DEFAULTS = {"url": "SRL_REDIS_URL", "queue_url": "SRL_QUEUE_URL"}
"""options whose default comes from the environment (a URL with a password belongs there, not in argv)"""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass and its bases (CleanRL style)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _scalar_type(tp: Any) -> Any:
    """int/float/str/bool from an annotation such as ``int | None``."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type, group_title: str) -> None:
    group = parser.add_argument_group(group_title)
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in SKIP_FIELDS or f.name == "run_once":
            continue
        tp = _scalar_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        if f.name in ENV_DEFAULTS:
            default = os.environ.get(ENV_DEFAULTS[f.name]) or default
        help_text = docs.get(f.name, "")
        if f.name in ENV_DEFAULTS:
            help_text += f" (env {ENV_DEFAULTS[f.name]})"
        if f.default is not dataclasses.MISSING:
            help_text += f" (default: {f.default})"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %: a "75%" must stay text
        if tp is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        elif tp in (int, float, str):
            group.add_argument(flag, dest=f.name, type=tp, default=default, help=help_text)


def build_dataclass(cls: type, args: argparse.Namespace) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in SKIP_FIELDS or f.name == "run_once" or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is None and f.default is dataclasses.MISSING:
            continue
        kwargs[f.name] = value
    return cls(**kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="srl", description="Distributed reinforcement learning (Ape-X style).")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_node(sub, "actor", "serve as an actor: wait for tasks on the board, act, send experience", ActorOptions)
    _add_node(sub, "trainer", "serve as the trainer: take the lease, learn, publish params", TrainerOptions,
              "--once")
    _add_node(sub, "inference", "serve central inference: act for every actor of a task that asks for it "
                                "(train_distribution(inference='central'))", InferenceOptions)

    status = sub.add_parser("status", help="show a task: status, slots, heartbeats, rates, queue depth")
    add_dataclass_options(status, RedisParameters, "board (Redis)")
    status.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="repeat every SECONDS")
    status.add_argument("--events", type=int, default=10, help="how many recent events to show")
    status.add_argument("--dead-letters", type=int, default=5,
                        help="how many of the latest refused messages to show (source and reason)")

    stop = sub.add_parser("stop", help="end a task (reason: cancelled)")
    add_dataclass_options(stop, RedisParameters, "board (Redis)")

    dashboard = sub.add_parser("dashboard", help="serve a live web page of every task on the board "
                                                 "(rates, stalls, lag, reward curve, events, a stop button)")
    add_dataclass_options(dashboard, RedisParameters, "board (Redis)")
    add_dataclass_options(dashboard, DashboardOptions, "dashboard (web page)")

    plot = sub.add_parser("plot", help="write reward.png, loss.png and throughput.png of a run next to its "
                                       "history.csv (log_dir of Runner.train / train_distribution)")
    plot.add_argument("log_dir", help="the run's log_dir")
    return parser


def _add_node(sub: Any, role: str, help_text: str, options: type, *run_once_aliases: str) -> None:
    """``srl <role>``: the board's options, the queue's URL, --run-once, and the role's own options."""
    node = sub.add_parser(role, help=help_text)
    add_dataclass_options(node, RedisParameters, "board (Redis)")
    node.add_argument("--queue-url", default=os.environ.get("SRL_QUEUE_URL") or None,
                      help="experience queue URL (amqp://, mqtt://, pubsub://...; env SRL_QUEUE_URL); "
                           "default: the board's Redis")
    node.add_argument("--run-once", *run_once_aliases, dest="run_once", action="store_true",
                      help="exit after one task")
    add_dataclass_options(node, options, role)


def _redis_params(args: argparse.Namespace) -> RedisParameters:
    params: RedisParameters = build_dataclass(RedisParameters, args)
    if params.is_embedded:
        params.host = "localhost"
    if params.password_file is None and os.environ.get("SRL_REDIS_PASSWORD"):
        params.password = os.environ["SRL_REDIS_PASSWORD"]
    _warn_if_password_in_argv(argv_values=sys.argv[1:])
    return params


def _warn_if_password_in_argv(argv_values: list[str]) -> None:
    """A URL with a password typed on the command line is readable by every user of the machine."""
    for value in argv_values:
        if "://" in value and "@" in value.partition("://")[2].partition("/")[0]:
            userinfo = value.partition("://")[2].partition("/")[0].rpartition("@")[0]
            if ":" in userinfo:
                logging.getLogger("srl").warning(
                    "a URL with a password is on the command line, where `ps` shows it to every user of this "
                    "machine; put it in SRL_REDIS_URL / SRL_QUEUE_URL, or use --password-file")
                return


class UsageError(Exception):
    """The command line asks for something that cannot be (a bad task name, URL or queue scheme): exit 2."""


RUNTIME_ERRORS: tuple[type[BaseException], ...] = (CredentialsError, OSError, redis.RedisError)
"""what a command meets at run time and says in one line (exit 1): a refused login, an unreachable server"""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from srl.runner.progress import ensure_logging

    ensure_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        code = _run(args)
        sys.stdout.flush()  # here, so that a reader that closed early is met inside this try, not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # a reader that stopped early (srl status | head): quiet, as command-line tools are
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except UsageError as e:
        return _error(args, e, 2)
    except RUNTIME_ERRORS as e:
        return _error(args, e, 1)
    except _node_errors() as e:
        return _error(args, e, 1)


def _node_errors() -> tuple[type[BaseException], ...]:
    from srl.runner.distribution.board.board import BoardError
    from srl.runner.distribution.node.serve import NodeCrashedError
    from srl.runner.distribution.queues import QueueError

    return BoardError, NodeCrashedError, QueueError


def _error(args: argparse.Namespace, error: BaseException, code: int) -> int:
    """One line on stderr (the traceback too with --verbose); the exit code."""
    if args.verbose:
        logging.getLogger("srl").exception("srl %s failed", args.command)
    print(f"srl: {_explained(args, error)}", file=sys.stderr)
    return code


def _explained(args: argparse.Namespace, error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)) and hasattr(args, "host"):
        where = args.redis_describe if hasattr(args, "redis_describe") else "the board's Redis"
        return (f"cannot reach Redis at {where} ({text}); is redis-server running there? check --host/--port or "
                "--url")
    return text


def _run(args: argparse.Namespace) -> int:
    if args.command == "plot":
        from srl.runner.plot import plot

        try:
            paths = plot(args.log_dir)
        except FileNotFoundError as e:
            raise UsageError(str(e)) from e
        for path in paths:
            print(path)
        return 0
    try:
        redis_params = _redis_params(args)
        args.redis_describe = redis_params.describe()
        if args.command in ("actor", "trainer", "inference"):
            from srl.runner.distribution.queues import check_queue

            check_queue(args.queue_url)  # a bad scheme or URL, a missing library: now, not when a task comes
        from srl.runner.distribution.board.board import Board

        # a command a person waits on: one quick retry, not redis-py's backoff, before "cannot reach"
        board = Board(redis_params.connect(retry=Retry(NoBackoff(), 1)), redis_params.task_name)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if args.command in ("actor", "trainer", "inference"):
        _terminate_as_interrupt()  # docker stop, kill: the node releases its lease as on Ctrl-C
    if args.command == "actor":
        from srl.runner.distribution.actor.run import actor_run_forever

        options = _node_options(ActorOptions, args)
        options.run_once = args.run_once
        actor_run_forever(redis_params, args.queue_url, options)
        return 0
    if args.command == "trainer":
        from srl.runner.distribution.trainer.run import trainer_run_forever

        options = _node_options(TrainerOptions, args)
        trainer_run_forever(redis_params, args.queue_url, run_once=args.run_once, options=options)
        return 0
    if args.command == "inference":
        from srl.runner.distribution.inference.run import inference_run_forever

        inference_options = _node_options(InferenceOptions, args)
        inference_options.run_once = args.run_once
        inference_run_forever(redis_params, args.queue_url, inference_options)
        return 0
    if args.command == "dashboard":
        from srl.dashboard import serve

        serve(redis_params, build_dataclass(DashboardOptions, args))
        return 0
    if args.command == "stop":
        ended = board.end_task("END", "cancelled")
        print("task ended (cancelled)" if ended else "the task was not running")
        return 0
    return _status(board, redis_params, args.watch, args.events, args.dead_letters)


def _node_options(cls: type, args: argparse.Namespace) -> Any:
    """A node's options from the command line, checked: a value no node can run with is a usage error (one
    line, exit 2), not a traceback."""
    options = build_dataclass(cls, args)
    try:
        options.validate()
    except ValueError as e:
        fields = [f.name for f in dataclasses.fields(cls)]
        # the options named as they are typed (lease_ttl: --lease-ttl): a name of two words anywhere, a
        # one-word name (listen) where the message begins with it
        names = "|".join(name for name in fields if "_" in name)
        text = str(e)
        first = text.split(" ", 1)[0]
        if first in fields and "_" not in first:
            text = "--" + text
        if names:
            text = re.sub(rf"\b({names})\b", lambda m: "--" + m.group(1).replace("_", "-"), text)
        raise UsageError(text) from e
    return options


def _terminate_as_interrupt() -> None:
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _status(board: Any, redis_params: RedisParameters, watch: float | None, events: int, dead_letters: int) -> int:
    from srl.runner.distribution.board.board import BoardError

    while True:
        try:
            status = board.get_status()
            if status is None:
                print(f"no task {redis_params.task_name!r} on {redis_params.describe()}")
                return 1
            from srl.runner.distribution.client.report import NodeHints, progress_lines, task_elapsed  # (loads torch)

            queue = board.get_task_config().get("queue")
            hints = NodeHints.of(redis_params, queue.get("describe") if isinstance(queue, dict) else None)
            lines = progress_lines(board, status, task_elapsed(board, status), hints=hints)
        except BoardError as e:  # a damaged record is shown, not a traceback
            print(f"task {redis_params.task_name!r} on {redis_params.describe()} cannot be read: {e}")
            return 2
        for line in lines:
            print(line)
        if status.end_reason:
            print(f"  ended: {status.end_reason}")
        for event in board.get_events(events):
            stamp = time.strftime("%H:%M:%S", time.localtime(event.ts))
            print(f"  {stamp} {event.level:<7} {event.text}")
        letters = board.get_dead_letters(dead_letters) if dead_letters > 0 else []
        if letters:
            print(f"  refused messages (latest {len(letters)}; acked and skipped):")
        for letter in letters:
            stamp = time.strftime("%H:%M:%S", time.localtime(letter.ts))
            print(f"  {stamp} {letter.size} bytes from {letter.source}: {letter.reason}")
        if watch is None:
            return 0
        sys.stdout.flush()  # each round as it is printed, also into a pipe
        time.sleep(watch)
        print()


if __name__ == "__main__":
    sys.exit(main())
