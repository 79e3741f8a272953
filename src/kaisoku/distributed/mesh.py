"""Parallel degrees (dp x pp) validated against the world, rank placement, and the DeviceMeshes.

Pipeline layouts get a ("dp", "pp") mesh (:func:`build_mesh`); sharded data parallelism a
("dp_replicate", "dp_shard") mesh (:func:`data_mesh_shape`, :func:`build_data_mesh`).

A layout ``dp x pp`` runs ``dp`` replicas of a pipeline of ``pp`` stages. Ranks are placed so that the
ranks of one pipeline sit on one node wherever the node has room for a whole pipeline: pipeline
neighbours exchange activations and gradients every micro-batch, while the data-parallel all-reduce
happens once per step, so it is the dimension that may cross nodes. When ``pp`` divides the ranks per
node this is the usual row-major order (``rank = dp_index * pp + pp_index``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kaisoku.distributed.layout import ParallelLayout
from kaisoku.errors import ConfigError, KaisokuError

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

#: Names of the mesh dimensions, outermost first.
MESH_DIM_NAMES: tuple[str, str] = ("dp", "pp")
#: Names of the sharded data-parallel mesh's dimensions: replicas (HSDP), then the ranks one copy is sharded over.
DATA_MESH_DIM_NAMES: tuple[str, str] = ("dp_replicate", "dp_shard")


def rank_grid(layout: ParallelLayout, ranks_per_node: int | None = None) -> list[list[int]]:
    """Global ranks arranged as ``grid[dp_index][pp_index]``.

    Ranks are numbered node by node (rank ``r`` lives on node ``r // ranks_per_node``, as torchrun and
    Slurm number them). Each node first takes as many whole pipelines as fit in it, from consecutive ranks;
    the ranks left over on all nodes, in rank order, then form the remaining pipelines, so the fewest
    pipelines cross a node boundary. Pipelines are numbered (dp index) by their first rank. With
    ``ranks_per_node`` unknown (None) every rank counts as one node's: plain row-major order.
    """
    world = layout.world_size
    per_node = world if ranks_per_node is None else ranks_per_node
    if per_node < 1:
        raise KaisokuError(f"ranks per node must be at least 1, got {per_node}")
    pipelines: list[list[int]] = []
    leftovers: list[int] = []
    for node_start in range(0, world, per_node):
        node_ranks = list(range(node_start, min(node_start + per_node, world)))
        whole = len(node_ranks) // layout.pp
        pipelines.extend(node_ranks[k * layout.pp : (k + 1) * layout.pp] for k in range(whole))
        leftovers.extend(node_ranks[whole * layout.pp :])
    pipelines.extend(leftovers[k : k + layout.pp] for k in range(0, len(leftovers), layout.pp))
    return sorted(pipelines, key=lambda ranks: ranks[0])


def rank_coordinates(rank: int, layout: ParallelLayout, ranks_per_node: int | None = None) -> tuple[int, int]:
    """``(dp_index, pp_index)`` of global ``rank`` under :func:`rank_grid`'s placement."""
    if not 0 <= rank < layout.world_size:
        raise KaisokuError(f"rank {rank} is outside the layout {layout} of {layout.world_size} ranks")
    for dp_index, pipeline in enumerate(rank_grid(layout, ranks_per_node)):
        if rank in pipeline:
            return dp_index, pipeline.index(rank)
    raise AssertionError("unreachable: every rank is placed")


@dataclass(frozen=True)
class ParallelMesh:
    """A built layout on this rank: the DeviceMesh with dims ("dp", "pp") and this rank's place in it."""

    layout: ParallelLayout
    mesh: DeviceMesh
    grid: tuple[tuple[int, ...], ...]
    dp_index: int
    pp_index: int

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks holding the same stage in every replica: gradients are averaged over it."""
        return self.mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's pipeline, in stage order."""
        return self.mesh.get_group("pp")

    def stage_owner(self, pp_index: int) -> int:
        """The global rank that holds stage ``pp_index`` in replica 0 (the source when gathering)."""
        return self.grid[0][pp_index]


def build_mesh(
    layout: ParallelLayout,
    *,
    ranks_per_node: int | None = None,
    device_type: str = "cpu",
    grid: list[list[int]] | None = None,
) -> ParallelMesh:
    """Build the DeviceMesh for ``layout`` on the initialised default process group (every rank calls it).

    ``grid`` overrides the placement (``grid[dp_index][pp_index] = rank``); by default it comes from
    :func:`rank_grid`. The row-major grid goes through ``init_device_mesh``; any other grid through
    ``DeviceMesh`` with the explicit rank tensor. Both work on gloo with ``device_type="cpu"``.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    world_size = dist.get_world_size()
    layout.check_world(world_size)
    ranks = grid if grid is not None else rank_grid(layout, ranks_per_node)
    if sorted(r for row in ranks for r in row) != list(range(world_size)) or any(
        len(row) != layout.pp for row in ranks
    ):
        raise KaisokuError(
            f"rank grid {ranks} does not place each of the {world_size} ranks once as {layout}"
        )
    row_major = [list(range(d * layout.pp, (d + 1) * layout.pp)) for d in range(layout.dp)]
    if ranks == row_major:
        mesh = init_device_mesh(device_type, (layout.dp, layout.pp), mesh_dim_names=MESH_DIM_NAMES)
    else:
        mesh = DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=MESH_DIM_NAMES)
    rank = dist.get_rank()
    dp_index, pp_index = next((d, row.index(rank)) for d, row in enumerate(ranks) if rank in row)
    return ParallelMesh(
        layout=layout,
        mesh=mesh,
        grid=tuple(tuple(row) for row in ranks),
        dp_index=dp_index,
        pp_index=pp_index,
    )


def data_mesh_shape(world_size: int, replicate: int) -> tuple[int, int]:
    """``(replicas, shards)`` of sharded data parallelism on ``world_size`` ranks with ``replicate`` replicas.

    Pure; a one-line :class:`KaisokuError` (a ConfigError) with the arithmetic when it does not divide.
    """
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
        raise ConfigError(f"parallel.dp_replicate must be a positive integer, got {replicate!r}")
    if world_size % replicate:
        raise ConfigError(
            f"parallel.dp_replicate {replicate} does not divide the world size {world_size}: "
            f"{world_size} / {replicate} = {world_size / replicate:g} ranks per replica; choose a divisor "
            f"of {world_size}"
        )
    return replicate, world_size // replicate


def build_data_mesh(replicate: int, shard: int, *, device_type: str = "cpu") -> DeviceMesh:
    """The ("dp_replicate", "dp_shard") DeviceMesh of sharded data parallelism (every rank calls it).

    Ranks are row-major: the ``shard`` ranks of one replica are consecutive, so with ``replicate`` set to the
    node count a replica lives on one node and only the gradient average between replicas crosses nodes.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=DATA_MESH_DIM_NAMES)
