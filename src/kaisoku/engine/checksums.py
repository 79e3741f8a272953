"""Content checksums that every checkpoint carries, so that a damaged one is never trained on.

A single-file checkpoint holds ``checksums``: the xxh3-64 digest of every tensor's bytes, keyed by the
tensor's dotted place in the state (``model.layer1.0.weight``), computed before the file is written; a load
recomputes them and names the first tensor that differs. A sharded folder holds ``checksums.json``: the
digest of every file in it, written last, just before the folder is renamed into place (the commit); a load
hashes the files again and names the first that differs or is missing. xxh3 hashes at memory speed
(``kaisoku bench checkpoint`` measures its share of a save), where a Python loop or a cryptographic hash
would cost a large part of the save.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from kaisoku.fsutil import atomic_write_text

#: The key of a single-file checkpoint's tensor digests.
STATE_KEY = "checksums"
#: The file of a sharded folder's file digests (written last, before the folder's rename).
FOLDER_FILE = "checksums.json"


class ChecksumMismatch(Exception):
    """What differs: ``str()`` is ``checksum of NAME differs`` or ``NAME is missing``."""


def _tensors(node: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        yield prefix, node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list | tuple):
        for index, value in enumerate(node):
            yield from _tensors(value, f"{prefix}.{index}" if prefix else str(index))


def tensor_digest(tensor: torch.Tensor) -> str:
    """The xxh3-64 digest (hex) of ``tensor``'s values as bytes, whatever its device, dtype and strides."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.is_quantized or flat.layout != torch.strided:
        return ""  # no plain bytes to hash: such a tensor is not checked
    return xxhash.xxh3_64_hexdigest(memoryview(flat.view(torch.uint8).numpy()))


def state_checksums(state: Mapping[str, Any]) -> dict[str, str]:
    """``{dotted name: digest}`` of every tensor in ``state`` (nested dicts, lists and tuples)."""
    return {name: tensor_digest(tensor) for name, tensor in _tensors(state, "") if name != STATE_KEY}


def verify_state(state: Mapping[str, Any]) -> bool:
    """Check a loaded single-file checkpoint against its ``checksums``: True when they match, False when it
    has none (an older checkpoint); ChecksumMismatch naming the first tensor that differs or is missing."""
    expected = state.get(STATE_KEY)
    if not isinstance(expected, Mapping):
        return False
    found = dict(_tensors({k: v for k, v in state.items() if k != STATE_KEY}, ""))
    for name, digest in expected.items():
        if name not in found:
            raise ChecksumMismatch(f"{name} is missing")
        if digest and tensor_digest(found[name]) != digest:
            raise ChecksumMismatch(f"checksum of {name} differs")
    return True


def file_digest(path: Path) -> str:
    """The xxh3-64 digest (hex) of a file's bytes, hashed where the file is mapped (no copy into Python)."""
    with path.open("rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_64_hexdigest(mapped)


def folder_checksums(folder: Path) -> dict[str, str]:
    """``{file name: digest}`` of every file directly in ``folder`` but the checksum file itself."""
    return {
        path.name: file_digest(path)
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != FOLDER_FILE
    }


def write_folder_checksums(folder: Path) -> None:
    """Hash every file of ``folder`` and write ``checksums.json`` there (fsynced; the folder's own rename,
    the caller's, makes it visible with the rest)."""
    atomic_write_text(folder / FOLDER_FILE, json.dumps(folder_checksums(folder), indent=0))


def verify_folder(folder: Path) -> bool:
    """Check a sharded folder against its ``checksums.json``: True when every file matches, False when it
    has none (an older checkpoint); ChecksumMismatch naming the first file that differs or is missing."""
    listing = folder / FOLDER_FILE
    if not listing.is_file():
        return False
    try:
        expected = json.loads(listing.read_text())
    except (OSError, ValueError):
        raise ChecksumMismatch(f"{FOLDER_FILE} is unreadable") from None
    if not isinstance(expected, dict):
        raise ChecksumMismatch(f"{FOLDER_FILE} is unreadable")
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file():
            raise ChecksumMismatch(f"{name} is missing")
        if file_digest(path) != digest:
            raise ChecksumMismatch(f"checksum of {name} differs")
    return True
