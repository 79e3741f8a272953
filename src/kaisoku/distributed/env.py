"""The world a rank runs in: rank, local rank and node from torchrun or Slurm; init and teardown.

Process-group initialisation can start eagerly in a background thread so that rendezvous (and, on
CUDA, communicator set-up with ``device_id``) overlaps model construction and data staging.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kaisoku.errors import KaisokuError


@dataclass(frozen=True, kw_only=True)
class World:
    """Where this process sits: global rank and size, rank on its node, node index and count."""

    rank: int = 0
    """Global rank."""
    world_size: int = 1
    """Number of ranks."""
    local_rank: int = 0
    """Rank on this node."""
    local_world_size: int = 1
    """Ranks on this node."""
    node: int = 0
    """Index of this node."""
    num_nodes: int = 1
    """Number of nodes."""

    @property
    def is_main(self) -> bool:
        """True on global rank 0, which writes checkpoints and logs."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1


def inside_torchrun() -> bool:
    """True in a process started by torchrun (torch.distributed.run)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def inside_slurm_step() -> bool:
    """True in a task of a multi-task Slurm step (srun), which is a world of its own."""
    return "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def world_from_env() -> World:
    """The World described by torchrun's or Slurm's environment variables; a single rank otherwise."""
    env = os.environ
    if inside_torchrun():
        world_size = int(env["WORLD_SIZE"])
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        return World(
            rank=int(env["RANK"]),
            world_size=world_size,
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=local_world_size,
            node=int(env.get("GROUP_RANK", int(env["RANK"]) // max(local_world_size, 1))),
            num_nodes=max(1, world_size // max(local_world_size, 1)),
        )
    if inside_slurm_step():
        world_size = int(env["SLURM_NTASKS"])
        num_nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
        local_world_size = int(env.get("SLURM_NTASKS_PER_NODE", str(world_size // num_nodes)).split("(")[0])
        return World(
            rank=int(env["SLURM_PROCID"]),
            world_size=world_size,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=local_world_size,
            node=int(env.get("SLURM_NODEID", "0")),
            num_nodes=num_nodes,
        )
    return World()


def expand_hostlist(nodelist: str) -> list[str]:
    """A Slurm host list (``node[01-03,07],gpu5``) as host names, without ``scontrol``."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)  # zero padding as written: node[01-03]
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{number:0{width}d}")
    return hosts


def _slurm_master_addr() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not nodelist:
        raise KaisokuError("under srun but SLURM_JOB_NODELIST is unset; set MASTER_ADDR to the first node")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        )
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return expand_hostlist(nodelist)[0]  # scontrol is not on every compute node


def pick_device(preference: str, world: World) -> torch.device:
    """The device for this rank: ``cuda:<local rank>`` when asked for (or auto) and every rank of the node can
    have a GPU of its own, else CPU. NCCL refuses two ranks on one GPU, so ``auto`` with more ranks than
    GPUs on a node runs on the CPU (gloo), and ``cuda`` stops with one line."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if preference == "cuda" and count == 0:
        raise KaisokuError("train.device is cuda but no CUDA device is visible; use --train.device cpu")
    if preference == "cuda" and world.local_world_size > count:
        raise KaisokuError(
            f"train.device is cuda with {world.local_world_size} ranks on this node but {count} CUDA "
            f"device{'s' if count != 1 else ''}: NCCL needs one GPU per rank; use --nproc {count} or "
            "--train.device cpu"
        )
    if preference in ("cuda", "auto") and 0 < world.local_world_size <= count:
        return torch.device("cuda", world.local_rank % count)
    return torch.device("cpu")


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, its store with a key prefix of this restart attempt; None elsewhere.

    torchrun's agent serves one TCPStore for all restarts. Without a per-attempt prefix the ranks of a
    restart can read the addresses the previous attempt's ranks published under the same keys and
    fail with ``Gloo connectFullMesh failed ... Connection refused`` before their peer overwrites them.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or not inside_torchrun():
        return None
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"kaisoku/attempt-{restart}", store)


class ProcessGroupInit:
    """Initialise the default process group, now or in a background thread.

    Start it before building the model; ``wait()`` before the first collective. On CUDA the NCCL
    communicator is created eagerly by passing ``device_id`` to ``init_process_group``.
    """

    def __init__(
        self, world: World, device: torch.device, timeout_s: float, *, background: bool = True
    ) -> None:
        self.world = world
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.error: BaseException | None = None
        self.seconds: float = 0.0
        self._thread: threading.Thread | None = None
        if not world.distributed or dist.is_initialized():
            return
        if background:
            self._thread = threading.Thread(target=self._run, name="kaisoku-pg-init", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        import time

        start = time.perf_counter()
        try:
            if inside_slurm_step() and not inside_torchrun():
                os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
                os.environ.setdefault("MASTER_PORT", "29500")
                os.environ.setdefault("RANK", str(self.world.rank))
                os.environ.setdefault("WORLD_SIZE", str(self.world.world_size))
            store = _attempt_store(self.timeout)
            where: dict[str, object] = {}
            if store is not None:
                where = {"store": store, "rank": self.world.rank, "world_size": self.world.world_size}
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                dist.init_process_group("nccl", timeout=self.timeout, device_id=self.device, **where)
            else:
                dist.init_process_group("gloo", timeout=self.timeout, **where)
        except BaseException as error:  # re-raised in wait(), on the main thread
            self.error = error
        self.seconds = time.perf_counter() - start

    def wait(self) -> None:
        """Block until the process group is ready; re-raise an initialisation failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            raise KaisokuError(f"could not join the process group: {self.error}") from self.error


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats over all ranks (one collective); identity on a single rank."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


