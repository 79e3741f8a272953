"""Factors against direct computations, and the preconditioned gradient against dense algebra.

Convention checked here (see ``kaisoku.optim.kfac.layers``): with a loss that is the batch mean of
per-sample losses, ``A = mean over rows of [a, 1][a, 1]^T`` and ``G = mean over samples of
sum over positions of g g^T`` with ``g`` the gradient of one sample's loss w.r.t. the layer output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisoku.optim.kfac import KFAC


def _per_sample_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).flatten(1).sum(1)


def _one_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, **kwargs: object) -> KFAC:
    kfac = KFAC(model, kl_clip=None, **kwargs)
    out = model(x)
    _per_sample_loss(out, target).mean().backward()
    kfac.step()
    return kfac


def test_linear_factors_equal_direct_expectations() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    target = torch.randn(5, 2)
    kfac = _one_step(layer, x, target)
    a = torch.cat([x, torch.ones(5, 1)], dim=1)
    expected_a = sum(torch.outer(row, row) for row in a) / 5
    with torch.no_grad():
        g = 2 * (layer(x) - target)  # d loss_n / d out_n, per sample
    expected_g = sum(torch.outer(row, row) for row in g) / 5
    factor_a, factor_g = kfac.layers[""].factors
    torch.testing.assert_close(factor_a, expected_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(factor_g, expected_g, rtol=1e-5, atol=1e-6)


def test_linear_without_bias_has_no_bias_column() -> None:
    torch.manual_seed(1)
    layer = nn.Linear(3, 2, bias=False)
    x = torch.randn(4, 3)
    kfac = _one_step(layer, x, torch.zeros(4, 2))
    torch.testing.assert_close(kfac.layers[""].factors[0], x.T @ x / 4)


@pytest.mark.parametrize(
    ("channels", "kernel", "stride", "padding", "size"),
    [(2, 3, 2, 1, 5), (1, 2, 1, 0, 6)],  # patches wider than positions, and narrower
)
def test_conv_factors_equal_explicit_patches(
    channels: int, kernel: int, stride: int, padding: int, size: int
) -> None:
    torch.manual_seed(2)
    conv = nn.Conv2d(channels, 3, kernel_size=kernel, stride=stride, padding=padding)
    x = torch.randn(2, channels, size, size)
    out_size = (size + 2 * padding - kernel) // stride + 1
    target = torch.randn(2, 3, out_size, out_size)
    kfac = _one_step(conv, x, target)
    padded = nn.functional.pad(x, (padding,) * 4)
    patches, grads = [], []
    with torch.no_grad():
        g = 2 * (conv(x) - target)
    for n in range(2):
        for i in range(out_size):
            for j in range(out_size):
                window = padded[n, :, stride * i : stride * i + kernel, stride * j : stride * j + kernel]
                patches.append(torch.cat([window.reshape(-1), torch.ones(1)]))
                grads.append(g[n, :, i, j])
    expected_a = sum(torch.outer(p, p) for p in patches) / len(patches)
    expected_g = sum(torch.outer(v, v) for v in grads) / 2  # mean over samples, sum over positions
    torch.testing.assert_close(kfac.layers[""].factors[0], expected_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kfac.layers[""].factors[1], expected_g, rtol=1e-5, atol=1e-5)


def test_batchnorm_unit_fisher_equals_per_sample_gradients() -> None:
    torch.manual_seed(3)
    bn = nn.BatchNorm1d(3)
    nn.init.normal_(bn.weight)
    x = torch.randn(6, 3)
    target = torch.randn(6, 3)
    kfac = _one_step(bn, x, target, bn="unit")
    x_hat = (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + bn.eps)
    rows = []
    for n in range(6):
        gamma = bn.weight.detach().clone().requires_grad_()
        beta = bn.bias.detach().clone().requires_grad_()
        loss = _per_sample_loss((gamma * x_hat[n] + beta)[None], target[n][None]).sum()
        d_gamma, d_beta = torch.autograd.grad(loss, [gamma, beta])
        rows.append(torch.stack([d_gamma * d_gamma, d_gamma * d_beta, d_beta * d_beta], dim=1))
    torch.testing.assert_close(kfac.layers[""].factors[0], sum(rows) / 6, rtol=1e-4, atol=1e-5)


def _grad_matrix(layer: nn.Linear) -> torch.Tensor:
    return torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)


def _tiny_layer() -> tuple[nn.Linear, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tiny layer and batch: (layer, x, target, raw gradient matrix, A, G) with A and G direct."""
    torch.manual_seed(4)
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    target = torch.randn(4, 2)
    _per_sample_loss(layer(x), target).mean().backward()
    grad = _grad_matrix(layer).clone()
    layer.zero_grad()
    a = torch.cat([x, torch.ones(4, 1)], dim=1)
    with torch.no_grad():
        g = 2 * (layer(x) - target)
    return layer, x, target, grad, a.T @ a / 4, g.T @ g / 4


