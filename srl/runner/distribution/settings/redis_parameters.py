"""How to reach the Redis that holds the blackboard (and, by default, the queue).

Owns: ``RedisParameters`` and turning it into a redis-py client whose errors say what happened: a refused
login is a :class:`CredentialsError`, and a refusal Redis answers only for a while (full, a replica after a
failover, stuck in a slow script) is a :class:`RedisRefusedError` naming it, which callers wait out like an
outage. Must never: write board keys (that is ``board/board.py``'s job).
"""

from __future__ import annotations

import dataclasses
import os
import re
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis

from srl.base.config import Settings
from srl.runner.distribution.settings.credentials import authentication_failed


def read_secret_file(path: str | None) -> str | None:
    """The first line of ``path`` (a password or secret file), or None without a path."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip()
    except OSError as e:
        raise ValueError(f"cannot read the password file {path!r}: {e}") from e


# Longest a read waits for a reply's next bytes, and (Python sockets time a send as a whole) the
# longest one command's send may take: long enough for a few hundred MB of params over a link of
# 5 MB/s; a slower link needs redis_options={"socket_timeout": ...}
DEFAULT_SOCKET_TIMEOUT_S = 60.0

TLS_VERIFY_HINT = (
    "set ssl_ca_certs (RedisParameters.ssl_ca_certs, --ssl-ca-certs, or ?ssl_ca_certs=PATH in the rediss:// URL) "
    "to the CA that signed the server's certificate, and connect by a host name that certificate names"
)


REDIS_CREDENTIALS_HINT = (
    "the password/user: RedisParameters(password=..., username=...), the user:password in the URL, "
    "--password-file, or SRL_REDIS_PASSWORD / SRL_REDIS_PASSWORD_FILE"
)


REFUSALS: dict[str, str] = {
    "OOM": "Redis is out of memory (maxmemory reached; a queue kept in the board's Redis counts too): raise "
           "maxmemory or free memory",
    "READONLY": "this Redis is a read-only replica (a failover demoted it?): srl waits for it to be a primary "
                "again; point srl at the primary (a Sentinel or cluster address) to move on",
    "BUSY": "Redis is running a slow script and answers nothing else until it ends (SCRIPT KILL ends it)",
    "MASTERDOWN": "this replica lost its primary and serves no stale data",
    "NOREPLICAS": "fewer replicas answer than min-replicas-to-write needs",
    "TRYAGAIN": "a cluster slot is moving",
    "CLUSTERDOWN": "the cluster is down",
}
"""the error codes of replies that refuse a command only for a while, with what each means; waited out"""

_REFUSED_CLASSES: tuple[tuple[type[redis.ResponseError], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.MasterDownError, "MASTERDOWN"),
    (redis.exceptions.TryAgainError, "TRYAGAIN"),
    (redis.exceptions.ClusterDownError, "CLUSTERDOWN"),
)
# Redis < 7 wraps the error of a command a script calls: "Error running script (call to f_<sha>):
# @user_script:38: @user_script: 38: -OOM command not allowed ..."; Redis 7 keeps its code and appends
# "script: <sha>, on @user_script:38."
_SCRIPT_ERROR = re.compile(r"Error running script .*?: -([A-Z]+) ")
_SCRIPT_PLACE = re.compile(r"\.? script: [0-9a-f]+, on @user_script:[0-9]+\.?$")


class RedisRefusedError(redis.ResponseError):
    """Redis answered, but refuses the command for now (``code``: a key of :data:`REFUSALS`): it is full,
    a replica, busy. Not the command's fault: waiting cures it, as it cures an outage."""

    def __init__(self, code: str, reply: str) -> None:
        wrapped = _SCRIPT_ERROR.search(reply)
        if wrapped:  # the command's own reply, not the script's wrapping
            reply = reply[wrapped.end():]
        reply = _SCRIPT_PLACE.sub("", reply.removeprefix(code + " ").strip())  # "BUSY Redis is busy": one code
        super().__init__(f"{code}: {reply} ({REFUSALS[code]})")
        self.code = code


def refusal_code(error: BaseException) -> str | None:
    """The :data:`REFUSALS` code of a reply error that refuses for now (from a command or a script), else None."""
    if isinstance(error, RedisRefusedError):
        return error.code
    if not isinstance(error, redis.ResponseError):
        return None
    for cls, code in _REFUSED_CLASSES:  # redis-py strips the code of the replies it has a class for
        if isinstance(error, cls):
            return code
    text = str(error)
    first = text.split(" ", 1)[0]
    if first in REFUSALS:
        return first
    wrapped = _SCRIPT_ERROR.search(text)
    return wrapped[1] if wrapped and wrapped[1] in REFUSALS else None


