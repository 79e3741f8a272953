"""The loader benchmark's one-thread profile: its stage figures over real JPEG bytes and its row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import simplejpeg

from kaisoku.data.loading.dataset import ImageLabelTransform
from kaisoku.data.loading.transforms import AugmentSpec
from kaisoku.data.shards.writer import pack
from kaisoku_bench import loader_profile


def _folder(root: Path, count: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    blobs = []
    for k in range(count):
        image = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
        blobs.append(simplejpeg.encode_jpeg(image, quality=95, colorsubsampling="444"))
        target = root / f"c{k % 2}" / f"{k:03d}.jpg"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blobs[-1])
    return blobs


def test_stage_figures_are_measured_over_the_bytes(tmp_path: Path) -> None:
    blobs = _folder(tmp_path / "train", 12)
    transform = ImageLabelTransform(spec=AugmentSpec(size=32), seed=0)
    stages = loader_profile.stage_us(blobs, transform, epoch=1)
    assert set(stages) == {"decoder_us", "batch_call_us", "decoder_range_us", "batch_call_range_us"}
    for stage in ("decoder", "batch_call"):
        low, high = stages[f"{stage}_range_us"]
        assert 0 < low <= round(stages[f"{stage}_us"], 1) <= high  # the median lies within its passes
    pack(tmp_path / "train", tmp_path / "packed", overwrite=True, progress=False, seed=0)
    stored = loader_profile.pack_images(tmp_path / "packed", 5)
    assert len(stored) == 5
    assert all(data in blobs for data in stored)  # the pack keeps the source's bytes


def test_profile_row_takes_each_rows_stages_off_its_cpu() -> None:
    own = {
        "decoder_us": 40.0,
        "batch_call_us": 50.0,
        "decoder_range_us": [39, 41],
        "batch_call_range_us": [49, 52],
    }
    own_format = {
        "decoder_us": 25.0,
        "batch_call_us": 33.0,
        "decoder_range_us": [24, 26],
        "batch_call_range_us": [32, 34],
    }
    row = loader_profile.profile_row("64px", own, own_format, {"kaisoku": 60.0, "ffcv": 31.0, "limit": 55.0})
    assert row["kaisoku_outside_stages_us"] == 10.0
    assert row["ffcv_outside_stages_us"] == 6.0  # FFCV's file is re-encoded: the own format's decoder
    assert "kaisoku-own-format_cpu_us" not in row  # a row that did not run is left out
    assert "limit_cpu_us" not in row
    assert row["own_format_batch_call_range_us"] == [32, 34]
