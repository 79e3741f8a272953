"""A synthetic universe set for CosmoFlow: 4-channel count volumes whose parameters a 3D CNN can learn.

For each sample four parameters are drawn uniformly and stored scaled to [-1, 1] (:data:`PARAMETERS`):
the amplitude ``sigma`` of the log-density, the spectral slope ``n`` of its power spectrum, the mean count
per voxel ``nbar`` and the growth ratio ``gamma`` between consecutive channels. A Gaussian random field with
power spectrum ``P(k) ∝ k^-n`` is made by filtering white noise in Fourier space and normalised to unit
variance; channel ``c`` (the four redshifts, earliest first) is the lognormal density
``exp(s_c g - s_c² / 2)`` with ``s_c = sigma * gamma**(3 - c)`` (growth factors as the redshifts' are),
and its counts are Poisson draws of mean ``nbar * density``. The four channels share their uniform variates
(one per voxel, through the Poisson quantile function), so each channel is exactly Poisson but a voxel's
counts rise and fall together over time, as the same matter's do. Volumes are int16 ``[4, D, D, D]``.

Every sample is a pure function of ``(seed, split, index)``. :func:`generate_cosmo` writes
``DIR/cosmo.npz`` (``x_train``/``y_train``/``x_val``/``y_val``), which ``kaisoku pack`` turns into a tensor
field ``x`` and a float target field ``y`` (the index then says ``task: regression``).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaisoku.data.loading.transforms import KeyedRandom
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_text
from kaisoku.units import format_bytes

PARAMETERS: dict[str, tuple[float, float]] = {
    "sigma": (0.6, 1.2),
    "slope": (1.0, 3.0),
    "nbar": (2.0, 8.0),
    "growth": (0.5, 0.9),
}
"""The four targets and their physical ranges; stored as ``2 * (v - low) / (high - low) - 1`` in [-1, 1]."""

CHANNELS = 4
"""Channels per volume (growth factors, as the four redshifts of the reference data)."""

NPZ_NAME = "cosmo.npz"
"""File name of the arrays :func:`generate_cosmo` writes."""

GENERATOR_VERSION = 1
"""Bumped whenever the generator's output changes."""

_SPLIT_KEYS = {"train": 0, "val": 1}


def physical(targets: np.ndarray) -> dict[str, float]:
    """The physical parameter values of scaled ``targets`` (4 values in [-1, 1])."""
    return {
        name: low + (float(t) + 1.0) * (high - low) / 2.0
        for (name, (low, high)), t in zip(PARAMETERS.items(), targets)
    }


def gaussian_field(size: int, slope: float, rng: np.random.Generator) -> np.ndarray:
    """A unit-variance Gaussian random field on a ``size``³ periodic grid with ``P(k) ∝ k^-slope``."""
    noise = rng.standard_normal((size, size, size))
    k = np.fft.fftfreq(size) * size
    kz = np.fft.rfftfreq(size) * size
    k2 = k[:, None, None] ** 2 + k[None, :, None] ** 2 + kz[None, None, :] ** 2
    k2[0, 0, 0] = 1.0
    amplitude = k2 ** (-slope / 4.0)  # sqrt(P(k)) with |k| = sqrt(k2)
    amplitude[0, 0, 0] = 0.0  # no mean mode
    field = np.fft.irfftn(np.fft.rfftn(noise) * amplitude, s=noise.shape, axes=(0, 1, 2))
    return (field - field.mean()) / max(float(field.std()), 1e-12)


