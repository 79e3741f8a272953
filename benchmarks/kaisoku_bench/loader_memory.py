"""The memory part of ``kaisoku bench loader``: the resident memory a training loader adds, per worker.

Each measurement is a fresh interpreter (``python -m kaisoku_bench.loader_memory``) that builds the
:class:`~kaisoku.data.loading.loader.ShardLoader` ``kaisoku train`` builds for one ``data.loader`` path,
notes the process tree's anonymous and shared memory (``Pss_Anon + Pss_Shmem`` of
``/proc/PID/smaps_rollup``, summed over the process and its children: DataLoader workers' private pages
and the shared-memory batches they hand over count, each shared page once), iterates ``EPOCHS`` epochs
while a thread samples that sum every ``SAMPLE_S`` seconds, and reports the peak above the start. Mapped
shard files and library code are file pages the page cache holds for every process: they do not count.
OpenCV is imported before the start on every path: its import's allocations are the process's, once, not
a worker's.

Rows per set: the default batch path, the per-sample path (the same threads and batch ring, one sample per
call: the loader as it decoded before the batch pipeline) and the DataLoader worker-process path
(``data.loader processes``), interleaved, each in its own process, ``repeats`` times. The goal is the batch
path's memory per worker against the per-sample path's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kaisoku_bench.common import goal, process_table, python_path
from kaisoku_bench.imagesets import log

PATHS = ("batch", "threads", "processes")
"""``data.loader`` paths measured: the default batch path, the per-sample path, DataLoader workers."""
EPOCHS = 2
"""Epochs per measurement: the second goes on round the first's batch ring while the trainer holds the
first's last batch, as training does."""
SAMPLE_S = 0.005
"""Seconds between samples of the process tree's memory."""


def _tree_pids(root: int) -> list[int]:
    """``root`` and its descendants."""
    parents = {pid: parent for pid, (parent, _) in process_table().items()}
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return sorted(tree)


def anon_shmem_bytes(pid: int) -> int:
    """``Pss_Anon + Pss_Shmem`` of process ``pid`` in bytes; 0 when it is gone or the kernel lacks them."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    total = 0
    for line in text.splitlines():
        if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
            total += int(line.split()[1]) * 1024
    return total


def tree_bytes(root: int) -> int:
    """:func:`anon_shmem_bytes` summed over ``root`` and its descendants."""
    return sum(anon_shmem_bytes(pid) for pid in _tree_pids(root))


class PeakSampler:
    """A thread sampling :func:`tree_bytes` of this process every :data:`SAMPLE_S` seconds; ``peak``."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_bytes(me))
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_bytes(os.getpid()))


def _measure(pack_dir: Path, size: int, crop: bool, path: str) -> dict[str, Any]:
    """In this (fresh) process: the loader's peak memory above its start, per worker."""
    import gc

    import torch

    from kaisoku.data.loading.transforms import resizer
    from kaisoku_bench.imagesets import WORKERS, epoch_of, production_loader, work_transform

    torch.set_num_threads(1)
    # OpenCV (the resizer, which the batch path also flips with) is imported before the start on every path:
    # its import allocates about 4 MiB once per process, not per worker.
    resizer()
    loader = production_loader(pack_dir, work_transform(size, crop), batch_path=path)
    gc.collect()
    start = tree_bytes(os.getpid())
    samples = 0
    with PeakSampler() as sampler:
        for epoch in range(1, EPOCHS + 1):
            for _, labels in epoch_of(loader, epoch):
                samples += int(labels.shape[0])
    loader.close()
    return {
        "path": path,
        "workers": WORKERS,
        "samples": samples,
        "start_bytes": start,
        "peak_bytes": sampler.peak,
        "added_bytes": sampler.peak - start,
        "per_worker_bytes": (sampler.peak - start) / WORKERS,
    }


def measure(pack_dir: Path, size: int, crop: bool, path: str) -> dict[str, Any]:
    """:func:`_measure` in a fresh interpreter (nothing else this benchmark imported or allocated counts)."""
    args = [
        sys.executable,
        "-m",
        "kaisoku_bench.loader_memory",
        str(pack_dir),
        str(size),
        str(int(crop)),
        path,
    ]
    env = {**os.environ, "PYTHONPATH": python_path(os.environ.get("PYTHONPATH", ""))}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loader memory ({path}) failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory_part(
    sets: Sequence[tuple[str, Path, int, bool]], repeats: int, paths: Sequence[str] = PATHS
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Rows and summary entries for ``sets`` of ``(name, pack_dir, size, crop)``: each of ``paths`` (the
    batch and the per-sample path among them) measured ``repeats`` times, interleaved (the order rotates
    each repeat)."""
    rows: list[dict[str, Any]] = []
    summary: dict[str, dict[str, Any]] = {}
    paths = tuple(paths)
    for name, pack_dir, size, crop in sets:
        measured: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
        for repeat in range(repeats):
            shift = repeat % len(paths)
            for path in paths[shift:] + paths[:shift]:
                start = time.perf_counter()
                measured[path].append(measure(pack_dir, size, crop, path))
                log(f"memory {name} {path}: {time.perf_counter() - start:.1f} s")
        per_worker = {path: [m["per_worker_bytes"] for m in values] for path, values in measured.items()}
        for path, values in measured.items():
            rows.append(
                {
                    "part": "memory",
                    "size": name,
                    "row": f"data.loader {path}",
                    "workers": values[0]["workers"],
                    "mib_per_worker": round(statistics.median(per_worker[path]) / 2**20, 1),
                    "mib_per_worker_runs": [round(v / 2**20, 1) for v in per_worker[path]],
                    "start_mib": round(statistics.median(m["start_bytes"] for m in values) / 2**20, 1),
                }
            )
        summary[f"loader_memory_per_worker_vs_per_sample_{name}"] = goal(
            None,
            "<= 1.0",
            samples=[b / t for b, t in zip(per_worker["batch"], per_worker["threads"], strict=True)],
            unit="repeats",
            batch_mib_per_worker=round(statistics.median(per_worker["batch"]) / 2**20, 1),
            per_sample_mib_per_worker=round(statistics.median(per_worker["threads"]) / 2**20, 1),
            processes_mib_per_worker=(
                round(statistics.median(per_worker["processes"]) / 2**20, 1) if "processes" in paths else None
            ),
        )
    return rows, summary


if __name__ == "__main__":
    pack, size_text, crop_text, loader_path = sys.argv[1:5]
    print(json.dumps(_measure(Path(pack), int(size_text), bool(int(crop_text)), loader_path)))
