"""A pack's destination folder: checked before anything is written, its stale shards removed after, and a
write it refuses (full, read-only, immutable) turned into one line, with the folders the pack made removed."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kaisoku.data.shards.format import INDEX_NAME, SHARD_SUFFIX, split_dirs
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import write_failure


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a file a pack writes (an index or a shard)."""
    return path.name == INDEX_NAME or (path.name.startswith("shard-") and path.name.endswith(SHARD_SUFFIX))


def prepare_destination(dst: Path, src: Path | None, overwrite: bool) -> None:
    """Check ``dst`` (not inside ``src``, a directory, empty unless ``overwrite``: then its old indexes go
    first) and create it."""
    if src is not None:
        src_resolved, dst_resolved = src.resolve(), dst.resolve()
        if dst_resolved == src_resolved or src_resolved in dst_resolved.parents:
            raise KaisokuError(
                f"destination {dst} is inside the source {src}; pack to a directory outside it"
            )
    if dst.exists() and not dst.is_dir():
        raise KaisokuError(f"destination {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:
            raise KaisokuError(
                f"destination {dst} is not empty; choose an empty or new directory, "
                "or pass overwrite (--overwrite) to replace a previous pack"
            )
        # Remove the old indexes first: until the new index lands, the directory is not a dataset.
        for directory in [dst, *split_dirs(dst)]:
            (directory / INDEX_NAME).unlink(missing_ok=True)
    dst.mkdir(parents=True, exist_ok=True)


def remove_stale_shards(directory: Path, keep: set[str]) -> None:
    """Remove the shards of an earlier pack in ``directory`` that the new one did not write."""
    for path in directory.iterdir():
        if path.is_file() and is_ours(path) and path.name != INDEX_NAME and path.name not in keep:
            path.unlink()


def remove_empty_folders(dst: Path, *, keep_root: bool) -> None:
    """Remove the folders a failed pack made and left empty (the split folders, ``dst`` where it made it)."""
    if not dst.is_dir():
        return
    for folder in sorted((p for p in dst.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only empty ones go
    if not keep_root:
        with contextlib.suppress(OSError):
            dst.rmdir()


def destination_failure(error: OSError, dst: Path) -> KaisokuError | None:
    """The one-line error of a write into ``dst`` refused for lack of space, a read-only file system, an
    immutable folder or permissions; None for anything else (such as an unreadable source file)."""
    if error.filename is not None:
        target, failed = dst.absolute(), Path(os.fsdecode(error.filename)).absolute()
        if failed != target and target not in failed.parents and failed not in target.parents:
            return None  # neither the destination, a folder in it, nor one it is created in
    return write_failure(error, dst, "the pack")
