"""Small models, batches and a few plain training steps shared by the memory tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchvision.models import VisionTransformer

from kaisoku.config import OptimConfig
from kaisoku.models.zoo import build_model
from kaisoku.optim.factory import build_optimizer


def small_resnet() -> nn.Module:
    """resnet10 with the small stem (BatchNorm in every block), seeded."""
    torch.manual_seed(0)
    return build_model("resnet10", num_classes=5, stem="small", zero_init_residual=False)


def small_vit() -> nn.Module:
    """A two-layer VisionTransformer on 16 px images, seeded."""
    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=5
    )
    # torchvision zeroes the head: no gradient would reach the body.
    nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


def batches(steps: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` fixed batches of 16 px images keyed by the step index."""
    out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        out.append((torch.randn(size, 3, 16, 16, generator=gen), torch.randint(0, 5, (size,), generator=gen)))
    return out


def optimizer_for(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """The run's optimizer ``name`` over ``model`` (as ``kaisoku train`` builds it)."""
    return build_optimizer(model, OptimConfig(name=name, lr=0.1, momentum=0.9, weight_decay=1e-4))  # type: ignore[arg-type]


def train(
    model: nn.Module,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    step: bool = True,
    on_grads: Callable[[int, nn.Module], None] | None = None,
) -> list[float]:
    """Train on ``data`` one batch per step; ``step=False`` leaves the update to hooks. The losses."""
    losses = []
    for index, (x, y) in enumerate(data):
        model.train()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if on_grads is not None:
            on_grads(index, model)
        if step:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    """Every parameter and buffer of ``a`` and ``b`` bit-identical."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
