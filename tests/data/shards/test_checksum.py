"""The one CRC-32 of records and shards gives zlib's values, on every kind of buffer the readers pass."""

from __future__ import annotations

import importlib.util
import mmap
import zlib
from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.shards import checksum


def test_crc32_gives_zlibs_values_on_every_buffer(tmp_path: Path) -> None:
    data = np.random.default_rng(3).integers(0, 256, 70_001, dtype=np.uint8).tobytes()
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        for part in (b"", data[:1], data, view[7:12_345], view[12_345:]):
            assert checksum.crc32(part) == zlib.crc32(part)
        # continued over chunks, as whole shards are checked
        running = 0
        for start in range(0, len(data), 4096):
            running = checksum.crc32(view[start : start + 4096], running)
        assert running == zlib.crc32(data)
        del view, part


@pytest.mark.skipif(importlib.util.find_spec("isal") is None, reason="isal is not installed on this platform")
def test_isal_is_used_where_it_is_installed() -> None:
    from isal import isal_zlib

    assert checksum.crc32 is isal_zlib.crc32


def test_a_files_crc32_is_zlibs_over_its_whole_bytes_across_read_chunks(tmp_path: Path) -> None:
    data = np.random.default_rng(5).integers(0, 256, (8 << 20) + 4097, dtype=np.uint8).tobytes()  # 2 chunks
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    assert checksum.file_crc32(path) == zlib.crc32(data)
    (tmp_path / "empty.bin").write_bytes(b"")
    assert checksum.file_crc32(tmp_path / "empty.bin") == 0
