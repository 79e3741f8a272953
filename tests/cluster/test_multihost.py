"""`kaisoku train` across hosts of a cluster in a box: torchrun's c10d and static rendezvous, each host
staging into its own disk, hosts.json saying which host ran which rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kaisoku.testing.cluster import ClusterBox, Link, unavailable_reason
from tests.cluster.box_runs import (
    ENDPOINT,
    finish,
    host_args,
    hosts_record,
    make_packed,
    staged_folders,
    start_hosts,
)
from tests.train_harness import metric_lines

REASON = unavailable_reason()
# Slow tier: two hosts in a cluster in a box.
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_packed(tmp_path_factory.mktemp("data"))


@pytest.fixture
def box(packed: Path) -> Iterator[ClusterBox]:
    with ClusterBox(2, shared=packed, link=Link(rate_mbit=500)) as built:
        yield built
    assert built.leftovers() == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_hosts_train_each_staging_into_its_own_disk(
    box: ClusterBox, tmp_path: Path, rendezvous: str
) -> None:
    run_dir = tmp_path / "run"
    args = host_args(box, run_dir, "--nnodes", "2", "--rdzv-endpoint", ENDPOINT, "--max-steps", "6")
    if rendezvous == "c10d":
        procs = start_hosts(box, args)
    else:
        procs = [start_hosts(box, [*args, "--node-rank", str(h)], hosts=[h])[0] for h in range(2)]
    results = finish(procs, timeout=240)
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    # Rank 0 prints the summary on its host; the host that did not hold rank 0 prints none.
    assert "run folder" in results[0][1] or "steps" in results[0][1]
    attempts = hosts_record(run_dir)
    assert len(attempts) == 1
    assert attempts[0]["hosts"] == {"kbox-node0": [0], "kbox-node1": [1]}
    assert [(r["host"], r["node"]) for r in attempts[0]["ranks"]] == [("kbox-node0", 0), ("kbox-node1", 1)]
    # Each rank read its shards from the shared source into its own host's tiers.
    data = attempts[0]["data"]
    assert all(
        data[str(rank)]["source_reads"] > 0 and data[str(rank)]["staged_bytes"] > 0 for rank in range(2)
    )
    assert [staged_folders(box, host) for host in range(2)] == [["node0"], ["node1"]]
    assert not any(box.local_dir.iterdir())  # nothing staged on the machine's own disk
    world = [line for line in metric_lines(run_dir) if line.get("event") == "world"]
    assert [(w["world_size"], w["hosts"]) for w in world] == [(2, attempts[0]["hosts"])]
    assert [line["step"] for line in metric_lines(run_dir) if "loss" in line][-1] == 6