class _Explained:
    """Mixed into redis-py's connection classes, so that every reply srl gets says what happened:

    * a refused login (no password for a server that needs one, a wrong one, a disabled user) is a
      :class:`CredentialsError` naming the server, at once, not a ConnectionError that redis-py, and then
      srl, would retry as an outage;
    * a reply that refuses a command for a while (OOM, READONLY, BUSY, ... of :data:`REFUSALS`) is a
      :class:`RedisRefusedError` naming it, whether the command came alone or from a script, which every
      caller waits out (``retry.TRANSIENT_ERRORS``) instead of ending a node on it."""

    host: str
    port: int
    db: int

    def on_connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().on_connect_check_health(*args, **kwargs)  # type: ignore[misc]
        except redis.AuthenticationError as e:
            self.disconnect()  # type: ignore[attr-defined]
            where = getattr(self, "path", "") or f"{getattr(self, 'host', '?')}:{getattr(self, 'port', '?')}"
            given = getattr(self, "password", None) or getattr(self, "credential_provider", None)
            reason = e if given else "it needs a password and none was given"
            raise authentication_failed(f"Redis at {where}", reason, REDIS_CREDENTIALS_HINT) from e

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError as e:
            code = refusal_code(e)
            if code is None or isinstance(e, RedisRefusedError):
                raise
            raise RedisRefusedError(code, str(e)) from e


_EXPLAINED: dict[type, type] = {}


def _explained(connection_class: type) -> type:
    """``connection_class`` with refused logins and refusals for now explained (one subclass per class)."""
    if issubclass(connection_class, _Explained):
        return connection_class
    if connection_class not in _EXPLAINED:
        _EXPLAINED[connection_class] = type(connection_class.__name__, (_Explained, connection_class), {})
    return _EXPLAINED[connection_class]


class ExplainedSSLConnection(redis.SSLConnection):
    """redis-py's TLS connection, whose failed certificate check says which option fixes it."""

    def _error_message(self, exception: BaseException) -> str:
        if isinstance(exception, ssl.SSLCertVerificationError):
            return (f"TLS certificate verification failed connecting to {self.host}:{self.port} "
                    f"({exception}); {TLS_VERIFY_HINT}")
        if isinstance(exception, FileNotFoundError) and self.ca_certs and not os.path.exists(self.ca_certs):
            return (f"cannot load the CA bundle ssl_ca_certs={self.ca_certs!r} for {self.host}:{self.port}: "
                    "no such file; expected a PEM file of CA certificates")
        message: str = super()._error_message(exception)
        return message


