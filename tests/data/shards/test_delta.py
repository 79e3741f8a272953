"""The delta codec: lossless and error-bounded round trips (absolute and log1p), bias, ratio, packing."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kaisoku.cli import cmd_pack
from kaisoku.data.cosmo import universe_arrays
from kaisoku.data.loading.dataset import ShardedDataset
from kaisoku.data.shards.codecs import get_codec
from kaisoku.data.shards.delta import PREDICTORS, DeltaCodec, delta_codec_name, parse_delta
from kaisoku.data.shards.format import read_index
from kaisoku.data.shards.writer import pack
from kaisoku.errors import ConfigError, KaisokuError


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
    errors = []
    for volume in x:
        back, size = _round_trip(lossy, volume)  # type: ignore[arg-type]
        assert int(np.abs(back.astype(np.int64) - volume).max()) <= bound
        assert back.min() >= volume.min()  # stays in the original's range: counts never go negative
        assert size < _round_trip(lossless, volume)[1]
        errors.append(back.astype(np.float64) - volume)
    error = np.concatenate([e.ravel() for e in errors])
    assert abs(float(error.mean())) < 0.05 * bound < float(np.abs(error).mean())  # symmetric: no drift
    floats = np.cumsum(np.random.default_rng(1).normal(size=(4, 50)), axis=0)
    back, _ = _round_trip(DeltaCodec(0.01), floats)
    assert float(np.abs(back - floats).max()) <= 0.01


@pytest.mark.parametrize("bound", [0.05, 0.2])
def test_log1p_bound_holds_for_every_value_without_bias(
    volumes: tuple[np.ndarray, np.ndarray], bound: float
) -> None:
    x, _ = volumes
    codec = get_codec(f"delta@log1p:{bound}")
    assert codec.name == delta_codec_name(bound, "log1p") and parse_delta(f"log1p:{bound}") == (
        bound,
        "log1p",
    )
    lossless = DeltaCodec()
    errors, stored, exact = [], 0, 0
    for volume in x:
        back, size = _round_trip(codec, volume)  # type: ignore[arg-type]
        error = np.log1p(back.astype(np.float64)) - np.log1p(volume.astype(np.float64))
        assert float(np.abs(error).max()) <= bound  # every value, in the domain the model sees
        small = volume <= 1  # neighbours further apart than the bound: kept exactly
        assert np.array_equal(back[small], volume[small])
        errors.append(error.ravel())
        stored += size
        exact += _round_trip(lossless, volume)[1]
    error = np.concatenate(errors)
    assert float(np.abs(error).max()) > bound / 2  # it did quantise
    assert abs(float(error.mean())) < 0.12 * bound  # no systematic shift of what the model sees
    assert stored < exact


def test_lossless_payload_without_value_range_still_decodes(volumes: tuple[np.ndarray, np.ndarray]) -> None:
    volume = volumes[0][0]
    codec = DeltaCodec()
    stored = codec.encode_array(volume.tobytes(), volume.dtype.str, volume.shape)
    (size,) = struct.unpack_from("<I", stored, 1)
    header = json.loads(stored[5 : 5 + size])
    del header["range"]  # payloads written before the prediction tables: predicted value by value
    meta = json.dumps(header).encode()
    older = stored[:1] + struct.pack("<I", len(meta)) + meta + stored[5 + size :]
    back = np.frombuffer(codec.decode(older), dtype=volume.dtype).reshape(volume.shape)
    assert np.array_equal(back, volume)


def test_log1p_mode_is_checked_once(tmp_path: Path, volumes: tuple[np.ndarray, np.ndarray]) -> None:
    with pytest.raises(KaisokuError, match="unknown error mode"):
        get_codec("delta@rel:0.1")
    with pytest.raises(KaisokuError, match="needs an error bound"):
        delta_codec_name(0, "log1p")
    signed = np.array([[-3, 4], [5, 6]], dtype=np.int16)
    with pytest.raises(KaisokuError, match="non-negative integer"):
        get_codec("delta@log1p:0.1").encode_array(signed.tobytes(), signed.dtype.str, signed.shape)  # type: ignore[attr-defined]
    x, y = volumes
    np.savez(tmp_path / "set.npz", x_train=x[:2], y_train=y[:2])
    args = [str(tmp_path / "set.npz"), str(tmp_path / "out"), "--codec", "delta", "--workers", "1"]
    assert cmd_pack([*args, "--error-bound", "0.1", "--error-mode", "log1p"]) == 0
    assert read_index(tmp_path / "out" / "train").codec == "delta@log1p:0.1"
    with pytest.raises(ConfigError, match="needs --codec delta"):
        cmd_pack([*args[:2], "--codec", "zstd", "--error-mode", "log1p"])


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
