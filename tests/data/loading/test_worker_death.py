"""A loader worker dies with the rank that started it, however the rank dies (a rank killed outright must not
leave its workers running, holding their memory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_RANK = """
import os, sys, time
import torch
from torch.utils.data import DataLoader
from kaisoku.distributed.launch import die_with_rank

def worker_pid(_):
    return torch.tensor(os.getpid())

if __name__ == "__main__":
    loader = DataLoader(range(8), batch_size=1, num_workers=1, collate_fn=worker_pid, worker_init_fn=die_with_rank,
                        persistent_workers=True)
    batches = iter(loader)
    print(int(next(batches)), flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(60)
def test_a_loader_worker_dies_with_its_rank_killed_outright(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    rank = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    assert rank.stdout is not None
    worker = int(rank.stdout.readline())
    assert worker != rank.pid and _alive(worker)
    rank.send_signal(signal.SIGKILL)
    rank.wait(timeout=10)
    # PDEATHSIG kills it at once; torch's own worker watchdog would notice only after its 5 s poll, or never
    # while the worker is blocked in a read.
    deadline = time.monotonic() + 2
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the worker outlived its rank"
