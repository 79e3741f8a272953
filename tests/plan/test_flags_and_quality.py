"""What ``kaisoku plan`` prints matches what it priced: quality in [0, 1] and consistent with the ranking,
reader counts in the per-file flags, tiers sized to the dataset, and a packed root accepted."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kaisoku.data.datagen import generate
from kaisoku.data.shards.writer import pack
from kaisoku.plan.cluster import load_cluster, load_dataset
from kaisoku.plan.command import BLOCK_SHARDS, cmd_plan, shuffle_quality_estimate, train_flags
from kaisoku.plan.model import Dataset, strategies

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def _small_dataset(shards: int) -> Dataset:
    return Dataset(name="small", samples=shards * 1200, sample_bytes=3500.0, shard_bytes=4 * 2**20)


def test_quality_is_within_zero_and_one_and_a_block_over_every_shard_scores_as_global() -> None:
    cluster = load_cluster(EXAMPLES / "abci-class.toml")
    for dataset in (_small_dataset(5), load_dataset(EXAMPLES / "dataset-imagenet-1k.toml")):
        scores = {s.name: shuffle_quality_estimate(s, dataset, cluster, 4) for s in strategies(4)}
        assert all(0.0 <= q <= 1.0 for q in scores.values()), scores
    few = _small_dataset(5)
    assert few.num_shards <= BLOCK_SHARDS
    by_shuffle = {s.shuffle: shuffle_quality_estimate(s, few, cluster, 4) for s in strategies(4) if s.staged}
    assert by_shuffle["block"] == by_shuffle["global"]


def test_flags_set_the_readers_priced_and_tiers_no_larger_than_the_dataset() -> None:
    cluster = replace(load_cluster(EXAMPLES / "abci-class.toml"), readers_per_node=8, ranks_per_node=4)
    dataset = Dataset(name="small", samples=150_000, sample_bytes=3500.0)  # ~500 MiB
    by_name = {s.name: train_flags(s, cluster, dataset) for s in strategies(4)}
    per_file = next(flags for name, flags in by_name.items() if "--data.path <image folder>" in flags)
    assert "--data.workers 2" in per_file  # 8 readers per node over 4 ranks
    staged = [flags for flags in by_name.values() if "--data.local-capacity" in flags]
    assert staged and all("--data.local-capacity 501MiB" in flags for flags in staged), staged
    assert all(
        "GiB" not in flags.split("--data.ram-capacity")[-1] for flags in staged if "ram-capacity" in flags
    )


@pytest.mark.timeout(120)
def test_plan_takes_a_packed_root_like_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = generate(tmp_path / "shapes", count=60, size=16, val_count=20, workers=1)
    pack(images, tmp_path / "packed", shard_bytes=16 * 1024, codec="raw", workers=1, progress=False)
    assert not (tmp_path / "packed" / "index.json").exists()  # a root of split folders
    assert load_dataset(tmp_path / "packed").samples == 60
    assert cmd_plan(["--cluster", str(EXAMPLES / "abci-class.toml"), "--dataset", str(tmp_path / "packed"),
                     "--nodes", "2"]) == 0  # fmt: skip
    assert "recommend" in capsys.readouterr().out.lower()
