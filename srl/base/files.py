"""Files written whole: the one way srl replaces a file that a reader or a restart relies on.

Owns: the temporary name beside the target (``.<name>.<pid>.tmp``, so a directory's cleanup can tell a
leftover from a record), writing it, renaming it over the target, and, for a file that must survive a
power loss, ``fsync`` of its data before the rename and of its directory after it. A write that fails
(a full disk, a full ``/dev/shm``) removes its temporary file before the error goes on, naming the target.
Must never: leave a partial file under the target's name, or a temporary file behind a failed write.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable
from pathlib import Path

TMP_SUFFIX = ".tmp"


def temporary_name(target: Path) -> Path:
    """Where ``target`` is written before it is renamed into place (hidden, this process's own)."""
    return target.with_name(f".{target.name}.{os.getpid()}{TMP_SUFFIX}")


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is named as :func:`temporary_name` names (a write under way, or one that died)."""
    return path.name.startswith(".") and path.name.endswith(TMP_SUFFIX)


def write_whole(target: str | os.PathLike[str], chunks: Iterable[bytes | bytearray | memoryview], *,
                durable: bool) -> None:
    """Replace ``target`` by ``chunks`` (written one after another): a reader sees the old file or the new
    one, never part of one. ``durable``: the new file is on the disk when this returns, and a power loss
    afterwards leaves it (not an empty or a half file: the data is synced before the rename, the rename
    after it); a file in memory (``/dev/shm``) has no need. An OSError names ``target``; nothing is left
    beside it and whatever was there is as it was."""
    path = Path(target)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # (f.write's own error names no file)
            raise OSError(e.errno, f"{e.strerror or e}; nothing was replaced", str(path)) from e
        raise
    if durable:
        _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX: fsync the directory). A filesystem that cannot sync a
    directory (some network and FUSE ones say EINVAL) makes the rename as durable as it makes anything."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # (Windows opens no directory: its rename is durable as it stands)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(fd)
