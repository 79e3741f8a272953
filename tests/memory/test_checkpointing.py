"""Per-block and selective recomputation train bit-identically to the plain model on CPU fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisoku.errors import ConfigError
from kaisoku.memory.checkpointing import _HOOKS_ARGUMENT, apply_recompute, parse_block_list
from kaisoku.models.blocks import ordered_blocks
from tests.memory.helpers import assert_same_state, batches, optimizer_for, small_resnet, small_vit, train


def _grads(store: list[dict[str, torch.Tensor]]):
    def record(index: int, model: nn.Module) -> None:
        store.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    return record


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["blocks", "selective"])
@pytest.mark.parametrize("build", [small_resnet, small_vit], ids=["resnet", "vit"])
def test_recompute_is_bit_identical(mode: str, build) -> None:
    data = batches(3)
    plain, ckpt = build(), build()
    assert apply_recompute(ckpt, mode) == list(range(len(ordered_blocks(plain))))  # type: ignore[arg-type]
    g_plain: list[dict[str, torch.Tensor]] = []
    g_ckpt: list[dict[str, torch.Tensor]] = []
    l_plain = train(plain, data, optimizer_for(plain, "sgd"), on_grads=_grads(g_plain))
    l_ckpt = train(ckpt, data, optimizer_for(ckpt, "sgd"), on_grads=_grads(g_ckpt))
    assert l_plain == l_ckpt
    for a, b in zip(g_plain, g_ckpt):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # Weights and BatchNorm running statistics (updated once per step, not again in recomputation).
    assert_same_state(plain, ckpt)
    if build is small_resnet:
        assert int(ckpt.state_dict()["bn1.num_batches_tracked"]) == 3


@pytest.mark.timeout(60)
def test_recompute_saves_fewer_tensors() -> None:
    """Fewer bytes are kept for backward with checkpointing (counted through saved-tensor hooks)."""
    x, y = batches(1, size=8)[0]

    def saved_bytes(mode: str) -> int:
        model = small_resnet()
        apply_recompute(model, mode)  # type: ignore[arg-type]
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            nn.functional.cross_entropy(model(x), y)
        return total

    plain, blocks, selective = saved_bytes("none"), saved_bytes("blocks"), saved_bytes("selective")
    assert blocks < plain
    if _HOOKS_ARGUMENT:  # older torch hides what selective recomputation keeps from outer hooks
        assert blocks < selective < plain


def test_block_list() -> None:
    assert parse_block_list("", 4) == [0, 1, 2, 3]
    assert parse_block_list("0,2-3", 4) == [0, 2, 3]
    with pytest.raises(ConfigError, match="outside the model's blocks 0-3"):
        parse_block_list("5", 4)
    model, plain = small_resnet(), small_resnet()
    assert apply_recompute(model, "blocks", "1-2") == [1, 2]
    x = batches(1)[0][0]
    model.eval()
    plain.eval()
    assert torch.equal(model(x), plain(x))
