"""The multi-rank harness itself: real gloo collectives, failures reported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks


def _all_reduce_rank(rank: int, world_size: int, tmp: Path) -> float:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return float(value.item())


def _fail_on_rank_one(rank: int, world_size: int, tmp: Path) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")


def test_all_reduce_sums_over_ranks(tmp_path: Path) -> None:
    assert run_ranks(_all_reduce_rank, 2, tmp_path) == [3.0, 3.0]


def test_failure_names_rank_and_error(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="boom on rank one"):
        run_ranks(_fail_on_rank_one, 2, tmp_path, timeout=60)
