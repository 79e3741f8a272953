"""Convolution factor statistics by kernel offset (``patch_sums``) against the unfolded patch matrix, and
bfloat16 factors against float32 ones."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisoku.errors import ConfigError
from kaisoku.optim.kfac import KFAC, patch_sums
from kaisoku.optim.kfac import patches as patches_module
from tests.optim.kfac.test_factors import _one_step


def _unfold_sums(
    x: torch.Tensor,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The previous path: the whole (N*L, C*kh*kw) patch matrix through ``F.unfold``, in float64."""
    cols = F.unfold(x.double(), kernel, dilation=dilation, padding=padding, stride=stride)
    rows = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    return rows.T @ rows, rows.sum(dim=0), rows.shape[0]


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "padding", "dilation"),
    [
        ((3, 2, 7, 5), (3, 3), (1, 1), (1, 1), (1, 1)),  # odd, non-square map
        ((2, 3, 9, 8), (3, 2), (2, 1), (0, 2), (1, 2)),  # mixed stride, padding, dilation
        ((2, 5, 13, 9), (7, 7), (2, 2), (3, 3), (1, 1)),  # a 7x7/2 stem
        ((2, 3, 5, 5), (3, 3), (3, 3), (3, 3), (2, 2)),  # padding wider than the kernel's reach
        ((2, 2, 6, 6), (1, 1), (2, 2), (0, 0), (1, 1)),  # 1x1 downsample
        ((2, 70, 2, 2), (3, 3), (1, 1), (1, 1), (1, 1)),  # wide channels on a tiny map: cropped blocks
        ((4, 100, 3, 3), (5, 5), (1, 1), (2, 2), (1, 1)),
        ((3, 1, 11, 1), (5, 1), (3, 1), (4, 0), (2, 1)),  # a height-1 kernel column
    ],
)
def test_patch_sums_equal_unfolded_patches(
    shape: tuple[int, ...],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape)
    stat, column, rows = patch_sums(x, kernel, stride, padding, dilation)
    expected_stat, expected_column, expected_rows = _unfold_sums(x, kernel, stride, padding, dilation)
    assert rows == expected_rows
    assert stat.dtype == torch.float32
    torch.testing.assert_close(stat.double(), expected_stat, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(column.double(), expected_column, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(stat, stat.T)  # the mirrored lower blocks


def test_patch_sums_in_chunks_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 4, 6, 5)  # 7 samples in chunks of 2: a shorter last chunk
    args = ((3, 3), (1, 2), (1, 1), (1, 1))
    whole = patch_sums(x, *args)
    monkeypatch.setattr(patches_module, "CHUNK_ELEMENTS", 2 * 9 * 4 * 6 * 3)
    chunked = patch_sums(x, *args)
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-5, atol=1e-5)


