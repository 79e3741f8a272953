"""The loader benchmark's peers keep one DataLoader with persistent workers across epochs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import simplejpeg

from kaisoku_bench import loader_peers
from kaisoku_bench.loader import cpu_seconds


def _folder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for k in range(8):
        path = root / f"class{k % 2}" / f"img{k}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(simplejpeg.encode_jpeg(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)))
    return root


def test_peer_workers_persist_across_epochs(tmp_path: Path) -> None:
    peer = loader_peers.imagefolder(_folder(tmp_path), decoder="simplejpeg", batch=2, workers=1, crop=8)
    first = peer.make()
    assert first.persistent_workers and first.num_workers == 1
    epochs = []
    for _ in range(2):
        loader = peer.make()
        assert loader is first  # built once, not per epoch
        epochs.append(sum(int(labels.shape[0]) for _, labels in loader))
        workers = [worker.pid for worker in loader._iterator._workers]  # type: ignore[union-attr]
        assert all(pid is not None for pid in workers)
        if len(epochs) == 1:
            first_workers = workers
    assert epochs == [8, 8] and workers == first_workers  # the same worker processes served both epochs
    assert cpu_seconds() > 0
