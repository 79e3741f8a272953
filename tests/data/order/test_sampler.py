"""A rank's batches and exact resume, on the same or another world size (pure, no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from kaisoku.data.order.sampler import EpochSampler, KeyedMicroBatches, rank_batches
from kaisoku.data.order.shuffle import ShuffleSpec
from kaisoku.errors import KaisokuError

SIZES = np.array([30, 25, 33, 28, 31, 27, 29, 26], dtype=np.int64)
BATCH = 24


def _samplers(world: int, spec: ShuffleSpec | None = None, seed: int = 11) -> list[EpochSampler]:
    return [
        EpochSampler(SIZES, global_batch=BATCH, rank=r, world_size=world, seed=seed, shuffle=spec)
        for r in range(world)
    ]


def _take(samplers: list[EpochSampler], steps: int | None) -> list[list[int]]:
    """Advance every rank by ``steps`` batches (all when None); return the global batches seen."""
    iterators = [iter(s) for s in samplers]
    seen: list[list[int]] = []
    count = 0
    while steps is None or count < steps:
        batches = [next(it, None) for it in iterators]
        if batches[0] is None:
            assert all(b is None for b in batches)  # same number of batches on every rank
            break
        seen.append([i for b in batches for i in b])
        count += 1
    return seen


def test_rank_batches_slice_each_global_batch() -> None:
    order = np.arange(48)
    assert rank_batches(order, 24, 1, 4).tolist() == [[6, 7, 8, 9, 10, 11], [30, 31, 32, 33, 34, 35]]
    assert rank_batches(order, 24, 0, 2, start_step=1).tolist() == [list(range(24, 36))]


def test_epoch_covers_order_once_with_equal_batches() -> None:
    samplers = _samplers(4)
    seen = _take(samplers, None)
    order = samplers[0].epoch_order(0)
    assert [i for batch in seen for i in batch] == order.tolist()
    assert len(seen) == sum(SIZES) // BATCH
    assert all(len(s) == 0 for s in samplers)


def test_epochs_differ_and_are_reproducible() -> None:
    sampler = _samplers(1)[0]
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    again = _samplers(1)[0]
    again.set_epoch(1)
    assert list(again) == second


@pytest.mark.parametrize("spec", [None, ShuffleSpec(name="block", block_shards=2, buffer_size=10)])
def test_resume_mid_epoch_same_world_is_exact(spec: ShuffleSpec | None) -> None:
    reference = _take(_samplers(2, spec), None)
    before = _samplers(2, spec)
    done = _take(before, 3)
    state = before[0].state_dict()
    assert state == before[1].state_dict()
    assert state["position"] == 3 * BATCH
    after = _samplers(2, spec)
    for sampler in after:
        sampler.load_state_dict(state)
        sampler.set_epoch(state["epoch"])  # the training loop's call must not rewind a resumed epoch
    assert done + _take(after, None) == reference


@pytest.mark.parametrize(("old", "new"), [(2, 4), (4, 2), (3, 1)])
def test_resume_on_another_world_loses_and_repeats_nothing(old: int, new: int) -> None:
    before = _samplers(old)
    done = _take(before, 4)
    after = _samplers(new)
    for sampler in after:
        sampler.load_state_dict(before[0].state_dict())
    rest = _take(after, None)
    consumed = [i for batch in done + rest for i in batch]
    assert sorted(consumed) == sorted(before[0].epoch_order(0).tolist())
    assert len(consumed) == len(set(consumed))
    # The global batch is fixed, so even each remaining step has the same samples as without the change.
    reference = _take(_samplers(new), None)
    assert [sorted(b) for b in rest] == [sorted(b) for b in reference[4:]]


def test_partial_resume_with_more_ranks_per_node_keeps_the_order() -> None:
    spec = ShuffleSpec(name="partial", exchange=0.4, num_nodes=2)
    before = _samplers(2, spec)
    done = _take(before, 2)
    after = _samplers(4, spec)
    for sampler in after:
        sampler.load_state_dict(before[0].state_dict())
        assert sampler.layout_matches(0)
    assert done + _take(after, None) == _take(_samplers(2, spec), None)


def test_partial_resume_on_another_node_count_finishes_the_saved_epoch() -> None:
    two_nodes = ShuffleSpec(name="partial", exchange=0.4, num_nodes=2)
    before = _samplers(2, two_nodes)
    done = _take(before, 2)
    one_node = ShuffleSpec(name="partial", exchange=0.4, num_nodes=1)
    after = _samplers(2, one_node)
    for sampler in after:
        sampler.load_state_dict(before[0].state_dict())
    assert not after[0].layout_matches(0)
    assert done + _take(after, None) == _take(_samplers(2, two_nodes), None)
    after[0].set_epoch(1)
    assert after[0].layout_matches(1) and after[0].spec_for(1) == one_node


def test_state_dict_at_the_step_training_reached() -> None:
    sampler = _samplers(2)[0]
    iterator = iter(sampler)
    for _ in range(5):  # a loader prefetching ahead of training
        next(iterator)
    state = sampler.state_dict(steps_done=3)
    assert state["position"] == 3 * BATCH
    with pytest.raises(KaisokuError, match="outside epoch"):
        sampler.state_dict(steps_done=1000)


def test_mismatched_state_explains_what_to_do() -> None:
    state = _samplers(2)[0].state_dict()
    other_seed = _samplers(2, seed=12)[0]
    with pytest.raises(KaisokuError, match="set train.seed=11 to resume"):
        other_seed.load_state_dict(state)
    other_data = EpochSampler(SIZES[:-1], global_batch=BATCH, rank=0, world_size=2, seed=11)
    with pytest.raises(KaisokuError, match="same packed dataset"):
        other_data.load_state_dict(state)
    moved = dict(state, position=BATCH)
    other_batch = EpochSampler(SIZES, global_batch=2 * BATCH, rank=0, world_size=2, seed=11)
    with pytest.raises(KaisokuError, match=f"data.global_batch={BATCH}"):
        other_batch.load_state_dict(moved)
    with pytest.raises(KaisokuError, match="version"):
        other_seed.load_state_dict(dict(state, version=99))


def test_world_that_cannot_split_the_batch_is_refused() -> None:
    with pytest.raises(KaisokuError, match="not a multiple of the world size 5"):
        EpochSampler(SIZES, global_batch=BATCH, rank=0, world_size=5, seed=0)
    with pytest.raises(KaisokuError, match="node count"):
        EpochSampler(
            SIZES,
            global_batch=BATCH,
            rank=0,
            world_size=4,
            seed=0,
            shuffle=ShuffleSpec(name="partial", num_nodes=3),
        )


# ------------------------------------------------------------------ the image-folder path (one "shard")


def _folder_sampler(num: int, batch: int, rank: int, world: int, seed: int, accum: int = 1) -> EpochSampler:
    return EpochSampler(
        [num],
        global_batch=batch,
        rank=rank,
        world_size=world,
        seed=seed,
        shuffle=ShuffleSpec(unpacked=True),
        micro_batches=accum,
    )


def _folder_steps(num: int, batch: int, world: int, epoch: int, accum: int = 1) -> list[list[int]]:
    """For each optimizer step, the union of all ranks' sample indices, in rank order."""
    per_rank = []
    for rank in range(world):
        sampler = _folder_sampler(num, batch, rank, world, seed=7, accum=accum)
        sampler.set_epoch(epoch, 0)
        micro = list(KeyedMicroBatches(sampler))
        per_rank.append(
            [sum((m for m in micro[s * accum : (s + 1) * accum]), []) for s in range(sampler.steps_per_epoch)]
        )
    return [[i for rank in range(world) for _, i in per_rank[rank][step]] for step in range(len(per_rank[0]))]