def _layer_factor_a(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        target = torch.zeros_like(module(x))
    return _one_step(module, x, target).layers[""].factors[0]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(3, 4, 3, stride=2, padding=1),
        nn.Conv2d(2, 3, (3, 5), padding="same", dilation=(2, 1), bias=False),
        nn.Conv2d(3, 2, 4, padding="same"),  # even kernel: asymmetric "same" padding
        nn.Conv2d(2, 3, 3, stride=(1, 2), padding=(2, 0), dilation=2),
    ],
)
def test_conv2d_factor_equals_unfolded_patches(conv: nn.Conv2d) -> None:
    torch.manual_seed(2)
    x = torch.randn(3, conv.in_channels, 9, 7)
    inputs = x
    padding = conv.padding
    if isinstance(padding, str):
        inputs, padding = F.pad(x, conv._reversed_padding_repeated_twice), (0, 0)
    stat, column, rows = _unfold_sums(inputs, conv.kernel_size, conv.stride, padding, conv.dilation)
    if conv.bias is not None:
        corner = torch.tensor([[float(rows)]], dtype=stat.dtype)
        stat = torch.cat([torch.cat([stat, column[:, None]], 1), torch.cat([column[None], corner], 1)])
    torch.testing.assert_close(_layer_factor_a(conv, x), (stat / rows).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv1d(3, 4, 5, stride=2, padding=2, dilation=1),
        nn.Conv1d(2, 3, 3, stride=1, padding="same", dilation=3, bias=False),
        nn.Conv1d(2, 2, 4, stride=3, padding=0, dilation=2),
    ],
)
def test_conv1d_factor_equals_unfolded_patches(conv: nn.Conv1d) -> None:
    torch.manual_seed(3)
    x = torch.randn(4, conv.in_channels, 17)
    inputs, padding = x, conv.padding
    if isinstance(padding, str):
        inputs, padding = F.pad(x, conv._reversed_padding_repeated_twice), (0,)
    stat, column, rows = _unfold_sums(
        inputs.unsqueeze(2),
        (1, conv.kernel_size[0]),
        (1, conv.stride[0]),
        (0, padding[0]),
        (1, conv.dilation[0]),
    )
    if conv.bias is not None:
        corner = torch.tensor([[float(rows)]], dtype=stat.dtype)
        stat = torch.cat([torch.cat([stat, column[:, None]], 1), torch.cat([column[None], corner], 1)])
    torch.testing.assert_close(_layer_factor_a(conv, x), (stat / rows).float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# bfloat16 factors.


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


def _factors(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: str) -> KFAC:
    kfac = KFAC(model, kl_clip=None, factor_dtype=dtype)
    F.cross_entropy(model(x), y).backward()
    kfac.step()
    return kfac


def test_bfloat16_factors_are_close_to_float32_factors() -> None:
    torch.manual_seed(4)
    model = _model()
    x, y = torch.randn(64, 3, 8, 8), torch.randint(0, 5, (64,))
    full = _factors(copy.deepcopy(model), x, y, "float32")
    half = _factors(copy.deepcopy(model), x, y, "bfloat16")
    compared = 0
    for name, layer in full.layers.items():
        low = half.layers[name]
        for reference, factor in zip(layer.factors, low.factors):
            assert reference is not None and factor is not None
            if layer.factor_names == ("F",):  # BatchNorm's Fisher stays float32
                assert factor.dtype == torch.float32
                continue
            assert factor.dtype == torch.bfloat16
            assert _relative(factor, reference) < 1e-2  # bfloat16's epsilon is 2^-8 = 3.9e-3
            compared += 1
        for held in half._decompositions.get(name, []):
            assert held is not None and all(t.dtype == torch.float32 for t in held)
    assert compared == 6  # A and G of three Kronecker layers


def _train(dtype: str, steps: int) -> list[float]:
    torch.manual_seed(5)
    model = _model()
    x, y = torch.randn(256, 3, 8, 8), torch.randint(0, 5, (256,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kfac = KFAC(model, lr=optimizer, damping=1e-2, inv_update_steps=5, factor_dtype=dtype)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        kfac.step()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_training_with_bfloat16_factors_reduces_the_loss_like_float32() -> None:
    full, half = _train("float32", steps=10), _train("bfloat16", steps=10)
    assert full[-1] < 0.5 * full[0]
    assert half[-1] < 0.5 * half[0]
    # The same initial weights and data, mid-descent: bfloat16 factors follow float32's loss curve.
    for a, b in zip(full, half):
        assert abs(a - b) < 0.05 * (full[0] - full[-1])


def test_bfloat16_factors_survive_a_checkpoint() -> None:
    torch.manual_seed(6)
    model = _model()
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    kfac = _factors(model, x, y, "bfloat16")
    state = kfac.state_dict()
    kfac.remove_hooks()
    fresh = KFAC(model, kl_clip=None, factor_dtype="bfloat16")
    fresh.load_state_dict(state)
    layer = fresh.layers["0"]
    assert layer.factors[0] is not None and layer.factors[0].dtype == torch.bfloat16
    torch.testing.assert_close(layer.factors[0], kfac.layers["0"].factors[0], rtol=0, atol=0)


def test_unknown_factor_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="factor_dtype must be one of float32, bfloat16"):
        KFAC(nn.Linear(2, 2), kl_clip=None, factor_dtype="float16")


def test_config_factor_dtype_reaches_kfac() -> None:
    from kaisoku.config import Config, apply_override
    from kaisoku.engine.build import build_kfac

    cfg = Config()
    apply_override(cfg, "optim.kfac.enabled", "true")
    apply_override(cfg, "optim.kfac.factor-dtype", "bfloat16")
    model = nn.Sequential(nn.Linear(3, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = build_kfac(cfg, model, optimizer, SimpleNamespace(scaler=None), None)  # type: ignore[arg-type]
    assert isinstance(kfac, KFAC)
    assert kfac.layers["0"].factor_dtype == torch.bfloat16
