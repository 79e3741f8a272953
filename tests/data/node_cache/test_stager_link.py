"""Staging at the link's speed: one source read feeds both tiers, reads run ahead, restarts reuse shards."""

from __future__ import annotations

import threading
import time
import zlib
from pathlib import Path

import pytest

from kaisoku.data.node_cache import stager as stager_module
from kaisoku.data.node_cache.cache import NodeCache
from kaisoku.data.node_cache.stager import staged_name
from kaisoku.data.node_cache.staging import StagingSchedule, sampler_trace_fn
from kaisoku.data.order.shuffle import ShuffleSpec
from tests.data.node_cache.test_cache import SHARD_BYTES, SIZES, _sampler, make_source, train_epoch


class ThrottledReader:
    """Reads a source file at a limited rate (a slow link), recording which thread read which file."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.reads: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def __call__(self, path: Path) -> bytes:
        data = path.read_bytes()
        time.sleep(len(data) / self.bytes_per_s)
        with self._lock:
            self.reads.append((path.name, threading.current_thread().name))
        return data


def _cache(
    tmp_path: Path, ram_dir: Path, reader: ThrottledReader | None, *, ram: int, token: str
) -> NodeCache:
    paths = make_source(tmp_path / "source", SIZES)
    sampler = _sampler(ShuffleSpec(name="global"))
    return NodeCache(
        paths,
        ram_dir=ram_dir / token,
        ram_capacity=ram,
        local_dir=tmp_path / "local",
        local_capacity=20 * SHARD_BYTES,
        schedule=StagingSchedule(sampler_trace_fn(sampler, node=0, ranks_per_node=1), num_epochs=1),
        run_token=token,
        shard_crcs=[zlib.crc32(p.read_bytes()) for p in paths],
        source_reader=reader,
    )


def test_one_read_feeds_both_tiers_and_reads_run_ahead(
    tmp_path: Path, ram_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier_reads: list[str] = []
    real_read_whole = stager_module.read_whole

    def spy(path: Path) -> bytes:  # the stager's reads of a tier's file (a RAM copy made from local disk)
        tier_reads.append(path.name)
        return real_read_whole(path)

    monkeypatch.setattr(stager_module, "read_whole", spy)
    reader = ThrottledReader(bytes_per_s=20 * SHARD_BYTES)
    cache = _cache(tmp_path, ram_dir, reader, ram=20 * SHARD_BYTES, token="tee")
    try:
        assert cache.wait_staged(0, timeout=60)
        stats = cache.node_stats()
        # Every shard crossed the link once and landed in both tiers; no tier file was read back.
        assert sorted(name for name, _ in reader.reads) == sorted(p.name for p in cache.source_paths)
        assert stats["source_reads"] == len(SIZES)
        assert stats["staged_bytes"] == 2 * len(SIZES) * SHARD_BYTES
        assert tier_reads == []
        # All but the first read ran on the read-ahead thread while the stager wrote the previous shard.
        ahead = [name for name, thread in reader.reads if thread.startswith("kaisoku-read-ahead")]
        assert len(ahead) >= len(SIZES) - 1
    finally:
        cache.close()


def test_restart_reuses_checked_shards_and_exit_removes_control_files(tmp_path: Path, ram_dir: Path) -> None:
    first = _cache(tmp_path, ram_dir, None, ram=0, token="run1")
    sampler = _sampler(ShuffleSpec(name="global"))
    try:
        train_epoch(first, sampler, 0)
        assert first.wait_staged(0, timeout=60)
        assert first.node_stats()["source_reads"] == len(SIZES)
    finally:
        first.close()
    assert not (ram_dir / "run1").exists()  # control files and the RAM tier are gone after a clean exit
    local = tmp_path / "local" / "kaisoku-shards"
    assert len(list(local.iterdir())) == len(SIZES)  # the local tier waits for the next run
    damaged = local / staged_name(2)
    data = bytearray(damaged.read_bytes())
    data[10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    (local / staged_name(5)).write_bytes(b"short")
    (local / ".shard-000001.tmp").write_bytes(b"left by a crash")

    second = _cache(tmp_path, ram_dir, None, ram=0, token="run2")
    try:
        assert sorted(second.reused_local) == [s for s in range(len(SIZES)) if s not in (2, 5)]
        assert not (local / ".shard-000001.tmp").exists()
        train_epoch(second, sampler, 0)
        assert second.wait_staged(0, timeout=60)
        # Only the two shards that failed their check crossed the link again.
        assert second.node_stats()["source_reads"] == 2
        assert (local / staged_name(2)).read_bytes() == second.source_paths[2].read_bytes()
    finally:
        second.close()
