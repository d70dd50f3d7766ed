"""Params fetched once per machine: the actors of one host share each params version they fetch.

An Atari CNN's params are ~7 MB. Fetched by every actor, a version costs Redis 7 MB per actor; with 64
actors on 8 machines, 450 MB per version. Here the first actor of a machine that wants a version takes a
lock file, fetches it and leaves the record (epoch, version, train count and the blob as the board held
it) in a directory of the machine; the others read it from there. Redis then sends a version once per
machine, and the others' reads are a memory copy (``/dev/shm`` is memory).

Owns: ``ParamsCache`` — the directory (one per user, 0700, refused if anyone else owns or can write it),
the lock, the record files (written whole, then renamed into place: ``srl.base.files``), and their cleanup
(a temporary file whose writer died goes once its lock would be stale). Must never: trust
a record more than the board: the codec checks its signature, epoch and version as it checks the board's
blob (the file holds those very bytes); a record it cannot parse is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from srl.base.files import is_temporary, write_whole
from srl.runner.distribution.board.board import ParamsRecord

logger = logging.getLogger("srl.params_cache")

_HEAD = struct.Struct("<4sqqq")
_MAGIC = b"SRLP"
LOCK_STALE_S = 30.0
"""a lock older than this is a fetcher that died: taken over"""
LEFT_OVER_S = 3600.0
"""another task's record untouched this long was left by actors that died: removed when a record is written"""


def default_directory() -> Path:
    """``/dev/shm/srl-<uid>`` where ``/dev/shm`` exists (memory), else one under the temp directory."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"srl-{os.getuid()}"


def private_directory(path: Path) -> Path | None:
    """``path`` created 0700 if missing; None (with a warning) when another user owns it or may write to it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as e:
        logger.warning("params are not shared on this machine: cannot use %s (%s)", path, e)
        return None
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        logger.warning("params are not shared on this machine: %s belongs to another user or others may write "
                       "to it", path)
        return None
    return path


class ParamsCache:
    """One machine's params records for one task (see the module docstring).

    ``key``: what tells this task apart from every other on the machine (the board's address and the task
    id). ``get(head, fetch)``: the record of at least ``head``'s (epoch, version), from the directory when
    another actor fetched it, else fetched with ``fetch`` (and left for the others).
    """

    def __init__(self, directory: Path, key: str, wait_s: float = 5.0) -> None:
        self.directory = directory
        self.prefix = "params-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        self.wait_s = wait_s
        self.fetched = 0
        """versions this process fetched from the board"""
        self.shared = 0
        """versions it read from the directory"""

    def _path(self, epoch: int, version: int) -> Path:
        return self.directory / f"{self.prefix}-{epoch:012d}-{version:012d}.bin"

    def _newest(self, at_least: tuple[int, int]) -> ParamsRecord | None:
        """The newest record here of at least ``at_least`` (epoch, version), or None."""
        best: tuple[tuple[int, int], Path] | None = None
        for path in self.directory.glob(f"{self.prefix}-*-*.bin"):
            try:
                _, epoch, version = path.stem.rsplit("-", 2)
                found = (int(epoch), int(version))
            except ValueError:
                continue
            if found >= at_least and (best is None or found > best[0]):
                best = (found, path)
        if best is None:
            return None
        return self._read(best[1])

    @staticmethod
    def _read(path: Path) -> ParamsRecord | None:
        try:
            data = path.read_bytes()
        except OSError:  # removed between the listing and the read
            return None
        if len(data) < _HEAD.size:
            return None
        magic, epoch, version, train_count = _HEAD.unpack_from(data)
        if magic != _MAGIC:
            return None
        return ParamsRecord(epoch, version, train_count, data[_HEAD.size:])

    def _write(self, record: ParamsRecord) -> None:
        path = self._path(record.epoch, record.version)
        # in memory: nothing to sync; a full directory raises with nothing left in it
        write_whole(path, [_HEAD.pack(_MAGIC, record.epoch, record.version, record.train_count), record.blob],
                    durable=False)
        now = time.time()
        for old in self.directory.glob("*params-*"):  # readers of an unlinked file keep reading it
            if old.name.startswith(self.prefix):
                if old.suffix == ".bin" and old.name < path.name:
                    old.unlink(missing_ok=True)
                continue
            # A temporary file (any task's) is written under its lock, and a lock this old is taken over: its
            # writer died. Another task's record or lock may only be slow: an hour.
            limit = LOCK_STALE_S if is_temporary(old) else LEFT_OVER_S
            try:
                if now - old.stat().st_mtime > limit:
                    old.unlink(missing_ok=True)
            except OSError:
                continue

    def clear(self) -> None:
        """Remove this task's records (an actor that stops: another actor of the machine still running the task
        fetches its next version from the board)."""
        for path in self.directory.glob(f"{self.prefix}-*.bin"):
            path.unlink(missing_ok=True)

    def discard(self, record: ParamsRecord) -> bool:
        """Remove the file of ``record`` (one that does not decode); whether there was one."""
        path = self._path(record.epoch, record.version)
        if not path.exists():
            return False
        path.unlink(missing_ok=True)
        return True

    def get(self, head: tuple[int, int], fetch: Callable[[], ParamsRecord | None]) -> ParamsRecord | None:
        record = self._newest(head)
        if record is not None:
            self.shared += 1
            return record
        lock = self._path(*head).with_suffix(".lock")
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                try:
                    stale = time.time() - lock.stat().st_mtime > LOCK_STALE_S
                except OSError:
                    continue  # released meanwhile: try again
                if stale:
                    lock.unlink(missing_ok=True)
                    continue
                time.sleep(0.005)  # another actor of this machine is fetching it
                record = self._newest(head)
                if record is not None:
                    self.shared += 1
                    return record
                if time.monotonic() >= deadline:  # it is slow or gone: fetch our own
                    break
                continue
            os.close(fd)
            try:
                record = self._newest(head)  # written between our look and our lock
                if record is not None:
                    self.shared += 1
                    return record
                record = fetch()
                if record is not None:
                    try:
                        self._write(record)
                    except OSError as e:  # a full /dev/shm: this actor goes on, the others fetch their own
                        logger.warning("cannot share params version %d on this machine (%s)", record.version, e)
            finally:
                lock.unlink(missing_ok=True)
            self.fetched += 1
            return record
        self.fetched += 1
        return fetch()
