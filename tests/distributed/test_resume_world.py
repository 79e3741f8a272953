"""Resume mid-epoch on another world size with real ranks: no sample lost, none repeated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from kaisoku.data.order.sampler import EpochSampler
from kaisoku.data.order.shuffle import ShuffleSpec
from tests.dist_harness import run_ranks

SIZES = np.array([30, 25, 33, 28, 31, 27, 29, 26, 35, 22], dtype=np.int64)
BATCH = 24
SPECS = {
    "global": ShuffleSpec(name="global"),
    "block": ShuffleSpec(name="block", block_shards=3, buffer_size=12),
    "partial": ShuffleSpec(name="partial", exchange=0.25, num_nodes=2),
}


def _run_part(rank: int, world_size: int, tmp: Path, states: dict | None, steps: int | None) -> dict:
    """Each shuffle: load ``states`` (if any), consume ``steps`` batches (None: the rest), save the state."""
    out: dict = {}
    for name, spec in SPECS.items():
        sampler = EpochSampler(
            SIZES, global_batch=BATCH, rank=rank, world_size=world_size, seed=21, shuffle=spec
        )
        if states is not None:
            sampler.load_state_dict(states[name])
        sampler.set_epoch(sampler.epoch)
        consumed: list[int] = []
        for count, batch in enumerate(sampler):
            consumed.extend(batch)
            if steps is not None and count + 1 == steps:
                break
        # Every rank must agree on the state, and no two ranks may have read the same sample.
        gathered: list[list[int] | None] = [None] * world_size
        dist.all_gather_object(gathered, consumed)
        everyone = [i for part in gathered for i in part]
        assert len(everyone) == len(set(everyone)), "two ranks read the same sample"
        state = sampler.state_dict()
        states_seen: list[dict | None] = [None] * world_size
        dist.all_gather_object(states_seen, state)
        assert all(s == state for s in states_seen)
        out[name] = {"consumed": everyone, "state": state}
    return out


def _resume(tmp_path: Path, old: int, new: int) -> None:
    first = run_ranks(_run_part, old, tmp_path / "before", None, 3, timeout=100)[0]
    states = {name: first[name]["state"] for name in SPECS}
    second = run_ranks(_run_part, new, tmp_path / "after", states, None, timeout=100)[0]
    for name, spec in SPECS.items():
        reference = EpochSampler(SIZES, global_batch=BATCH, rank=0, world_size=old, seed=21, shuffle=spec)
        expected = reference.epoch_order(0).tolist()
        consumed = first[name]["consumed"] + second[name]["consumed"]
        assert first[name]["state"]["position"] == 3 * BATCH
        assert sorted(consumed) == sorted(expected), f"{name}: samples lost or repeated"
        assert second[name]["state"]["world_size"] == new


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_two_ranks_on_four(tmp_path: Path) -> None:
    _resume(tmp_path, 2, 4)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_four_ranks_on_two(tmp_path: Path) -> None:
    _resume(tmp_path, 4, 2)
