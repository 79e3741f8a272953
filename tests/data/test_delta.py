"""The delta codec: lossless and error-bounded round trips, its ratio, and packing through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.codecs import get_codec
from kaisoku.data.cosmo import universe_arrays
from kaisoku.data.dataset import ShardedDataset
from kaisoku.data.delta import PREDICTORS, DeltaCodec
from kaisoku.data.format import read_index
from kaisoku.data.writer import pack
from kaisoku.errors import KaisokuError


@pytest.fixture(scope="module")
def volumes() -> tuple[np.ndarray, np.ndarray]:
    return universe_arrays(6, 16, seed=2)


def _round_trip(codec: DeltaCodec, array: np.ndarray) -> tuple[np.ndarray, int]:
    stored = codec.encode_array(array.tobytes(), array.dtype.str, array.shape)
    back = np.frombuffer(codec.decode(stored), dtype=array.dtype).reshape(array.shape)
    return back, len(stored)


def test_lossless_is_exact_and_beats_zstd_on_correlated_frames(
    volumes: tuple[np.ndarray, np.ndarray],
) -> None:
    x, _ = volumes
    codec = get_codec("delta")
    zstd = get_codec("zstd")
    delta_bytes = zstd_bytes = 0
    for volume in x:
        back, size = _round_trip(codec, volume)  # type: ignore[arg-type]
        assert np.array_equal(back, volume)
        delta_bytes += size
        zstd_bytes += len(zstd.encode(volume.tobytes()))
    assert zstd_bytes / delta_bytes > 1.3


def test_lossless_floats_and_other_shapes_round_trip() -> None:
    rng = np.random.default_rng(0)
    codec = DeltaCodec()
    frames = np.cumsum(rng.normal(size=(5, 7, 3)), axis=0).astype(np.float32)
    frames[2, 0, 0] = np.nan  # bit patterns, not values: NaN survives too
    back, _ = _round_trip(codec, frames)
    assert np.array_equal(back.view(np.uint32), frames.view(np.uint32))
    for array in (np.arange(12, dtype=np.uint8).reshape(3, 4), np.array([[-5, 7]], dtype=np.int64)):
        assert np.array_equal(_round_trip(codec, array)[0], array)
    text = b"not an array"
    assert codec.decode(codec.encode(text)) == text  # non-array fields: plain zstd


@pytest.mark.parametrize("bound", [1, 2.5])
def test_error_bound_holds_for_every_value(volumes: tuple[np.ndarray, np.ndarray], bound: float) -> None:
    x, _ = volumes
    lossless, lossy = DeltaCodec(), get_codec(f"delta@{bound}")
    assert lossy.name == f"delta@{bound:g}"
    for volume in x:
        back, size = _round_trip(lossy, volume)  # type: ignore[arg-type]
        assert int(np.abs(back.astype(np.int64) - volume).max()) <= bound
        assert back.min() >= volume.min()  # stays in the original's range: counts never go negative
        assert size < _round_trip(lossless, volume)[1]
    floats = np.cumsum(np.random.default_rng(1).normal(size=(4, 50)), axis=0)
    back, _ = _round_trip(DeltaCodec(0.01), floats)
    assert float(np.abs(back - floats).max()) <= 0.01


def test_bad_bounds_and_unknown_codecs_are_refused() -> None:
    with pytest.raises(KaisokuError, match="error bound"):
        get_codec("delta@-1")
    with pytest.raises(KaisokuError, match="must be a number"):
        get_codec("delta@x")
    with pytest.raises(KaisokuError, match="unknown codec"):
        get_codec("zstd@3")
    assert "linear" in PREDICTORS


def test_packed_through_delta_and_read_back(tmp_path: Path, volumes: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = volumes
    source = tmp_path / "set.npz"
    np.savez(source, x_train=x, y_train=y)
    indexes = pack(source, tmp_path / "packed", codec="delta@1", workers=1, progress=False)
    index = read_index(tmp_path / "packed" / "train")
    assert index.codec == "delta@1" and index.task == "regression" and index.target == "y"
    assert indexes["train"].num_samples == len(x)
    dataset = ShardedDataset(tmp_path / "packed" / "train")
    order = {y_row.tobytes(): i for i, y_row in enumerate(y)}
    for k in range(len(dataset)):
        sample = dataset[k]
        i = order[sample["y"].tobytes()]  # targets are stored exactly (a 1-D field: plain zstd)
        assert int(np.abs(sample["x"].astype(np.int64) - x[i]).max()) <= 1


def test_pack_cli_checks_error_bound_needs_delta(
    tmp_path: Path, volumes: tuple[np.ndarray, np.ndarray]
) -> None:
    x, y = volumes
    np.savez(tmp_path / "set.npz", x_train=x[:2], y_train=y[:2])
    result = subprocess.run(
        [sys.executable, "-m", "kaisoku", "pack", str(tmp_path / "set.npz"), str(tmp_path / "out"),
         "--codec", "zstd", "--error-bound", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "--error-bound needs --codec delta" in result.stderr
