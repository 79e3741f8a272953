"""Out-of-core saved activations with real files: same gradients, files written and read back, bad dirs refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from kaisoku.engine.compile import synthetic_batch
from kaisoku.errors import ConfigError
from kaisoku.memory.checkpointing import apply_techniques
from kaisoku.memory.offload import DiskOffload, check_offload_dir
from kaisoku.models.blocks import ordered_blocks
from tests.memory.helpers import batches, small_resnet, small_vit


def _grads(model: nn.Module, data, store=None, flush: bool = False) -> list[torch.Tensor]:
    model.train()
    x, y = data
    if store is None:
        loss = nn.functional.cross_entropy(model(x), y)
    else:
        with store.step():
            loss = nn.functional.cross_entropy(model(x), y)
        if flush:
            store.flush()  # every saved tensor on disk: backward reads them all back from files
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("build", [small_resnet, small_vit])
def test_disk_offload_gives_the_same_gradients(tmp_path: Path, build) -> None:
    data = batches(1, size=8)[0]
    plain = _grads(build(), data)
    store = DiskOffload(str(tmp_path), read_ahead=2, min_bytes=1024)
    try:
        # Backward reading files, then racing the writer (some tensors still in memory).
        offloaded = [_grads(build(), data, store, flush=flush) for flush in (True, False)]
        assert store.written_bytes > 0  # real files were written
        store.flush()  # a write that raced backward (its tensor used from memory) removes its own file
        assert not list(store.dir.glob("*.bin"))  # and deleted once backward read them
    finally:
        store.close()
    assert not store.dir.exists()
    for grads in offloaded:
        for a, b in zip(plain, grads):
            assert torch.equal(a, b)


def test_per_block_plan_mixes_every_technique(tmp_path: Path) -> None:
    data = batches(1, size=8)[0]
    plain = _grads(small_resnet(), data)
    model = small_resnet()
    store = DiskOffload(str(tmp_path))
    try:
        plan = (["offload", "recompute", "keep"] * 4)[: len(ordered_blocks(model))]
        apply_techniques(model, plan, offload=store)
        planned = _grads(model, data)
        assert store.written_bytes > 0
    finally:
        store.close()
    for a, b in zip(plain, planned):
        assert torch.equal(a, b)  # keep, recompute and offload are exact
    compressed = small_resnet()
    apply_techniques(compressed, ["compress"] * len(plan))
    approx = _grads(compressed, data)
    diff = torch.cat([(a - b).flatten() for a, b in zip(plain, approx)]).norm()
    assert 0 < float(diff / torch.cat([a.flatten() for a in plain]).norm()) < 1e-2
    quantized = small_resnet()  # int8 blocks (the planner's other compression), bf16 elsewhere
    apply_techniques(quantized, (["int8", "compress"] * 8)[: len(plan)])
    approx = _grads(quantized, data)
    diff = torch.cat([(a - b).flatten() for a, b in zip(plain, approx)]).norm()
    # Per-tensor int8 is coarse on BatchNorm inputs: the bound of test_compress.py
    assert 0 < float(diff / torch.cat([a.flatten() for a in plain]).norm()) < 0.3


def test_bad_offload_dirs_are_refused_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=f"memory.offload_dir {missing} does not exist"):
        check_offload_dir(str(missing))
    with pytest.raises(ConfigError, match="memory.offload_dir /proc is not writable"):
        check_offload_dir("/proc")
    with pytest.raises(ConfigError, match=f"memory.offload_dir {tmp_path} is full") as info:
        check_offload_dir(str(tmp_path), need_bytes=1 << 60)
    assert "\n" not in str(info.value)
    assert check_offload_dir(str(tmp_path)) == tmp_path
    assert not [p for p in os.listdir(tmp_path)]  # the probe file is gone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned offload needs CUDA")
def test_pinned_offload_gives_the_same_gradients_on_cuda() -> None:
    from kaisoku.memory.offload import PinnedOffload

    device = torch.device("cuda")
    x, y = batches(1, size=8)[0]
    data = (x.to(device), y.to(device))
    store = PinnedOffload(device)
    store.min_bytes = 1024
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):  # bit-exact convs
        plain = _grads(small_resnet().to(device), data)
        offloaded = _grads(small_resnet().to(device), data, store)
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b)


def test_pinned_offload_is_refused_without_cuda() -> None:
    from kaisoku.memory.offload import PinnedOffload

    with pytest.raises(ConfigError, match="memory.offload pinned needs a CUDA device"):
        PinnedOffload(torch.device("cpu"))


def test_profile_offers_int8_and_models_each_backward(tmp_path: Path) -> None:
    """The profile behind memory.budget: int8 holds less than bf16, every block's backward is costed, and
    the model of the plain step (every block kept, plus the calibrated fixed part) is its measured rise."""
    from kaisoku.memory.planner import minimum_peak
    from kaisoku.memory.profile import profile_step

    model = small_resnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = profile_step(
        model,
        batch=synthetic_batch((8, 3, 16, 16), 5, torch.device("cpu"), seed=0),
        device=torch.device("cpu"),
        offload="disk",
        offload_dir=str(tmp_path),
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # profiling changes nothing
    first = profile.blocks[0]
    assert first.options["int8"].held_bytes < first.options["compress"].held_bytes < first.saved_bytes
    assert all(block.backward_bytes > 0 for block in profile.blocks)
    keep = dict.fromkeys(range(len(profile.blocks)), "keep")
    modelled = minimum_peak(profile.blocks, profile.fixed, keep)
    assert modelled >= profile.plain_peak
    assert profile.fixed == 0 or modelled == profile.plain_peak


def test_read_ahead_stays_within_a_block(tmp_path: Path) -> None:
    """Under a per-block plan each block's hooks are a segment: backward of a block never reads an
    earlier block's tensors back while its own are still held (what the planner's model assumes)."""
    store = DiskOffload(str(tmp_path))
    try:
        store.begin()
        x = torch.randn(64, 256, requires_grad=True)
        with store.hooks():  # block 0: saves two tensors
            y = (x * 2).tanh().sin().cos()
        with store.hooks():  # block 1: saves two more
            z = (y * 3).tanh().sin().cos()
        handles = sorted(store._segments)
        assert len(handles) == 4
        assert store._ahead(handles[3], 4) == [handles[2]]
        assert store._ahead(handles[1], 4) == [handles[0]]
        z.sum().backward()  # and the gradients come back exact
        plain = x.detach().clone().requires_grad_()
        ((plain * 2).tanh().sin().cos() * 3).tanh().sin().cos().sum().backward()
        assert x.grad is not None and torch.equal(x.grad, plain.grad)
    finally:
        store.close()
