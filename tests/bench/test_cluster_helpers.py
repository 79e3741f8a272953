"""The pure parts of ``kaisoku bench cluster``: merging the scaling ranks' records, efficiencies, the
planner's prediction of a cell, and the launcher's rendezvous clocks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kaisoku.bench import cluster_scaling as scaling
from kaisoku.bench.cluster import planner_errors
from kaisoku.bench.cluster_rank import split_clocks
from kaisoku.distributed.launch import DEFAULT_TIMING, RendezvousTiming, rendezvous_for


def _record(repeat: int, hosts: int, exchange: float, rank: int, seconds: float) -> dict[str, object]:
    return {
        "repeat": repeat, "hosts": hosts, "exchange": exchange, "rank": rank, "seconds": seconds,
        "delivered_bytes": 10, "source_bytes": 20, "exchanged_bytes": 5 if hosts > 1 else 0,
    }  # fmt: skip


def test_a_cell_takes_its_slowest_host_and_sums_the_bytes() -> None:
    per_rank = [
        [_record(0, 1, 0.0, 0, 2.0), _record(0, 2, 0.25, 0, 2.5)],
        [_record(0, 2, 0.25, 1, 3.0)],
    ]
    rows = scaling.cells(per_rank)
    assert [(r["hosts"], r["seconds"], r["source_bytes"], r["exchanged_bytes"]) for r in rows] == [
        (1, 2.0, 20, 0),
        (2, 3.0, 40, 10),
    ]
    assert scaling.efficiencies(rows, 2, 0.25) == [pytest.approx(2.0 / 3.0, abs=1e-4)]
    assert scaling.efficiencies(rows, 2, 0.0) == []  # no local-only cell measured


def test_the_planner_prices_the_exchange_on_the_hosts_own_links(tmp_path: Path) -> None:
    plan = replace(scaling.plan_for(False, tmp_path), sample_bytes=1500.0)
    # Each host's link carries its own partition: staging alone scales perfectly in the model...
    assert scaling.predicted_efficiency(plan, 4, 0.0) == pytest.approx(1.0, rel=0.02)
    # ...and the exchange adds Q of the partition to the same link.
    assert scaling.predicted_efficiency(plan, 4, 0.25) == pytest.approx(1 / 1.25, rel=0.02)


def test_cells_are_rotated_per_repeat_and_one_host_has_no_exchange(tmp_path: Path) -> None:
    plan = scaling.plan_for(False, tmp_path)
    first, second = scaling._cell_order(plan, 0), scaling._cell_order(plan, 1)
    assert first[0] == (1, 0.0) and sorted(first) == sorted(second) and first != second
    assert [cell for cell in first if cell[0] == 1] == [(1, 0.0)]


def test_the_bench_clocks_reach_torchruns_rendezvous_and_the_default_is_unchanged() -> None:
    timing, rest = split_clocks(["--clocks", "1:3:1", "--config", "x.toml"])
    assert timing == RendezvousTiming(1, 3, 1) and rest == ["--config", "x.toml"]
    assert split_clocks(["--config", "x.toml"])[0] == DEFAULT_TIMING
    fast = rendezvous_for("1:2", -1, "node0", run_id="r", join_timeout=60, timing=timing)
    default = rendezvous_for("1:2", -1, "node0", run_id="r", join_timeout=60)
    assert fast is not None and default is not None
    assert (
        "--rdzv-conf=join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
        in (fast.torchrun_args())
    )
    assert (
        "--rdzv-conf=join_timeout=60,last_call_timeout=5,keep_alive_interval=5,keep_alive_max_attempt=3"
        in default.torchrun_args()
    )


def test_a_probe_that_saw_the_link_rate_predicts_what_the_nominal_links_do(tmp_path: Path) -> None:
    plan = replace(scaling.plan_for(False, tmp_path), sample_bytes=1500.0)
    link_mb = plan.rate_mbit / 8  # MB/s
    profile = {
        "cluster": {"name": "box", "nodes": 1},
        "shared_fs": {"readers": [1, 2], "seq_read_MBps": [link_mb, link_mb], "small_reads_per_s": [50, 60]},
        "network": {"node_bandwidth_MBps": 1000.0},
    }
    for hosts, exchange in ((1, 0.0), (2, 0.25), (4, 0.0)):
        row = {"hosts": hosts, "exchange": exchange}
        assert scaling.probed_epoch_s(plan, profile, row) == pytest.approx(
            scaling.predicted_epoch_s(plan, hosts, exchange), rel=0.01
        )


def test_planner_errors_judge_each_cells_median_and_each_repeats_worst() -> None:
    rows = [
        {"box": "a", "hosts": 2, "exchange": 0.25, "repeat": 0, "seconds": 2.0, "probed_s": 2.2},
        {"box": "a", "hosts": 2, "exchange": 0.25, "repeat": 1, "seconds": 2.0, "probed_s": 2.2},
        {"box": "b", "hosts": 3, "exchange": 0.0, "repeat": 0, "seconds": 4.0, "probed_s": 2.0},
        {"box": "b", "hosts": 3, "exchange": 0.0, "repeat": 1, "seconds": 2.0, "probed_s": 2.0},
        {"box": "b", "hosts": 1, "exchange": 0.0, "repeat": 0, "seconds": 1.0},  # no probe: left out
    ]
    errors, worst = planner_errors(rows)
    # Cell b: measured median 3.0 s, predicted 2.0 s.
    assert errors == [pytest.approx(0.1), pytest.approx(1 / 3, abs=1e-4)]
    assert worst == [0.5, pytest.approx(0.1)]
