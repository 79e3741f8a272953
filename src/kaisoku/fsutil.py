"""Atomic file writes: a temp file in the same directory, fsync, then rename.

A reader never sees a half-written file, and a crash leaves either the old file or the new one.
:func:`write_failure` turns the ways a destination refuses a write into one line saying what to do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from kaisoku.errors import KaisokuError

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)


def fsync_dir(path: Path) -> None:
    """Flush a directory entry so that a rename inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str],
    mode: str = "wb",
    *,
    before_rename: Callable[[Path], None] | None = None,
    **kwargs: Any,
) -> Iterator[IO[Any]]:
    """Open a temp file beside ``path``; on a clean exit fsync it and rename it over ``path``.

    On an exception the temp file is removed and ``path`` is left untouched. ``before_rename`` is
    called with the temp file's path just before the rename (tests use it to stop a writer there).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    # mkstemp makes the file private (0600); give it the mode a plain open() would have.
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    try:
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_failure(error: OSError, destination: str | os.PathLike[str], what: str) -> KaisokuError | None:
    """One line for a write into ``destination`` that failed because the destination is full, read-only,
    immutable or not ours to write; None for any other error (a bug or a source problem: keep its traceback).

    ``what``: what was being written, for the message ("the pack", "the run report").
    """
    if error.errno in _FULL:
        return KaisokuError(
            f"cannot write {what} to {destination}: no space left on its file system "
            f"({error.strerror}); free some space or choose another destination"
        )
    if error.errno in _REFUSED:
        why = "read-only file system" if error.errno == errno.EROFS else error.strerror
        return KaisokuError(
            f"cannot write {what} to {destination}: {why} (at {error.filename or destination}); "
            "choose a writable destination or fix its permissions and attributes (chattr -i)"
        )
    return None
