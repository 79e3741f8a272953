"""Run a function on N real gloo ranks in separate processes on this machine, with a file:// rendezvous.

The one rank launcher of the tests and the benchmarks (training itself starts ranks through torchrun).
The function must live at module level so that the child can import it::

    def _body(rank: int, world_size: int, tmp: Path) -> float:
        ...
        return value

    results = run_ranks(_body, world_size=2, tmp_path=tmp_path)

Each rank runs with one thread, joins the group through a rendezvous file in ``tmp_path``, passes a
barrier before the group is destroyed, and hands its result back through a file.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_CONTEXT = mp.get_context("forkserver")
# The fork server imports torch (and the pipelining package, seconds per process otherwise) once; each
# rank then starts as a cheap fork of a process that never ran an OpenMP region, which makes fork safe.
# A fork server already started in this process keeps the preload it started with.
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.pipelining", "kaisoku"])


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    tmp: str,
    args: tuple[Any, ...],
    env: dict[str, str],
    collective_timeout: float,
    backend: str,
) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    result_path = Path(tmp) / f"result_{rank}.pt"
    try:
        extra: dict[str, Any] = {}
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            extra["device_id"] = device
        dist.init_process_group(
            backend,
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
            **extra,
        )
        result = fn(rank, world_size, Path(tmp), *args)
        dist.barrier()
        dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, result_path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        raise


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    collective_timeout: float = 60.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, tmp_dir, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``timeout``: seconds for the whole run, after which every rank is killed; ``collective_timeout``:
    the process group's timeout; ``env``: variables set in each rank before the group starts;
    ``backend``: ``"nccl"`` puts rank r on ``cuda:r`` (modulo the devices) and creates its communicator eagerly.
    Raises AssertionError with the failing rank's traceback, or on a timeout after killing every rank.
    """
    tmp = tmp_path / f"ranks{world_size}"
    tmp.mkdir(parents=True, exist_ok=True)
    for stale in tmp.glob("result_*.pt"):
        stale.unlink()
    (tmp / "rendezvous").unlink(missing_ok=True)
    procs = [
        _CONTEXT.Process(
            target=_child, args=(fn, rank, world_size, str(tmp), args, env or {}, collective_timeout, backend)
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    end = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    results: list[Any] = []
    errors: list[str] = []
    for rank in range(world_size):
        path = tmp / f"result_{rank}.pt"
        if not path.exists():
            errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
            continue
        record = torch.load(path, weights_only=False)
        if record["ok"]:
            results.append(record["result"])
        else:
            errors.append(f"rank {rank} failed:\n{record['error']}")
    if hung:
        errors.insert(0, f"ranks {hung} still running after {timeout:.0f} s; killed")
    if errors:
        raise AssertionError("\n".join(errors))
    return results
