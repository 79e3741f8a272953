"""Weak scaling of loading and exchange in a cluster in a box (``kaisoku bench cluster``'s cells): each
host stages its partition over sshfs through its own shaped link and exchanges over it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kaisoku.testing.cluster import unavailable_reason
from kaisoku.testing.sshfs import unavailable_reason as sshfs_unavailable_reason
from kaisoku_bench import cluster_scaling as scaling

REASON = unavailable_reason() or sshfs_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.mark.slow  # a cluster in a box: hosts in network namespaces, 23 s
@pytest.mark.timeout(400)
def test_every_cell_stages_its_hosts_partitions_and_two_hosts_exchange(tmp_path: Path) -> None:
    plan = replace(scaling.plan_for(True, tmp_path / "work"), per_host=128, repeats=2, probe_seconds=2.0)
    rows, ran, profile = scaling.measure(plan, timeout=300)
    # kaisoku probe ran on host 0 over its mount, and every cell has the planner's prediction from it.
    assert profile is not None and profile["shared_fs"]["seq_read_MBps"][0] > 0
    assert all(row["probed_s"] > 0 for row in rows)
    strategy_rows = [row for row in rows if row["cell"] == "strategy"]
    rows = [row for row in rows if row["cell"] == "scaling"]
    assert [(r["repeat"], r["hosts"], r["exchange"]) for r in rows] == [
        (0, 1, 0.0), (0, 2, 0.25), (1, 1, 0.0), (1, 2, 0.25),
    ]  # fmt: skip
    # Every other strategy kaisoku plan compares at 2 hosts ran in each repeat, each as it says.
    by_name = {row["strategy"]: row for row in strategy_rows if row["repeat"] == 0}
    assert sorted(by_name) == sorted(name for _, _, name in scaling.strategy_cells(ran))
    assert len(strategy_rows) == 2 * len(by_name)
    one_set = ran.sample_bytes * 2 * ran.per_host
    # Global staging: each host stages every shard; per-file: each host reads its half, file by file.
    assert by_name["staged-global"]["source_bytes"] == pytest.approx(2 * one_set, rel=0.15)
    assert by_name["per-file"]["source_bytes"] == pytest.approx(one_set, rel=0.15)
    assert by_name["partial-Q1"]["exchanged_bytes"] > by_name["partial-Q0.1"]["exchanged_bytes"] > 0
    assert by_name["local-only"]["exchanged_bytes"] == 0 == by_name["staged-block"]["exchanged_bytes"]
    packed = {hosts: ran.sample_bytes * hosts * ran.per_host for hosts in ran.sizes}
    for row in rows:
        # Every host read its own partition from the mount: the cell's set once over, no more.
        assert row["source_bytes"] == pytest.approx(packed[row["hosts"]], rel=0.15)
        assert row["seconds"] > 0 and row["predicted_s"] > 0
        assert (row["exchanged_bytes"] > 0) == (row["hosts"] > 1)
    assert len(scaling.efficiencies(rows, 2, 0.25)) == 2
    box_folder = Path(ran.mounts[0]).parents[1]  # the sshfs mounts lived in the box's folder
    assert not box_folder.exists()
    assert str(box_folder) not in Path("/proc/self/mountinfo").read_text()
