"""``srl dashboard``: a live web page of every task on one Redis, with a stop button per running task.

Owns: a standard-library HTTP server (``ThreadingHTTPServer``) that reads the
board of each task (``list_tasks``, then one :class:`Board` per task) and
answers the page in ``srl/dashboard_static`` (plain HTML, CSS and JS: no CDN,
nothing fetched from the internet), and the in-memory reward samples drawn for
a task that has no history rows yet.

Must never: write to the board except to end a task its user asked to stop
(``Board.end_task`` and one event that says so); trust what it reads (every
value sent to the page is a finite number, a bool, a short text or null, and
the page puts text into the DOM through ``textContent`` only); let one damaged
task record break the page (that task shows its error text, the others go
on); or act on a request another web site could make a browser send: every
request must name this server in ``Host`` (no DNS rebinding), and a stop must
also carry the ``X-SRL-Dashboard`` header (which a cross-site form cannot set,
and which makes a cross-site ``fetch`` need a CORS preflight that is never
granted) and, when the browser sends one, a same-origin ``Origin``.

Endpoints: ``GET /`` (the page), ``GET /api/tasks`` (a summary row per task),
``GET /api/task/<name>`` (one task in full: slots, rates, stalls, policy lag,
counters, reward curve, events, refused messages), ``POST
/api/task/<name>/stop`` (end it as END, "stopped from the dashboard").
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

from srl.base.config import Settings
from srl.runner.distribution.board.board import (
    Board,
    BoardError,
    TaskState,
    TaskStatus,
    inference_lease,
    list_tasks,
    task_key_prefix,
)
from srl.runner.distribution.node.stats import ActorStats, NodeStats, Reports
from srl.runner.distribution.sending.in_flight import batches_in_flight
from srl.runner.distribution.settings.redis_parameters import RedisParameters

logger = logging.getLogger("srl.dashboard")


@dataclass
class DashboardOptions(Settings):
    """Where the dashboard's web server listens (``srl dashboard --bind ... --http-port ...``)."""

    bind: str = "127.0.0.1"
    """address the web page is served on; anything but loopback lets whoever reaches it stop tasks"""
    http_port: int = 8265
    """TCP port of the web page (0: any free port); --port is the Redis port, as in every srl command"""


STOP_REASON = "stopped from the dashboard"
"""the end reason a stop from the page writes on the board"""
CSRF_HEADER = "X-SRL-Dashboard"
"""header the page sets on its requests; a stop without it is refused"""
SHOWN_ACTORS = 64
"""actor slots shown per task (a task may have up to 100,000; the rest are counted, not listed)"""
CURVE_POINTS = 1000
"""most points of a reward curve: history rows read, or samples kept per task"""
SHOWN_EVENTS = 50
"""latest events shown per task"""
SHOWN_DEAD_LETTERS = 10
"""latest refused-message notes shown per task"""
TEXT_LIMIT = 300
"""characters kept of any text read from the board"""
STATS_KEYS_LIMIT = 100
"""stats fields kept per role"""
_MAX_SAFE_INT = 2**53
"""JavaScript numbers hold integers exactly up to here"""

_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_TASK_PATH = re.compile(r"/api/task/([^/]+)")
_STOP_PATH = re.compile(r"/api/task/([^/]+)/stop")


