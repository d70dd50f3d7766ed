"""How to reach the Redis that holds the blackboard (and, by default, the queue).

Owns: ``RedisParameters`` and turning it into a redis-py client. Must never:
write board keys (that is ``board.py``'s job).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

if TYPE_CHECKING:
    from srl.runner.distribution.embedded import EmbeddedRedis


@dataclass
class RedisParameters:
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
    password: str | None = None
    """password (or the ACL user's password)"""
    task_name: str = "srl"
    """task namespace: every key of the task lives under this prefix"""
    redis_options: dict[str, Any] = field(default_factory=dict)
    """extra keyword options passed to redis.Redis (socket_timeout, ssl_ca_certs, ...)"""

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
        options: dict[str, Any] = {"socket_connect_timeout": 5.0, "health_check_interval": 30}
        options.update(self.redis_options)
        options.update(overrides)
        if self.username is not None:
            options.setdefault("username", self.username)
        if self.password is not None:
            options.setdefault("password", self.password)
        if self.url is not None:
            return redis.Redis.from_url(self.url, **options)
        if self.host is None:
            raise ValueError(
                "RedisParameters() with no host and no url means an embedded Redis; "
                "start it first with RedisParameters.resolve() (or "
                "srl.runner.distribution.embedded.start_embedded_redis()) and connect to what it returns"
            )
        return redis.Redis(host=self.host, port=self.port, db=self.db, **options)

    def resolve(self) -> tuple[RedisParameters, EmbeddedRedis | None]:
        """Parameters that point at a real server, and the embedded server started for them (or None).

        For an embedded one the caller owns the returned ``EmbeddedRedis``: stop it (or use it as a
        context manager) when done; it also stops at interpreter exit and when this process dies.
        """
        if not self.is_embedded:
            return self, None
        from srl.runner.distribution.embedded import start_embedded_redis

        server = start_embedded_redis()
        return self.replace(host=server.host, port=server.port, db=0), server

    def replace(self, **changes: Any) -> RedisParameters:
        return dataclasses.replace(self, **changes)
