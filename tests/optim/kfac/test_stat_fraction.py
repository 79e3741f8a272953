"""Factor statistics on a sub-sample of the batch, and Conv1d layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisoku.config import Config
from kaisoku.errors import ConfigError
from kaisoku.optim.kfac import KFAC
from kaisoku.run_facts import check_config
from tests.optim.kfac.test_factors import _one_step


def test_conv1d_factors_equal_explicit_patches() -> None:
    torch.manual_seed(3)
    conv = nn.Conv1d(2, 3, kernel_size=3, stride=2, padding=1)
    x = torch.randn(2, 2, 9)
    out_len = (9 + 2 - 3) // 2 + 1
    target = torch.randn(2, 3, out_len)
    kfac = _one_step(conv, x, target)
    padded = nn.functional.pad(x, (1, 1))
    with torch.no_grad():
        g = 2 * (conv(x) - target)
    patches = [
        torch.cat([padded[n, :, 2 * i : 2 * i + 3].reshape(-1), torch.ones(1)])
        for n in range(2)
        for i in range(out_len)
    ]
    grads = [g[n, :, i] for n in range(2) for i in range(out_len)]
    expected_a = sum(torch.outer(p, p) for p in patches) / len(patches)
    expected_g = sum(torch.outer(v, v) for v in grads) / 2
    torch.testing.assert_close(kfac.layers[""].factors[0], expected_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kfac.layers[""].factors[1], expected_g, rtol=1e-5, atol=1e-5)


def test_subsampled_factors_are_those_of_the_first_samples() -> None:
    torch.manual_seed(4)
    layer = nn.Linear(3, 2)
    x, target = torch.randn(8, 3), torch.randn(8, 2)
    kfac = _one_step(layer, x, target, stat_fraction=0.25)  # the first 2 of 8
    a = torch.cat([x[:2], torch.ones(2, 1)], dim=1)
    with torch.no_grad():
        g = 2 * (layer(x[:2]) - target[:2])  # one sample's gradient, as in the full-batch factor
    torch.testing.assert_close(kfac.layers[""].factors[0], a.T @ a / 2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kfac.layers[""].factors[1], g.T @ g / 2, rtol=1e-5, atol=1e-6)


def _conv_factors(fraction: float) -> list[torch.Tensor]:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 3, 3))
    x, target = torch.randn(2000, 2, 8), torch.randn(2000, 3, 6)
    kfac = _one_step(model, x, target, stat_fraction=fraction)
    return [factor for layer in kfac.layers.values() for factor in layer.factors]


def test_subsampled_factors_converge_to_full_batch_factors() -> None:
    full = _conv_factors(1.0)

    def error(fraction: float) -> float:
        return max(float((f - r).norm() / r.norm()) for f, r in zip(_conv_factors(fraction), full))

    errors = [error(fraction) for fraction in (0.02, 0.25, 1.0)]
    assert errors[0] > errors[1] > errors[2] == 0.0
    assert errors[1] < 0.2  # a quarter of 2,000 iid samples estimates the factors well


def test_stat_fraction_is_checked() -> None:
    with pytest.raises(ConfigError, match="stat_fraction"):
        KFAC(nn.Linear(2, 2), kl_clip=None, stat_fraction=0.0)
    cfg = Config()
    cfg.optim.kfac.stat_fraction = 1.5
    with pytest.raises(ConfigError, match=r"optim\.kfac\.stat_fraction"):
        check_config(cfg)
