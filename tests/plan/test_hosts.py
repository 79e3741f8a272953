"""The planner per host and per link: a probe of every host of a job (two torchrun agents with real gloo),
the merged profile, and the model's choices when one host or one link is slow."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kaisoku.errors import ConfigError
from kaisoku.plan.cluster import cluster_from_dict
from kaisoku.plan.command import cmd_plan, plan_record
from kaisoku.plan.model import MB, Dataset, predict_all
from kaisoku.plan.probe import probe
from kaisoku.plan.probe_hosts import merge_profiles

DATA = Dataset(name="d", samples=10_000, sample_bytes=100_000.0, shard_bytes=10e6)  # 1 GB


def _profile(
    seq: tuple[float, ...] = (100.0, 100.0),
    links: tuple[tuple[float, ...], ...] | None = None,
    *,
    step: float,
    small: float,
    capacity: str = "1TB",
) -> dict[str, Any]:
    """A cluster description of ``len(seq)`` hosts, host ``h`` reading the shared FS at ``seq[h]`` MB/s
    (one reader; twice that at four) and ``small`` small files per second in all, split as ``seq``."""
    total = sum(seq)
    hosts = len(seq)
    data: dict[str, Any] = {
        "cluster": {"nodes": hosts, "readers_per_node": 2, "ranks_per_node": 1},
        "shared_fs": {
            "readers": [hosts, 4 * hosts],
            "seq_read_MBps": [total, 2 * total],
            "small_reads_per_s": [2 * small, 4 * small],
            "small_file_bytes": 1000,
        },
        "network": {"node_bandwidth_MBps": 100},
        "local": {"capacity": capacity, "read_MBps": 1000, "write_MBps": 500},
        "ram": {"capacity": 0, "bandwidth_MBps": 5000},
        "compute": {"step_seconds": step, "batch_per_rank": 10},
        "host": [
            {
                "name": f"h{h}",
                "seq_read_MBps": [s, 2 * s],
                "small_reads_per_s": [2 * small * s / total, 4 * small * s / total],
            }
            for h, s in enumerate(seq)
        ],
    }
    if links is not None:
        data["network"]["links_MBps"] = [list(row) for row in links]
    return data


def _choice(data: dict[str, Any], epochs: int) -> str:
    return plan_record(cluster_from_dict(data), DATA, len(data["host"]), 0.9, epochs=epochs)[
        "recommendation"
    ]["strategy"]


def test_a_slow_host_moves_the_choice_off_the_shared_file_system() -> None:
    even = _profile(step=0.05, small=200)
    assert _choice(even, 1) == "per-file"  # every host keeps up with per-file reads
    # Host 1 reads at 30 MB/s of 200: per-file would wait for it every epoch; reading only its own share once
    # (local-only) is what keeps the run fastest.
    slow = _profile((100.0, 30.0), step=0.05, small=200)
    assert _choice(slow, 1) == "local-only"
    record = plan_record(cluster_from_dict(slow), DATA, 2, 0.9, epochs=1)
    assert record["hosts"]["slowest_reader"]["host"] == "h1"
    assert record["hosts"]["slowest_reader"]["share_of_mean"] == pytest.approx(30 / 65, abs=1e-3)
    notes = next(row["notes"] for row in record["strategies"] if row["strategy"] == "staged-global")
    assert any("host h1" in note for note in notes)


def test_a_slow_link_moves_the_choice_to_a_smaller_exchange() -> None:
    fast = _profile(links=((0, 100), (100, 0)), step=0.2, small=5, capacity="0.8GB")
    assert _choice(fast, 10) == "partial-Q0.5"
    # h1 -> h0 at 10 MB/s: exchanging half a partition through it no longer hides under compute.
    slow = _profile(links=((0, 100), (10, 0)), step=0.2, small=5, capacity="0.8GB")
    assert _choice(slow, 10) == "partial-Q0.1"
    record = plan_record(cluster_from_dict(slow), DATA, 2, 0.9, epochs=10)
    assert record["hosts"]["slowest_link"] == {"from": "h1", "to": "h0", "MBps": 10.0}


def test_even_hosts_and_links_predict_as_one_kind_of_node() -> None:
    with_hosts = cluster_from_dict(_profile(links=((0, 100), (100, 0)), step=0.1, small=500))
    plain = replace(with_hosts, host_names=(), host_seq_share=(), host_small_share=(), links=())
    assert with_hosts.host_seq_share == (1.0, 1.0) and with_hosts.links[1][0] == 100 * MB
    for a, b in zip(predict_all(with_hosts, DATA), predict_all(plain, DATA), strict=True):
        assert a.first_epoch_s == pytest.approx(b.first_epoch_s) and a.steady_epoch_s == pytest.approx(
            b.steady_epoch_s
        )


def test_a_job_runs_on_the_first_hosts_and_beyond_them_meets_the_slowest() -> None:
    cluster = cluster_from_dict(_profile((100.0, 100.0, 25.0), step=0.0, small=100))
    assert cluster.slowest_share(cluster.host_seq_share, 2) == (pytest.approx(100 / 75), "h0")  # hosts 0, 1
    share, name = cluster.slowest_share(cluster.host_seq_share, 3)
    assert name == "h2" and share == pytest.approx(25 / 75)
    assert cluster.slowest_share(cluster.host_seq_share, 64)[1] == "h2"  # a larger job holds it too
    two = {p.strategy.name: p for p in predict_all(cluster, DATA, 2)}
    three = {p.strategy.name: p for p in predict_all(cluster, DATA, 3)}
    assert three["local-only"].first_epoch_s > two["local-only"].first_epoch_s  # the slow host joined


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"links_MBps": [[0, 100]]}, r"network.links_MBps must be a 2 x 2 matrix"),
        ({"links_MBps": [[0, 100], [0, 0]]}, r"network.links_MBps\[1\]\[0\] must be a number > 0"),
        ({"links_MBps": [[0, 100], [90, 0]], "links_MBps_low": [[0, 90], [80, 0]]}, "needs its pair"),
        (
            {"links_MBps": [[0, 100], [90, 0]], "links_MBps_low": [[0, 90], [95, 0]],
             "links_MBps_high": [[0, 110], [99, 0]]},
            r"network.links_MBps\[1\]\[0\] must lie within",
        ),
    ],
)  # fmt: skip
def test_bad_link_matrices_name_the_key(change: dict[str, Any], message: str) -> None:
    data = _profile(step=0.0, small=100)
    data["network"] |= change
    with pytest.raises(ConfigError, match=message) as info:
        cluster_from_dict(data, "c.toml")
    assert "\n" not in str(info.value) and str(info.value).startswith("c.toml: ")


def test_bad_host_tables_name_the_key() -> None:
    data = _profile(step=0.0, small=100)
    data["host"][1]["seq_read_MBps"] = [100]
    with pytest.raises(ConfigError, match=r"host\[1\].seq_read_MBps must be a list of 2 numbers"):
        cluster_from_dict(data, "c.toml")
    data = _profile(step=0.0, small=100)
    data["host"][0]["speed"] = 3
    with pytest.raises(ConfigError, match=r"unknown key host\[0\].speed"):
        cluster_from_dict(data, "c.toml")
    data = _profile(step=0.0, small=100)
    data["network"]["links_MBps"] = [[0, 1], [1, 0]]
    del data["host"]
    with pytest.raises(ConfigError, match="needs a \\[\\[host\\]\\] table per host"):
        cluster_from_dict(data, "c.toml")


def test_merged_profiles_sum_the_hosts_and_keep_each_one(tmp_path: Path) -> None:
    profiles = []
    for host in range(2):
        folder = tmp_path / f"fs{host}"
        folder.mkdir()
        profiles.append(probe(folder, seconds=1.0, local=tmp_path / f"local{host}", readers=(1, 2)))
    links = [[[], [50e6, 60e6, 70e6]], [[10e6, 12e6, 11e6], []]]
    merged = merge_profiles(profiles, links, ["a", "b"])
    fs = merged["shared_fs"]
    assert fs["readers"] == [2, 4]
    for i in range(2):
        assert fs["seq_read_MBps"][i] == pytest.approx(
            sum(p["shared_fs"]["seq_read_MBps"][i] for p in profiles)
        )
        assert fs["seq_read_MBps_low"][i] <= fs["seq_read_MBps"][i] <= fs["seq_read_MBps_high"][i]
    assert merged["network"]["links_MBps"] == [[0.0, 60.0], [11.0, 0.0]]
    assert merged["network"]["node_bandwidth_MBps_low"] == 10.0
    assert merged["network"]["node_bandwidth_MBps_high"] == 70.0
    assert merged["local"]["capacity"] == min(p["local"]["capacity"] for p in profiles)
    cluster = cluster_from_dict(merged, "merged")  # what kaisoku plan reads
    assert cluster.host_names == ("a", "b") and cluster.links[1][0] == 11 * MB
    assert cluster.at_end(0).links[0][1] == 50 * MB and cluster.at_end(1).links[1][0] == 12 * MB
    assert sum(cluster.host_seq_share) == pytest.approx(2.0, rel=0.3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_probe_under_torchrun_measures_every_host_and_their_links(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two torchrun agents on this machine, one rank each (two hosts to torch.distributed): one profile."""
    shared, out = tmp_path / "shared", tmp_path / "machine.toml"
    shared.mkdir()
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "kaisoku",
                "probe",
                str(shared),
                "--out",
                str(out),
                "--seconds",
                "2",
                "--local-dir",
                str(tmp_path / f"local{node}"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in range(2)
    ]
    try:
        logs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], logs
    assert "2 hosts; links" in logs[0]
    profile = tomllib.loads(out.read_text())
    assert len(profile["host"]) == 2 and profile["cluster"]["nodes"] == 2
    assert profile["shared_fs"]["readers"] == [2, 4, 8, 16, 32]
    links = profile["network"]["links_MBps"]
    assert links[0][1] > 0 and links[1][0] > 0 and links[0][0] == 0.0
    assert all(row["seq_read_MBps"][0] > 0 for row in profile["host"])
    assert not list(shared.iterdir())  # every host's scratch files are gone
    cmd_plan(["--cluster", str(out), "--dataset", str(_dataset(tmp_path)), "--json"])
    record = json.loads(capsys.readouterr().out)
    assert len(record["hosts"]["in_job"]) == 2 and "slowest_link" in record["hosts"]


def _dataset(tmp_path: Path) -> Path:
    path = tmp_path / "dataset.toml"
    path.write_text('[dataset]\nname = "d"\nsamples = 100000\nsample_bytes = "110KB"\n')
    return path