def test_eigen_preconditioned_gradient_equals_dense_damped_kronecker_solve() -> None:
    damping = 0.05
    layer, x, target, grad, factor_a, factor_g = _tiny_layer()
    kfac = _one_step(layer, x, target, damping=damping, method="eigen")
    fisher = torch.kron(factor_g, factor_a).double() + damping * torch.eye(8, dtype=torch.float64)
    expected = torch.linalg.solve(fisher, grad.double().reshape(-1)).reshape(2, 4).float()
    torch.testing.assert_close(_grad_matrix(layer), expected, rtol=1e-4, atol=1e-5)
    assert kfac.steps == 1


def test_inverse_preconditioned_gradient_equals_dense_factored_damping() -> None:
    damping = 0.04
    layer, x, target, grad, factor_a, factor_g = _tiny_layer()
    _one_step(layer, x, target, damping=damping, method="inverse")
    root = damping**0.5
    fisher = torch.kron(factor_g + root * torch.eye(2), factor_a + root * torch.eye(4)).double()
    expected = torch.linalg.solve(fisher, grad.double().reshape(-1)).reshape(2, 4).float()
    torch.testing.assert_close(_grad_matrix(layer), expected, rtol=1e-4, atol=1e-5)


def test_batchnorm_diagonal_preconditioning() -> None:
    torch.manual_seed(5)
    bn = nn.BatchNorm2d(2)
    x = torch.randn(4, 2, 3, 3)
    target = torch.randn(4, 2, 3, 3)
    _per_sample_loss(bn(x), target).mean().backward()
    raw = torch.stack([bn.weight.grad, bn.bias.grad], dim=1).clone()
    bn.zero_grad()
    kfac = _one_step(bn, x, target, damping=0.1, bn="diagonal")
    fisher = kfac.layers[""].factors[0]
    assert fisher.shape == (2, 2)
    torch.testing.assert_close(torch.stack([bn.weight.grad, bn.bias.grad], dim=1), raw / (fisher + 0.1))


def test_kl_clip_bounds_the_quadratic_form_of_the_update() -> None:
    """KL clipping scales v by nu so that lr^2 * nu^2 * (v . g) <= kl_clip."""
    lr, kl_clip = 0.5, 1e-6
    results = []
    for clip in (None, kl_clip):
        torch.manual_seed(6)
        layer = nn.Linear(4, 3)
        x, target = torch.randn(8, 4), torch.randn(8, 3)
        kfac = KFAC(layer, kl_clip=clip, lr=lr, damping=1e-2)
        _per_sample_loss(layer(x), target).mean().backward()
        raw = _grad_matrix(layer).clone()
        kfac.step()
        results.append(_grad_matrix(layer).clone())
    unclipped, clipped = results
    nu = float(clipped.norm() / unclipped.norm())
    torch.testing.assert_close(clipped, unclipped * nu)
    assert nu < 1.0
    assert lr * lr * nu * nu * float((unclipped * raw).sum()) <= kl_clip * (1 + 1e-4)
