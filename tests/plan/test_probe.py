"""``kaisoku probe``: a short real probe of a temporary folder, its TOML, and a read-only folder."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import kaisoku.plan.probe as probe_module
from kaisoku.cli import cmd_probe
from kaisoku.errors import ConfigError
from kaisoku.plan.cluster import load_cluster
from kaisoku.plan.probe import probe


def test_probe_writes_a_profile_that_plan_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "machine.toml"
    data = tmp_path / "fs"
    data.mkdir()
    config = tmp_path / "tiny.toml"
    config.write_text(
        '[model]\nname = "small-cnn"\nnum_classes = 10\n[data]\nimage_size = 16\nglobal_batch = 8\n'
    )
    cmd_probe(
        [str(data), "--out", str(out), "--seconds", "3", "--local", str(tmp_path / "local"),
         "--train", str(config), "--ranks", "2"]
    )  # fmt: skip
    profile = tomllib.loads(out.read_text())
    # --train: the step time of the config's model at its per-rank batch (8 over 2 ranks), in [compute]
    assert profile["compute"]["batch_per_rank"] == 4 and profile["compute"]["step_seconds"] > 0
    assert profile["cluster"]["ranks_per_node"] == 2  # the plan prices the steps of the ranks timed
    assert "small-cnn" in profile["probe"]["compute_method"]
    fs = profile["shared_fs"]
    assert fs["readers"] == [1, 2, 4, 8, 16]
    assert len(fs["seq_read_MBps"]) == 5 and min(fs["seq_read_MBps"]) > 0
    assert min(fs["small_reads_per_s"]) > 0
    for key in ("seq_read_MBps", "small_reads_per_s"):  # every figure with the range of its passes
        assert all(lo <= mid <= hi for lo, mid, hi in zip(fs[f"{key}_low"], fs[key], fs[f"{key}_high"]))
    net = profile["network"]
    assert net["node_bandwidth_MBps_low"] <= net["node_bandwidth_MBps"] <= net["node_bandwidth_MBps_high"]
    assert profile["probe"]["date"].endswith("Z") and "cache" in profile["probe"]
    assert not any(p.name.startswith("kaisoku-probe-") for p in data.iterdir())  # scratch removed
    cluster = load_cluster(out)
    assert cluster.nodes == 1 and cluster.fs_seq.at(1) > 0
    assert cluster.has_spread and cluster.at_end(0).fs_seq.at(1) <= cluster.fs_seq.at(1)
    assert cluster.step_seconds == profile["compute"]["step_seconds"] and cluster.batch_per_rank == 4
    assert cluster.ranks_per_node == 2
    assert "wrote" in capsys.readouterr().out


def test_read_only_path_measures_existing_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(20):
        (tmp_path / f"f{i}.bin").write_bytes(bytes(2000 + 100 * i))
    (tmp_path / "large.bin").write_bytes(bytes(1 << 20))  # read for bandwidth, never as a small file
    monkeypatch.setattr(probe_module, "is_writable", lambda folder: False)
    profile = probe(tmp_path, seconds=1.0, readers=(1, 2), local=tmp_path / "local")
    assert "not writable" in capsys.readouterr().err
    assert "not writable" in profile["probe"]["notes"][0]
    assert len(profile["shared_fs"]["seq_read_MBps"]) == 2
    assert 2000 <= profile["shared_fs"]["small_file_bytes"] < 4000
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names == sorted([*(f"f{i}.bin" for i in range(20)), "large.bin"])


def test_bad_train_config_stops_before_measuring(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[data]\nglobal_batch = 0\n")
    out = tmp_path / "machine.toml"
    # Read as kaisoku train --config reads it: the batch is refused before any pass runs.
    with pytest.raises(ConfigError, match="data.global_batch"):
        cmd_probe([str(tmp_path), "--out", str(out), "--seconds", "30", "--train", str(config)])
    assert not out.exists()
    assert not any(p.name.startswith("kaisoku-probe-") for p in tmp_path.iterdir())