@dataclass
class RedisParameters(Settings):
    """Where the Redis blackboard lives.

    With neither ``host`` nor ``url`` this means an embedded Redis: a real
    redis-server started on demand on this machine.
    """

    host: str | None = None
    """host name of the Redis server (None with no url: embedded Redis)"""
    port: int = 6379
    """TCP port of the Redis server"""
    db: int = 0
    """Redis database number"""
    url: str | None = None
    """redis://, rediss:// (TLS) or unix:// URL; overrides host/port/db"""
    username: str | None = None
    """ACL user name"""
    password: str | None = field(default=None, repr=False)
    """password (or the ACL user's password); never on a command line: see password_file"""
    password_file: str | None = None
    """file holding the password (read when connecting; what --password-file sets)"""
    task_name: str = "srl"
    """task namespace: every key of the task lives under this prefix"""
    redis_options: dict[str, Any] = field(default_factory=dict)
    """extra keyword options passed to redis.Redis (socket_timeout, ssl_ca_certs, ...); srl sets
    socket_connect_timeout 5 s, socket_timeout ``DEFAULT_SOCKET_TIMEOUT_S`` (60 s) and
    health_check_interval 30 s unless given here"""
    ssl_ca_certs: str | None = None
    """CA bundle (PEM file) that signed the server's TLS certificate; None: the system CAs. For a rediss://
    URL (?ssl_ca_certs=PATH in the URL does the same); with host, setting it turns TLS on. Over TLS the
    certificate and the host name are checked"""

    @classmethod
    def from_env(cls, **overrides: Any) -> RedisParameters:
        """Parameters from the environment, the way containers and notebooks pass them:
        ``SRL_REDIS_URL`` (else ``SRL_REDIS_HOST``, default localhost), ``SRL_REDIS_PASSWORD`` or
        ``SRL_REDIS_PASSWORD_FILE``, ``SRL_TASK_NAME``; keyword arguments win."""
        env = os.environ
        fields: dict[str, Any] = {"task_name": env.get("SRL_TASK_NAME") or "srl"}
        if env.get("SRL_REDIS_URL"):
            fields["url"] = env["SRL_REDIS_URL"]
        else:
            fields["host"] = env.get("SRL_REDIS_HOST") or "localhost"
        if env.get("SRL_REDIS_PASSWORD"):
            fields["password"] = env["SRL_REDIS_PASSWORD"]
        elif env.get("SRL_REDIS_PASSWORD_FILE"):
            fields["password_file"] = env["SRL_REDIS_PASSWORD_FILE"]
        return cls(**{**fields, **overrides})

    @classmethod
    def from_url(cls, url: str, **fields: Any) -> RedisParameters:
        """Parameters for a ``redis://``, ``rediss://`` (TLS) or ``unix://`` URL; ValueError when it is malformed."""
        params = cls(url=url, **fields)
        try:
            parts = urlsplit(url)
            _ = parts.port  # raises ValueError on a port that is not a number
        except ValueError as e:
            raise ValueError(f"malformed Redis URL {params.describe()!r}: {e}; expected "
                             "redis://[user:password@]host[:port][/db]") from None
        if parts.scheme.lower() not in ("redis", "rediss", "unix"):
            raise ValueError(f"a redis://, rediss:// or unix:// URL was expected, got {params.describe()!r}")
        return params

    def __repr__(self) -> str:
        # the url may carry a password: show where it points, never the secret
        return f"RedisParameters({self.describe()!r}, task_name={self.task_name!r})"

    @property
    def is_embedded(self) -> bool:
        return self.host is None and self.url is None

    def describe(self) -> str:
        """Where this points, without secrets, for log lines and errors."""
        if self.url is not None:
            scheme, _, rest = self.url.partition("://")
            return f"{scheme}://{rest.rpartition('@')[2]}"
        if self.host is not None:
            return f"redis://{self.host}:{self.port}/{self.db}"
        return "embedded redis"

    def connect(self, **overrides: Any) -> redis.Redis:
        """A redis-py client for these parameters (no I/O until first use)."""
        # socket_timeout: a connection that stops answering (a dropped route, a half-open TCP
        # connection) raises TimeoutError, which every caller retries on a new connection, instead
        # of leaving the node waiting for ever on one read; srl sends no command that waits longer
        options: dict[str, Any] = {"socket_connect_timeout": 5.0, "socket_timeout": DEFAULT_SOCKET_TIMEOUT_S,
                                   "health_check_interval": 30}
        options.update(self.redis_options)
        options.update(overrides)
        if self.username is not None:
            options.setdefault("username", self.username)
        password = self.password if self.password is not None else read_secret_file(self.password_file)
        if password is not None:
            options.setdefault("password", password)
        if self.ssl_ca_certs is not None:
            options.setdefault("ssl_ca_certs", self.ssl_ca_certs)
        if self.url is not None:
            if self.ssl_ca_certs is not None and not self.url.lower().startswith("rediss://"):
                raise ValueError(
                    f"ssl_ca_certs is set but {self.describe()} is not a TLS URL; use rediss://host:port/db "
                    "(TLS), or drop ssl_ca_certs"
                )
            client = redis.Redis.from_url(self.url, **options)
        elif self.host is None:
            raise ValueError(
                "RedisParameters() with no host and no url means an embedded Redis; "
                "start it first with srl.runner.distribution.client.embedded.resolve(params) (or "
                "srl.runner.distribution.client.embedded.start_embedded_redis()) and connect to what it returns"
            )
        else:
            if self.ssl_ca_certs is not None:
                options.setdefault("ssl", True)
            client = redis.Redis(host=self.host, port=self.port, db=self.db, **options)
        pool = client.connection_pool
        if pool.connection_class is redis.SSLConnection:
            pool.connection_class = ExplainedSSLConnection
        pool.connection_class = _explained(pool.connection_class)
        return client

    def replace(self, **changes: Any) -> RedisParameters:
        return dataclasses.replace(self, **changes)
