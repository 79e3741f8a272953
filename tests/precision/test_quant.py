"""precision/quant.py: the straight-through gradient, the rounded backward, the swap keeps the model's names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisoku.errors import ConfigError
from kaisoku.models.zoo import build_model
from kaisoku.precision import quantize_model, resolve_keep
from kaisoku.precision.quant import QuantConv2d, QuantLinear, dequantize_model, round_forward, round_gradient
from kaisoku.precision.scaler import ExponentScaler


def test_straight_through_estimator_passes_the_gradient_unchanged() -> None:
    x = torch.tensor([0.3, -1.7, 0.01, 2.5], requires_grad=True)
    y = round_forward(x, ExponentScaler("int8"))
    assert not torch.equal(y.detach(), x.detach())  # rounded
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    (y * weights).sum().backward()
    assert torch.equal(x.grad, weights)


def test_backward_rounds_the_incoming_gradient_with_its_own_scaler() -> None:
    scaler = ExponentScaler("int8")
    x = torch.ones(3, requires_grad=True)
    y = round_gradient(x, scaler)
    assert torch.equal(y.detach(), x.detach())
    y.backward(torch.tensor([1.0, 2.0**-9, 0.3]))  # e = 0: 2^-9 vanishes, 0.3 lands on the 2^-7 grid
    assert x.grad.tolist() == [127 / 128, 0.0, round(0.3 * 128) / 128]
    assert scaler.window()["underflow_fraction"] == pytest.approx(1 / 3)


def test_swap_keeps_names_and_state_and_rounds_the_middle_layers() -> None:
    torch.manual_seed(0)
    model = build_model("small-cnn", num_classes=10, in_channels=1)
    keys = list(model.state_dict())
    plain = build_model("small-cnn", num_classes=10, in_channels=1)
    plain.load_state_dict(model.state_dict())
    layers = quantize_model(model, "int8-stats")
    assert list(model.state_dict()) == keys
    assert isinstance(model.features[1][0], QuantConv2d) and isinstance(model.features[1][0], nn.Conv2d)
    assert isinstance(model.head[2], QuantLinear)
    assert layers["features.0.0"].label == "bf16" and layers["head.2"].label == "bf16"  # first, last kept
    assert layers["features.1.0"].label == "int8"
    x = torch.randn(4, 1, 28, 28)
    out, ref = model(x), plain(x)
    assert not torch.equal(out, ref)
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    dequantize_model(model)
    assert type(model.features[1][0]) is nn.Conv2d
    assert torch.equal(model(x), plain(x))


def test_a_quantized_model_learns() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    quantize_model(model, "fp8-stats", keep=[])
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(3))
    y = (x[:, 0] * x[:, 1] > 0).long()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = None
    for _ in range(60):
        loss = nn.functional.cross_entropy(model(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.6 * first


def test_keep_names_are_checked_with_one_line_listing_the_layers() -> None:
    model = build_model("small-cnn", num_classes=10, in_channels=1)
    assert resolve_keep(model, ["first", "head.2"]) == ["features.0.0", "head.2"]
    with pytest.raises(ConfigError) as info:
        resolve_keep(model, ["features.9"])
    message = str(info.value)
    assert "\n" not in message and "features.1.0" in message and "head.2" in message
