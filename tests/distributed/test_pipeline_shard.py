"""Pipeline stages sharded over their data-parallel ranks (``--parallel.pp 2 --parallel.shard grad|full``) on 4
real gloo ranks: the same trajectory as whole stages averaged over dp, and a checkpoint that resumes on plain
data parallelism.

A small model of LayerNorm / Linear blocks (no BatchNorm, no dropout) keeps every layout on one trajectory:
each step's gradient is the mean over the same global batch whatever its split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kaisoku.distributed.layout import ParallelLayout
from kaisoku.distributed.mesh import ParallelMesh, build_mesh
from kaisoku.distributed.pipeline import HybridOptions, HybridParallel, OptimizerFactory, replica_batch_slice
from kaisoku.optim.lars import LAMB
from tests.dist_harness import run_ranks

#: fp32 sums of the same terms in another order (gradients reduce-scattered vs all-reduced).
ATOL = 1e-5
STEPS = 4
SAVED_AT = 2
MAX_GRAD_NORM = 0.5  # small enough to clip every step: the norm over shards and stages is checked too


def layer_norm_blocks() -> nn.Sequential:
    """Four blocks of LayerNorm and Linear layers (two per stage, each its own FSDP unit)."""
    torch.manual_seed(0)
    width = 16
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, width)),
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()),
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()),
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4)),
    )


def adamw(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for _, p in named], lr=1e-2, weight_decay=0.1)


def lamb(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """Layer-wise trust ratios: the norms of whole parameters, summed over a stage's shards."""
    return LAMB([p for _, p in named], lr=1e-2, weight_decay=0.1)


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator))
        for _ in range(STEPS)
    ]


def _steps(hybrid: HybridParallel, steps: range) -> list[float]:
    data = global_batches()
    losses = []
    for step in steps:
        inputs, targets = data[step]
        part = replica_batch_slice(16, hybrid.dp_index, hybrid.dp_size)
        losses.append(hybrid.train_step(inputs[part], targets[part], max_grad_norm=MAX_GRAD_NORM))
    return losses


def _hybrid(
    mesh: ParallelMesh, options: HybridOptions, optimizer: OptimizerFactory = adamw
) -> HybridParallel:
    return HybridParallel(
        layer_norm_blocks(),
        mesh,
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=optimizer,
        options=options,
    )


def _four_ranks(rank: int, world_size: int, tmp: Path, checkpoint: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = build_mesh(ParallelLayout(dp=2, pp=2))
    runs: dict[str, Any] = {}
    sharded_locally = True
    for name, options, optimizer in (
        ("dp", HybridOptions(microbatches=2, schedule="1f1b"), adamw),
        ("full", HybridOptions(microbatches=2, schedule="1f1b", shard="full"), adamw),
        # Two stages per rank (one block each), each sharded on its own.
        (
            "grad",
            HybridOptions(microbatches=2, schedule="interleaved-1f1b", virtual_stages=2, shard="grad"),
            adamw,
        ),
        ("dp-lamb", HybridOptions(microbatches=2, schedule="gpipe"), lamb),
        ("full-lamb", HybridOptions(microbatches=2, schedule="gpipe", shard="full"), lamb),
    ):
        hybrid = _hybrid(mesh, options, optimizer)
        if options.shard != "none":
            # Every stage parameter is a DTensor holding this rank's half (rows) of the whole.
            sharded_locally &= all(
                isinstance(p, DTensor) and p.to_local().shape[0] == (p.shape[0] + 1) // 2
                for _, p in hybrid.named_parameters
            )
        losses = _steps(hybrid, range(SAVED_AT))
        state = hybrid.full_state_dict()
        if name == "full" and rank == 0:
            torch.save(state, checkpoint)
        losses += _steps(hybrid, range(SAVED_AT, STEPS))
        runs[name] = {"losses": losses, "final": hybrid.full_state_dict()}
    return {"runs": runs, "sharded": sharded_locally}


def _resume_on_dp(rank: int, world_size: int, tmp: Path, checkpoint: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    hybrid = _hybrid(build_mesh(ParallelLayout(dp=2, pp=1)), HybridOptions(microbatches=1))
    hybrid.load_full_state_dict(torch.load(checkpoint, weights_only=False))
    losses = _steps(hybrid, range(SAVED_AT, STEPS))
    return {"losses": losses, "final": hybrid.full_state_dict()}


def _assert_close(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    torch.testing.assert_close(actual["model"], expected["model"], rtol=0, atol=ATOL)
    assert actual["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    torch.testing.assert_close(
        actual["optimizer"]["state"], expected["optimizer"]["state"], rtol=0, atol=ATOL
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_stages_match_whole_stages_and_resume_on_plain_dp(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "step-2.pt")
    ranks = run_ranks(_four_ranks, 4, tmp_path, checkpoint, timeout=240)
    assert all(result["sharded"] for result in ranks)
    runs = ranks[0]["runs"]
    for sharded, whole in (("full", "dp"), ("grad", "dp"), ("full-lamb", "dp-lamb")):
        assert runs[sharded]["losses"] == pytest.approx(runs[whole]["losses"], abs=ATOL)
        _assert_close(runs[sharded]["final"], runs[whole]["final"])
        for other in ranks[1:]:  # every rank gathers the same whole state
            _assert_close(other["runs"][sharded]["final"], runs[sharded]["final"])
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["layout"] == str(ParallelLayout(dp=2, pp=2))
    assert not any(isinstance(t, DTensor) for t in saved["model"].values())
    resumed = run_ranks(_resume_on_dp, 2, tmp_path, checkpoint, timeout=120)[0]
    assert resumed["losses"] == pytest.approx(runs["dp"]["losses"][SAVED_AT:], abs=ATOL)
    _assert_close(resumed["final"], runs["dp"]["final"])