# ---------------------------------------------------------------- what is sent to the page
def _scalar(value: Any) -> float | int | str | bool | None:
    """A value read from the board as something safe to send: a finite number, a bool, a short text, or None."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -_MAX_SAFE_INT <= value <= _MAX_SAFE_INT else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value[:TEXT_LIMIT]
    return None


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (a text, a bool, a missing value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _clean_stats(stats: NodeStats | None) -> dict[str, float | int | str | bool | None]:
    """A role's stats for the page: the fields of its stats dataclass (the names the page reads) and its
    numbers, each a scalar the page can show."""
    record = stats.to_record() if stats is not None else {}
    return {str(k)[:64]: _scalar(v) for k, v in list(record.items())[:STATS_KEYS_LIMIT]}


def _heartbeat_age(stats: NodeStats | None, now: float) -> float | None:
    """Seconds since the role last wrote its stats (its heartbeat), or None when it never did."""
    if stats is None or not stats.updated_at:
        return None
    return round(max(0.0, now - stats.updated_at), 2)


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:TEXT_LIMIT * 2]


class Dashboard:
    """What the page asks for, read from the boards of every task on one Redis (thread-safe)."""

    def __init__(self, client: redis.Redis, where: str) -> None:
        self.client = client
        self.where = where
        """where the board lives, without secrets (RedisParameters.describe())"""
        self._lock = threading.Lock()
        self._samples: dict[str, deque[dict[str, float | None]]] = {}
        self._sampled_at: dict[str, float] = {}

    # ------------------------------------------------------------ every task
    def tasks(self) -> dict[str, Any]:
        """A summary row per task on this Redis; a task whose record is damaged has its error text instead."""
        names = list_tasks(self.client)
        with self._lock:  # reward samples of deleted tasks go with them
            for name in set(self._samples) - set(names):
                self._samples.pop(name, None)
                self._sampled_at.pop(name, None)
        return {"redis": self.where, "now": time.time(), "tasks": [self._summary(name) for name in names]}

    def _summary(self, name: str) -> dict[str, Any]:
        row: dict[str, Any] = {"name": name, "status": None, "error": None}
        try:
            board = Board(self.client, name)
            status = board.get_status()
            if status is None:  # deleted between the SCAN and now
                row["error"] = "the task was deleted"
                return row
            counters = board.get_counters()
        except BoardError as e:
            row["error"] = _error_text(e)
            return row
        row.update(_status_fields(status))
        row["env_steps"] = _scalar(counters.get("env_steps", 0.0))
        return row

    # ------------------------------------------------------------ one task
    def task(self, name: str) -> dict[str, Any] | None:
        """One task in full; None when there is no such task. ValueError: ``name`` is not a task name."""
        task_key_prefix(name)
        board = Board(self.client, name)
        try:
            status = board.get_status()
        except BoardError as e:
            return {"name": name, "status": None, "error": _error_text(e)}
        if status is None:
            return None
        try:
            return self._detail(board, status)
        except BoardError as e:
            return {"name": name, **_status_fields(status), "error": _error_text(e)}

    def _detail(self, board: Board, status: TaskStatus) -> dict[str, Any]:
        now = time.time()
        shown_slots = range(min(status.actor_num, SHOWN_ACTORS))
        # stats, counters, config and every lease shown in one round trip: a read per slot cost a round trip
        # each, 64 per refresh of the page
        view = board.view(status.actor_num, lease_slots=len(shown_slots), servers=status.inference_servers)
        servers = [inference_lease(k) for k in range(status.inference_servers)]
        reports = Reports.of(view.stats)
        counters = view.counters
        detail: dict[str, Any] = {"name": board.task_name, **_status_fields(status), "error": None, "now": now}
        try:  # the task config (unverified: for display); a damaged one is named, and reads as {}
            config, config_error = view.config, None
        except BoardError as e:
            config, config_error = {}, e
        detail.update(self._config_fields(config, config_error))
        start = status.started_at or status.created_at
        detail["elapsed_s"] = round(max(0.0, (status.ended_at or now) - start), 1) if start else None

        trainer = reports.trainer
        holders = [view.holders[name] for name in ("trainer", *(f"actor:{slot}" for slot in shown_slots))]
        detail["trainer"] = {
            "holder": _scalar(holders[0]), "heartbeat_age_s": _heartbeat_age(trainer, now),
            "stats": _clean_stats(trainer),
        }
        detail["train_count"] = trainer.train_count if trainer is not None and trainer.train_count else \
            status.train_count

        detail["inference_servers"] = []
        if config.get("inference") == "central":  # the inference servers to show
            detail["inference_servers"] = [
                {"name": name if len(servers) > 1 else "inference", "holder": _scalar(view.holders[name]),
                 "heartbeat_age_s": _heartbeat_age(reports.servers.get(k), now),
                 "stats": _clean_stats(reports.servers.get(k))} for k, name in enumerate(servers)]
        detail["inference"] = detail["inference_servers"][0] if detail["inference_servers"] else None

        actors = []
        actor_stats = []
        for slot, holder in zip(shown_slots, holders[1:], strict=True):
            s = reports.actor(slot)
            if s is not None:
                actor_stats.append(s)
            actors.append({"slot": slot, "holder": _scalar(holder),
                           "heartbeat_age_s": _heartbeat_age(s, now), "stats": _clean_stats(s)})
        detail["actors"] = actors
        detail["elastic_actors"] = config.get("elastic_actors") is True  # a free slot is not missing
        detail["actors_not_shown"] = max(0, status.actor_num - SHOWN_ACTORS)

        detail["counters"] = {k: _scalar(v) for k, v in sorted(counters.items())[:STATS_KEYS_LIMIT]}
        detail["batches_in_flight"] = _scalar(max(0.0, batches_in_flight(counters)))
        env_steps = counters.get("env_steps", 0.0)
        detail["env_steps"] = _scalar(env_steps)
        detail["curve"] = self._curve(board, actor_stats, env_steps)
        detail["events"] = [
            {"ts": e.ts, "level": e.level, "text": e.text[:TEXT_LIMIT * 2], "source": e.source[:TEXT_LIMIT]}
            for e in board.get_events(SHOWN_EVENTS)
        ]
        detail["dead_letters"] = [
            {"ts": d.ts, "source": d.source[:TEXT_LIMIT], "reason": d.reason[:TEXT_LIMIT], "size": d.size}
            for d in board.get_dead_letters(SHOWN_DEAD_LETTERS)
        ]
        return detail

    @staticmethod
    def _config_fields(config: dict[str, Any], error: BoardError | None) -> dict[str, Any]:
        """Algorithm and env from the task config; a damaged config is named."""
        if error is not None:
            return {"algorithm": None, "env": None, "config_error": _error_text(error)}
        env = config.get("env")
        env_id = env.get("id") if isinstance(env, dict) else None
        algorithm = config.get("algorithm")
        return {"algorithm": algorithm[:TEXT_LIMIT] if isinstance(algorithm, str) else None,
                "env": env_id[:TEXT_LIMIT] if isinstance(env_id, str) else None, "config_error": None}

    # ------------------------------------------------------------ reward curve
    def _curve(self, board: Board, actor_stats: list[ActorStats], env_steps: float) -> dict[str, Any]:
        """The reward curve: the task's history rows, or (none yet) the actors' reward stats sampled here."""
        rows = board.get_history(CURVE_POINTS)
        if rows:
            points = []
            for i, row in enumerate(rows):
                x = _number(row.get("env_steps"))
                points.append({
                    "x": i if x is None else x,
                    "reward_mean": _number(row.get("reward_mean")),
                    "reward_min": _number(row.get("reward_min")),
                    "reward_max": _number(row.get("reward_max")),
                    "eval_mean": _number(row.get("eval_mean")),
                })
            return {"source": "history", "points": points}
        self._sample_rewards(board.task_name, actor_stats, env_steps)
        with self._lock:
            sampled = list(self._samples.get(board.task_name, ()))
        return {"source": "actor reward samples", "points": sampled}

    def _sample_rewards(self, name: str, actor_stats: list[ActorStats], env_steps: float) -> None:
        """Add a point when an actor has reported a reward since the last one (so polls never repeat points)."""
        reported = [(s.reward, s.updated_at) for s in actor_stats if s.reward is not None]
        if not reported:
            return
        rewards = [reward for reward, _ in reported]
        newest = max(updated for _, updated in reported)
        with self._lock:
            if newest <= self._sampled_at.get(name, 0.0):
                return
            self._sampled_at[name] = newest
            series = self._samples.setdefault(name, deque(maxlen=CURVE_POINTS))
            series.append({"x": _number(env_steps) or 0.0, "reward_mean": sum(rewards) / len(rewards),
                           "reward_min": min(rewards), "reward_max": max(rewards), "eval_mean": None})

    # ------------------------------------------------------------ the one write
    def stop(self, name: str, requested_by: str) -> bool | None:
        """End the task as END (STOP_REASON); False if it had already ended, None if there is no such task.
        ValueError: ``name`` is not a task name."""
        task_key_prefix(name)
        board = Board(self.client, name)
        try:
            if board.get_status() is None:
                return None
        except BoardError:
            pass  # a damaged record can still be ended: the end script checks the status itself
        ended = board.end_task(TaskState.END, STOP_REASON)
        if ended:
            board.log_event(f"task stopped from the dashboard (request from {requested_by})", level="WARNING",
                            source="dashboard")
            logger.warning("task %r stopped from the dashboard (request from %s)", name, requested_by)
        return ended


def _status_fields(status: TaskStatus) -> dict[str, Any]:
    return {
        "status": status.status.value, "end_reason": status.end_reason[:TEXT_LIMIT * 2],
        "created_at": status.created_at, "started_at": status.started_at, "ended_at": status.ended_at,
        "actor_num": status.actor_num, "max_train_count": status.max_train_count, "max_steps": status.max_steps,
        "timeout": status.timeout, "params_version": status.params_version,
        "train_count": status.train_count, "running": not status.status.finished,
    }


# ---------------------------------------------------------------- HTTP
def _static_files() -> dict[str, bytes]:
    folder = resources.files("srl") / "dashboard_static"
    return {name: (folder / name).read_bytes() for name, _ in set(_STATIC.values())}


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _split_host(host_header: str) -> tuple[str, int | None]:
    """``("name", port)`` of a Host header (``name:port``, ``[v6]:port``); port None when absent or bad."""
    host, port = host_header.strip().lower(), ""
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        host, port = name, rest[1:] if rest.startswith(":") else ""
    elif host.count(":") == 1:
        host, port = host.split(":")
    return host, int(port) if port.isdigit() and len(port) <= 5 else None


class DashboardServer(ThreadingHTTPServer):
    """The dashboard's web server; ``serve_forever()`` it (in a thread, for tests)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], dashboard: Dashboard) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.dashboard = dashboard
        self.bind_address = address[0]
        self.static = _static_files()
        wildcard = self.bind_address in ("", "0.0.0.0", "::")
        # names a browser may put in Host for this server; an IP literal is also fine (DNS cannot rebind it)
        self.host_names = {"localhost", self.bind_address.lower()}
        if wildcard or not _is_loopback(self.bind_address):
            self.host_names |= {socket.gethostname().lower(), socket.getfqdn().lower()}

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        host = self.bind_address
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/"

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether ``Host`` names this server: a DNS-rebinding page would send its own domain name."""
        if not host_header:
            return False
        name, port = _split_host(host_header)
        if port != self.port:
            return False
        if name in self.host_names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    server_version = "srl-dashboard"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    # ------------------------------------------------------------ routes
    def do_GET(self) -> None:
        if not self._host_checked():
            return
        path = urlsplit(self.path).path
        if path in _STATIC:
            filename, content_type = _STATIC[path]
            self._send(HTTPStatus.OK, self.server.static[filename], content_type)
            return
        dashboard = self.server.dashboard
        if path == "/api/tasks":
            self._answer(dashboard.tasks)
            return
        match = _TASK_PATH.fullmatch(path)
        if match:
            name = unquote(match[1])
            self._answer(lambda: dashboard.task(name), not_found=f"no task {name!r} on {dashboard.where}")
            return
        self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {path[:100]!r}: try / or /api/tasks"})

    def do_POST(self) -> None:
        if not self._host_checked():
            return
        refusal = self._cross_site_refusal()
        if refusal:
            logger.warning("refused a stop from %s: %s", self.address_string(), refusal)
            self._json(HTTPStatus.FORBIDDEN, {"error": refusal})
            return
        path = urlsplit(self.path).path
        match = _STOP_PATH.fullmatch(path)
        if not match:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"nothing to POST at {path[:100]!r}: try /api/task/NAME/stop"})
            return
        name = unquote(match[1])
        dashboard = self.server.dashboard
        self._answer(lambda: _stopped(dashboard.stop(name, self.address_string())),
                     not_found=f"no task {name!r} on {dashboard.where}")

    # ------------------------------------------------------------ checks
    def _host_checked(self) -> bool:
        host = self.headers.get("Host")
        if self.server.host_allowed(host):
            return True
        self._json(HTTPStatus.FORBIDDEN, {
            "error": f"Host {str(host)[:100]!r} does not name this dashboard; open it by its address "
                     f"(e.g. http://localhost:{self.server.port}/)"})
        return False

    def _cross_site_refusal(self) -> str | None:
        """Why this POST may have come from another site (None: it did not)."""
        if self.headers.get(CSRF_HEADER) != "1":
            return f"a stop needs the {CSRF_HEADER}: 1 header (the dashboard page sets it)"
        origin = self.headers.get("Origin")
        if origin is not None and origin.lower() != f"http://{self.headers.get('Host', '').lower()}":
            return f"Origin {origin[:100]!r} is not this dashboard"
        if self.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
            return "the request came from another site"
        return None

    # ------------------------------------------------------------ answers
    def _answer(self, read: Callable[[], Mapping[str, Any] | None], not_found: str = "not found") -> None:
        """Send what ``read()`` returns as JSON: None is 404, a bad task name 400, Redis down 503."""
        try:
            body = read()
        except ValueError as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)[:TEXT_LIMIT]})
            return
        except redis.RedisError as e:
            self._json(HTTPStatus.SERVICE_UNAVAILABLE,
                       {"error": f"the board at {self.server.dashboard.where} did not answer: {_error_text(e)}"})
            return
        except Exception as e:  # one bad answer must not take the server down
            logger.exception("dashboard request %s failed", self.path[:200])
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": _error_text(e)})
            return
        if body is None:
            self._json(HTTPStatus.NOT_FOUND, {"error": not_found})
        else:
            self._json(HTTPStatus.OK, body)

    def _json(self, code: HTTPStatus, body: Mapping[str, Any]) -> None:
        self._send(code, json.dumps(body, separators=(",", ":"), allow_nan=False).encode(),
                   "application/json; charset=utf-8")

    def _send(self, code: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("X-Frame-Options", "DENY")
        if content_type.startswith("text/html"):
            self.send_header("Content-Security-Policy", _CSP)
        self.end_headers()
        self.wfile.write(body)


def _stopped(ended: bool | None) -> dict[str, Any] | None:
    if ended is None:
        return None
    return {"ended": ended, "reason": STOP_REASON if ended else "the task had already ended"}


# ---------------------------------------------------------------- entry points
def make_server(redis_params: RedisParameters, options: DashboardOptions) -> DashboardServer:
    """A dashboard server for the Redis ``redis_params`` points at (bound, not yet serving)."""
    dashboard = Dashboard(redis_params.connect(), redis_params.describe())
    return DashboardServer((options.bind, options.http_port), dashboard)


def serve(redis_params: RedisParameters, options: DashboardOptions) -> None:
    """Serve the dashboard until Ctrl-C (what ``srl dashboard`` runs)."""
    server = make_server(redis_params, options)
    if not _is_loopback(options.bind):
        logger.warning("the dashboard listens on %s, not loopback: whoever reaches %s can stop tasks on %s; "
                       "bind 127.0.0.1 and use an SSH tunnel instead", options.bind, server.url,
                       redis_params.describe())
    print(f"srl dashboard: {server.url} (board {redis_params.describe()}; Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
