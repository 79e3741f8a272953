"""The optimizer step inside backward gives the ordinary step's weights, bit for bit, on CPU fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from kaisoku.memory.in_backward import attach_update_in_backward, install_update_hooks
from tests.dist_harness import run_ranks
from tests.memory.helpers import assert_same_state, batches, optimizer_for, small_resnet, train


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["sgd", "lars", "lamb"])
def test_in_backward_single_rank(name: str) -> None:
    data = batches(3)
    plain, hooked = small_resnet(), small_resnet()
    train(plain, data, optimizer_for(plain, name))
    opt = optimizer_for(hooked, name)
    seen: list[int] = []
    install_update_hooks(hooked, opt)
    train(
        hooked,
        data,
        opt,
        step=False,
        on_grads=lambda i, m: seen.append(sum(p.grad is not None for p in m.parameters())),
    )
    assert seen == [0, 0, 0]  # every gradient was freed inside backward
    assert_same_state(plain, hooked)
    # The optimizer state is the ordinary one (checkpoints of either path load into the other).
    assert len(opt.state) == len(list(hooked.parameters()))


def _ddp_body(rank: int, world_size: int, tmp: Path, name: str, in_backward: bool) -> dict[str, torch.Tensor]:
    model = small_resnet()
    ddp = DistributedDataParallel(model, bucket_cap_mb=1, gradient_as_bucket_view=True)
    opt = optimizer_for(model, name)
    if in_backward:
        attach_update_in_backward(ddp, opt)  # the update chained onto each bucket's all-reduce
    data = batches(3 * world_size)[rank::world_size]  # each rank its own share
    train(ddp, data, opt, step=not in_backward)
    dist.barrier()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_in_backward_ddp_two_ranks(tmp_path: Path, name: str) -> None:
    plain = run_ranks(_ddp_body, 2, tmp_path / "plain", name, False, timeout=200)
    hooked = run_ranks(_ddp_body, 2, tmp_path / "hooked", name, True, timeout=200)
    for a, b in zip(plain, hooked):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    for key, _ in small_resnet().named_parameters():
        assert torch.equal(hooked[0][key], hooked[1][key]), key  # the replicas' weights agree