def poisson_quantile(rate: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The smallest ``k`` with ``P(Poisson(rate) <= k) >= u``, elementwise (exact, vectorised).

    A Cornish-Fisher guess (off by one in a few percent of cases) is corrected step by step with the
    regularised incomplete gamma function (``P(N <= k) = Q(k + 1, rate)``); a few passes suffice.
    """
    lam = np.asarray(rate, dtype=np.float64).ravel()
    uu = np.asarray(u, dtype=np.float64).ravel()
    z = torch.special.ndtri(torch.from_numpy(np.clip(uu, 1e-12, 1 - 1e-12))).numpy()
    k = np.maximum(np.floor(lam + np.sqrt(lam) * z + (z * z - 1) / 6 + 0.5), 0.0)  # Cornish-Fisher
    active = np.arange(k.size)
    for _ in range(64):  # a value that did not move is the quantile; only moved ones are checked again
        ka, la, ua = k[active], lam[active], uu[active]
        up = _gammaincc(ka + 1, la) < ua
        down = (ka > 0) & (_gammaincc(ka, la) >= ua)
        moved = up | down
        if not moved.any():
            break
        k[active] = ka + up - down
        active = active[moved]
    return k.reshape(np.shape(rate))


def _gammaincc(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The regularised upper incomplete gamma function ``Q(a, x)`` (torch's, on numpy arrays)."""
    return torch.special.gammaincc(torch.from_numpy(a), torch.from_numpy(x)).numpy()


def draw_targets(rng: np.random.Generator) -> np.ndarray:
    """Four scaled targets, uniform in [-1, 1] (float32)."""
    return rng.uniform(-1.0, 1.0, CHANNELS).astype(np.float32)


def make_universe(targets: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """The int16 ``[4, size, size, size]`` count volume of scaled ``targets``."""
    p = physical(targets)
    g = gaussian_field(size, p["slope"], rng)
    u = rng.uniform(0.0, 1.0, g.shape)
    out = np.empty((CHANNELS, size, size, size), dtype=np.int16)
    for c in range(CHANNELS):
        s = p["sigma"] * p["growth"] ** (CHANNELS - 1 - c)
        rate = p["nbar"] * np.exp(s * g - s * s / 2.0)
        counts = poisson_quantile(rate, u)
        out[c] = np.clip(counts, 0, np.iinfo(np.int16).max).astype(np.int16)
    return out


def sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of sample ``index`` of ``split``: a pure function of the three."""
    return np.random.Generator(np.random.PCG64([seed, _SPLIT_KEYS.get(split, 2), index, GENERATOR_VERSION]))


def universe_sample(seed: int, split: str, index: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(int16 volume [4, size, size, size], float32 targets [4])`` of one sample."""
    rng = sample_rng(seed, split, index)
    targets = draw_targets(rng)
    return make_universe(targets, size, rng), targets


def universe_arrays(
    count: int, size: int, *, seed: int = 0, split: str = "train", start: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``start .. start + count - 1`` of ``split`` as stacked arrays ``(x, y)``."""
    x = np.empty((count, CHANNELS, size, size, size), dtype=np.int16)
    y = np.empty((count, CHANNELS), dtype=np.float32)
    for i in range(count):
        x[i], y[i] = universe_sample(seed, split, start + i, size)
    return x, y


def _split_arrays(args: tuple[int, int, int, str, int]) -> tuple[np.ndarray, np.ndarray]:
    count, size, seed, split, start = args
    torch.set_num_threads(1)
    return universe_arrays(count, size, seed=seed, split=split, start=start)


def generate_cosmo(
    root: str | os.PathLike[str],
    *,
    count: int,
    size: int = 32,
    val_count: int | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write ``root/cosmo.npz`` with ``count`` training and ``val_count`` validation universes.

    ``val_count`` defaults to ``max(16, count // 8)``. The folder is built beside ``root`` and renamed into
    place when complete. Returns the path of the ``.npz``.
    """
    root = Path(root).expanduser()
    if count < 1:
        raise KaisokuError(f"datagen: --count must be >= 1, got {count}")
    if size < 2 or size & (size - 1):
        raise KaisokuError(f"datagen --kind cosmo: --size {size} must be a power of two >= 2 (e.g. 32)")
    val_count = max(16, count // 8) if val_count is None else val_count
    if root.exists() and any(root.iterdir()):
        raise KaisokuError(f"datagen: {root} is not empty; choose a new folder or delete it")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    arrays: dict[str, np.ndarray] = {}
    chunk = 64
    for split, total in (("train", count), ("val", val_count)):
        jobs = [(min(chunk, total - s), size, seed, split, s) for s in range(0, total, chunk)]
        parts = list(_map(jobs, workers, progress))
        arrays[f"x_{split}"] = np.concatenate([p[0] for p in parts]) if parts else np.empty(0)
        arrays[f"y_{split}"] = np.concatenate([p[1] for p in parts]) if parts else np.empty(0)
    np.savez(staging / NPZ_NAME, **arrays)
    manifest: dict[str, Any] = {
        "kind": "cosmo",
        "task": "regression",
        "targets": list(PARAMETERS),
        "ranges": {k: list(v) for k, v in PARAMETERS.items()},
        "train": count,
        "val": val_count,
        "size": size,
        "seed": seed,
        "generator_version": GENERATOR_VERSION,
    }
    atomic_write_text(staging / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    if root.exists():
        root.rmdir()
    os.replace(staging, root)
    return root / NPZ_NAME


def _map(
    jobs: list[tuple[int, int, int, str, int]],
    workers: int | None,
    progress: Callable[[int], None] | None,
) -> Any:
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            part = _split_arrays(job)
            if progress:
                progress(job[0])
            yield part
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers) as pool:
        for job, part in zip(jobs, pool.map(_split_arrays, jobs)):
            if progress:
                progress(job[0])
            yield part


# ---------------------------------------------------------------------------------------------
# The loader side: log1p volumes and float targets
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class VolumeTargetTransform:
    """``sample -> (float32 log1p volume [C, D, D, D], float32 targets)``, flipped by ``(seed, epoch, index)``.

    Training (``train``) flips each spatial axis with probability 1/2, keyed by the sample's key alone
    (the statistics of a universe do not change under reflection); evaluation applies no randomness.
    """

    seed: int = 0
    """Run seed; with the epoch and the sample index it keys the flips."""
    train: bool = True
    """Random axis flips (training) or none (evaluation)."""
    volume_field: str = "x"
    """Field holding the volume."""
    target_field: str = "y"
    """Field holding the float targets."""

    def _flips(self, epoch: int, index: int) -> tuple[slice, ...]:
        if not self.train:
            return (slice(None),) * 3
        rng = KeyedRandom(self.seed, epoch, index)
        return tuple(slice(None, None, -1) if rng.integers(0, 2) else slice(None) for _ in range(3))

    def __call__(self, sample: dict[str, Any], *, index: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The log1p volume and the targets of ``sample``."""
        volume = np.asarray(sample[self.volume_field])
        out = np.empty(volume.shape, dtype=np.float32)
        return out, self.into(sample, index=index, epoch=epoch, out=out)

    def into(self, sample: dict[str, Any], *, index: int, epoch: int, out: np.ndarray) -> np.ndarray:
        """Write ``log1p`` of the (flipped) volume into ``out`` (float32); return the targets."""
        volume = np.asarray(sample[self.volume_field])
        if out.shape != volume.shape:
            raise KaisokuError(f"volume is {volume.shape}, the batch slot given is {tuple(out.shape)}")
        flipped = volume[(slice(None), *self._flips(epoch, index))]
        if flipped.dtype == np.int16:
            # A table of log1p over every int16 value: one gather, several times faster than computing it.
            np.take(_log1p_table(), flipped.view(np.uint16), out=out)
        else:
            np.log1p(flipped, out=out, dtype=np.float32)
        return np.asarray(sample[self.target_field], dtype=np.float32)


@functools.lru_cache(maxsize=1)
def _log1p_table() -> np.ndarray:
    """float32 ``log1p(v)`` for every int16 ``v``, indexed by its uint16 bit pattern (NaN below -1)."""
    values = np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log1p(values)


def _volume_bytes(count: int, size: int) -> int:
    """Bytes of the demo set's int16 volumes, training and validation (the default eighth): its raw .npz."""
    return (count + max(16, count // 8)) * 4 * size**3 * 2


def ensure_cosmo_dataset(
    cache_dir: str | os.PathLike[str],
    *,
    count: int = 1024,
    size: int = 32,
    seed: int = 0,
    codec: str = "zstd",
) -> Path:
    """The packed universe set under ``cache_dir`` (train/ and val/), generated and packed on first use.

    Safe when several ranks ask at once (a file lock); what ``cosmoflow-cpu`` trains on when no
    ``data.path`` is given.
    """
    # start-up: packing and the generator load only when the set must be made
    from kaisoku.data.datagen import _locked
    from kaisoku.data.shards.writer import pack

    cache = Path(cache_dir).expanduser()
    root = cache / f"cosmo-v{GENERATOR_VERSION}-{count}-{size}cubed-seed{seed}"
    packed = root / f"packed-{codec.replace('@', '-')}"
    with _locked(cache / ".datagen.lock"):
        if not (packed / "train" / "index.json").is_file():
            print(
                f"kaisoku: generating the CosmoFlow demo set once ({count:,} training universes of "
                f"4x{size}^3: {format_bytes(_volume_bytes(count, size))} of volumes, then packed) "
                f"into {root}; later runs reuse it",
                flush=True,
            )
            if not (root / "raw" / NPZ_NAME).is_file():
                shutil.rmtree(root / "raw", ignore_errors=True)
                generate_cosmo(root / "raw", count=count, size=size, seed=seed)
            pack(root / "raw" / NPZ_NAME, packed, codec=codec, overwrite=True, progress=False, seed=seed)
    return packed