def test_folder_step_contents_do_not_depend_on_world_size_or_accumulation() -> None:
    one = _folder_steps(100, 16, 1, epoch=3)
    assert one == _folder_steps(100, 16, 2, epoch=3)
    assert one == _folder_steps(100, 16, 4, epoch=3, accum=2)
    assert len(one) == 100 // 16  # the short tail is dropped
    flat = [i for step in one for i in step]
    assert len(set(flat)) == len(flat)


def test_folder_micro_batches_are_pinned() -> None:
    """The image-folder demo run's data: these keys must never change (the run replays exactly)."""
    sampler = _folder_sampler(64, 16, rank=1, world=2, seed=5, accum=2)
    sampler.set_epoch(1, 2)
    batches = iter(KeyedMicroBatches(sampler))
    assert [next(batches) for _ in range(3)] == [
        [(1, 22), (1, 8), (1, 9), (1, 45)],
        [(1, 41), (1, 7), (1, 56), (1, 55)],
        [(1, 52), (1, 54), (1, 24), (1, 0)],
    ]


def test_start_step_skips_exactly_the_consumed_steps() -> None:
    sampler = _folder_sampler(64, 8, rank=1, world=2, seed=0)
    sampler.set_epoch(2, 0)
    full = list(KeyedMicroBatches(sampler))
    sampler.set_epoch(2, start_step=3)
    assert sampler.state_dict()["position"] == 3 * 8
    assert list(KeyedMicroBatches(sampler)) == full[3:]


def test_sampler_rejects_batches_that_do_not_divide() -> None:
    with pytest.raises(KaisokuError, match="not a multiple of the world size 3"):
        _folder_sampler(100, 16, rank=0, world=3, seed=0)
    with pytest.raises(KaisokuError, match="train.grad_accum 3 does not divide the 8 samples per rank"):
        _folder_sampler(100, 16, rank=0, world=2, seed=0, accum=3)
    with pytest.raises(KaisokuError, match="fewer than one global batch"):
        _folder_sampler(10, 16, rank=0, world=2, seed=0)


def test_set_shard_takes_another_slice_of_the_same_global_batches() -> None:
    sampler = _folder_sampler(64, 8, rank=0, world=1, seed=3)
    sampler.set_epoch(0, 0)
    whole = [batch for batch in sampler]
    sampler.set_shard(1, 4)
    sampler.set_epoch(0, 0)
    assert [batch for batch in sampler] == [b[2:4] for b in whole]
    with pytest.raises(KaisokuError, match="not a multiple of the world size 3"):
        sampler.set_shard(0, 3)
    assert (sampler.rank, sampler.world_size) == (1, 4)


def test_folder_state_of_earlier_versions_resumes() -> None:
    sampler = _folder_sampler(64, 8, rank=0, world=2, seed=0)
    sampler.load_state_dict({"epoch": 2, "step": 3, "seed": 0, "num_samples": 64, "global_batch": 8})
    assert (sampler.epoch, sampler.step) == (2, 3)
    with pytest.raises(KaisokuError, match="seed"):
        sampler.load_state_dict({"epoch": 2, "step": 3, "seed": 1, "num_samples": 64, "global_batch": 8})
