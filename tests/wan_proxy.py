"""A wide-area network between a node and a server, on loopback: a TCP proxy with latency, a bandwidth cap,
partitions and resets.

Owns: :class:`WanProxy`, one listening port in front of one ``host:port`` (Redis, RabbitMQ, Mosquitto,
the Pub/Sub emulator). Every connection a node opens to the proxy gets its own to the server, and each
direction's bytes arrive ``delay_s`` after they were read (one way: a round trip costs twice that),
no faster than ``rate`` bytes per second. ``partition()`` stops all traffic without closing anything
(packets dropped on a cut link: TCP holds the connection, the peers see silence) and refuses nothing
(new connections hang the same way); ``heal()`` delivers what was held, in order. ``reset()`` aborts every
open connection with a TCP RST, as a middlebox or a restarting NAT does. The machine has no ``netem``;
this is the part of it srl's nodes can feel. Must never: reorder bytes within a connection, or drop
any outside ``reset()``.

    with WanProxy("127.0.0.1", 6379, delay_s=0.05) as proxy:   # 100 ms round trips to Redis
        url = f"redis://127.0.0.1:{proxy.port}/0"
        ...
        proxy.partition(); ...; proxy.heal()
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

CHUNK = 64 * 1024
T = TypeVar("T")


@dataclass
class WanStats:
    connections: int = 0
    bytes_up: int = 0
    """client to server"""
    bytes_down: int = 0
    """server to client"""
    resets: int = 0


class WanProxy:
    """A TCP proxy on ``listen_host`` (an ephemeral port unless ``listen_port``) in front of
    ``target_host:target_port``; see the module docstring. Runs its own event loop in a thread."""

    def __init__(self, target_host: str, target_port: int, *, delay_s: float = 0.0, rate: float | None = None,
                 listen_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        if delay_s < 0 or (rate is not None and rate <= 0):
            raise ValueError(f"delay_s must be >= 0 and rate > 0 or None, got {delay_s!r}, {rate!r}")
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.rate = rate
        self.stats = WanStats()
        self.partitioned_at = 0.0
        """when the last :meth:`partition` began (monotonic)"""
        self._listen = (listen_host, listen_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="wan-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._links: set[_Link] = set()
        self._accepting: set[asyncio.Task[None]] = set()
        """each accepted connection's task (waiting for a partition to heal, or pumping): cancelled at the stop,
        not left pending in a closed loop"""
        self.port = 0

    # ------------------------------------------------------------ control (any thread)
    def start(self) -> WanProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> WanProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_delay(self, delay_s: float) -> None:
        """One-way delay for bytes read from now on."""
        self.delay_s = delay_s

    def partition(self) -> None:
        """Stop all traffic (open and new connections alike) until :meth:`heal`; nothing is closed."""
        self._call(self._set_flowing, False)
        self.partitioned_at = time.monotonic()

    def heal(self) -> None:
        """Deliver what the partition held, in order, and let traffic flow again."""
        self._call(self._set_flowing, True)

    def reset(self, fraction: float = 1.0) -> int:
        """Abort open connections with a TCP RST on both sides, each with probability ``fraction`` (1: all);
        returns how many."""
        return self._call(self._reset, fraction)

    @property
    def open_connections(self) -> int:
        return len(self._links)

    def url(self, scheme: str, path: str = "", userinfo: str = "") -> str:
        """``scheme://[userinfo@]127.0.0.1:port[path]``: a server's URL pointed at the proxy."""
        return f"{scheme}://{userinfo + '@' if userinfo else ''}{self._listen[0]}:{self.port}{path}"

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        async def run() -> T:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    # ------------------------------------------------------------ the loop's side
    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, *self._listen)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for link in list(self._links):
            link.close(abort=True)
        tasks = list(self._accepting)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()

    def _set_flowing(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    def _reset(self, fraction: float) -> int:
        links = [link for link in self._links if fraction >= 1.0 or random.random() < fraction]
        for link in links:
            link.close(abort=True)
        self.stats.resets += len(links)
        return len(links)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self._flowing is not None
        self._accepting.add(task)
        try:
            try:
                await self._flowing.wait()  # a partitioned link: the connect hangs until it heals
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except (OSError, asyncio.CancelledError) as e:
                _abort(writer)
                if isinstance(e, asyncio.CancelledError):
                    raise
                return
            self.stats.connections += 1
            link = _Link(self, (reader, writer), (up_reader, up_writer))
            self._links.add(link)
            try:
                await link.run()
            finally:
                self._links.discard(link)
        finally:
            self._accepting.discard(task)


class _Link:
    """One proxied connection: a pump per direction."""

    def __init__(self, proxy: WanProxy, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 server: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        self.tasks = [asyncio.ensure_future(self._pump(self.client[0], self.server[1], up=True)),
                      asyncio.ensure_future(self._pump(self.server[0], self.client[1], up=False))]
        # each direction ends at its EOF (passed on as one); a reset on either side aborts the other
        _, pending = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_EXCEPTION)
        self.close(abort=bool(pending))
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def close(self, abort: bool) -> None:
        for task in self.tasks:
            task.cancel()
        for _, writer in (self.client, self.server):
            if abort:
                _abort(writer)
            else:
                writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool) -> None:
        """Read, stamp each chunk with when it may arrive, and deliver in order (latency and rate on the
        delivering side, so a slow link does not stop the reading of what follows)."""
        proxy = self.proxy
        assert proxy._flowing is not None
        flowing = proxy._flowing
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            free_at = 0.0
            while (item := await queue.get()) is not None:
                due, data = item
                if proxy.rate is not None:
                    free_at = max(free_at, due) + len(data) / proxy.rate
                    due = free_at
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                await flowing.wait()
                writer.write(data)
                await writer.drain()
                if up:
                    proxy.stats.bytes_up += len(data)
                else:
                    proxy.stats.bytes_down += len(data)
            writer.write_eof() if writer.can_write_eof() else writer.close()

        delivering = asyncio.ensure_future(deliver())
        try:
            while True:
                await flowing.wait()
                data = await reader.read(CHUNK)
                if not data:
                    break
                await flowing.wait()  # read while the link was being cut: held like the rest
                queue.put_nowait((time.monotonic() + proxy.delay_s, data))
            queue.put_nowait(None)
            await delivering
        finally:
            delivering.cancel()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
