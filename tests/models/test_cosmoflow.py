"""CosmoFlow: shapes at each volume size, pooling stages, determinism, ordered blocks, the zoo entry."""

from __future__ import annotations

import pytest
import torch

from kaisoku.errors import ConfigError
from kaisoku.models.blocks import ordered_blocks, run_blocks
from kaisoku.models.cosmoflow import CosmoFlow, pooling_stages
from kaisoku.models.zoo import block_count, build_model


def test_pooling_stages_follow_the_volume_size() -> None:
    assert pooling_stages(128) == 5  # the reference: 4³ into the head
    assert pooling_stages(32) == 5
    assert pooling_stages(16) == 4
    assert pooling_stages(8) == 3
    with pytest.raises(ConfigError):
        pooling_stages(0)


@pytest.mark.parametrize("size", [8, 16, 32])
def test_output_shape_and_range(size: int) -> None:
    torch.manual_seed(0)
    model = CosmoFlow(size=size, width=8)
    out = model(torch.randn(2, 4, size, size, size) * 10)
    assert out.shape == (2, 4)
    assert bool((out.abs() <= 1.2).all())  # tanh * 1.2


def test_reference_layout_at_128_cubed() -> None:
    with torch.device("meta"):
        model = CosmoFlow(size=128)
        out = model(torch.empty(1, 4, 128, 128, 128))
    assert out.shape == (1, 4)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv3d)]
    assert [c.out_channels for c in convs] == [32, 64, 128, 256, 512]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(lin.in_features, lin.out_features) for lin in linears] == [(512 * 4**3, 128), (128, 64), (64, 4)]
    assert sum(isinstance(m, torch.nn.Dropout) and m.p == 0.5 for m in model.modules()) == 2
    assert all(m.negative_slope == 0.3 for m in model.modules() if isinstance(m, torch.nn.LeakyReLU))


def test_reference_initialisation_keeps_the_signal() -> None:
    torch.manual_seed(0)
    model = CosmoFlow(size=16, width=8)
    assert all(
        float(m.bias.detach().abs().max()) == 0 for m in model.modules() if isinstance(m, torch.nn.Conv3d)
    )
    x = torch.rand(8, 4, 16, 16, 16) * torch.linspace(0.5, 4, 8).view(8, 1, 1, 1, 1)
    with torch.no_grad():
        spread = float(model.features(x).flatten(1).std(0).mean())
        for module in model.modules():
            if isinstance(module, torch.nn.Conv3d):
                module.reset_parameters()  # torch's default initialisation
        default = float(model.features(x).flatten(1).std(0).mean())
    assert spread > 2 * default  # samples stay apart through the five blocks


def test_same_seed_same_weights_and_blocks_compose_the_model() -> None:
    torch.manual_seed(3)
    first = CosmoFlow(size=16, width=4)
    torch.manual_seed(3)
    second = CosmoFlow(size=16, width=4)
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)
    first.eval()
    x = torch.randn(3, 4, 16, 16, 16)
    blocks = ordered_blocks(first)
    assert len(blocks) == 6  # five conv blocks and the head
    assert torch.allclose(run_blocks(blocks, x), first(x))


def test_zoo_builds_cosmoflow_with_a_size_and_rejects_images() -> None:
    model = build_model("cosmoflow", num_classes=4, in_channels=4, size=16)
    assert isinstance(model, CosmoFlow) and model.size == 16
    assert block_count("cosmoflow") == 6
    with pytest.raises(ConfigError, match=r"expects volumes \[N, 4, 16, 16, 16\]"):
        model(torch.zeros(2, 3, 16, 16))
