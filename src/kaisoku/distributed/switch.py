"""Switch-parallel: change the parallel layout inside one run, and layout-independent checkpoints.

A switch schedule says which layout trains which range of epochs (or steps), e.g.
``"dp2xpp2:0-10,dp4:10-"``: epochs 0..9 as 2 replicas of a 2-stage pipeline, epoch 10 onwards as 4
data-parallel replicas. At a boundary the whole model and optimizer state is gathered from the stages
(:meth:`HybridParallel.full_state_dict`), the new layout is built on the same model object and the
state loaded into it, so training goes on with identical weights and optimizer state. Under
``HybridOptions.shard`` the gather collects the stages' shards and the load keeps each rank's own pieces
of the new layout's (a re-shard; a layout without stages is one stage of every block over all replicas).

The checkpoint form is that gathered state: the model's own ``state_dict`` names and an optimizer state
keyed by the same names, so a checkpoint written under one layout loads under any other.
"""

from __future__ import annotations

import torch

from kaisoku.distributed.layout import (  # noqa: F401  (the schedule's public home is layout.py)
    SWITCH_UNITS,
    ParallelLayout,
    SwitchSchedule,
    SwitchSegment,
    parse_switch_schedule,
)
from kaisoku.distributed.mesh import ParallelMesh, build_mesh
from kaisoku.distributed.pipeline import HybridParallel


def switch_layout(
    current: HybridParallel,
    target: ParallelLayout | ParallelMesh,
    *,
    ranks_per_node: int | None = None,
    device_type: str = "cpu",
    example_input: torch.Tensor | None = None,
) -> HybridParallel:
    """Gather ``current``'s model and optimizer state, build ``target`` on the same model, load it there.

    Every rank calls this at the same boundary. ``target`` is a layout (its mesh is built here) or a mesh
    built before (to reuse process groups when switching back and forth). ``current`` is closed.
    """
    state = current.full_state_dict()
    current.close()
    mesh = (
        target
        if isinstance(target, ParallelMesh)
        else build_mesh(target, ranks_per_node=ranks_per_node, device_type=device_type)
    )
    following = HybridParallel(
        current.model,
        mesh,
        loss_fn=current.loss_fn,
        optimizer_factory=current.optimizer_factory,
        options=current.options,
        example_input=example_input,
        device=current.device,
        sync_initial_state=False,
    )
    following.load_full_state_dict(state)
    return following
