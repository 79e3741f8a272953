"""End to end: with --data.skip-corrupt true a damaged validation record is skipped and counted (D10)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kaisoku.data.datagen import generate
from kaisoku.data.shards.format import read_index
from kaisoku.data.shards.writer import pack
from tests.train_harness import metric_lines, train_args, train_env

# Slow tier: a whole run with a damaged validation record.
pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_a_damaged_validation_record_is_skipped_and_counted(tmp_path: Path) -> None:
    images = generate(tmp_path / "shapes", count=160, size=20, val_count=20, workers=1)
    pack(images, tmp_path / "packed", shard_bytes=20 * 1024, codec="raw", workers=1, progress=False)
    val = read_index(tmp_path / "packed" / "val")
    shard = val.shard_path(0)
    data = bytearray(shard.read_bytes())
    data[int(val.shards[0].offsets[2]) + 40] ^= 0xFF  # record 2 of the validation set
    shard.write_bytes(bytes(data))
    run_dir = tmp_path / "run"
    args = ["--model.name", "small-cnn", "--data.skip-corrupt", "true", "--train.epochs", "1"]
    result = subprocess.run(
        train_args(tmp_path / "packed", run_dir, *args),
        capture_output=True, text=True, timeout=240, env=train_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    validations = [r for r in metric_lines(run_dir) if r.get("event") == "validation"]
    assert validations and all(r["val_samples"] == 19 for r in validations), validations
    assert all(r.get("val_skipped_records") == 1 for r in validations), validations
    last = result.stdout.strip().splitlines()[-1]
    assert "; 1 record skipped (1 in validation);" in last, last