#: Groups whose collectives run beside training (a background checkpoint save): a training phase's short
#: timeout never applies to them.
_BACKGROUND_GROUPS: list[dist.ProcessGroup] = []


def background_group() -> dist.ProcessGroup:
    """A new gloo group of every rank for collectives that run in a thread beside training (a background
    checkpoint save), so that they never interleave with the training group's; exempt from
    :func:`collective_timeout` (a large save may wait on slow writers for minutes)."""
    group = dist.new_group(backend="gloo")
    _BACKGROUND_GROUPS.append(group)
    return group


def _joined_groups() -> list[dist.ProcessGroup]:
    """Every process group this process is in that training's collectives use: the default one, and those a
    device mesh or a K-FAC or exchange set-up made (torch keeps no public list of them); not the
    :func:`background_group` ones."""
    if not dist.is_initialized():
        return []
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or [dist.group.WORLD])
    return [
        g
        for g in groups
        if isinstance(g, dist.ProcessGroup)
        and dist.get_rank(g) >= 0
        and not any(g is background for background in _BACKGROUND_GROUPS)
    ]


class CollectiveTimeout(RuntimeError):
    """A collective of a phase under :func:`collective_timeout` waited its whole short timeout."""


@contextlib.contextmanager
def collective_timeout(seconds: float, restore: float, phase: str) -> Iterator[None]:
    """Collectives of every joined group time out after ``seconds`` inside, and after ``restore`` seconds
    (the run's ``dist.timeout``) again after it: a phase where every rank runs the same short steps (start-up
    checks, validation) gets a short timeout, so that a rank that never comes is said in seconds, as
    :class:`CollectiveTimeout` naming ``phase``. ``seconds`` 0, or a single rank: nothing changes."""
    groups = _joined_groups() if seconds > 0 and dist.is_initialized() and dist.get_world_size() > 1 else []
    for group in groups:
        dist.set_timeout(datetime.timedelta(seconds=seconds), group)
    try:
        yield
    except Exception as error:
        if groups and ("Timed out" in str(error) or type(error).__name__ == "DistBackendError"):
            raise CollectiveTimeout(
                f"{phase}: Timed out after {seconds:g} s waiting for another rank (dist.short_timeout)"
            ) from error
        raise
    finally:
        for group in groups:
            dist.set_timeout(datetime.timedelta(seconds=restore), group)


def barrier() -> None:
    """Wait for every rank, where there is more than one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_gather_object(obj: object) -> list[object]:
    """Every rank's ``obj``, in rank order; ``[obj]`` on a single rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from ``src`` to every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shutdown() -> None:
    """Leave the process group cleanly: a barrier, then destroy it."""
    if dist.is_initialized():
        try:
            barrier()
        finally:
            dist.destroy_process_group()


def cpu_collective_group() -> dist.ProcessGroup | None:
    """A gloo group for CPU-side collectives (sample exchange): the default group when it is gloo."""
    if not dist.is_initialized():
        return None
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def shared_token() -> str:
    """A token every rank agrees on (rank 0's), naming this run's shared files."""
    import uuid

    return str(broadcast_object(uuid.uuid4().hex[:12]))


def data_parallel_group() -> dist.ProcessGroup | None:
    """The group plain data parallelism (DDP, K-FAC's factor averaging) runs over: every rank's.

    None before a group is joined or with a single rank: nothing to communicate.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD


def default_nproc() -> int:
    """Ranks kaisoku starts on this node when ``dist.nproc`` is 0: one per GPU, else 2 CPU ranks."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def planned_world_size(nproc: int) -> int:
    """The world size a run will have: the launcher's inside torchrun or a Slurm step, else ``nproc`` ranks
    on this node (``0``: :func:`default_nproc`)."""
    if inside_torchrun() or inside_slurm_step():
        return world_from_env().world_size
    return nproc or default_nproc()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """The maximum of a few floats over all ranks (one collective); identity on a single rank."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def rank_zero_value(value: object, *, ready: ProcessGroupInit | None = None) -> object:
    """Rank 0's ``value`` on every rank (one broadcast, after ``ready.wait()``); ``value`` itself on one rank.

    For what every rank must do alike although each worked it out on its own (the memory plan, chosen
    from measured timings): the other ranks' values are dropped.
    """
    if ready is not None:
        ready.wait()
    return broadcast_object(value, src=0)
