"""``kaisoku bench slowfs`` without a mount: rows and goals from synthetic records (medians over repeats,
the ceiling, the peer figure), and the kaisoku node's ShardLoader built by the training builder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kaisoku.data.datagen import generate
from kaisoku.data.loading.dataset import ShardedDataset
from kaisoku.data.node_cache.staging import CacheEvent
from kaisoku.data.order.shuffle import ShuffleSpec
from kaisoku.data.shards.writer import pack
from kaisoku_bench.plan import measure_cell
from kaisoku_bench.slowfs import ThreadGrid, tune_threads
from kaisoku_bench.slowfs_readers import (
    CacheDirs,
    EncodedSize,
    cache_plan_reads,
    merge_nodes,
    node_loader,
    read_files,
)
from kaisoku_bench.slowfs_rows import (
    cache_runs,
    finish_group,
    kaisoku_row,
    peer_goal,
    peer_row,
    perfile_row,
    rereads_goal,
    summary_b,
)

BASE = {"link": "1Gbit/s, RTT+2ms", "set": "64px (3.4 KiB/file, 1024 files)"}


def _kaisoku_records(io_e1: list[float], *, e2_reads: int = 0, exchanged: int = 0) -> list[dict[str, Any]]:
    """Records as kaisoku_epochs returns them: one per (repeat, mode, epoch)."""
    records = []
    for repeat, seconds in enumerate(io_e1):
        for mode in ("io", "e2e"):
            for epoch in range(2):
                records.append(
                    {
                        "repeat": repeat,
                        "mode": mode,
                        "epoch": epoch,
                        "seconds": seconds if (mode, epoch) == ("io", 0) else 0.5 * (epoch + 1),
                        "total": 1_000_000 if mode == "io" else 1000,
                        "source_reads": 4 if epoch == 0 else (e2_reads if repeat == 1 else 0),
                        "source_bytes": 1_100_000 if epoch == 0 else 0,
                        "exchanged_bytes": exchanged,
                    }
                )
    return records


def test_kaisoku_row_takes_medians_over_repeats_and_the_worst_epoch2_reads() -> None:
    records = _kaisoku_records([0.1, 5.0, 0.2], e2_reads=3, exchanged=777)
    row = kaisoku_row(BASE, "partial", "partial", records, quality=0.9, nbytes=1_100_000, rate_bytes=1.25e8)
    assert row["repeats"] == 3
    assert row["io_e1_s"] == 0.2  # the median, not the 5 s outlier nor the mean
    assert row["io_e1_runs_s"] == [0.1, 5.0, 0.2]
    assert row["io_e1_samples_per_s"] == 5000.0
    assert row["io_e1_MBps"] == 5.0
    assert row["e2e_e1_samples_per_s"] == 2000.0 and row["e2e_e2_samples_per_s"] == 1000.0
    assert row["source_reads_e1"] == 4
    assert row["source_reads_e2"] == 3  # one repeat read the source in epoch 2: the row says so
    assert row["exchanged_bytes_per_epoch"] == 777
    assert row["_io_rate"] == pytest.approx(5e6)


def test_perfile_and_peer_rows_are_medians() -> None:
    timings = {("io", 0): [2.0, 1.0, 4.0], ("io", 1): [1.0] * 3, ("e2e", 0): [2.0] * 3, ("e2e", 1): [2.0] * 3}
    row = perfile_row(
        BASE, "8 threads", timings, files=1000, nbytes=4_000_000, set_files=20000, rate_bytes=1.25e8,
        quality=1.0,
    )  # fmt: skip
    assert row["repeats"] == 3 and row["io_e1_s"] == 2.0 and row["io_e1_samples_per_s"] == 500.0
    assert row["epoch_e1_s_extrapolated"] == 40.0
    records = [
        {"repeat": r, "epoch": e, "seconds": s, "total": 768}
        for r, (s1, s2) in enumerate([(1.0, 0.5), (3.0, 0.5), (2.0, 0.25)])
        for e, s in enumerate((s1, s2))
    ]
    peer = peer_row(BASE, "webdataset", records, cache="none")
    assert peer["row"] == "peer webdataset" and peer["repeats"] == 3
    assert peer["e2e_e1_samples_per_s"] == 384.0 and peer["e2e_e2_samples_per_s"] == 1536.0


def test_finish_group_uses_the_median_ceiling_and_leaves_peers_and_skips_without_a_ratio() -> None:
    rows = [
        {**BASE, "row": "kaisoku global", "_io_rate": 80e6, "io_e1_s": 1.0, "link_bound_s": 0.9},
        {**BASE, "row": "peer mds", "e2e_e1_samples_per_s": 10.0},
        {**BASE, "row": "peer litdata", "skipped": "not installed"},
    ]
    done = finish_group(rows, [100e6, 10e6, 120e6])
    assert done[0]["ceiling_MBps"] == 100.0 and done[0]["io_e1_vs_ceiling"] == 0.8
    assert done[0]["link_bound_note"] == "link-bound" and "_io_rate" not in done[0]
    assert "io_e1_vs_ceiling" not in done[1] and done[1]["ceiling_MBps"] == 100.0
    assert done[2] == {**BASE, "row": "peer litdata", "skipped": "not installed"}


def _group(link: str, kaisoku_e1: float, peers: dict[str, float]) -> list[dict[str, Any]]:
    base = {"link": link, "set": BASE["set"]}
    rows = [
        {**base, "row": "kaisoku global", "e2e_e1_samples_per_s": kaisoku_e1, "e2e_e2_samples_per_s": 100.0}
    ]
    for name, rate in peers.items():
        rows.append(
            {**base, "row": f"peer {name}", "e2e_e1_samples_per_s": rate, "e2e_e2_samples_per_s": 50.0}
        )
    return rows


def test_peer_goal_is_the_worst_group_against_its_best_peer() -> None:
    rows = _group("1Gbit/s, RTT+2ms", 300.0, {"mds": 100.0, "litdata": 200.0})
    rows += _group("200Mbit/s, RTT+0ms", 90.0, {"webdataset": 100.0})
    rows.append({**BASE, "row": "peer webdataset", "skipped": "not installed: pip install webdataset"})
    entry = peer_goal(rows)
    assert entry["value"] == 0.9 and entry["met"] is False
    assert entry["per_group"]["1Gbit/s, RTT+2ms | 64px"] == {
        "best_peer": "litdata",
        "e1": 1.5,
        "e2_vs_best_e2": 2.0,
    }
    assert entry["peers_skipped"] == ["peer webdataset: not installed: pip install webdataset"]


def test_peer_goal_without_peers_says_why() -> None:
    rows = _group("1Gbit/s, RTT+2ms", 300.0, {})
    rows.append({**BASE, "row": "peer mds", "skipped": "not installed: pip install mosaicml-streaming"})
    entry = peer_goal(rows)
    assert entry["value"] is None and entry["met"] is False
    assert "mosaicml-streaming" in entry["reason"]


def test_summary_keeps_every_goal_when_the_setup_is_unavailable() -> None:
    summary = summary_b([], unavailable="setup unavailable: no sshfs")
    from tests.bench.test_quick_runs import GOALS

    assert set(summary) == GOALS["slowfs"]
    assert all(e["met"] is False and "no sshfs" in e["reason"] for e in summary.values())


def test_encoded_size_reports_the_image_bytes_without_decoding() -> None:
    sample = {"image": b"\xff\xd8" + bytes(98), "label": 3}
    out = np.zeros(1, dtype=np.int64)
    assert EncodedSize().into(sample, index=0, epoch=0, out=out) == 3 and out[0] == 100
    array, label = EncodedSize()(sample, index=0, epoch=0)
    assert array.tolist() == [100] and label == 3


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("slowfs")
    images = generate(root / "shapes", count=512, size=8, val_count=0, workers=1)
    pack(images / "train", root / "pack", shard_bytes="64KiB", overwrite=True, progress=False, seed=0)
    return root / "pack"


@pytest.mark.timeout(120)
def test_node_loader_is_the_training_shard_loader_with_its_node_cache(
    tiny_pack: Path, tmp_path: Path
) -> None:
    dirs = CacheDirs(ram=tmp_path / "ram", local=tmp_path / "local", capacity=64 << 20)
    spec = ShuffleSpec(name="partial", exchange=0.25, num_nodes=2)
    partial = node_loader(str(tiny_pack), spec, dirs, rank=1, world_size=2, mode="io", size=8)
    assert partial.needs_exchange and partial.node == 1 and partial.sampler.spec.exchange == 0.25
    assert Path(partial.cache_settings.ram_dir) == tmp_path / "ram" / "node1"
    loader = node_loader(
        str(tiny_pack), ShuffleSpec(name="global"), dirs, rank=0, world_size=1, mode="io", size=8
    )
    loader.connect(run_token="test")
    try:
        loader.set_epoch(0, 0)
        delivered = sum(int(images.sum()) for images, _ in loader)
        stats = loader.epoch_stats()
    finally:
        loader.close()
    dataset = ShardedDataset(tiny_pack, decode_images=False)
    order = loader.sampler.epoch_order(0)[: loader.steps_per_epoch * 256]
    assert delivered == sum(len(dataset[int(i)]["image"]) for i in order)
    assert stats is not None and stats["source_reads"] == len(dataset.index.shards)


def test_merge_nodes_takes_the_slowest_node_and_sums_the_counts() -> None:
    def record(epoch: int, seconds: float, total: int) -> dict:
        counts = {"source_reads": total // 10, "source_bytes": total * 2, "exchanged_bytes": 1}
        return {"repeat": 0, "mode": "io", "epoch": epoch, "seconds": seconds, "total": total, **counts}

    merged = merge_nodes(
        [[record(0, 2.0, 100), record(1, 0.5, 100)], [record(0, 1.0, 60), record(1, 0.7, 60)]]
    )
    assert [m["seconds"] for m in merged] == [2.0, 0.7]
    assert [m["total"] for m in merged] == [160, 160]
    assert merged[0]["source_reads"] == 16 and merged[0]["exchanged_bytes"] == 2 and merged[1]["epoch"] == 1


def test_read_files_reads_every_file_whole(tmp_path: Path) -> None:
    paths = []
    for i in range(5):
        (tmp_path / f"{i}.bin").write_bytes(bytes(100 * (i + 1)))
        paths.append(str(tmp_path / f"{i}.bin"))
    assert read_files(paths, threads=3) == 1500


@pytest.mark.timeout(180)
def test_plan_cell_times_two_epochs_of_the_slowest_node(tiny_pack: Path, tmp_path: Path) -> None:
    """A staged cell of ``kaisoku bench plan`` on 2 gloo ranks (each a node with its own cache), unthrottled."""
    seconds = measure_cell("partial-Q0.25", 2, tiny_pack, [], tmp_path)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


# ------------------------------------------------------------------ the tuned per-file baseline


def _tuned_group(grid_rates: dict[int, float], kaisoku_rates: list[float]) -> list[dict[str, Any]]:
    """The reference group: a per-file row tuned over ``grid_rates`` (threads -> files/s, through
    tune_threads and perfile_row) and a kaisoku global row whose epoch-1 I/O runs give ``kaisoku_rates``."""
    tuned = tune_threads(
        ThreadGrid(threads=(4, 8, 16, 32, 64), extend_limit=2),
        lambda n: {"threads": n, "files": 1, "seconds": 1.0, "files_per_s": grid_rates.get(n, 0.0)},
    )
    best = grid_rates[tuned["threads_tuned"]]
    times = [1000 / best * f for f in (0.99, 1.0, 1.01)]
    timings = {("io", 0): times, ("io", 1): times, ("e2e", 0): times, ("e2e", 1): times}
    perfile = perfile_row(
        BASE, f"{tuned['threads_tuned']} threads", timings, files=1000, nbytes=4_000_000, set_files=20000,
        rate_bytes=1.25e8, quality=1.0, grid=tuned,
    )  # fmt: skip
    seconds = [1000 / rate for rate in kaisoku_rates]  # 1,000 samples per epoch
    kaisoku = kaisoku_row(
        BASE, "global", "global", _kaisoku_records(seconds), quality=1.0, nbytes=1_100_000, rate_bytes=1.25e8
    )
    finish_group([perfile, kaisoku], [100e6] * 3)
    return [perfile, kaisoku]


def test_the_tuned_baseline_is_the_grid_optimum_with_neighbours_falling_off_on_each_side() -> None:
    rates = {4: 300.0, 8: 600.0, 16: 1000.0, 32: 900.0, 64: 500.0}
    rows = _tuned_group(rates, [20000.0, 20100.0, 19900.0])
    perfile = rows[0]
    assert perfile["threads_tuned"] == 16 and perfile["threads_inside"] is True
    assert perfile["row"] == "per-file random reads, 16 threads (tuned)"
    assert [p["threads"] for p in perfile["thread_grid"]] == [4, 8, 16, 32, 64]
    entry = summary_b(rows)["kaisoku_global_io_vs_tuned_perfile_1G_2msRTT_64px"]
    assert entry["value"] == pytest.approx(20.0, rel=0.02) and entry["perfile_threads"] == 16
    assert entry["met"] is True


def test_a_one_sided_thread_grid_leaves_the_10x_goal_unmet_whatever_the_ratio() -> None:
    rates = {4: 100.0, 8: 200.0, 16: 400.0, 32: 800.0, 64: 1000.0, 128: 1100.0, 256: 1200.0}
    rows = _tuned_group(rates, [24000.0, 24100.0, 23900.0])
    perfile = rows[0]
    assert perfile["threads_tuned"] == 256 and perfile["threads_inside"] is False
    assert [p["threads"] for p in perfile["thread_grid"]] == [4, 8, 16, 32, 64, 128, 256]  # 2 extensions
    entry = summary_b(rows)["kaisoku_global_io_vs_tuned_perfile_1G_2msRTT_64px"]
    assert entry["value"] == pytest.approx(20.0, rel=0.02)
    assert entry["met"] is False and "not tuned" in entry["reason"] and "256: 1200" in entry["reason"]


def test_the_thread_grid_extends_downwards_and_stops_at_one_thread() -> None:
    rates = {1: 400.0, 2: 350.0, 4: 300.0, 8: 200.0, 16: 100.0, 32: 50.0, 64: 20.0}
    tuned = tune_threads(
        ThreadGrid(extend_limit=3),
        lambda n: {"threads": n, "files": 1, "seconds": 1.0, "files_per_s": rates[n]},
    )
    # 1 thread is best; below it no thread reads nothing (0 files/s, not measured): the lower side falls off
    assert tuned["threads_tuned"] == 1 and tuned["threads_inside"] is True
    assert [p["threads"] for p in tuned["thread_grid"]] == [1, 2, 4, 8, 16, 32, 64]


# ------------------------------------------------------------------ the undersized node cache


def _events(*items: tuple[int, str, str, int, int]) -> list[tuple[int, str, CacheEvent]]:
    """(epoch, tier, kind, position, shard) -> the stager log's (epoch, tier, event)."""
    return [(epoch, tier, CacheEvent(position, kind, shard)) for epoch, tier, kind, position, shard in items]


