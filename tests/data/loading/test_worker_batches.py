"""The batch path's worker processes: kept across epochs, whole batches into shared buffers, the thread
paths' batches bit for bit, exact resume, damage named or skipped, stopped by close()."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kaisoku.data.loading.dataset import ShardedDataset
from kaisoku.data.shards.format import read_index
from kaisoku.data.shards.records import CorruptRecordError
from tests.data.loading.test_batches import _epoch, _loader


def _same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) and torch.equal(lx, ly) for (x, lx), (y, ly) in zip(a, b, strict=True)
    )


def _children() -> set[int]:
    return {process.pid for process in multiprocessing.active_children() if process.pid is not None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "micro"), [(1, 1), (2, 1), (2, 2)])
def test_worker_processes_give_the_per_sample_paths_batches_and_outlive_an_epoch(
    packed: Path, workers: int, micro: int
) -> None:
    reference = _loader(packed, path="threads", workers=1, micro=micro)
    loader = _loader(packed, path="batch", workers=workers, micro=micro)
    before = _children()
    first = _epoch(loader, 1)
    started = _children() - before
    assert len(started) == workers  # worker processes, not threads
    second = _epoch(loader, 2)
    assert _children() - before == started  # the same workers made epoch 2
    assert _same(first, _epoch(reference, 1)) and len(first) > 2
    assert _same(second, _epoch(reference, 2))
    assert not _same(first, second)  # the epochs differ: the comparison can fail
    loader.close()
    assert not _children() - before, "close() left workers running"


@pytest.mark.timeout(120)
def test_a_pass_left_early_and_a_resume_mid_epoch_give_the_exact_batches(packed: Path) -> None:
    full = _epoch(_loader(packed, path="threads", workers=1), 3)
    loader = _loader(packed, path="batch", workers=2)
    loader.set_epoch(3)
    taken = []
    for k, (images, labels) in enumerate(loader):  # a pass dropped after two batches, workers ahead of it
        taken.append((images, images.clone(), labels.clone()))
        if k == 1:
            break
    assert all(torch.equal(held, copy) for held, copy, _ in taken)  # held batches kept their pixels
    assert _same([(copy, labels) for _, copy, labels in taken], full[:2])
    assert _same(_epoch(loader, 3, start_step=2), full[2:])  # resumed mid-epoch, on the same workers
    assert _same(_epoch(loader, 3), full)
    loader.close()


@pytest.mark.timeout(120)
def test_a_damaged_record_is_named_in_one_line_or_skipped(packed: Path) -> None:
    index = read_index(packed)
    shard = index.shards[1]
    loader = _loader(packed, path="batch", workers=2)
    _epoch(loader, 0)  # sound: the workers are running and make every batch of the next epoch
    with open(index.shard_path(1), "r+b") as handle:  # damage every record of shard 1
        for record in range(shard.samples):
            handle.seek(int(shard.offsets[record]) + 3)
            handle.write(b"\xff\x00\xff")
    with pytest.raises(CorruptRecordError, match=r"record \d+ \(sample \d+\) fails its checksum") as caught:
        _epoch(loader, 1)
    assert "\n" not in str(caught.value) and "Traceback" not in str(caught.value)
    notes = getattr(caught.value, "__notes__", [])  # where the worker raised it: for the run's log
    assert any("loader worker process" in note and "Traceback" in note for note in notes), notes
    loader.close()
    skipping = _loader(packed, path="batch", workers=2, skip=True)
    got = _epoch(skipping, 0)
    reference = _epoch(_loader(packed, path="threads", workers=1, skip=True), 0)
    assert _same(got, reference)
    stats = skipping.epoch_stats()
    assert stats is not None and stats["skipped_records"] == shard.samples  # counted in the workers
    skipping.close()


_SIGNALLED_RANK = """
import multiprocessing, sys
from pathlib import Path
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.loading.transforms import AugmentSpec
from kaisoku.data.order.shuffle import ShuffleSpec

dataset = ShardedDataset(Path(sys.argv[1]), transform=ImageLabelTransform(spec=AugmentSpec(size=12), seed=5))
loader = ShardLoader(dataset, global_batch=2, rank=0, world_size=1, ranks_per_node=1, seed=2,
                     shuffle=ShuffleSpec(), workers=2)
loader.set_epoch(0)
batches = iter(loader)
count = len(next(batches)[1]) + len(next(batches)[1])  # the first is made here, the second by the workers
print(sorted(process.pid for process in multiprocessing.active_children()), flush=True)
sys.stdin.readline()  # the test has signalled the workers
count += sum(len(labels) for _, labels in batches)
print(count, flush=True)
"""


@pytest.mark.timeout(120)
def test_workers_outlive_the_stop_signals_their_rank_handles_and_end_with_it(
    packed: Path, tmp_path: Path
) -> None:
    """Slurm signals every process of a step at its time limit: the rank stops with a checkpoint and needs
    its workers for the step it finishes. Ignoring SIGTERM, they are still stopped as the rank exits. The
    rank is a script with no ``__main__`` guard, as users write them: the workers must not run it again."""
    script = tmp_path / "rank.py"
    script.write_text(_SIGNALLED_RANK)
    rank = subprocess.Popen(
        [sys.executable, str(script), str(packed)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert rank.stdout is not None and rank.stdin is not None
    workers = json.loads(rank.stdout.readline())
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGUSR1)
    rank.stdin.write("go\n")
    rank.stdin.flush()
    out, err = rank.communicate(timeout=60)  # a worker that ignored SIGTERM at exit too would hang it here
    assert rank.returncode == 0, err  # a worker killed by either signal fails the rank's next batches
    samples = len(ShardedDataset(packed))
    assert int(out) == samples - samples % 2


@pytest.mark.timeout(120)
def test_the_first_samples_read_to_size_the_buffers_may_be_damaged_and_skipped(packed: Path) -> None:
    index = read_index(packed)
    loader = _loader(packed, path="batch", workers=2, skip=True)
    loader.set_epoch(0)
    first_two = [int(i) for i in next(iter(loader.sampler.batches(0, 0)))[:2]]
    starts = np.cumsum([0] + [shard.samples for shard in index.shards])
    for sample in first_two:  # the first batch's first two samples: read here, before the workers start
        shard = int(np.searchsorted(starts, sample, side="right")) - 1
        with open(index.shard_path(shard), "r+b") as handle:
            handle.seek(int(index.shards[shard].offsets[sample - starts[shard]]) + 3)
            handle.write(b"\xff\x00\xff")
    got = _epoch(loader, 0)
    reference = _epoch(_loader(packed, path="threads", workers=1, skip=True), 0)
    assert _same(got, reference) and len(got[0][1]) == len(reference[1][1]) - 2  # both skipped
    stats = loader.epoch_stats()
    assert stats is not None and stats["skipped_records"] == 2  # counted once, here
    loader.close()
