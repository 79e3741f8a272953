"""The synthetic universe generator: determinism, statistics, the Poisson quantile, the loader transform."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.cosmo import (
    VolumeTargetTransform,
    ensure_cosmo_dataset,
    gaussian_field,
    generate_cosmo,
    make_universe,
    physical,
    poisson_quantile,
    universe_sample,
)
from kaisoku.errors import KaisokuError


def test_samples_are_keyed_by_seed_split_and_index() -> None:
    a, ta = universe_sample(0, "train", 5, 8)
    b, tb = universe_sample(0, "train", 5, 8)
    assert a.dtype == np.int16 and a.shape == (4, 8, 8, 8)
    assert np.array_equal(a, b) and np.array_equal(ta, tb)
    c, _ = universe_sample(0, "train", 6, 8)
    d, _ = universe_sample(0, "val", 5, 8)
    e, _ = universe_sample(1, "train", 5, 8)
    assert not np.array_equal(a, c) and not np.array_equal(a, d) and not np.array_equal(a, e)
    assert ta.dtype == np.float32 and bool((np.abs(ta) <= 1).all())


def test_gaussian_field_has_unit_variance_and_its_slope() -> None:
    rng = np.random.default_rng(0)
    for slope in (1.0, 3.0):
        g = gaussian_field(32, slope, rng)
        assert abs(g.mean()) < 1e-9 and abs(g.std() - 1) < 1e-9
    # Steeper spectra put more power on large scales: neighbours are more alike.
    smooth = gaussian_field(32, 3.0, np.random.default_rng(1))
    rough = gaussian_field(32, 1.0, np.random.default_rng(1))
    corr = [float(np.corrcoef(f[:-1].ravel(), f[1:].ravel())[0, 1]) for f in (smooth, rough)]
    assert corr[0] > corr[1] + 0.2


def test_poisson_quantile_is_exact() -> None:
    rng = np.random.default_rng(0)
    rate = rng.uniform(0.1, 40, 20000)
    u = rng.uniform(0, 1, rate.shape)
    k = poisson_quantile(rate, u)
    assert k.dtype == np.float64 and bool((k >= 0).all())
    # Poisson(rate) draws: mean and variance both near the rate.
    assert abs((k - rate).mean()) < 0.15
    assert abs(((k - rate) ** 2).mean() / rate.mean() - 1) < 0.05
    # A larger u never gives a smaller count (the channels share their uniforms).
    assert bool((poisson_quantile(rate, np.minimum(u + 0.1, 1 - 1e-9)) >= k).all())


def test_universe_statistics_follow_the_targets() -> None:
    low = np.array([0, 0, -1, -1], dtype=np.float32)  # nbar 2, growth 0.5
    high = np.array([0, 0, 1, 1], dtype=np.float32)  # nbar 8, growth 0.9
    a = make_universe(low, 16, np.random.default_rng(0))
    b = make_universe(high, 16, np.random.default_rng(0))
    assert abs(a.mean() - physical(low)["nbar"]) < 0.5
    assert abs(b.mean() - physical(high)["nbar"]) < 1.5
    # Later channels (larger growth factor) are more clustered; more so for a small growth ratio.
    spread = [np.log1p(a[c]).std() for c in range(4)]
    assert spread == sorted(spread)
    # Channels rise and fall together (shared uniforms): strongly correlated counts.
    assert float(np.corrcoef(b[2].ravel(), b[3].ravel())[0, 1]) > 0.9


def test_generate_writes_npz_and_manifest(tmp_path: Path) -> None:
    path = generate_cosmo(tmp_path / "set", count=3, size=8, val_count=2, workers=1)
    with np.load(path) as archive:
        assert archive["x_train"].shape == (3, 4, 8, 8, 8) and archive["x_train"].dtype == np.int16
        assert archive["y_val"].shape == (2, 4) and archive["y_val"].dtype == np.float32
        x0, y0 = universe_sample(0, "train", 0, 8)
        assert np.array_equal(archive["x_train"][0], x0) and np.array_equal(archive["y_train"][0], y0)
    assert '"task": "regression"' in (tmp_path / "set" / "manifest.json").read_text()
    with pytest.raises(KaisokuError, match="power of two"):
        generate_cosmo(tmp_path / "bad", count=3, size=12)


def test_transform_applies_log1p_and_keyed_flips() -> None:
    x, y = universe_sample(0, "train", 0, 8)
    sample = {"x": x, "y": y}
    evaluation = VolumeTargetTransform(train=False)
    volume, target = evaluation(sample, index=0, epoch=0)
    assert volume.dtype == np.float32 and np.allclose(volume, np.log1p(x.astype(np.float32)))
    assert np.array_equal(target, y)
    train = VolumeTargetTransform(seed=1, train=True)
    first = train(sample, index=7, epoch=2)[0]
    assert np.array_equal(first, train(sample, index=7, epoch=2)[0])  # keyed, repeatable
    flipped = [not np.array_equal(train(sample, index=i, epoch=0)[0], volume) for i in range(64)]
    assert any(flipped) and not all(flipped)  # each axis flipped with probability 1/2
    assert np.isclose(first.sum(), volume.sum())  # a flip moves voxels, never changes them


def test_ensure_cosmo_dataset_says_what_and_where_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    packed = ensure_cosmo_dataset(tmp_path, count=4, size=8)
    said = capsys.readouterr().out.splitlines()
    assert (
        len(said) == 1 and "generating the CosmoFlow demo set once (4 training universes of 4x8^3" in said[0]
    )
    assert f"into {packed.parent};" in said[0], said
    assert (packed / "train" / "index.json").is_file()
    assert ensure_cosmo_dataset(tmp_path, count=4, size=8) == packed
    assert capsys.readouterr().out == ""