def test_cache_plan_reads_counts_first_reads_rereads_of_evicted_shards_and_bypasses() -> None:
    sizes = [100, 200, 300, 400]
    log = _events(
        (0, "local", "load", 0, 0),
        (0, "local", "load", 1, 1),
        (0, "local", "evict", 2, 0),
        (0, "local", "load", 2, 2),
        (0, "local", "bypass", 3, 3),  # read by the reader from the source
        (1, "local", "evict", 0, 1),
        (1, "local", "load", 0, 0),  # re-read: evicted in epoch 0
        (1, "local", "bypass", 1, 3),
    )
    plan = cache_plan_reads(log, sizes)
    assert plan[0] == {
        "planned_reads": 4, "planned_bytes": 1000, "planned_bypasses": 1, "evictions": 1, "evicted_bytes": 100,
    }  # fmt: skip
    assert plan[1] == {
        "planned_reads": 2, "planned_bytes": 500, "planned_bypasses": 1, "evictions": 1, "evicted_bytes": 200,
    }  # fmt: skip


def test_cache_plan_reads_counts_a_shard_once_across_tiers() -> None:
    sizes = [10, 20, 30]
    log = _events(
        (0, "local", "load", 0, 0),
        (0, "ram", "load", 0, 0),  # copied from the local tier: no source read
        (0, "ram", "load", 1, 1),  # not held locally: read from the source
        (0, "ram", "evict", 2, 0),  # still held locally: not evicted from the node
        (0, "local", "bypass", 2, 1),  # RAM holds it: no read
        (0, "local", "bypass", 3, 2),
        (0, "ram", "bypass", 3, 2),  # both tiers bypass it: one read by the reader
    )
    assert cache_plan_reads(log, sizes)[0] == {
        "planned_reads": 3, "planned_bytes": 60, "planned_bypasses": 1, "evictions": 0, "evicted_bytes": 0,
    }  # fmt: skip


