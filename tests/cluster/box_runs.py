"""Helpers for `kaisoku train` across the hosts of a cluster in a box: the data, the command, the runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kaisoku.data.datagen import generate
from kaisoku.data.shards.writer import pack
from kaisoku.testing.cluster import ClusterBox

REPO = Path(__file__).resolve().parents[2]
ENDPOINT = "kbox-node0:29400"


def make_packed(root: Path) -> Path:
    """A small packed shapes set (160 train images in 20 KiB shards) under ``root/packed``."""
    images = generate(root / "shapes", count=160, size=20, val_count=20, workers=1)
    return pack(images, root / "packed", shard_bytes=20 * 1024, codec="raw", workers=1) and root / "packed"


def host_args(box: ClusterBox, run_dir: Path, *extra: str, nproc: int = 1) -> list[str]:
    """``kaisoku train`` as every host of ``box`` runs it: the shared data, each host's own disk and RAM."""
    return [
        sys.executable, "-m", "kaisoku", "train",
        "--nproc", str(nproc),
        "--run-dir", str(run_dir),
        "--data.path", str(box.shared_dir),
        "--data.local-cache", str(box.local_dir),
        "--data.local-capacity", "64MiB",
        "--data.ram-dir", "/dev/shm/kaisoku",
        "--data.image-size", "16",
        "--data.global-batch", "8",
        "--data.workers", "0",
        "--model.name", "small-cnn",
        "--train.epochs", "2",
        "--train.log-every", "1",
        "--metrics.progress", "false",
        "--dist.timeout", "60",
        *extra,
    ]  # fmt: skip


def box_env(**extra: str) -> dict[str, str]:
    """The environment of a rank in the box: this checkout's kaisoku, one thread per rank."""
    path = os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def start_hosts(
    box: ClusterBox,
    args: Sequence[str],
    *,
    hosts: Sequence[int] | None = None,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[str]]:
    """Run ``args`` on each host of ``box`` (or of ``hosts``), output captured."""
    return [
        box.popen(
            host,
            list(args),
            env=env or box_env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in (hosts if hosts is not None else range(box.hosts))
    ]


def finish(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process; kills them all when one overruns ``timeout``."""
    out = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        out.append((proc.returncode, stdout, stderr))
    return out


def hosts_record(run_dir: Path) -> list[dict]:
    """The attempts of ``run_dir/hosts.json``."""
    return json.loads((run_dir / "hosts.json").read_text())["attempts"]


def staged_folders(box: ClusterBox, host: int) -> list[str]:
    """The node folders in host ``host``'s node-local disk (``node0``, ...)."""
    found = box.run(host, ["find", str(box.local_dir), "-mindepth", "2", "-maxdepth", "2"]).stdout.split()
    return sorted(Path(path).name for path in found)
