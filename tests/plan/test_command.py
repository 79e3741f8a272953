"""The I/O model of ``kaisoku plan``: monotonic in bandwidths, limits at the extremes, hand-worked cases,
and the cluster/dataset descriptions' checks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kaisoku.errors import ConfigError
from kaisoku.plan.cluster import cluster_from_dict, load_cluster, load_dataset
from kaisoku.plan.command import cmd_plan, plan_record, show
from kaisoku.plan.model import (
    MB,
    Cluster,
    Dataset,
    RateTable,
    first_batch_fraction,
    predict,
    predict_all,
    recommend,
    staged_first_epoch,
    strategies,
    strategy_hint,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def _cluster(**changes: object) -> Cluster:
    base = Cluster(
        name="test",
        nodes=4,
        ranks_per_node=1,
        readers_per_node=2,
        fs_seq=RateTable((1, 4), (100 * MB, 200 * MB)),
        fs_small=RateTable((1, 4), (1000.0, 2000.0)),
        small_file_bytes=1000.0,
        network_bw=100 * MB,
        local_capacity=1e12,
        local_read_bw=1000 * MB,
        local_write_bw=500 * MB,
        ram_capacity=0.0,
        ram_bw=5000 * MB,
        step_seconds=0.0,
        batch_per_rank=10,
    )
    return replace(base, **changes)


DATA = Dataset(name="d", samples=10_000, sample_bytes=100_000.0, shard_bytes=10e6)  # 1 GB


def _by_name(cluster: Cluster, dataset: Dataset = DATA, nodes: int | None = None) -> dict:
    return {p.strategy.name: p for p in predict_all(cluster, dataset, nodes)}


def test_rate_table_interpolates_in_log_readers_and_saturates() -> None:
    table = RateTable((1, 4, 16), (10.0, 30.0, 40.0))
    assert table.at(1) == 10.0 and table.at(4) == 30.0
    assert table.at(2) == pytest.approx(20.0)  # halfway in log2
    assert table.at(64) == 40.0  # saturated
    assert table.at(0.5) == pytest.approx(5.0)  # fewer readers than the first point: proportional


def test_hand_worked_perfile_and_staging_times() -> None:
    c = _cluster()
    p = _by_name(c)
    # per-file: 8 readers (saturated table): 10,000 / 2000 + 10,000 * 99,000 / 200e6 = 5 + 4.95 s
    assert p["per-file"].steady_epoch_s == pytest.approx(5 + 4.95)
    # staged-global: 4 nodes read 1 GB each at 200 MB/s aggregate = 20 s; writing 1 GB locally 2 s
    assert p["staged-global"].first_epoch_s == pytest.approx(20.0)
    # steady: each node reads its 0.25 GB share from local disk at 1000 MB/s
    assert p["staged-global"].steady_epoch_s == pytest.approx(0.25)
    # partial Q=0.5: 1 GB from the FS at 200 MB/s = 5 s, all staged before the exchange (it reads the
    # records it sends); exchange 0.5 * 0.25 GB at 100 MB/s = 1.25 s; then the 0.25 GB share locally 0.25 s
    assert p["partial-Q0.5"].first_epoch_s == pytest.approx(5.0 + 1.25 + 0.25)
    assert p["partial-Q0.5"].network_bytes == pytest.approx(0.5e9)
    assert p["local-only"].network_bytes == 0.0


def test_first_epoch_waits_for_the_staging_its_first_batch_touches() -> None:
    assert first_batch_fraction(1, 5) == 1.0
    assert first_batch_fraction(100, 10) == pytest.approx(1 - 0.99**10)  # 0.0956
    # Node batch 1,000 over 100 shards: the first batch touches all but 0.004% of them, so the
    # staging (4 nodes x 1 GB at 200 MB/s = 20 s) comes before reading; with a loader of 1,000
    # samples/s the node's 2,500 samples take 2.5 s after it.
    c = _cluster(batch_per_rank=1000, loader_rate=1000.0)
    lead = 1 - 0.99**1000
    p = _by_name(c)
    assert p["staged-global"].first_epoch_s == pytest.approx(lead * 20 + 2.5)
    assert p["staged-global"].steady_epoch_s == pytest.approx(2.5)
    # Block shuffle: the first batch waits for its block of 8 shards (8% of the staging), the rest
    # overlaps the 2.5 s of loading: 0.08 * 20 + max(0.92 * 20, 2.5)
    block = 0.08 * (1 - (7 / 8) ** 1000)
    assert p["staged-block"].first_epoch_s == pytest.approx(block * 20 + max((1 - block) * 20, 2.5))
    # Local-only: 25 shards per node; 1 GB from the FS at 200 MB/s = 5 s, nearly all before the first batch
    lead_local = 1 - 0.96**1000
    assert p["local-only"].first_epoch_s == pytest.approx(lead_local * 5 + max((1 - lead_local) * 5, 2.5))
    assert staged_first_epoch(0.0, 3.0, 5.0) == 5.0 and staged_first_epoch(1.0, 3.0, 5.0) == 8.0


def test_compute_bound_epochs_reach_au_one() -> None:
    c = _cluster(step_seconds=100.0)
    for p in predict_all(c, DATA):
        assert p.bound == "compute" or p.strategy.exchange > 0
        assert p.au_steady == pytest.approx(p.compute_s / p.steady_epoch_s)
    assert _by_name(c)["staged-global"].au_steady == pytest.approx(1.0)


@pytest.mark.parametrize(
    "field", ["fs_seq", "fs_small", "network_bw", "local_read_bw", "local_write_bw", "ram_bw"]
)
def test_epoch_times_never_grow_when_a_bandwidth_grows(field: str) -> None:
    small_local = _cluster(local_capacity=3e8, ram_capacity=1e8, step_seconds=0.01)
    for base in (_cluster(), small_local):
        for factor in (1.5, 4.0, 100.0):
            value = getattr(base, field)
            faster = replace(
                base, **{field: value.scaled(factor) if isinstance(value, RateTable) else value * factor}
            )
            slow, fast = _by_name(base), _by_name(faster)
            for name in slow:
                assert fast[name].first_epoch_s <= slow[name].first_epoch_s + 1e-12, name
                assert fast[name].steady_epoch_s <= slow[name].steady_epoch_s + 1e-12, name


def test_limits_at_the_extremes() -> None:
    # An infinitely fast file system and network: epochs cost only the local tier.
    fast = _cluster(fs_seq=RateTable((1,), (1e30,)), fs_small=RateTable((1,), (1e30,)), network_bw=1e30)
    p = _by_name(fast)
    assert p["per-file"].steady_epoch_s == pytest.approx(0.0, abs=1e-9)
    assert p["partial-Q1"].steady_epoch_s == pytest.approx(p["local-only"].steady_epoch_s)
    # A crawling network makes exchange the bound; Q=0 is untouched.
    slow_net = _by_name(_cluster(network_bw=1.0))
    assert slow_net["partial-Q1"].bound == "network"
    assert slow_net["local-only"].steady_epoch_s == pytest.approx(
        _by_name(_cluster())["local-only"].steady_epoch_s
    )
    # No local capacity: the block shuffle streams every epoch; the global one reads records per file.
    none = _by_name(_cluster(local_capacity=0.0))
    assert none["staged-block"].fs_bytes_steady == pytest.approx(4 * DATA.nbytes)
    assert none["staged-global"].steady_epoch_s == pytest.approx(none["per-file"].steady_epoch_s)


def test_one_node_has_no_partial_strategies() -> None:
    names = [s.name for s in strategies(1)]
    assert "local-only" not in names and not any(n.startswith("partial") for n in names)
    assert len(predict_all(_cluster(nodes=1), DATA)) == len(names)


def test_recommendation_is_the_most_random_meeting_the_target() -> None:
    c = _cluster(
        step_seconds=1.0
    )  # compute 250 steps... 10,000 / 40 = 250 s per epoch: every strategy meets AU
    best, why = recommend(predict_all(c, DATA), c, 0.9, epochs=1)
    assert best.strategy.randomness == 0 and "AU >= 0.9" in why
    # Compute-free: nothing reaches AU 0.9: the fastest steady epoch is chosen and the reason says so.
    c0 = _cluster()
    best, why = recommend(predict_all(c0, DATA), c0, 0.9, epochs=1)
    assert best.first_epoch_s == min(p.first_epoch_s for p in predict_all(c0, DATA))  # 1 epoch: the run
    assert "no strategy reaches" in why


def test_a_measured_spread_gives_every_figure_a_range_and_the_choice_holds_at_its_slow_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The probe's passes spread the shared FS 4x below and 10% above its median figures.
    c = replace(
        _cluster(step_seconds=0.1),
        fs_seq_range=(RateTable((1, 4), (25 * MB, 50 * MB)), RateTable((1, 4), (110 * MB, 220 * MB))),
        fs_small_range=(RateTable((1, 4), (250.0, 500.0)), RateTable((1, 4), (1100.0, 2200.0))),
    )
    record = plan_record(c, DATA, 4, 0.9, epochs=10)
    rows = {row["strategy"]: row for row in record["strategies"]}
    for row in rows.values():
        low, high = row["range"]["run_s"]
        assert low <= row["run_s"] <= high
    assert rows["per-file"]["range"]["run_s"][1] > 1.5 * rows["per-file"]["run_s"]  # reads the slow FS
    chosen = record["recommendation"]["strategy"]
    assert rows[chosen]["range"]["au_run"][0] >= 0.9  # the target holds at the slow end
    assert "slow end of the measured range" in record["recommendation"]["why"]
    # The median alone picks the most random strategy, which misses the target at the slow end.
    plain = plan_record(replace(c, fs_seq_range=None, fs_small_range=None), DATA, 4, 0.9, epochs=10)
    assert plain["recommendation"]["strategy"] == "per-file" != chosen
    assert rows["per-file"]["range"]["au_run"][0] < 0.9
    assert "range" not in plain["strategies"][0] and plain["spread"].startswith("none")
    show(record)
    line = next(text for text in capsys.readouterr().out.splitlines() if "per-file" in text)
    assert line.count("(") >= 3, line  # epoch 1, steady epoch and the run, each with its range


def test_examples_load_and_plan_as_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for toml in EXAMPLES.glob("*.toml"):
        if toml.name.startswith("dataset-"):
            assert load_dataset(toml).samples > 0
        else:
            assert load_cluster(toml).nodes >= 1
    cmd_plan(
        ["--cluster", str(EXAMPLES / "abci-class.toml"), "--dataset", str(EXAMPLES / "dataset-imagenet-1k.toml"),
         "--nodes", "8", "--json"]
    )  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    assert record["nodes"] == 8 and len(record["strategies"]) == 8
    assert record["recommendation"]["flags"].startswith("--data.path")
    assert all(0.0 <= row["quality"] <= 1.1 for row in record["strategies"])


def test_plan_record_matches_the_model() -> None:
    c = _cluster()
    record = plan_record(c, DATA, 4, 0.9)
    by_name = {row["strategy"]: row for row in record["strategies"]}
    assert by_name["staged-global"]["first_epoch_s"] == pytest.approx(
        predict(c, DATA, strategies(4)[1]).first_epoch_s
    )


GOOD = {
    "cluster": {"nodes": 2},
    "shared_fs": {"readers": [1, 4], "seq_read_MBps": [100, 200], "small_reads_per_s": [10, 20]},
    "network": {"node_bandwidth_MBps": 100},
}


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (("cluster", "nodes", 0), "cluster.nodes"),
        (("network", "node_bandwidth_MBps", -1), "network.node_bandwidth_MBps"),
        (("shared_fs", "readers", [4, 1]), "shared_fs.readers"),
        (("shared_fs", "seq_read_MBps", [100, -2]), "shared_fs.seq_read_MBps[1]"),
        (("shared_fs", "small_reads_per_s", [1]), "shared_fs.small_reads_per_s"),
        (("local", "capacity", "-5GB"), "local.capacity"),
        (("cluster", "nodez", 3), "cluster.nodez"),
        (("shared_fs", "seq_read_MBps_low", [90, 150]), "shared_fs.seq_read_MBps_low needs its pair"),
        (("network", "node_bandwidth_MBps_high", 120), "network.node_bandwidth_MBps_high needs its pair"),
    ],
)
def test_bad_cluster_values_name_the_key(change: tuple, key: str) -> None:
    data = json.loads(json.dumps(GOOD))
    section, name, value = change
    data.setdefault(section, {})[name] = value
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")) as info:
        cluster_from_dict(data, "c.toml")
    assert "\n" not in str(info.value)
    assert cluster_from_dict(GOOD).nodes == 2


def test_a_range_must_hold_its_figure() -> None:
    data = json.loads(json.dumps(GOOD))
    data["shared_fs"] |= {"seq_read_MBps_low": [90, 150], "seq_read_MBps_high": [110, 190]}  # 200 above it
    with pytest.raises(ConfigError, match=r"shared_fs.seq_read_MBps\[1\] must lie within"):
        cluster_from_dict(data, "c.toml")
    data["shared_fs"]["seq_read_MBps_high"] = [110, 210]
    data["network"] |= {"node_bandwidth_MBps_low": 80, "node_bandwidth_MBps_high": 130}
    cluster = cluster_from_dict(data, "c.toml")
    assert cluster.fs_seq_range is not None and cluster.fs_seq_range[0].at(4) == 150 * MB
    assert cluster.at_end(0).network_bw == 80 * MB and cluster.at_end(1).fs_seq.at(1) == 110 * MB
    assert cluster.fs_small_range is None and cluster.at_end(0).fs_small == cluster.fs_small


def test_missing_key_and_bad_dataset(tmp_path: Path) -> None:
    data = json.loads(json.dumps(GOOD))
    del data["network"]
    with pytest.raises(ConfigError, match="network.node_bandwidth_MBps is missing"):
        cluster_from_dict(data, "c.toml")
    bad = tmp_path / "d.toml"
    bad.write_text("[dataset]\nsamples = 10\nsample_bytes = 0\n")
    with pytest.raises(ConfigError, match="dataset.sample_bytes"):
        load_dataset(bad)


def test_strategy_hint_names_a_change_only_when_waiting() -> None:
    assert strategy_hint(0.05, staged=True, shuffle="global", exchange=0.0, local_cache=False) is None
    line = strategy_hint(0.5, staged=True, shuffle="global", exchange=0.0, local_cache=False)
    assert line is not None and "--data.local-cache" in line and "2.0x" in line and "\n" not in line
    partial = strategy_hint(0.3, staged=True, shuffle="partial", exchange=0.5, local_cache=True)
    assert partial is not None and "--data.exchange 0.25" in partial


def test_a_finished_run_that_waited_on_a_network_mount_gets_the_plan_hint(tmp_path: Path) -> None:
    from kaisoku.engine.metrics import MetricsLogger
    from kaisoku.engine.report import data_hint

    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "index.json").write_text("{}")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/export {pack} nfs4 rw 0 0\n")
    local = tmp_path / "local-mounts"
    local.write_text("/dev/vda / ext4 rw 0 0\n")

    def run(waits: list[float]) -> Path:
        run_dir = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
        logger = MetricsLogger(
            run_dir, enabled=True, total_steps=len(waits), progress=False, tensorboard=False
        )
        for step, wait in enumerate(waits):
            logger.log({"step": step + 1, "data_wait_fraction": wait})
        logger.close()
        (run_dir / "config.toml").write_text(
            f'[data]\npath = "{pack}"\nshuffle = "global"\nlocal_cache = ""\n'
        )
        return run_dir

    waiting = run([0.9, 0.5, 0.5, 0.5])  # the first window (start-up) is left out: mean 0.5
    line = data_hint(waiting, str(mounts))
    assert line is not None and "\n" not in line and "50%" in line and "2.0x" in line
    assert "--data.local-cache" in line
    assert data_hint(waiting, str(local)) is None  # a local source: not the I/O model's case
    assert data_hint(run([0.9, 0.02, 0.03]), str(mounts)) is None  # no real wait: no hint
