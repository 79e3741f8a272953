"""Sharded data parallelism: FSDP2 ``fully_shard`` on the model's ordered blocks over the data mesh.

Each ordered block (the unit pipeline partitioning and the memory planner use) becomes one FSDP unit: its
parameters, gradients and optimizer state live as DTensor shards over the mesh's ``dp_shard`` dimension,
gathered for its forward and backward and reduce-scattered after. A block made for the split rather than
held by the model (a ResNet's stem, a ViT's head) never runs as a module in ``model(x)``, so its
children that belong to the model form the unit instead; the root unit takes what is left (a ViT's class
token and position embedding). With a 2-D mesh (``dp_replicate`` > 1) this is HSDP: shards within a
replica, gradients all-reduced between replicas.

LARS and LAMB need each layer's whole-parameter norm: :func:`shard_norm_reducer` sums the local squared
norms of every layer in one all-reduce over the shard group (replicas hold the same shards).

Under pipeline stages, :func:`shard_stage` shards one stage's blocks over the stage's data-parallel
ranks (a 1-D mesh), and :func:`group_norm_reducer` sums the norms over that group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from kaisoku.errors import KaisokuError
from kaisoku.models.blocks import ordered_blocks
from kaisoku.precision.float32_layers import Float32Norm, Float32PaddedConv

ShardUnit = nn.Module | list[nn.Module]
"""What one ``fully_shard`` call takes: a module, or modules that are gathered together."""


def shard_units(model: nn.Module) -> list[ShardUnit]:
    """The FSDP units of ``model`` in execution order, one per ordered block (see the module docstring).

    A model that cannot be split into blocks has none: the root unit then holds the whole model.
    """
    try:
        blocks = ordered_blocks(model)
    except KaisokuError:
        return []
    held = {id(module) for module in model.modules()}
    units: list[ShardUnit] = []
    for block in blocks:
        if not any(True for _ in block.parameters()):
            continue
        if id(block) in held:
            units.append(block)
            continue
        children = [c for c in block.children() if id(c) in held and any(True for _ in c.parameters())]
        if children:
            units.append(children)
    return units


ROOT_SHARE = 0.02
"""Largest share of the model's parameters that small units may add to the root unit (see
:func:`units_of_their_own`)."""


def _unit_numel(unit: ShardUnit) -> int:
    modules = unit if isinstance(unit, list) else [unit]
    return sum(p.numel() for module in modules for p in module.parameters())


def units_of_their_own(units: Sequence[ShardUnit], total: int, share: float = ROOT_SHARE) -> list[ShardUnit]:
    """The units that get a ``fully_shard`` of their own: all but the smallest, which join the root unit
    while together they hold at most ``share`` of the ``total`` parameters.

    Every unit costs a collective (and its latency) in forward and again in backward; a patch embedding
    or a classifier head is often a fraction of a percent of the model. The root stays gathered from
    forward through backward, so what joins it is held whole for the step: at most ``share`` of the model.
    """
    budget = share * total
    folded: set[int] = set()
    for index in sorted(range(len(units)), key=lambda i: _unit_numel(units[i])):
        budget -= _unit_numel(units[index])
        if budget < 0:
            break
        folded.add(index)
    return [unit for index, unit in enumerate(units) if index not in folded]


def mixed_precision(mode: str) -> MixedPrecisionPolicy:
    """The FSDP2 policy of ``precision.mode``: bf16 weights in forward and backward (and bf16 all-gathers)
    with fp32 gradient reduction and fp32 outputs for the loss; fp32 leaves everything in fp32."""
    if mode == "bf16":
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    return MixedPrecisionPolicy()


def float32_units(model: nn.Module) -> list[nn.Module]:
    """Layers the bf16 path keeps in float32 (:mod:`kaisoku.precision.float32_layers`: normalization, convs
    over maps so small a tap sees only padding) that hold parameters: each its own fp32 unit."""
    kept = (Float32Norm, Float32PaddedConv)
    return [
        m for m in model.modules() if isinstance(m, kept) and any(True for _ in m.parameters(recurse=False))
    ]


def shard_model(
    model: nn.Module, mesh: DeviceMesh, *, level: Literal["grad", "full"], precision_mode: str
) -> FSDPModule:
    """Shard ``model`` in place over ``mesh`` (``("dp_replicate", "dp_shard")``), block by block, then the root.

    The smallest blocks (a patch embedding, a head) join the root unit rather than paying collectives of
    their own (:func:`units_of_their_own`). ``level`` full reshards each block after its forward (gathered again for backward: the least memory);
    grad keeps the gathered weights until backward (one gather per block and step, more memory). Under
    bf16 the blocks are gathered in bf16 and the layers kept in float32 (normalization) in float32, each
    layer its own small unit; the step still runs under autocast, as the data-parallel bf16 path does.
    """
    policy = mixed_precision(precision_mode)
    # A 2-D mesh makes FSDP2 replicate over the first dimension and shard over the second (HSDP).
    target = mesh if mesh.size(0) > 1 else mesh["dp_shard"]
    reshard = level == "full"
    if policy.param_dtype is not None:
        # Layers that compute in float32 need float32 weights: gathered as such, in units of their own
        # (inner units first; the block's unit then leaves them out).
        for layer in float32_units(model):
            fully_shard(layer, mesh=target, reshard_after_forward=reshard, mp_policy=MixedPrecisionPolicy())
    total = sum(p.numel() for p in model.parameters())
    for unit in units_of_their_own(shard_units(model), total):
        # A unit of modules that are all float32 units already (a ResNet stem's conv and norm) has none left.
        if isinstance(unit, list):
            unit = [module for module in unit if not isinstance(module, FSDPModule)]
        if unit and not isinstance(unit, FSDPModule):
            fully_shard(unit, mesh=target, reshard_after_forward=reshard, mp_policy=policy)
    # The root's own parameters are needed again at once by backward: keep them gathered.
    fully_shard(model, mesh=target, reshard_after_forward=False, mp_policy=policy)
    assert isinstance(model, FSDPModule)
    return model


def shard_stage(
    stage: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    level: Literal["grad", "full"],
    precision_mode: str,
) -> FSDPModule:
    """Shard a pipeline stage in place over ``mesh`` (1-D: the ranks holding this stage in every replica).

    Each of the stage's ``blocks`` (run as modules by the stage) becomes one unit and the stage the root,
    with the level and precision policy of :func:`shard_model`. The pipeline schedule drives the units:
    gradients are reduce-scattered after the last micro-batch's backward, not after each.
    """
    policy = mixed_precision(precision_mode)
    reshard = level == "full"
    if policy.param_dtype is not None:
        for layer in float32_units(stage):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=MixedPrecisionPolicy())
    for block in blocks:
        if not isinstance(block, FSDPModule) and any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(stage, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    assert isinstance(stage, FSDPModule)
    return stage


def set_micro_batch(model: nn.Module, *, last: bool) -> None:
    """Before a micro-batch's backward: reduce gradients only on the step's last one, and keep the gathered
    weights between micro-batches (no all-gather per micro-batch); reshard after the last."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def broadcast_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics), as DDP does before each forward.

    Sharding leaves buffers whole and unsynchronised; validation and checkpoints use rank 0's.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def shard_norm_reducer(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """``reduce(squares) -> squares`` summed over the mesh's shard group in one all-reduce, in place."""
    group = mesh.get_group("dp_shard")

    def reduce(squares: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(squares, group=group)
        return squares

    return reduce


def group_norm_reducer(group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    """``reduce(squares) -> squares`` summed over ``group`` (the ranks a layer is sharded over), in place."""

    def reduce(squares: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(squares, group=group)
        return squares

    return reduce


def local_weights_finite(model: nn.Module) -> torch.Tensor:
    """A bool tensor: this rank's shards and buffers are all finite (no collective; the caller agrees)."""
    tensors = []
    for tensor in model.state_dict().values():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and local.numel():
            tensors.append(local.detach())
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    return torch.isfinite(torch.stack(torch._foreach_norm(tensors)).float()).all()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (its local shard for a DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole_tensor(value: Any, device: torch.device) -> Any:
    """``value`` as a whole CPU tensor: a DTensor gathered over its mesh (a collective), on ``device`` first
    since the gather runs over the mesh's own backend; other values as they are, tensors copied."""
    if isinstance(value, DTensor):
        return value.to(device).full_tensor().detach().cpu().clone()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def placed_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``like``: this rank's shard of it for a DTensor (cut locally, no communication)."""
    if not isinstance(like, DTensor):
        return whole
    local = local_part(like)
    return distribute_tensor(
        whole.to(device=local.device, dtype=local.dtype),
        like.device_mesh,
        like.placements,
        src_data_rank=None,
    )