def _undersized_rows(
    *, e2_source_reads: int, e2_planned_reads: int, bypasses: int = 0
) -> list[dict[str, Any]]:
    """A row of two runs whose epoch 1 read each of 10 shards of 100 bytes once and evicted 4, and whose
    epoch 2 read ``e2_source_reads`` shards (the loader's count) where the plan re-read
    ``e2_planned_reads``."""
    records = []
    for repeat in range(2):
        for epoch, (counted, planned, evicted) in enumerate(
            [(10, 10, 4), (e2_source_reads, e2_planned_reads, 4)]
        ):
            records.append(
                {
                    "repeat": repeat, "mode": "io", "epoch": epoch, "source_reads": counted,
                    "source_bytes": 100 * counted, "planned_reads": planned, "planned_bytes": 100 * planned,
                    "planned_bypasses": bypasses if epoch else 0, "evictions": evicted,
                    "evicted_bytes": 100 * evicted, "stager_reads": 0, "reader_reads": 0,
                }
            )  # fmt: skip
    row = {**BASE, "row": "kaisoku block, node cache 0.5 of the set", "cache_runs": cache_runs(records)}
    return [row]


def test_rereads_equal_to_the_evictions_meet_the_goal() -> None:
    entry = rereads_goal(_undersized_rows(e2_source_reads=4, e2_planned_reads=4))
    assert entry["value"] == 0 and entry["met"] is True and "exact" in entry
    run = next(iter(entry["per_run"].values()))
    assert run["source_reads_e2"] == 4 and run["evictions_e1"] == 4 and run["source_reads"] == 14


