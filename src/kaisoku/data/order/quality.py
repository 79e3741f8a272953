"""Shuffle quality: how well a sample order mixes shards within each batch.

The metric (reported with every run and benchmark row)::

    quality = mean_b H(b) / E[H]

    H(b)  = -sum_s p_bs * ln(p_bs),  p_bs = (samples of batch b from shard s) / batch_size
    E[H]  = expected H of a batch drawn uniformly at random without replacement from the whole dataset
          = ln(B) - (1/B) * sum_s E[C_s ln C_s],  C_s ~ Hypergeometric(N, n_s, B)

with ``B`` the batch size, ``N`` the sample count and ``n_s`` the size of shard ``s``. The mean runs over
the order's whole batches. A uniform (global) shuffle scores about 1; reading shards in file order scores
about 0 (only batches that straddle a shard boundary have any entropy); the block shuffle lands in
between, rising with the number of shards per block. Orders that spread every batch over more shards than
chance does (e.g. round-robin over shards) can score slightly above 1.

What it measures is the mixing inside each batch, which is what a gradient step (and BatchNorm) sees.
For ``partial`` evaluate it on a node's batches: with few shards per node and a small exchange fraction a
node's batches draw from fewer shards and score below 1; with many shards per node they score near 1 even
at Q = 0, whose remaining cost is that a node sees only its own partition across epochs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kaisoku.data.order.shuffle import as_shard_sizes, shard_of
from kaisoku.errors import KaisokuError


def batch_entropies(order: np.ndarray, shard_sizes: Any, batch_size: int) -> np.ndarray:
    """``H(b)`` (natural log) of the shard composition of each whole batch of ``order``."""
    sizes = as_shard_sizes(shard_sizes)
    if batch_size < 1:
        raise KaisokuError(f"batch size must be >= 1, got {batch_size}")
    num_batches = len(order) // batch_size
    if num_batches == 0:
        raise KaisokuError(f"the order has {len(order)} samples, fewer than one batch of {batch_size}")
    shards = shard_of(np.asarray(order[: num_batches * batch_size]), sizes)
    batch_ids = np.repeat(np.arange(num_batches, dtype=np.int64), batch_size)
    pairs, counts = np.unique(batch_ids * sizes.size + shards, return_counts=True)
    counts = counts.astype(np.float64)
    # H = ln B - (1/B) * sum_s c_s ln c_s for counts c_s of one batch.
    c_log_c = np.bincount(pairs // sizes.size, weights=counts * np.log(counts), minlength=num_batches)
    return math.log(batch_size) - c_log_c / batch_size


def expected_random_entropy(shard_sizes: Any, batch_size: int) -> float:
    """``E[H]`` for a batch drawn uniformly at random without replacement (exact, hypergeometric)."""
    sizes = as_shard_sizes(shard_sizes)
    total = int(sizes.sum())
    if not 1 <= batch_size <= total:
        raise KaisokuError(f"batch size {batch_size} must be between 1 and the sample count {total}")
    lgamma = np.vectorize(math.lgamma, otypes=[np.float64])

    def log_choose(n: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
        n_arr = np.asarray(n, dtype=np.float64)
        k_arr = np.asarray(k, dtype=np.float64)
        return lgamma(n_arr + 1) - lgamma(k_arr + 1) - lgamma(n_arr - k_arr + 1)

    expected_c_log_c = 0.0
    unique_sizes, multiplicity = np.unique(sizes[sizes > 0], return_counts=True)
    for n_s, times in zip(unique_sizes.tolist(), multiplicity.tolist()):
        k = np.arange(max(1, batch_size - (total - n_s)), min(batch_size, n_s) + 1)
        if k.size == 0:
            continue
        log_p = log_choose(n_s, k) + log_choose(total - n_s, batch_size - k) - log_choose(total, batch_size)
        expected_c_log_c += times * float(np.sum(np.exp(log_p) * k * np.log(k)))
    return math.log(batch_size) - expected_c_log_c / batch_size


def shuffle_quality(order: np.ndarray, shard_sizes: Any, batch_size: int) -> float:
    """The shuffle-quality score ``mean_b H(b) / E[H]`` of ``order`` (see the module docstring).

    A dataset of one shard has nothing to mix; every order then scores 1.
    """
    expected = expected_random_entropy(shard_sizes, batch_size)
    if expected <= 1e-12:
        return 1.0
    return float(np.mean(batch_entropies(order, shard_sizes, batch_size)) / expected)
