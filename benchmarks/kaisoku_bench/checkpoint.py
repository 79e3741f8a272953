"""``kaisoku bench checkpoint``: what content checksums cost a checkpoint save.

A state of about 200M fp32 parameters (twelve 4096 x 4096 layers and their biases, 805 MB) is saved through
:class:`~kaisoku.engine.checkpoint.CheckpointManager`, the object the trainer saves with, as a single file
and as a sharded folder (one shard: the folder form a sharded run writes). Each round saves once (checksums
included, as every save does) and hashes the same state once on its own, interleaved; the figure is the
hashing's share of a save without it, ``hash / (save - hash)``, the median over rounds judged on its
distribution-free interval. Saves go to the disk under the system's temp folder, fsynced as in training.
Setup and goals: ``benchmarks/README.md``, section checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kaisoku.engine import checksums
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku_bench.common import median_iqr, print_table, write_result
from kaisoku_bench.engine import median_ratio_goal

#: The goal: checksums cost at most this share of a save.
TARGET = "<= 0.10"


def model_state(layers: int, width: int) -> dict[str, torch.Tensor]:
    """``layers`` Linear layers of ``width`` x ``width`` with biases, seeded (a state dict's shape)."""
    generator = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for index in range(layers):
        state[f"layers.{index}.weight"] = torch.randn(width, width, generator=generator)
        state[f"layers.{index}.bias"] = torch.randn(width, generator=generator)
    return state


def _trainer_state(model: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a trainer's checkpoint holds around the weights (small beside them)."""
    return {
        "model": model,
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": list(range(len(model)))}]},
        "scheduler": {"last_epoch": 0},
        "step": 1,
        "data": {"epoch": 0},
        "rng": {"torch": torch.random.get_rng_state()},
    }


def _timed(block: Callable[[], object]) -> float:
    start = time.perf_counter()
    block()
    return time.perf_counter() - start


def measure_layout(state: dict[str, Any], folder: Path, *, sharded: bool, rounds: int) -> dict[str, Any]:
    """Rounds of one save (checksums included) and one hashing of the same bytes on their own, alternating
    which goes first; the row with the per-round share ``hash / (save - hash)``."""
    manager = CheckpointManager(folder, keep=1, sharded=sharded)
    step = [0]

    def save() -> float:
        step[0] += 1
        return _timed(lambda: manager.save({**state, "step": step[0]}, is_main=True))

    def hash_only() -> float:
        if sharded:  # what a save hashes: the files of the folder just written
            newest = manager.list()[-1]
            return _timed(lambda: checksums.folder_checksums(newest))
        return _timed(lambda: checksums.state_checksums(state))

    save()  # warm-up: allocator, page cache, the folder's first write
    saves, hashes, shares = [], [], []
    for index in range(rounds):
        if index % 2 == 0:
            saved, hashed = save(), hash_only()
        else:
            hashed, saved = hash_only(), save()
        saves.append(saved)
        hashes.append(hashed)
        shares.append(hashed / max(saved - hashed, 1e-9))
    fields, entry = median_ratio_goal(shares, TARGET)
    size = (
        sum(p.stat().st_size for p in manager.list()[-1].rglob("*") if p.is_file())
        if sharded
        else (manager.list()[-1].stat().st_size)
    )
    row = {
        "layout": "sharded folder" if sharded else "single file",
        "bytes": size,
        "save_s": round(median_iqr(saves)[0], 3),
        "hash_s": round(median_iqr(hashes)[0], 4),
        "hash_gb_per_s": round(size / median_iqr(hashes)[0] / 1e9, 2),
        **fields,
        "entry": entry,
    }
    return row


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Both layouts, the table and ``checkpoint.json``."""
    layers, width, rounds = (2, 512, 6) if quick else (12, 4096, 9)
    model = model_state(layers, width)
    parameters = sum(t.numel() for t in model.values())
    state = _trainer_state(model)
    rows: list[dict[str, Any]] = []
    scratch = Path(tempfile.mkdtemp(prefix="kaisoku-bench-checkpoint-"))
    try:
        for sharded in (False, True):
            rows.append(measure_layout(state, scratch / str(sharded), sharded=sharded, rounds=rounds))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {
        "checksum_share_of_save_file": rows[0].pop("entry"),
        "checksum_share_of_save_sharded": rows[1].pop("entry"),
    }
    for row in rows:
        row["parameters"] = parameters
    print_table("checkpoint: what checksums cost a save", rows, summary)
    return write_result(
        "checkpoint",
        out_dir,
        summary,
        rows,
        quick=quick,
        notes=(
            f"{parameters:,} fp32 parameters ({layers} Linear layers of {width} x {width} with biases) saved "
            "by CheckpointManager (temp file + fsync + rename; a sharded folder through DCP, then its "
            "checksums.json, fsync and rename) into the system temp folder on disk. Each round: one save "
            "(checksums included) and one hashing of the same bytes alone (the tensors for a file, the "
            "folder's files for a sharded folder), the order alternating; share = hash / (save - hash), "
            "median over rounds with its distribution-free 95% interval."
        ),
        extra={"rounds": rounds},
    )