def test_an_epoch2_reread_that_differs_from_the_evictions_fails_the_goal() -> None:
    entry = rereads_goal(_undersized_rows(e2_source_reads=6, e2_planned_reads=4))  # 2 held shards re-read
    assert entry["met"] is False and entry["value"] == 200 and entry["signed_difference_bytes"] == 200
    assert "reason" not in entry  # judged, not excused
    fewer = rereads_goal(_undersized_rows(e2_source_reads=3, e2_planned_reads=4))
    assert fewer["met"] is False and fewer["signed_difference_bytes"] == -100


def test_the_rereads_goal_is_unmet_when_the_check_could_not_fail_or_count_exactly() -> None:
    idle = rereads_goal(_undersized_rows(e2_source_reads=0, e2_planned_reads=0))
    assert idle["met"] is False and "could not fail" in idle["reason"]
    bypassed = rereads_goal(_undersized_rows(e2_source_reads=4, e2_planned_reads=4, bypasses=1))
    assert bypassed["met"] is False and "bypassed" in bypassed["reason"]
    missing = rereads_goal([], "setup unavailable: no sshfs")
    assert missing["met"] is False and "no sshfs" in missing["reason"]


@pytest.fixture(scope="module")
def long_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 steps of 256 samples over ~10 shards: a block (one shard) spans steps, as in the benchmark."""
    root = tmp_path_factory.mktemp("slowfs-long")
    images = generate(root / "shapes", count=4096, size=8, val_count=0, workers=1)
    pack(images / "train", root / "pack", shard_bytes="256KiB", overwrite=True, progress=False, seed=0)
    return root / "pack"


@pytest.mark.timeout(180)
def test_the_stager_reads_exactly_what_its_logged_plan_loads_under_an_undersized_cache(
    long_pack: Path, tmp_path: Path
) -> None:
    nbytes = ShardedDataset(long_pack, decode_images=False).index.nbytes
    dirs = CacheDirs(ram=tmp_path / "ram", local=tmp_path / "local", capacity=nbytes // 2, ram_capacity=0)
    spec = ShuffleSpec(name="block", block_shards=1)
    loader = node_loader(str(long_pack), spec, dirs, rank=0, world_size=1, mode="io", size=8)
    loader.connect(run_token="undersized")
    try:
        for epoch in range(2):
            loader.set_epoch(epoch, 0)
            for _ in loader:
                pass
        assert loader.cache is not None and loader.cache.wait_staged(1, timeout=60.0)
        plan = cache_plan_reads(
            loader.cache.stager_log, [p.stat().st_size for p in loader.cache.source_paths]
        )
        stager_reads = loader.cache.stager_stats()["source_reads"]
    finally:
        loader.close()
    loads = sum(e["planned_reads"] - e["planned_bypasses"] for e in plan.values())
    shards = len(ShardedDataset(long_pack, decode_images=False).index.shards)
    assert stager_reads == loads
    assert loads > shards and plan[1]["evictions"] + plan[0]["evictions"] > 0  # it re-read what it evicted
